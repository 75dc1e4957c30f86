"""Admission table: build time, file size and the plugin's reload time (real Lua 5.1) at N keys.

    .venv/bin/python bench/admission_table.py --keys 10000 100000
    .venv/bin/python bench/admission_table.py --keys 10000 --admit-latency

A real history (SQLite in a temporary directory) holds N recorded decisions with distinct table
keys over 1,000 job classes (100 users x 10 job names, each learned: 2 GiB peaks, so they share),
varied by time limit and QoS; the publisher (admission/publish.py) builds the class table
through the handler's own decide path, with the default [policy] (4 reachable gate states).
Printed per N: the cold build (every key decided), a re-publication with nothing changed (same
version), a rebuild after one class learned an observation (one class's keys decided again, a new
version written and archived), the table's size, the time the job_submit plugin (the tree's
slurm_plugin/swapaware_table.lua in lua5.1, as bench/lua_table.py) takes to stat, read, index and
check it (slurmctld holds its Lua mutex meanwhile), its Lua heap, and the archive's size. Written
for the compact file (core/admission_format.py) and also runs in a tree from before it (JSON).
--admit-latency: Admit's latency in the same process (the service's GIL switch interval), idle and
while the publisher's thread builds the table from cold.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy_service._generated.swapaware.v1 import policy_pb2 as pb  # noqa: E402
from policy_service.admission.archive import TableArchive, archive_path  # noqa: E402
from policy_service.admission.publish import AdmissionPublisher  # noqa: E402
from policy_service.history.journal_records import DecisionRecord  # noqa: E402
from policy_service.history.store import HistoryStore  # noqa: E402
from policy_service.history.schema import stats_to_json  # noqa: E402
from policy_service.config import AdmissionConfig, Config  # noqa: E402
from policy_service.core.types import ClassStats, KeyLevel  # noqa: E402
from policy_service.serving.handler import PolicyHandler  # noqa: E402
from policy_service.serving.server import GIL_SWITCH_INTERVAL_S  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lua_table import load_seconds  # noqa: E402

GIB = 1024 ** 3
USERS, NAMES = 100, 10


def facts(i: int) -> pb.JobFacts:
    cls = i % (USERS * NAMES)
    return pb.JobFacts(user=f"user{cls // NAMES:03d}", uid=10000 + cls // NAMES, account="proj", partition="gpu",
                       job_name=f"train{cls % NAMES}", tres_per_node="gres/gpu:1", script_fingerprint="00000001deadbeef",
                       time_limit_min=1 + (i // (USERS * NAMES)) % 1440, qos=("normal", "high")[(i // 1440000) % 2],
                       work_dir="/home/x", min_nodes=1, num_tasks=1, is_batch=True)


def setup(tmp: Path, n: int) -> tuple[PolicyHandler, AdmissionPublisher]:
    cfg = Config(admission=AdmissionConfig(table_path=str(tmp / "admission.json"), max_entries=max(n, 1)))
    cfg = dataclasses.replace(cfg, service=dataclasses.replace(cfg.service, db_path=tmp / "history.sqlite3"))
    store = HistoryStore(tmp / "history.sqlite3", accept_empty=True)
    handler = PolicyHandler(cfg, store, None)
    learned = ClassStats(samples=3, runs=3, ewma_peak_bytes=2 * GIB, max_peak_bytes=2 * GIB, last_peak_bytes=2 * GIB)
    db = sqlite3.connect(str(tmp / "history.sqlite3"))
    classes = {}
    for c in range(USERS * NAMES):
        _, _, keys = handler._decide(facts(c))
        classes[keys[KeyLevel.CLASS]] = keys
    db.executemany("INSERT INTO class_stats (level, key, stats_json, updated_at) VALUES (?, ?, ?, 0)",
                   [(KeyLevel.CLASS.value, k, stats_to_json(learned)) for k in classes])
    db.commit()
    now = time.time()
    store.record([DecisionRecord(f"{i:016x}", now - n + i, "k", "u", "a", "p", "n", "share", 1, "m", {},
                                 facts(i).SerializeToString(), b"") for i in range(n)])
    return handler, AdmissionPublisher(handler, cfg, TableArchive(archive_path(str(tmp / "history.sqlite3"))))


def decisions_in(data: bytes) -> tuple[int, int]:
    """(the table's decisions, one per entry and state; the distinct ones its file holds)."""
    try:
        from policy_service.core.admission_format import read_table
    except ImportError:  # a tree from before the compact file: one JSON object per entry and state
        states = sum(len(e) - 1 for e in json.loads(data)["entries"].values())
        return states, states
    head = json.loads(data.split(b"\n", 2)[1])
    return sum(len(e) - 1 for e in read_table(data)["entries"].values()), head["decisions"]


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def admit_latency(handler: PolicyHandler, seconds: float, busy: threading.Event | None = None) -> list[float]:
    """Latencies (s) of Admit for a learned job, one after another, for ``seconds`` (or while
    ``busy`` is set)."""
    req = pb.AdmitRequest(job=facts(1))
    out = []
    end = time.perf_counter() + seconds
    while (busy.is_set() if busy is not None else time.perf_counter() < end):
        t = time.perf_counter()
        handler.admit(req)
        out.append(time.perf_counter() - t)
        time.sleep(0.001)  # slurmctld's submissions arrive spread out, not back to back
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6


def latency_during_build(n: int) -> None:
    """Admit's latency (this process's handler, the service's GIL switch interval) while nothing
    else runs, and while the publisher builds the table of ``n`` keys from cold."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    with tempfile.TemporaryDirectory() as d:
        handler, pub = setup(Path(d), n)
        idle = admit_latency(handler, 5.0)
        busy = threading.Event()
        busy.set()

        def build():
            try:
                pub.publish("bench: cold, beside Admit")
            finally:
                busy.clear()

        t = threading.Thread(target=build)
        t.start()
        during = admit_latency(handler, 0, busy)
        t.join()
        print(f"keys={n} admit_us idle p50={pct(idle, .5):.0f} p99={pct(idle, .99):.0f} max={max(idle) * 1e6:.0f} "
              f"(n={len(idle)}); during cold build p50={pct(during, .5):.0f} p99={pct(during, .99):.0f} "
              f"max={max(during) * 1e6:.0f} (n={len(during)})", flush=True)
        pub.archive.close()
        handler.close()
        handler.store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[10000, 100000])
    ap.add_argument("--admit-latency", action="store_true",
                    help="instead: Admit's latency idle and while the table is built (at each --keys)")
    args = ap.parse_args()
    if args.admit_latency:
        for n in args.keys:
            latency_during_build(n)
        return
    for n in args.keys:
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            handler, pub = setup(tmp, n)
            cold, t_cold = timed(lambda: pub.publish("bench: cold"))
            same, t_same = timed(lambda: pub.publish("bench: unchanged"))
            _, _, first = handler._decide(facts(0))  # its history keys
            # one class learned an observation that changes its decisions (peaks now 5 GiB)
            db = sqlite3.connect(str(tmp / "history.sqlite3"))
            db.execute("UPDATE class_stats SET stats_json = ? WHERE level = ? AND key = ?",
                       (stats_to_json(ClassStats(samples=4, runs=4, ewma_peak_bytes=5 * GIB, max_peak_bytes=5 * GIB,
                                                 last_peak_bytes=5 * GIB)),
                        KeyLevel.CLASS.value, first[KeyLevel.CLASS]))
            db.commit()
            db.close()
            handler.learned.update(first.values())
            one, t_one = timed(lambda: pub.publish("bench: one class learned"))
            data = pub.table.read_bytes()
            states, distinct = decisions_in(data)
            t_lua, heap = load_seconds(pub.table, handler.dialect.name)
            arc = os.path.getsize(archive_path(str(tmp / "history.sqlite3")))
            print(f"keys={n} entries={cold.entries} decisions={states} ({distinct} distinct in the file) "
                  f"build_cold_s={t_cold:.2f} republish_unchanged_s={t_same:.2f} (same version: {same.reused}) "
                  f"rebuild_one_class_s={t_one:.2f} (new version: {one.version != cold.version}) "
                  f"table_bytes={len(data)} ({len(data) / n:.0f} per key) lua_reload_s={t_lua:.3f} "
                  f"lua_heap_mib={heap:.0f} archive_bytes={arc} ({arc / 2:.0f} per version for 2 versions)",
                  flush=True)
            pub.archive.close()
            handler.close()
            handler.store.close()


if __name__ == "__main__":
    main()
