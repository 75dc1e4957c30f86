"""A burst of submissions against the real dev cluster: N `sbatch --hold --gres=gpu:1` from 8
parallel submitters, with the plugin off (and the service stopped: a cluster without swapaware),
on, and on with the service hung (SIGSTOP), interleaved
in rounds so machine noise hits every mode alike. Printed per mode: p50/p99 sbatch latency and
their ratios against plugin-off, errors, `squeue` latency sampled during the burst, and for the
modes with swapaware's plugin on: the decisions the history recorded in the round against the
AdminComments Slurm holds (equal: nothing lost, nothing extra).

--modes table: the plugin decides from the service's published admission table (the dev stack up
with SWAPAWARE_DEV_TABLE=1). Every mode submits the same 20 job names, whose classes are put in
the table before the rounds (one round-trip decision each, then the table waited for:
bench/table_mode.py), so in mode table every job is a table hit; the history learns those
decisions from Slurm afterwards (catch-up after each queue poll), and the bench waits for it:
"catch-up s" is how long after the block's last sbatch the history held every AdminComment id.
--modes tstop: the same with the service stopped during the block (SIGSTOP, as off, noop and hung),
so that what is left is slurmctld's and the Lua's own cost; the history catches up after SIGCONT.
--modes tbase (with --baseline REV): mode tstop with the plugin's Lua files of git revision REV (or
of a directory: table_mode.plugin_files), so that the plugin before and after a change are
measured side by side in one run.
--modes tnull: job_submit.lua as in tstop (swapaware's modules loaded, the timing wrapper) but the
timed call returns at once: what loading the plugin costs apart from deciding (compare with noop).
--modes rewrite (with table or tstop): a job_submit.lua that at once makes the assignments the
table makes for the job's name (shards, site factor, an AdminComment of the same length, disguised
so that the service never takes it for a decision), service stopped: what slurmctld spends on a job
shaped as swapaware shapes it, apart from swapaware's Lua (rewrite - noop; tstop - rewrite is the Lua).
Modes on, hung, table, tstop and tbase run the plugin under a job_submit.lua that times swapaware.submit
inside slurmctld (lua-socket's clock, logged every 16 calls): "Lua us/job".

The dev stack's service polls the queue every 2 s (its tests wait for snapshots); each poll is an
`squeue` that holds slurmctld's job read lock while it packs every job record, which during a
10,000-job burst is a cost the product's default (policy.queue_poll_s = 15) pays a seventh as
often. The bench restarts the service with --queue-poll-s (default: the product's) for the
burst and puts the dev stack's own setting back at the end.

    bash contrib/dev-stack.sh up
    .venv/bin/python bench/submit_burst.py --jobs 10000 --rounds 5
    SWAPAWARE_DEV_TABLE=1 bash contrib/dev-stack.sh up
    .venv/bin/python bench/submit_burst.py --jobs 750 --rounds 2 --modes off,noop,on,table,tstop
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
from table_mode import (BATCH, NOOP_LUA, lua_us, log_size, rewrite_lua, set_table, table_on,  # noqa: E402
                        table_sets, timed_lua_dir, wait_gate_after, warm)

from proc_cpu import cpu_s, user_cpu_s  # noqa: E402

from policy_service.config import PolicyConfig  # noqa: E402

ID_RE = re.compile(r"swapaware:v1 id=([0-9a-f]+)")
MODES = ("off", "on", "hung")
# --modes noop: table_mode.NOOP_LUA, service stopped.
# tstop: mode table with the service stopped during the block (what the table path costs slurmctld
# without the service's queue polls, catch-up and publisher competing for the controller's CPUs;
# the history catches up once it runs again).
TABLE = ("table", "tstop", "tbase")  # modes deciding from the table
STOPPED = ("off", "hung", "noop", "tstop", "tbase", "rewrite", "tnull")  # modes during which the service process is stopped
DECIDING = ("on", "hung", *TABLE)  # modes whose job_submit.lua is swapaware's: decisions checked against Slurm
NAMES = 20  # job names (classes) every mode submits: {run_tag}-0 .. -19


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
    r = subprocess.run(["sbatch", "--hold", "--gres=gpu:1", f"--job-name={tag}-{i % NAMES}", "--wrap=true",
                        "--output=/dev/null"], env=env, capture_output=True, text=True, timeout=120)
    return time.perf_counter() - t0, "" if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")


def squeue_sampler(env: dict[str, str], stop: threading.Event, out: list[float]) -> None:
    while not stop.wait(0.5):
        t0 = time.perf_counter()
        subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, timeout=120)
        out.append(time.perf_counter() - t0)


def held_comments(env: dict[str, str], tag: str) -> tuple[set[str], int]:
    """The decision ids of the pending jobs of ``tag``, and how many were made from the table."""
    out = sh("squeue", "-h", "-t", "PD", "-n", ",".join(f"{tag}-{k}" for k in range(NAMES)), "-O",
             "admin_comment:400", env=env)
    return {m.group(1) for m in ID_RE.finditer(out)}, out.count(" tbl=")


def recorded(db: Path, tag: str, since: float) -> set[str]:
    """The decisions of ``tag``'s job names decided (Slurm's SubmitTime for table decisions, whole
    seconds) since ``since``."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return {r[0] for r in conn.execute("SELECT decision_id FROM decisions WHERE job_name LIKE ? AND decided_at >= ?",
                                           (f"{tag}-%", int(since) - 1))}


