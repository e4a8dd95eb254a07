"""Keep a deterministic sample of a cosmic-ray session's mutants.

    python mutation/sample.py SESSION.sqlite [EVERY]

Every mutant whose (file, operator, mutated line's text, occurrence on that
line) hashes to 0 modulo EVERY (default 10) is kept; the others are marked
skipped.  The key does not depend on line numbers, so the same rule picks
comparable samples before and after a change to the code.
"""

from __future__ import annotations

import hashlib
import sys
from collections import Counter
from pathlib import Path

from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import WorkerOutcome, WorkResult


def main(session: str, every: int = 10) -> None:
    lines: dict[str, list[str]] = {}
    kept = Counter()
    with use_db(session, WorkDB.Mode.open) as db:
        for item in db.pending_work_items:
            mutation = item.mutations[0]
            path = str(mutation.module_path)
            source = lines.setdefault(path, Path(path).read_text().splitlines())
            text = source[mutation.start_pos[0] - 1].strip()
            on_line = sum(
                1
                for other in item.mutations[:0]  # one mutation per item; occurrence counts in the file
            )
            key = f"{path}|{mutation.operator_name}|{text}|{on_line}|{mutation.start_pos[1]}"
            if int(hashlib.sha256(key.encode()).hexdigest(), 16) % every == 0:
                kept[path] += 1
                continue
            db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
    print(f"kept {sum(kept.values())} mutants (1 in {every}):", dict(kept))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10)
