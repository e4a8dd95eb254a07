"""The performance page's tables, generated from ``attnx bench`` runs.

Each folder of ``bench/results/`` holds one run's ``results.json`` (a row
per implementation and shape) and ``run.json`` (command, date, machine,
library versions), as ``attnx bench --out FOLDER`` writes them. Each run
gives one dated section naming its machine, with one table per attnx
backend: its time over every baseline measured in the same run, at the same
operation, shape and dtype (below 1 = attnx is faster). Absolute times on
shared machines drift; ratios within one run do not, much.
"""

from __future__ import annotations

import json
from pathlib import Path

_BASELINE_ORDER = ("torch-sdpa", "jax-sdpa", "keras-sdpa", "numpy-textbook")


def _key(row: dict) -> tuple:
    shape = (row["batch"], row["heads"], row["n"], row["head_dim"], row["dtype"])
    return (row["operation"], *shape, row.get("kv_heads"), row.get("queries", 1))


def _shape(row: dict) -> str:
    if row["operation"] == "decode":  # (B, H/H_kv, new queries, cache, d)
        heads = f"{row['heads']}/{row.get('kv_heads') or row['heads']}"
        return f"({row['batch']}, {heads}, {row.get('queries', 1)}, {row['n']}, {row['head_dim']})"
    return f"({row['batch']}, {row['heads']}, {row['n']}, {row['head_dim']})"


def _shape_header(rows: list[dict]) -> str:
    if all(row["operation"] == "decode" for row in rows):
        return "shape (B, H/H_kv, queries, cache, d)"
    return "shape (B, H, n, d)"


def _vector(machine: dict) -> str:
    """The vector units, where the run recorded them (runs before the
    fifty-fourth session did not)."""
    return f" ({machine['vector']})" if machine.get("vector") else ""


def _section(folder: Path) -> list[str]:
    run = json.loads((folder / "run.json").read_text())
    rows = [row for row in json.loads((folder / "results.json").read_text()) if row["median_s"]]
    machine = run["machine"]
    libraries = ", ".join(f"{name} {version}" for name, version in run["libraries"].items())
    lines = [
        f"## {run['date']}: {machine['cpu']}, {machine['cpus']} CPUs",
        "",
        f"`{run['command']}` on {machine['arch']}{_vector(machine)}, {machine['python']}; {libraries}.",
    ]
    if machine.get("idle"):
        lines += ["", f"Idle policy: {machine['idle']}."]
    baselines = {}
    for row in rows:
        if not row["implementation"].startswith("attnx:"):
            baselines.setdefault(row["implementation"], {})[_key(row)] = row["median_s"]
    names = [name for name in _BASELINE_ORDER if name in baselines] + sorted(set(baselines) - set(_BASELINE_ORDER))
    for backend in sorted({row["implementation"] for row in rows if row["implementation"].startswith("attnx:")}):
        lines += [
            "",
            f"### {backend.removeprefix('attnx:')}",
            "",
            f"| operation | {_shape_header(rows)} | dtype | attnx ms | "
            + " | ".join(f"x {name}" for name in names)
            + " |",
            "|---|---|---|---:|" + "---:|" * len(names),
        ]
        for row in rows:
            if row["implementation"] != backend:
                continue
            ratios = []
            for name in names:
                baseline = baselines[name].get(_key(row))
                ratios.append(f"{row['median_s'] / baseline:.2f}" if baseline else "")
            shape = _shape(row)
            lines.append(
                f"| {row['operation']} | {shape} | {row['dtype']} | {row['median_s'] * 1e3:.2f} | "
                + " | ".join(ratios)
                + " |"
            )
    return lines


def write(results: Path, out: Path) -> None:
    """Write every run under ``results`` into ``out``, newest first."""
    folders = sorted(
        (folder for folder in results.iterdir() if (folder / "run.json").exists()),
        key=lambda folder: json.loads((folder / "run.json").read_text())["date"],
        reverse=True,
    )
    lines: list[str] = []
    for folder in folders:
        lines += [*_section(folder), ""]
    text = "\n".join(lines)
    # Sphinx rebuilds a page whose file changed: write only when it did.
    if not out.exists() or out.read_text() != text:
        out.write_text(text)
