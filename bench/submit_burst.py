"""A burst of submissions against the real dev cluster: N `sbatch --hold --gres=gpu:1` from 8
parallel submitters, with the plugin off (and the service stopped: a cluster without swapaware),
on, and on with the service hung (SIGSTOP), interleaved
in rounds so machine noise hits every mode alike. Printed per mode: p50/p99 sbatch latency and
their ratios against plugin-off, errors, `squeue` latency sampled during the burst, and for the
modes with swapaware's plugin on: the decisions the history recorded in the round against the
AdminComments Slurm holds (equal: nothing lost, nothing extra).

The dev stack's service polls the queue every 2 s (its tests wait for snapshots); each poll is an
`squeue` that holds slurmctld's job read lock while it packs every job record, which during a
10,000-job burst is a cost the product's default (policy.queue_poll_s = 15) pays a seventh as
often. The bench restarts the service with --queue-poll-s (default: the product's) for the
burst and puts the dev stack's own setting back at the end.

    bash contrib/dev-stack.sh up
    .venv/bin/python bench/submit_burst.py --jobs 10000 --rounds 5
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from submit_overhead import CLUSTER, STACK, set_mode, sh  # noqa: E402  (the modes are switched the same way)

from policy_service.config import PolicyConfig  # noqa: E402

ID_RE = re.compile(r"swapaware:v1 id=([0-9a-f]+)")
MODES = ("off", "on", "hung")
# --modes noop: a job_submit.lua that returns at once (service stopped): what loading any
# job_submit.lua costs or saves in Slurm itself, apart from swapaware.
NOOP_LUA = ("function slurm_job_submit(job_desc, part_list, submit_uid) return slurm.SUCCESS end\n"
            "function slurm_job_modify(job_desc, job_rec, part_list, modify_uid) return slurm.SUCCESS end\n")
STOPPED = ("off", "hung", "noop")  # modes during which the service process is stopped
DECIDING = ("on", "hung")  # modes whose job_submit.lua is swapaware's: decisions checked against Slurm


def stack_env() -> dict[str, str]:
    env = dict(os.environ)
    for line in sh("bash", str(STACK), "env", env=env).splitlines():
        if line.startswith("export "):
            k, _, v = line[len("export "):].partition("=")
            env[k] = v.strip("'\"")
    return env


def percentile(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def submit(env: dict[str, str], tag: str, i: int) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = subprocess.run(["sbatch", "--hold", "--gres=gpu:1", f"--job-name={tag}-{i % 20}", "--wrap=true",
                        "--output=/dev/null"], env=env, capture_output=True, text=True, timeout=120)
    return time.perf_counter() - t0, "" if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")


def squeue_sampler(env: dict[str, str], stop: threading.Event, out: list[float]) -> None:
    while not stop.wait(0.5):
        t0 = time.perf_counter()
        subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, timeout=120)
        out.append(time.perf_counter() - t0)


def held_comments(env: dict[str, str], tag: str) -> set[str]:
    out = sh("squeue", "-h", "-t", "PD", "-n", ",".join(f"{tag}-{k}" for k in range(20)), "-O",
             "admin_comment:400", env=env)
    return {m.group(1) for m in ID_RE.finditer(out)}


def recorded(db: Path, tag: str) -> set[str]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return {r[0] for r in conn.execute("SELECT decision_id FROM decisions WHERE job_name LIKE ?", (f"{tag}-%",))}


def service_pid(env: dict[str, str]) -> int:
    return int((Path(env["SWAPAWARE_DEV_DIR"]) / "run" / "swapaware.pid").read_text())


SUBMIT_RPC_RE = re.compile(r"REQUEST_SUBMIT_BATCH_JOB\s*\(\s*\d+\)\s*count:(\d+)\s+ave_time:(\d+)")


def submit_rpc_us(env: dict[str, str]) -> tuple[int, int]:
    """(count, mean microseconds) of the submit RPCs slurmctld served since `sdiag -r`: the time
    each submission spent inside slurmctld, job_submit and waits for its locks included."""
    m = SUBMIT_RPC_RE.search(sh("sdiag", env=env))
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def block(env: dict[str, str], mode: str, n: int, tag: str, submitters: int) -> dict:
    sh("sdiag", "-r", env=env)
    stop, sq = threading.Event(), []
    sampler = threading.Thread(target=squeue_sampler, args=(env, stop, sq), daemon=True)
    sampler.start()
    # off: a cluster without swapaware, so the service does not run either (its queue poll's
    # squeue calls load slurmctld); hung: the plugin on and the service stopped; noop: a plugin
    # that is not swapaware's.
    if mode in STOPPED:
        os.kill(service_pid(env), signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(submitters) as pool:
            results = list(pool.map(lambda i: submit(env, tag, i), range(n)))
    finally:
        if mode in STOPPED:
            os.kill(service_pid(env), signal.SIGCONT)
        stop.set()
        sampler.join()
    count, mean_us = submit_rpc_us(env)
    out = {"lat": [r[0] for r in results], "errors": [r[1] for r in results if r[1]], "squeue": sq,
           "rpc_us": [mean_us] * count}
    if mode in DECIDING:
        db = Path(env["SWAPAWARE_DEV_DIR"]) / "lib" / "history.sqlite3"
        comments = held_comments(env, tag)
        # Wait for the writer to catch up, and (hung) for what the service decides of the requests
        # slurmctld gave up on while it was stopped: those are the decisions Slurm never held.
        deadline = time.monotonic() + (30 if mode == "on" else 5)
        while time.monotonic() < deadline and (mode == "hung" or not comments <= recorded(db, tag)):
            time.sleep(0.2)
        hist = recorded(db, tag)
        out.update(comments=len(comments), recorded=len(hist), lost=len(comments - hist), extra=len(hist - comments))
    subprocess.run(["scancel", "--user=root", "--state=PENDING"], env=env, timeout=300)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=10_000, help="submissions in all (split over modes and rounds)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--submitters", type=int, default=8)
    ap.add_argument("--modes", default=",".join(MODES), help=f"modes to run, from {MODES + ('noop',)}; off first")
    ap.add_argument("--queue-poll-s", type=float, default=PolicyConfig().queue_poll_s,
                    help="the service's policy.queue_poll_s during the burst (default: the product's)")
    args = ap.parse_args()
    env = stack_env()
    restart_service(env, {"SWAPAWARE_POLICY__QUEUE_POLL_S": str(args.queue_poll_s)})
    try:
        run(args, env)
    finally:
        restart_service(env, {})


def switch(mode: str, env: dict[str, str]) -> None:
    if mode != "noop":
        set_mode("off" if mode == "off" else "on", env)
        return
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "job_submit.lua").write_text(NOOP_LUA)
        sh("bash", str(CLUSTER), "plugin", "on", env={**env, "SWAPAWARE_LUA_DIR": d})


def restart_service(env: dict[str, str], extra: dict[str, str]) -> None:
    sh("bash", str(STACK), "service-stop", env=env)
    sh("bash", str(STACK), "service-start", env={**env, **extra})


def run(args: argparse.Namespace, env: dict[str, str]) -> None:
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or modes[0] != "off" or not set(modes) <= {*MODES, "noop"}:
        raise SystemExit(f"--modes: off first, then any of on, hung, noop (got {args.modes!r})")
    per_block = max(1, args.jobs // (len(modes) * args.rounds))
    stats = {m: {"lat": [], "errors": [], "squeue": [], "rpc_us": [], "comments": 0, "recorded": 0, "lost": 0,
                 "extra": 0}
             for m in modes}
    run_tag = f"burst{int(time.time()) % 100000}"
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else tuple(reversed(modes))):
            switch(mode, env)
            block(env, mode, args.submitters, f"{run_tag}w{r}{mode}", args.submitters)  # warm-up, not counted
            res = block(env, mode, per_block, f"{run_tag}r{r}{mode}", args.submitters)
            for k, v in res.items():
                stats[mode][k] += v
            print(f"round {r + 1}/{args.rounds} {mode:4s}: p50 {1e3 * percentile(res['lat'], 0.5):.1f} ms, "
                  f"p99 {1e3 * percentile(res['lat'], 0.99):.1f} ms, errors {len(res['errors'])}", file=sys.stderr)
    set_mode("on", env)
    base50, base99 = percentile(stats["off"]["lat"], 0.5), percentile(stats["off"]["lat"], 0.99)
    print(f"{per_block * args.rounds} sbatch per mode from {args.submitters} submitters, {args.rounds} interleaved rounds; "
          f"the service polls the queue every {args.queue_poll_s:g} s; off = plugin off and service stopped")
    print(f"{'mode':5s} {'p50 ms':>8s} {'p99 ms':>8s} {'p50/off':>8s} {'p99/off':>8s} {'errors':>7s} "
          f"{'squeue p50/p99 ms':>18s} {'submit RPC us':>14s} {'AdminComments':>14s} {'recorded':>9s} {'lost':>5s} {'extra':>6s}")
    for mode in modes:
        s = stats[mode]
        p50, p99 = percentile(s["lat"], 0.5), percentile(s["lat"], 0.99)
        sq = f"{1e3 * percentile(s['squeue'], 0.5):.0f}/{1e3 * percentile(s['squeue'], 0.99):.0f}"
        rpc = sum(s["rpc_us"]) / len(s["rpc_us"]) if s["rpc_us"] else float("nan")
        tail = ("" if mode not in DECIDING else
                f" {s['comments']:14d} {s['recorded']:9d} {s['lost']:5d} {s['extra']:6d}")
        print(f"{mode:5s} {1e3 * p50:8.1f} {1e3 * p99:8.1f} {p50 / base50:8.3f} {p99 / base99:8.3f} "
              f"{len(s['errors']):7d} {sq:>18s} {rpc:14.0f}{tail}")
        for e in sorted(set(s["errors"]))[:3]:
            print(f"      error: {e[:200]}")
    print("submit RPC us: mean time of a submission inside slurmctld (sdiag), job_submit and lock waits included")
    print("target: p99 on/off <= 1.15; lost = extra = 0")


if __name__ == "__main__":
    main()
