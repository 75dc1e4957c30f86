"""Admit latency over gRPC and over the controller-local socket, and decisions per second
with concurrent clients. The service runs as its own process (`swapaware serve`), exactly as
deployed; clients are separate processes.

    .venv/bin/python bench/admit_latency.py [--calls 2000] [--clients 8] [--seconds 10]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def facts(i: int) -> dict:
    return {"user": f"user{i % 50}", "account": "proj", "partition": "gpu", "jobName": f"job{i % 200}",
            "tresPerNode": "gres:gpu:1", "scriptFingerprint": f"{i % 200:016x}", "timeLimitMin": 60}


def socket_admit(path: str, i: int) -> float:
    line = json.dumps({"method": "Admit", "request": {"job": facts(i)}}).encode() + b"\n"
    t0 = time.perf_counter()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(line)
        reply = s.makefile("rb").readline()
    dt = time.perf_counter() - t0
    if b'"response"' not in reply:
        raise RuntimeError(reply[:200])
    return dt


def grpc_client(address: str):
    from policy_service._generated.swapaware.v1 import policy_pb2 as pb
    from policy_service.serving.client import PolicyClient
    from google.protobuf import json_format

    client = PolicyClient(address, 5.0)

    def admit(i: int) -> float:
        job = json_format.ParseDict(facts(i), pb.JobFacts())
        t0 = time.perf_counter()
        client.admit(job)
        return time.perf_counter() - t0

    return admit


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def worker(kind: str, target: str, seconds: float, seed: int, out: mp.Queue) -> None:
    admit = grpc_client(target) if kind == "grpc" else (lambda i: socket_admit(target, i))
    n, i, end = 0, seed * 100000, time.perf_counter() + seconds
    while time.perf_counter() < end:
        admit(i)
        n, i = n + 1, i + 1
    out.put(n)


def throughput(kind: str, target: str, clients: int, seconds: float) -> float:
    ctx = mp.get_context("spawn")  # gRPC channels do not survive fork
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(kind, target, seconds, k, q)) for k in range(clients)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    total = sum(q.get(timeout=seconds + 60) for _ in procs)
    for p in procs:
        p.join()
    return total / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="swapaware-bench-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "SWAPAWARE_SERVICE__DB_PATH": str(tmp / "h.sqlite3"),
           "SWAPAWARE_SERVICE__SOCKET_PATH": str(tmp / "p.sock"),
           "SWAPAWARE_SERVICE__GRPC_ADDRESS": f"127.0.0.1:{port}", "SWAPAWARE_SERVICE__LOG_LEVEL": "WARNING",
           "SWAPAWARE_SERVICE__SLURM_BACKEND": "cli"}
    svc = subprocess.Popen([str(BIN / "swapaware"), "serve"], env=env, stderr=subprocess.DEVNULL)
    try:
        sock = str(tmp / "p.sock")
        for _ in range(100):
            if os.path.exists(sock):
                break
            time.sleep(0.1)
        grpc_admit = grpc_client(f"127.0.0.1:{port}")
        for i in range(200):  # warm up both paths
            grpc_admit(i)
            socket_admit(sock, i)
        g = [grpc_admit(i) for i in range(args.calls)]
        u = [socket_admit(sock, i) for i in range(args.calls)]
        print(f"Admit latency, {args.calls} sequential calls each (ms):")
        for name, v in (("gRPC", g), ("local socket", u)):
            print(f"  {name:13s} p50 {1e3 * statistics.median(v):6.2f}  p99 {1e3 * pct(v, 0.99):6.2f}  "
                  f"max {1e3 * max(v):6.2f}")
        for kind, target in (("grpc", f"127.0.0.1:{port}"), ("socket", sock)):
            rate = throughput(kind, target, args.clients, args.seconds)
            print(f"decisions/s with {args.clients} concurrent {kind} clients over {args.seconds:.0f} s: {rate:8.0f}")
        print(f"(machine: {os.cpu_count()} CPUs; every Admit writes its decision to SQLite)")
    finally:
        svc.terminate()
        svc.wait(10)


if __name__ == "__main__":
    main()
