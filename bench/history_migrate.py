"""How long `swapaware history migrate` takes for a large history (issue 23: a 1M-decision history).

Builds a synthetic schema-3 SQLite history with the store's own schema (direct inserts, one
transaction per 50,000 rows): ``--decisions`` decisions of realistic size (facts ~200 bytes,
decision ~150 bytes), a run, a start and a finish event and an observation for each (a job
followed every decision), ``--classes`` learned keys, a status per decision. Then copies it into
a private MariaDB (tests/mariadb_server.py: needs mariadbd, root) with the same code the command
runs, and prints the time, rows/s per table and in all, and the verified counts.

    .venv/bin/python bench/history_migrate.py --decisions 1000000 [--batch 5000]
"""
from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy_service.history.store import HistoryStore  # noqa: E402
from policy_service.history.migrate import migrate_history  # noqa: E402
from policy_service.history.schema import stats_to_json  # noqa: E402
from policy_service.core.types import ClassStats  # noqa: E402
from tests.mariadb_server import MariaDbServer  # noqa: E402

CHUNK = 50_000


def build(path: Path, decisions: int, classes: int) -> float:
    HistoryStore(path, accept_empty=True).close()  # the schema, as the service creates it
    t0 = time.monotonic()
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA synchronous=OFF")
    facts, dec = os.urandom(200), os.urandom(150)
    gib = 1 << 30

    def rows(i: int):
        c = f"user{i % 500}/job{i % classes}/{i % classes:016x}/gres:gpu:1"
        keys = json.dumps({"class": c, "user_name": f"user{i % 500}/job{i % classes}", "account": "proj",
                           "partition": "gpu"}, sort_keys=True)
        at = 1.7e9 + i * 0.5
        inst = f"cluster/{i}/{int(at)}"
        return ((f"{i:08x}-0000-4000-8000-{i:012x}", at, c, f"user{i % 500}", "proj", "gpu", f"job{i % classes}",
                 "share" if i % 3 else "whole", 2, "m3", keys, facts, dec),
                (inst, "node%03d" % (i % 128), i, int(at), f"{i:08x}-0000-4000-8000-{i:012x}", "[0]", at + 5,
                 at + 600),
                (f"start-{i}", "start", at + 5), (f"finish-{i}", "finish", at + 601),
                (f"finish-{i}", i, f"{i:08x}-0000-4000-8000-{i:012x}", "node%03d" % (i % 128), "[0]", at + 5,
                 at + 600, 595.0, 0, 3 * gib, 0, 1, 1, "nvml", at + 601, inst, int(at)),
                (f"{i:08x}-0000-4000-8000-{i:012x}", "held", at + 900))

    for start in range(0, decisions, CHUNK):
        batch = [rows(i) for i in range(start, min(decisions, start + CHUNK))]
        db.execute("BEGIN")
        db.executemany("INSERT INTO decisions VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", [b[0] for b in batch])
        db.executemany("INSERT INTO runs (instance, node, job_id, submit_time, decision_id, gpu_indices, started_at, "
                       "finished_at) VALUES (?,?,?,?,?,?,?,?)", [b[1] for b in batch])
        db.executemany("INSERT INTO events VALUES (?,?,?)", [b[2] for b in batch] + [b[3] for b in batch])
        db.executemany("INSERT INTO observations VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", [b[4] for b in batch])
        db.executemany("INSERT INTO decision_status VALUES (?,?,?)", [b[5] for b in batch])
        db.execute("COMMIT")
    stats = stats_to_json(ClassStats(samples=20, runs=20, ewma_peak_bytes=3.0 * gib, max_peak_bytes=3 * gib))
    db.executemany("INSERT OR REPLACE INTO class_stats VALUES (?,?,?,?)",
                   [(lvl, f"{lvl}-{k}", stats, 1.7e9) for k in range(classes) for lvl in ("class", "user_name")])
    db.close()
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decisions", type=int, default=1_000_000)
    ap.add_argument("--classes", type=int, default=5000)
    ap.add_argument("--batch", type=int, default=5000)
    ap.add_argument("--source", type=Path, help="reuse this synthetic history (built when missing)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="swapaware-migrate-"))
    src = args.source or tmp / "history.sqlite3"
    if not src.exists():
        built = build(src, args.decisions, args.classes)
        print(f"built {src}: {args.decisions} decisions, {src.stat().st_size / 1e6:.0f} MB, in {built:.1f} s")
    server = MariaDbServer.start(buffer_pool="512M")  # as the dev cluster's (contrib/dev-cluster/cluster.sh)
    try:
        target = server.database("migrated")
        t0 = time.monotonic()
        result = migrate_history(src, target, tmp / "service" / "history.sqlite3", batch=args.batch)
        wall = time.monotonic() - t0
    finally:
        server.stop()
    for t in result.tables:
        print(f"  {t.table:<16} {t.source_rows:>9} rows {t.seconds:8.1f} s {t.source_rows / max(t.seconds, 1e-9):>9,.0f} rows/s"
              f"  (target {t.target_rows})")
    print(f"migrate: {result.rows} rows ({args.decisions} decisions) in {wall:.1f} s, "
          f"{result.rows_per_s:,.0f} rows/s, batch {args.batch}; counts verified")


if __name__ == "__main__":
    main()
