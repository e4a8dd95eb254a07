"""What the README and the install page promise a new user is what the package installs."""

from __future__ import annotations

import re
from importlib.metadata import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
INSTALL = (ROOT / "docs" / "install.md").read_text()


def test_every_extra_the_install_page_lists_is_in_the_installed_package():
    listed = set(re.findall(r"^\| `([a-z-]+)` \|", INSTALL, re.M))
    assert {"torch", "jax", "cupy", "dask", "plot", "test", "bench"} <= listed
    provided = set(metadata("attnx").get_all("Provides-Extra") or [])
    assert listed <= provided, f"the install page lists extras the package lacks: {listed - provided}"


def test_every_extra_the_readme_installs_is_in_the_installed_package():
    named = {extra for group in re.findall(r"\.\[([a-z,-]+)\]", README) for extra in group.split(",")}
    assert {"torch", "plot"} <= named
    provided = set(metadata("attnx").get_all("Provides-Extra") or [])
    assert named <= provided, f"the README names extras the package lacks: {named - provided}"


def test_the_readme_installs_from_a_clone_and_says_why():
    assert "not on the package index yet" in README
    assert not re.search(r"pip install '?attnx\[", README), "attnx[...] is not on the index: install '.[...]'"


def test_no_extra_asks_for_a_source_only_package():
    # PyPI's "cupy" is source only (it compiles against CUDA); the wheels are cupy-cudaNNx.
    requirements = metadata("attnx").get_all("Requires-Dist") or []
    names = {re.split(r"[<>=!~; \[]", requirement, maxsplit=1)[0].lower() for requirement in requirements}
    assert "cupy" not in names, requirements


def test_the_readme_tells_cpu_users_how_to_get_pytorch_s_cpu_wheel():
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in README
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in INSTALL
