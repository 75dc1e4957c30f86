"""CPU per co-runner read (``HistoryStore.co_runners``, once per JobFinished event and per run in
``swapaware report``) against how many runs the node has held: a node of 8 GPUs running 10-minute
jobs holds about 1,150 runs a day, 100,000 in three months. A SQLite history is filled with runs
of one node, one after another 600 s apart on GPUs 0-7 in turn, and the newest run's co-runners
are read ``--reads`` times; CPU time of this process (time.process_time).

    .venv/bin/python bench/co_runners.py                      # 1,000 / 10,000 / 100,000 runs
    .venv/bin/python bench/co_runners.py --runs 500000 --reads 50
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from policy_service.history.store import HistoryStore  # noqa: E402

OPEN_RUN_MAX_S = 7 * 86400.0  # service.open_run_max_s's default


def fill(store: HistoryStore, runs: int) -> float:
    """``runs`` finished runs of node n1; the end of the newest."""
    with store._tx() as c:
        for i in range(runs):
            t0 = 1_000_000.0 + i * 600.0
            c.execute("INSERT INTO runs (instance, node, job_id, submit_time, decision_id, gpu_indices, started_at, "
                      "finished_at) VALUES (?,?,?,?,?,?,?,?)",
                      (f"bench/{i}", "n1", i, 0, "", json.dumps([i % 8]), t0, t0 + 3000.0))
    return 1_000_000.0 + runs * 600.0


def measure(runs: int, reads: int) -> tuple[float, int]:
    """(us of CPU per co_runners read, co-runners found) at ``runs`` runs of the node."""
    with tempfile.TemporaryDirectory() as d:
        store = HistoryStore(Path(d) / "history.sqlite3", accept_empty=True)
        try:
            end = fill(store, runs)
            t = time.process_time()
            for _ in range(reads):
                found = store.co_runners("n1", [0], end - 3000.0, end, "bench/new", OPEN_RUN_MAX_S)
            return (time.process_time() - t) / reads * 1e6, len(found)
        finally:
            store.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=lambda s: [int(x) for x in s.split(",")], default=[1000, 10000, 100000])
    ap.add_argument("--reads", type=int, default=200)
    args = ap.parse_args(argv)
    for n in args.runs:
        us, found = measure(n, args.reads)
        print(f"{n:>9,} runs on the node: {us:8.0f} us CPU per co_runners read ({found} co-runner(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
