"""Sample a cosmic-ray session deterministically, and report its score.

    python mutation/session.py sample SESSION.sqlite [EVERY]
    python mutation/session.py report SESSION.sqlite [EVERY] [--out FILE]

A mutant is in the sample when a hash of (file, operator, the mutated line's
text, column) is 0 modulo EVERY (default 20).  The key does not depend on
line numbers, so the same rule picks comparable samples before and after a
change; a 1-in-20 sample is a subset of the 1-in-10 one.  ``sample`` marks
the others skipped; ``report`` scores the sampled mutants that ran (killed /
(killed + survived)) and lists the survivors with their diffs.
"""

from __future__ import annotations

import argparse
import hashlib
import sqlite3
from collections import Counter
from pathlib import Path


def in_sample(path: str, operator: str, row: int, column: int, every: int, lines: dict[str, list[str]]) -> bool:
    source = lines.setdefault(path, Path(path).read_text().splitlines())
    # The "0" field keeps the key of the first measured sample (2026-11-23), so scores stay comparable.
    key = f"{path}|{operator}|{source[row - 1].strip()}|0|{column}"
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % every == 0


def sample(session: str, every: int) -> None:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    lines: dict[str, list[str]] = {}
    kept: Counter[str] = Counter()
    with use_db(session, WorkDB.Mode.open) as db:
        for item in db.pending_work_items:
            mutation = item.mutations[0]
            path = str(mutation.module_path)
            if in_sample(path, mutation.operator_name, *mutation.start_pos, every, lines):
                kept[path] += 1
            else:
                db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
    print(f"kept {sum(kept.values())} mutants (1 in {every}):", dict(kept))


def report(session: str, every: int, out: str | None) -> None:
    lines: dict[str, list[str]] = {}
    rows = sqlite3.connect(session).execute(
        "select s.module_path, s.operator_name, s.start_pos_row, s.start_pos_col, r.test_outcome, r.diff "
        "from mutation_specs s join work_results r on s.job_id = r.job_id where r.worker_outcome = 'NORMAL'"
    )
    outcomes: Counter[str] = Counter()
    survivors = []
    for path, operator, row, column, outcome, diff in rows:
        if not in_sample(path, operator, row, column, every, lines):
            continue
        outcomes[outcome] += 1
        if outcome == "SURVIVED":
            survivors.append(f"{path}:{row} {operator}\n{diff}")
    ran = outcomes["KILLED"] + outcomes["SURVIVED"]
    score = outcomes["KILLED"] / ran if ran else float("nan")
    summary = (
        f"mutation score {score:.1%}: {outcomes['KILLED']} killed, {outcomes['SURVIVED']} survived "
        f"of {ran} sampled mutants (1 in {every}); {outcomes['INCOMPETENT']} incompetent"
    )
    print(summary)
    if out:
        Path(out).write_text(summary + "\n\nSurviving mutants:\n\n" + "\n".join(survivors))
        print(f"survivors written to {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["sample", "report"])
    parser.add_argument("session")
    parser.add_argument("every", nargs="?", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    sample(args.session, args.every) if args.action == "sample" else report(args.session, args.every, args.out)
