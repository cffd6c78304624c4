"""Cost of the controller's journal per record (``python tests/measure_journal.py [out.json]``).

A commit appends nothing (its metadata rides to the units with the bytes); a claim,
ack, register, delete or reset appends one record. This measures one claim record of
a 64-sample batch, flushed to the OS (the default: survives the controller's process)
and fsynced (``journal_fsync``: survives the machine), plus a compaction of 100k
consumed ids. Prints a table and writes JSON.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

from dataplane_server.core.journal import Journal


def _per_record_us(fsync: bool, n: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        journal = Journal(d, compact_every=10**9, fsync=fsync)
        ids = [f"sample-{i:08d}" for i in range(64)]
        t0 = time.perf_counter()
        for i in range(n):
            journal.append("claim", "partition-0", "train", ids, None, i)
        elapsed = time.perf_counter() - t0
        journal.close()
    return elapsed / n * 1e6


def _compaction_ms(samples: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        journal = Journal(d)
        state = {
            "p": {
                "declaration": {
                    "fields": ["x"],
                    "expected_samples": None,
                    "consumer_tasks": ["t"],
                    "group_size": None,
                    "task_leases": {},
                },
                "tasks": {"t": {"consumed": [f"s{i}" for i in range(samples)]}},
            }
        }
        t0 = time.perf_counter()
        journal.compact(state)
        return (time.perf_counter() - t0) * 1e3


def main() -> None:
    rows = {
        "claim record, flushed (us)": _per_record_us(False, 20_000),
        "claim record, fsync (us)": _per_record_us(True, 500),
        "snapshot of 100k consumed ids (ms)": _compaction_ms(100_000),
    }
    for name, value in rows.items():
        print(f"{name:40s} {value:10.1f}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
