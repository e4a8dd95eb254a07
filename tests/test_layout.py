"""The layout's rules, read from the source: the built-in backends reach
attnx only through its public API, as a backend in another package must,
and the algorithms import no array library."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import attnx

ROOT = Path(__file__).resolve().parent.parent
#: Modules of attnx that may import an array library: parameters drawn once
#: in NumPy (the same numbers on every backend), the tools around the
#: algorithms (benchmarks, plots, the command line), and the framework
#: layers (attnx.torch: an nn.Module, attnx.flax: an nnx.Module,
#: attnx.keras: a Keras layer, each imported only when asked for).
ARRAY_LIBRARY_USERS = {"_params.py", "benchmark.py", "cli.py", "plot.py", "torch.py", "flax.py", "keras.py"}
ARRAY_LIBRARIES = {"numpy", "torch", "cupy", "jax", "dask"}


def _sources(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*.py"))


def private_uses(source: str) -> list[str]:
    """Each use of attnx beyond its public API in ``source``: a private
    module (``attnx._masking``), a name a module does not list in its
    ``__all__``, or a private attribute of ``attnx`` (``attnx._registry``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "attnx":
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"from {node.module} import ...")
                continue
            public = importlib.import_module(node.module).__all__
            found += [f"from {node.module} import {alias.name}" for alias in node.names if alias.name not in public]
        elif isinstance(node, ast.Import):
            found += [
                f"import {alias.name}"
                for alias in node.names
                if alias.name.split(".")[0] == "attnx" and any(part.startswith("_") for part in alias.name.split("."))
            ]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "attnx":
            if node.attr.startswith("_") and node.attr not in ("__version__",):
                found.append(f"attnx.{node.attr}")
    return found


@pytest.mark.parametrize("path", _sources("backends", "examples"), ids=lambda path: str(path.relative_to(ROOT)))
def test_backends_and_examples_use_only_attnx_s_public_api(path):
    assert private_uses(path.read_text()) == []


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from attnx import _masking", ["from attnx import _masking"]),
        ("from attnx._tiling import KEY_CHUNK", ["from attnx._tiling import ..."]),
        ("from attnx.attention import choose_chunks", ["from attnx.attention import choose_chunks"]),
        ("import attnx._registry", ["import attnx._registry"]),
        ("import attnx\nattnx._registry.get('numpy')", ["attnx._registry"]),
        ("from attnx import Backend, natives\nfrom attnx.natives import MIN_ROWS", []),
    ],
)
def test_the_check_finds_each_kind_of_private_use(source, expected):
    assert private_uses(source) == expected


def test_every_public_module_lists_its_api():
    for module in ("attnx", "attnx.natives", "attnx.blocks", "attnx.masks", "attnx.backend"):
        assert importlib.import_module(module).__all__, module
    assert "natives" in attnx.__all__


@pytest.mark.parametrize(
    "path",
    [path for path in _sources("attnx") if path.name not in ARRAY_LIBRARY_USERS],
    ids=lambda path: path.name,
)
def test_algorithms_import_no_array_library(path):
    """The algorithms are written once against the array API: the namespace
    comes from the arrays (array-api-compat), never from an import."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert not imported & ARRAY_LIBRARIES
