"""The history on SQLite and on MariaDB side by side, in one run (issue 23: Admit latency with
MariaDB vs SQLite). For each backend: the store's ``stats()`` read (what Admit reads), a
``record_decision`` write (one autocommit statement; fenced: in a transaction that locks the lease
row first), and the handler's whole Admit (decide from the history, journal, answer; the writer
thread puts the decisions into the history beside it), each as median and p99 in microseconds,
and the MariaDB/SQLite ratio.

MariaDB: a private server on a Unix socket (tests/mariadb_server.py: needs mariadbd, root), or the
one a config names (--config, [history] backend = "mariadb"; its database must be empty).

    .venv/bin/python bench/history_backends.py [--calls 2000] [--config swapaware.toml]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy_service._generated.swapaware.v1 import policy_pb2 as pb  # noqa: E402
from policy_service.history.store import HistoryStore, ObservationRow  # noqa: E402
from policy_service.config import Config, load_config  # noqa: E402
from policy_service.core.types import ClassStats, KeyLevel  # noqa: E402
from policy_service.serving.handler import PolicyHandler  # noqa: E402
from tests.mariadb_server import MariaDbServer  # noqa: E402
from tests.slurm_cli_fake import RecordingCli  # noqa: E402

GIB = 1024**3


def facts(i: int) -> pb.JobFacts:
    return pb.JobFacts(user=f"user{i % 50}", account="proj", partition="gpu", job_name=f"job{i % 200}",
                       tres_per_node="gres:gpu:1", script_fingerprint=f"{i % 200:016x}", time_limit_min=60)


def timed(fn, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def summary(us: list[float]) -> tuple[float, float]:
    us = sorted(us)
    return statistics.median(us), us[min(len(us) - 1, int(len(us) * 0.99))]


def warm(store: HistoryStore, handler: PolicyHandler) -> None:
    """Every class of the bench learned (stats rows exist for every key Admit reads)."""
    for i in range(200):
        d = handler.admit(pb.AdmitRequest(job=facts(i))).decision
        handler.flush()
        keys = {KeyLevel(k): v for k, v in store.decision(d.decision_id).keys.items()}
        obs = ObservationRow(f"w{i}", i, d.decision_id, "n1", (0,), 1.0, 100.0, 99.0, 0, 3 * GIB, False, 0, False,
                             "fake-nvml", 100.0, f"c/{i}/1", 1)
        store.record_finish(obs, keys, lambda level, s: ClassStats(samples=s.samples + 5, runs=s.runs + 5,
                                                            ewma_peak_bytes=3.0 * GIB, max_peak_bytes=3 * GIB,
                                                            last_peak_bytes=3 * GIB))


def measure(name: str, cfg: Config, store: HistoryStore, calls: int) -> dict[str, tuple[float, float]]:
    handler = PolicyHandler(cfg, store, RecordingCli("24.11"))
    try:
        warm(store, handler)
        keys = next(store.decisions()).keys
        res = {"stats() read": summary(timed(lambda i: store.stats(keys), calls))}

        def write(i: int) -> None:
            store.record_decision(decision_id=f"{name}-w{i}", decided_at=time.time(), job_class="c", user="u",
                                  account="a", partition="p", job_name="n", action="share", shards=2,
                                  model_version="m", keys=keys, facts_pb=b"f" * 200, decision_pb=b"d" * 150)
        res["record_decision"] = summary(timed(write, calls))
        store.fence = "bench"
        store.claim_writer("bench", 600.0)
        res["record_decision fenced"] = summary(timed(lambda i: write(calls + i), calls))
        store.release_writer("bench")
        store.fence = None
        res["Admit (handler)"] = summary(timed(lambda i: handler.admit(pb.AdmitRequest(job=facts(i))), calls))
        handler.flush()
        return res
    finally:
        handler.close()
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--config", type=Path, help="a config whose [history] names the MariaDB to use")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="swapaware-bench-"))
    server = None
    if args.config:
        maria_cfg = load_config(args.config)
    else:
        server = MariaDbServer.start(buffer_pool="512M")  # as the dev cluster's (contrib/dev-cluster/cluster.sh)
        h = server.database("bench")
        maria_cfg = load_config(env={"SWAPAWARE_HISTORY__BACKEND": "mariadb", "SWAPAWARE_HISTORY__UNIX_SOCKET":
                                     h.unix_socket, "SWAPAWARE_HISTORY__DATABASE": h.database, "SWAPAWARE_HISTORY__USER": h.user,
                                     "SWAPAWARE_HISTORY__PASSWORD_FILE": h.password_file,
                                     "SWAPAWARE_SERVICE__DB_PATH": str(tmp / "maria" / "history.sqlite3")})
    try:
        sqlite_cfg = load_config(env={"SWAPAWARE_SERVICE__DB_PATH": str(tmp / "history.sqlite3")})
        results = {
            "sqlite": measure("sqlite", sqlite_cfg, HistoryStore(sqlite_cfg.service.db_path), args.calls),
            "mariadb": measure("mariadb", maria_cfg, HistoryStore(maria_cfg.service.db_path, mariadb=maria_cfg.history),
                               args.calls),
        }
    finally:
        if server is not None:
            server.stop()
    print(f"{args.calls} calls each; microseconds, median / p99 (MariaDB: {maria_cfg.history.where()})")
    print(f"{'operation':<24} {'sqlite':>18} {'mariadb':>18} {'ratio (median)':>15}")
    for op in results["sqlite"]:
        s, m = results["sqlite"][op], results["mariadb"][op]
        print(f"{op:<24} {s[0]:>8.0f} / {s[1]:>7.0f} {m[0]:>8.0f} / {m[1]:>7.0f} {m[0] / s[0]:>14.2f}x")


if __name__ == "__main__":
    main()
