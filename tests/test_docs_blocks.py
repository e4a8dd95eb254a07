"""Every Python block of the README and of the docs runs as written.

Each block is a whole program (its imports and its data): it runs as a
script in a fresh interpreter, in an empty folder. Where a ``text`` block
follows it directly, that is what the block prints, and the test holds the
printed output to it exactly. A block that needs a library this environment
lacks, or a GPU, skips saying which.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PAGES = [page for page in PAGES if not {"_build", "generated", "archive"} & set(page.relative_to(ROOT).parts)]
FENCE = re.compile(r"^(?P<indent> *)```(?P<language>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)


def blocks(page: Path) -> list[tuple[str, str, str | None]]:
    """``(where, code, printed)`` for each Python block of a page."""
    text = page.read_text()
    fences = list(FENCE.finditer(text))
    found = []
    for index, fence in enumerate(fences):
        if fence["language"] != "python":
            continue
        printed = None
        following = fences[index + 1] if index + 1 < len(fences) else None
        if following and following["language"] == "text" and not text[fence.end() : following.start()].strip():
            printed = _dedent(following["body"], following["indent"])
        line = text.count("\n", 0, fence.start()) + 1
        found.append((f"{page.relative_to(ROOT)}:{line}", _dedent(fence["body"], fence["indent"]), printed))
    return found


def _dedent(body: str, indent: str) -> str:
    return "".join(line.removeprefix(indent) for line in body.splitlines(keepends=True))


def _run_at_import(tree: ast.AST):
    """The nodes a script runs as it starts: not the bodies of its functions
    and classes (a backend's ``namespace()`` imports its library when called)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield node
        yield from _run_at_import(node)


def _missing(code: str) -> str | None:
    """Why this environment cannot run a block, or None."""
    modules = set()
    for node in _run_at_import(ast.parse(code)):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.add(node.module.split(".")[0])
    for module in sorted(modules):
        if importlib.util.find_spec(module) is None:
            return f"needs {module}, not installed here"
    if "cuda" in code:
        import attnx

        gpus = [info for info in attnx.list_backends() if any("cuda" in d for d in info.devices)]
        if not gpus:
            return "needs a CUDA GPU, and none is here"
    return None


CASES = [case for page in PAGES for case in blocks(page)]


def test_the_pages_have_blocks_to_run():
    assert len(CASES) >= 20, [where for where, _, _ in CASES]


def test_the_readme_is_a_first_screen():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, len(lines)


@pytest.mark.parametrize(("where", "code", "printed"), CASES, ids=[where for where, _, _ in CASES])
def test_block_runs_as_written(where, code, printed, tmp_path):
    reason = _missing(code)
    if reason:
        pytest.skip(reason)
    script = tmp_path / "block.py"
    script.write_text(code)
    environment = {**os.environ, "MPLBACKEND": "Agg", "PYTHONHASHSEED": "0"}
    environment.pop("ATTNX_BACKEND", None)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=environment
    )
    assert done.returncode == 0, f"{where} failed:\n{done.stderr[-3000:]}"
    if printed is not None:
        assert done.stdout.rstrip() == printed.rstrip(), f"{where} printed:\n{done.stdout}"


def _update(page: Path) -> None:
    """Rewrite each ``text`` block after a Python block with what it prints."""
    import tempfile

    text = page.read_text()
    fences = list(FENCE.finditer(text))
    replacements = []
    for index, fence in enumerate(fences[:-1]):
        following = fences[index + 1]
        if fence["language"] != "python" or following["language"] != "text":
            continue
        if text[fence.end() : following.start()].strip():
            continue
        with tempfile.TemporaryDirectory() as folder:
            script = Path(folder) / "block.py"
            script.write_text(_dedent(fence["body"], fence["indent"]))
            done = subprocess.run(
                [sys.executable, str(script)],
                cwd=folder,
                capture_output=True,
                text=True,
                env={**os.environ, "MPLBACKEND": "Agg", "PYTHONHASHSEED": "0"},
            )
        if done.returncode:
            raise SystemExit(f"{page}: a block failed:\n{done.stderr}")
        indent = following["indent"]
        body = "".join(indent + line if line.strip() else line for line in done.stdout.rstrip().splitlines(True))
        replacements.append((following.start("body"), following.end("body"), body + "\n"))
    for start, end, body in reversed(replacements):
        text = text[:start] + body + text[end:]
    page.write_text(text)


if __name__ == "__main__":
    # python tests/test_docs_blocks.py --update PAGE...: show each block's real output
    if sys.argv[1:2] != ["--update"]:
        raise SystemExit("usage: python tests/test_docs_blocks.py --update PAGE...")
    for name in sys.argv[2:]:
        _update(Path(name).resolve())
