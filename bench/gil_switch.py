"""Admit latency over the local socket while another thread of the service runs Python, with the
interpreter's default GIL switch interval (5 ms) and the one the service sets
(``server.GIL_SWITCH_INTERVAL_S``), in alternating rounds of one run.

The service side is built as ``swapaware serve`` builds it (PolicyHandler on a real SQLite
history with its journal, ``start_local_socket``); the background thread does what the queue
monitor does at each poll, over a pending queue of ``--pending`` jobs: ``parse_squeue_pending``
on squeue's text and ``queue_state`` (continuously: the worst case, a poll running whenever an
Admit arrives; ``--duty`` < 1 sleeps between polls). The client is another process on one
persistent connection, as job_submit.lua is, sending the facts job_submit.lua sends, one Admit
every ``--gap-ms``.

    .venv/bin/python bench/gil_switch.py [--calls 1000] [--rounds 3] [--pending 10000] [--duty 1.0]
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from policy_service.history.store import HistoryStore
from policy_service.serving.local_socket import start_local_socket
from policy_service.slurm.queue import queue_state
from policy_service.slurm.slurm_text import parse_squeue_pending
from policy_service.config import Config
from policy_service.serving.handler import PolicyHandler
from policy_service.serving.server import GIL_SWITCH_INTERVAL_S

DEFAULT_INTERVAL_S = 0.005  # CPython's


def admit_line(i: int) -> bytes:
    job = {"user": f"user{i % 50}", "uid": 1000 + i % 50, "account": "proj", "partition": "gpu",
           "jobName": f"job{i % 200}", "tresPerNode": "gres:gpu:1", "tresPerJob": "", "tresPerTask": "",
           "tresPerSocket": "", "timeLimitMin": 60, "scriptFingerprint": f"{i % 200:016x}", "workDir": "/home/u/x",
           "comment": "", "envMemHint": "", "minNodes": 1, "numTasks": 1, "isBatch": True, "hetJob": False,
           "qos": "normal"}
    return json.dumps({"method": "Admit", "request": {"job": job, "brief": True,
                                                      "plugin": {"instance": "bench", "breakerOpen": 0,
                                                                 "serviceError": 0}}}).encode() + b"\n"


def squeue_text(n: int) -> str:
    return "".join(f"{1000 + i}|gres:gpu:1|N/A|N/A|1|1|normal|{'Resources' if i % 3 else 'JobHeldUser'}\n"
                   for i in range(n))


def client(path: str, calls: int, gap_s: float, start: mp.Event, out: mp.Queue, rounds: int) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        f = s.makefile("rb")
        for r in range(rounds):
            start.wait()
            start.clear()
            lat = []
            for i in range(calls):
                line = admit_line(r * calls + i)
                t0 = time.perf_counter()
                s.sendall(line)
                reply = f.readline()
                lat.append(time.perf_counter() - t0)
                if b'"response"' not in reply:
                    raise RuntimeError(reply[:200])
                time.sleep(gap_s)
            out.put(lat)


def background(text: str, duty: float, stop: threading.Event) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        queue_state(parse_squeue_pending(text), total_gpus=64, shards_per_gpu=8)
        if duty < 1:
            time.sleep((time.perf_counter() - t0) * (1 - duty) / duty)


def pct(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=1000, help="Admits per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per interval (alternating)")
    ap.add_argument("--pending", type=int, default=10000, help="pending jobs in the polled queue")
    ap.add_argument("--duty", type=float, default=1.0, help="fraction of the time the poll thread runs")
    ap.add_argument("--gap-ms", type=float, default=1.0, help="pause between Admits (slurmctld's own work)")
    ap.add_argument("--intervals-ms", default="", help="more switch intervals to compare, e.g. 1,0.5")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as d:
        store = HistoryStore(Path(d) / "history.sqlite3")
        handler = PolicyHandler(Config(), store, None)
        path = Path(d) / "policy.sock"
        server, _ = start_local_socket(handler, path)
        text = squeue_text(args.pending)
        t0 = time.perf_counter()
        parse_squeue_pending(text)
        poll_ms = (time.perf_counter() - t0) * 1e3
        stop = threading.Event()
        bg = threading.Thread(target=background, args=(text, args.duty, stop), daemon=True)
        bg.start()
        start, out = mp.Event(), mp.Queue()
        extra = [float(x) / 1e3 for x in args.intervals_ms.split(",") if x.strip()]
        intervals = list(dict.fromkeys([DEFAULT_INTERVAL_S, GIL_SWITCH_INTERVAL_S, *extra]))
        proc = mp.Process(target=client, args=(str(path), args.calls, args.gap_ms / 1e3, start, out,
                                               args.rounds * len(intervals)))
        proc.start()
        got: dict[float, list[float]] = {iv: [] for iv in intervals}
        for _ in range(args.rounds):
            for iv in intervals:
                sys.setswitchinterval(iv)
                start.set()
                got[iv].extend(out.get(timeout=600))
        proc.join(30)
        stop.set()
        bg.join()
        server.shutdown()
        handler.close()
        store.close()
    print(f"Admit over the local socket, {args.calls} x {args.rounds} per interval, alternating; a poll thread "
          f"parsing {args.pending} pending jobs ({poll_ms:.0f} ms a poll alone), duty {args.duty:.0%}")
    base = got[DEFAULT_INTERVAL_S]
    for iv in intervals:
        v = got[iv]
        print(f"  switch interval {iv * 1e3:5.2f} ms: p50 {statistics.median(v) * 1e6:7.0f} us  "
              f"p99 {pct(v, 0.99) * 1e6:7.0f} us  max {max(v) * 1e6:7.0f} us  "
              f"(p50 ratio {statistics.median(v) / statistics.median(base):.2f}, "
              f"p99 ratio {pct(v, 0.99) / pct(base, 0.99):.2f} against 5 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