def service_pid(env: dict[str, str]) -> int:
    return int((Path(env["SWAPAWARE_DEV_DIR"]) / "run" / "swapaware.pid").read_text())


def ctld_pid(env: dict[str, str]) -> int:
    return int((Path(env["SWAPAWARE_DEV_DIR"]) / "run" / "slurmctld.pid").read_text())


def controller_cpu(env: dict[str, str]) -> tuple[float, float, float]:
    """(slurmctld's, the service's) CPU seconds so far: their own pids' utime + stime; then
    slurmctld's utime alone. Its stime is mostly the kernel creating each job's state files, and
    swings 2x from block to block on ext4 (measured with perf on the dev cluster: inode allocation
    stepping over the inodes of jobs purged in the last minute, ext4's recently_deleted), whatever
    the plugin does; its utime holds the plugin's Lua and Slurm's own work."""
    ctld = ctld_pid(env)
    return cpu_s(ctld), cpu_s(service_pid(env)), user_cpu_s(ctld)


SUBMIT_RPC_RE = re.compile(r"REQUEST_SUBMIT_BATCH_JOB\s*\(\s*\d+\)\s*count:(\d+)\s+ave_time:(\d+)")


def submit_rpc_us(env: dict[str, str]) -> tuple[int, int]:
    """(count, mean microseconds) of the submit RPCs slurmctld served since `sdiag -r`: the time
    each submission spent inside slurmctld, job_submit and waits for its locks included."""
    m = SUBMIT_RPC_RE.search(sh("sdiag", env=env))
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


AGENT_RE = re.compile(r"DBD Agent queue size:\s*(\d+)")


