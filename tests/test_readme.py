"""What the README promises a new user is what the package installs."""

from __future__ import annotations

import re
from importlib.metadata import metadata
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_extra_the_readme_names_is_in_the_installed_package():
    named = {extra for group in re.findall(r"attnx\[([a-z,-]+)\]", README) for extra in group.split(",")}
    assert {"torch", "plot", "test", "bench", "cupy"} <= named
    provided = set(metadata("attnx").get_all("Provides-Extra") or [])
    assert named <= provided, f"the README names extras the package lacks: {named - provided}"


def test_no_extra_asks_for_a_source_only_package():
    # PyPI's "cupy" is source only (it compiles against CUDA); the wheels are cupy-cudaNNx.
    requirements = metadata("attnx").get_all("Requires-Dist") or []
    names = {re.split(r"[<>=!~; \[]", requirement, maxsplit=1)[0].lower() for requirement in requirements}
    assert "cupy" not in names, requirements


def test_the_readme_tells_cpu_users_how_to_get_pytorch_s_cpu_wheel():
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in README


def test_the_flex_attention_examples_run_as_written(capsys):
    pytest = __import__("pytest")
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    section = README[README.index("## Programmable attention") : README.index("## Choosing a backend")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    namespace: dict = {}
    for block in blocks:
        exec(block, namespace)
    printed = capsys.readouterr().out.strip()
    said = re.search(r"# (BlockMask\(.*\))", blocks[0]).group(1)
    assert printed == said
    assert namespace["out"].shape == (1, 2, 8192, 64)