def settle(env: dict[str, str], timeout_s: float = 60) -> float:
    """Wait until slurmctld's queue of records for slurmdbd is empty (the jobs of the block before,
    cancelled, and the mode switch's restart): every block starts from the same state, whatever
    came before it (a mode that waited for its catch-up would otherwise start on a quieter
    slurmctld). Seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        m = AGENT_RE.search(sh("sdiag", env=env))
        if m is None or m.group(1) == "0":
            break
        time.sleep(0.2)
    return time.monotonic() - t0


def block(env: dict[str, str], mode: str, n: int, tag: str, submitters: int, catchup_s: float,
          before: frozenset[str] = frozenset(), sample_squeue: bool = True, window_s: float = 0.0) -> dict:
    """One block of ``n`` submissions in ``mode``. ``before``: the ids of the block just before
    with the same job names (decided within a second of this one's start, not extra). The CPU
    of slurmctld and of the service is counted from the first submission until the history holds
    the block's decisions (the table's catch-up included) and at least ``window_s`` after the last
    submission, the same in every mode (the service's queue polls and their squeue in slurmctld
    counted alike; off: the service stays stopped until then), before the jobs are cancelled."""
    settle(env)
    sh("sdiag", "-r", env=env)
    since, log_at = time.time(), log_size(env)
    stop, sq = threading.Event(), []
    sampler = threading.Thread(target=squeue_sampler, args=(env, stop, sq), daemon=True)
    if sample_squeue:
        sampler.start()
    cpu0, t_cpu0 = controller_cpu(env), time.monotonic()
    # off: a cluster without swapaware, so the service does not run either (its queue poll's
    # squeue calls load slurmctld); hung: the plugin on and the service stopped; noop: a plugin
    # that is not swapaware's.
    resume_late = mode in STOPPED and mode not in DECIDING  # no decision to catch up: stopped through the window
    if mode in STOPPED:
        os.kill(service_pid(env), signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(submitters) as pool:
            results = list(pool.map(lambda i: submit(env, tag, i), range(n)))
    finally:
        if mode in STOPPED and not resume_late:
            os.kill(service_pid(env), signal.SIGCONT)
        stop.set()
        if sample_squeue:
            sampler.join()
    ended = time.monotonic()
    count, mean_us = submit_rpc_us(env)
    lua_n, lua_sum = lua_us(env, log_at)
    out = {"lat": [r[0] for r in results], "errors": [r[1] for r in results if r[1]], "squeue": sq,
           "rpc_us": [mean_us] * count, "lua_n": lua_n, "lua_us": lua_sum, "ids": frozenset()}
    if mode in DECIDING:
        db = Path(env["SWAPAWARE_DEV_DIR"]) / "lib" / "history.sqlite3"
        comments, by_table = held_comments(env, tag)
        # Wait for the writer (table: the catch-up after the service's next queue poll) to catch
        # up, and (hung) for what the service decides of the requests slurmctld gave up on while it
        # was stopped: those are the decisions Slurm never held.
        deadline = ended + {"on": 30, "hung": 5}.get(mode, catchup_s)
        while time.monotonic() < deadline and (mode == "hung" or not comments <= recorded(db, tag, since)):
            time.sleep(0.2)
        caught = time.monotonic() - ended
        hist = recorded(db, tag, since) - before
        out.update(comments=len(comments), recorded=len(hist), lost=len(comments - hist), extra=len(hist - comments),
                   by_table=by_table, catchup_s=[caught], ids=frozenset(comments))
    while time.monotonic() < ended + window_s:
        time.sleep(0.2)
    cpu1, t_cpu1 = controller_cpu(env), time.monotonic()
    if resume_late:
        os.kill(service_pid(env), signal.SIGCONT)
    out.update(ctld_cpu=cpu1[0] - cpu0[0], svc_cpu=cpu1[1] - cpu0[1], ctld_user=cpu1[2] - cpu0[2], submitted=n,
               window_s=(t_cpu1 - t_cpu0) if mode not in STOPPED else 0.0)
    subprocess.run(["scancel", "--user=root", "--state=PENDING"], env=env, timeout=300)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=10_000, help="submissions in all (split over modes and rounds)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--submitters", type=int, default=8)
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"modes to run, from {MODES + ('noop', 'rewrite', 'tnull', *TABLE)}; off first")
    ap.add_argument("--queue-poll-s", type=float, default=PolicyConfig().queue_poll_s,
                    help="the service's policy.queue_poll_s during the burst (default: the product's)")
    ap.add_argument("--idle-s", type=float, default=30,
                    help="seconds the service's CPU is read with nothing submitted, before the rounds")
    ap.add_argument("--baseline", default="", help="mode tbase: the git revision (or directory) whose plugin files it runs")
    ap.add_argument("--no-squeue", action="store_true",
                    help="no squeue sampled during the blocks (its calls load slurmctld alike in every mode)")
    ap.add_argument("--catchup-timeout-s", type=float, default=300,
                    help="mode table: how long to wait after a block for the history to hold its decisions")
    args = ap.parse_args()
    env = stack_env()
    after = "table" if table_on(env) else "on"   # the plugin's mode put back at the end
    restart_service(env, {"SWAPAWARE_POLICY__QUEUE_POLL_S": str(args.queue_poll_s)})
    try:
        with tempfile.TemporaryDirectory() as d:
            base = timed_lua_dir(Path(d) / "base", args.baseline) if args.baseline else None
            run(args, env, timed_lua_dir(Path(d) / "tree"), base, timed_lua_dir(Path(d) / "null", null=True))
    finally:
        restart_service(env, {})
        set_table(env, after == "table")
        set_mode("on", env)


def switch(mode: str, env: dict[str, str], lua_dir: Path, rewrite: str = "", base_dir: Path | None = None,
           null_dir: Path | None = None) -> None:
    """off: no plugin; noop: a job_submit.lua that returns at once; rewrite: ``rewrite`` (one that
    makes the table's assignments at once); on / hung: swapaware's plugin (timed, from ``lua_dir``),
    every GPU job a round trip; table: the same deciding from the table; tbase: the table path with
    the plugin files of ``base_dir``."""
    if mode == "off":
        set_mode("off", env)
    elif mode in ("noop", "rewrite"):
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "job_submit.lua").write_text(NOOP_LUA if mode == "noop" else rewrite)
            sh("bash", str(CLUSTER), "plugin", "on", env={**env, "SWAPAWARE_LUA_DIR": d})
    else:
        set_table(env, mode in TABLE or mode == "tnull")
        dirs = {"tbase": base_dir, "tnull": null_dir}
        set_mode("on", env, dirs.get(mode) or lua_dir)


def restart_service(env: dict[str, str], extra: dict[str, str]) -> None:
    sh("bash", str(STACK), "service-stop", env=env)
    sh("bash", str(STACK), "service-start", env={**env, **extra})


def run(args: argparse.Namespace, env: dict[str, str], lua_dir: Path, base_dir: Path | None = None,
        null_dir: Path | None = None) -> None:
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if (not modes or modes[0] != "off" or not set(modes) <= {*MODES, "noop", "rewrite", "tnull", *TABLE}
            or ("rewrite" in modes and not set(TABLE) & set(modes)) or (("tbase" in modes) != (base_dir is not None))):
        raise SystemExit(f"--modes: off first, then any of on, hung, noop, table, tstop, tnull, rewrite (with table "
                         f"or tstop), tbase (with --baseline, and only with it) (got {args.modes!r})")
    per_block = max(1, args.jobs // (len(modes) * args.rounds))
    stats = {m: {"lat": [], "errors": [], "squeue": [], "rpc_us": [], "comments": 0, "recorded": 0, "lost": 0,
                 "extra": 0, "lua_n": 0, "lua_us": 0.0, "by_table": 0, "catchup_s": [], "ctld_cpu": 0.0,
                 "svc_cpu": 0.0, "ctld_user": 0.0, "submitted": 0, "window_s": 0.0}
             for m in modes}
    tag = f"burst{int(time.time()) % 100000}"   # every block submits the job names {tag}-0 .. -{NAMES - 1}
    rewrite = ""
    if set(TABLE) & set(modes):
        switch("on", env, lua_dir)
        keys: dict[str, str] = {}
        took = warm(env, [f"{tag}-{k}" for k in range(NAMES)], keys=keys)
        print(f"table warm: the published table held the {NAMES} job classes {took:.1f} s after their "
              f"round-trip decisions", file=sys.stderr)
        rewrite = rewrite_lua(table_sets(env, keys))
    # the service's CPU with nothing submitted (its queue polls, the catch-up's squeue, the table's
    # publisher): what it spends per second whatever the submissions, taken out of a block's share below
    switch("on", env, lua_dir)
    settle(env)
    c0, t0 = cpu_s(service_pid(env)), time.monotonic()
    time.sleep(args.idle_s)
    idle_rate = (cpu_s(service_pid(env)) - c0) / (time.monotonic() - t0)
    print(f"service idle: {1e3 * idle_rate:.1f} ms CPU per s over {args.idle_s:g} s (queue polls every "
          f"{args.queue_poll_s:g} s)", file=sys.stderr)
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else tuple(reversed(modes))):
            switch(mode, env, lua_dir, rewrite, base_dir, null_dir)
            if mode in TABLE:  # slurmctld restarted (and up by now): its plugin uses the table from the next
                wait_gate_after(env, time.time())  # queue snapshot on
            # not counted; BATCH calls: the timed job_submit.lua (a new Lua state at each switch)
            # logs its first sum at the warm-up's end, so the block's sums are its own
            warmup = block(env, mode, max(args.submitters, BATCH), tag, args.submitters, args.catchup_timeout_s,
                           sample_squeue=not args.no_squeue)
            res = block(env, mode, per_block, tag, args.submitters, args.catchup_timeout_s, warmup["ids"],
                        not args.no_squeue, args.queue_poll_s + 1)
            for k, v in res.items():
                if k != "ids":
                    stats[mode][k] += v
            catchup = f", caught up {res['catchup_s'][0]:.1f} s" if mode in DECIDING else ""
            print(f"round {r + 1}/{args.rounds} {mode:6s}: p50 {1e3 * percentile(res['lat'], 0.5):.1f} ms, "
                  f"p99 {1e3 * percentile(res['lat'], 0.99):.1f} ms, errors {len(res['errors'])}{catchup}",
                  file=sys.stderr)
    report(args, modes, per_block, stats, idle_rate)


def report(args: argparse.Namespace, modes: tuple[str, ...], per_block: int, stats: dict, idle_rate: float) -> None:
    base50, base99 = percentile(stats["off"]["lat"], 0.5), percentile(stats["off"]["lat"], 0.99)
    rpc_off = mean(stats["off"]["rpc_us"])
    print(f"{per_block * args.rounds} sbatch per mode from {args.submitters} submitters, {args.rounds} interleaved rounds; "
          f"the service polls the queue every {args.queue_poll_s:g} s; off = plugin off and service stopped")
    print(f"{'mode':6s} {'p50 ms':>8s} {'p99 ms':>8s} {'p50/off':>8s} {'p99/off':>8s} {'errors':>7s} "
          f"{'squeue p50/p99 ms':>18s} {'submit RPC us':>14s} {'RPC/off':>8s} {'Lua us/job':>11s} "
          f"{'AdminComments':>14s} {'by table':>9s} {'recorded':>9s} {'lost':>5s} {'extra':>6s} {'catch-up s max':>15s}")
    for mode in modes:
        s = stats[mode]
        p50, p99 = percentile(s["lat"], 0.5), percentile(s["lat"], 0.99)
        sq = f"{1e3 * percentile(s['squeue'], 0.5):.0f}/{1e3 * percentile(s['squeue'], 0.99):.0f}"
        rpc = mean(s["rpc_us"])
        lua = f"{s['lua_us'] / s['lua_n']:11.1f}" if s["lua_n"] else f"{'-':>11s}"
        tail = ("" if mode not in DECIDING else
                f" {s['comments']:14d} {s['by_table']:9d} {s['recorded']:9d} {s['lost']:5d} {s['extra']:6d} "
                f"{max(s['catchup_s']):15.1f}")
        print(f"{mode:6s} {1e3 * p50:8.1f} {1e3 * p99:8.1f} {p50 / base50:8.3f} {p99 / base99:8.3f} "
              f"{len(s['errors']):7d} {sq:>18s} {rpc:14.0f} {rpc / rpc_off:8.3f} {lua}{tail}")
        for e in sorted(set(s["errors"]))[:3]:
            print(f"      error: {e[:200]}")
    print(f"{'mode':6s} {'slurmctld CPU us/job':>21s} {'service CPU us/job':>19s} {'sum us/job':>11s} {'sum/off':>8s} "
          f"{'slurmctld user us/job':>22s} {'user+service/off':>17s} {'service less idle us/job':>25s}")
    off = stats["off"]
    off_cpu = (off["ctld_cpu"] + off["svc_cpu"]) / max(1, off["submitted"])
    off_user = (off["ctld_user"] + off["svc_cpu"]) / max(1, off["submitted"])
    for mode in modes:
        s = stats[mode]
        per = [1e6 * s[k] / max(1, s["submitted"]) for k in ("ctld_cpu", "svc_cpu", "ctld_user")]
        print(f"{mode:6s} {per[0]:21.0f} {per[1]:19.0f} {per[0] + per[1]:11.0f} {(per[0] + per[1]) / 1e6 / off_cpu:8.3f} "
              f"{per[2]:22.0f} {(per[2] + per[1]) / 1e6 / max(off_user, 1e-9):17.3f} "
              f"{1e6 * (s['svc_cpu'] - idle_rate * s['window_s']) / max(1, s['submitted']):25.0f}")
    print(f"CPU: utime + stime of slurmctld's and the service's own pids (/proc), per submission, from a block's first "
          f"sbatch until the history held its decisions and at least queue_poll_s + 1 = {args.queue_poll_s + 1:g} s "
          "after its last (every mode alike); off: the service stopped throughout (a cluster without swapaware); "
          "slurmctld user: its utime alone (its stime, the kernel writing each job's state files, swings 2x between "
          "blocks on ext4 whatever the plugin does); service less idle: its CPU less what it spends idle "
          f"({1e3 * idle_rate:.1f} ms/s, measured before the rounds) over the block's window")
    print("submit RPC us: mean time of a submission inside slurmctld (sdiag), job_submit and lock waits included; "
          "Lua us/job: swapaware.submit timed inside slurmctld")
    print("targets: table: submit RPC/off <= 1.15, p50/off and p99/off <= 1.05, Lua <= 100 us/job; lost = extra = 0")


def mean(v: list[float]) -> float:
    return sum(v) / len(v) if v else float("nan")


if __name__ == "__main__":
    main()
