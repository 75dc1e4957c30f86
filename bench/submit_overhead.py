"""What the job_submit plugin adds to `sbatch`, measured side by side on the real dev cluster.

Modes (--modes), interleaved in rounds so machine noise hits all of them alike:
  off   JobSubmitPlugins unset
  on    JobSubmitPlugins=lua, policy service up (every GPU job gets a decision by a round trip)
  down  JobSubmitPlugins=lua, policy service stopped (fail-open path + circuit breaker)
  table JobSubmitPlugins=lua deciding from the service's published admission table: the dev stack
        up with SWAPAWARE_DEV_TABLE=1; the jobs' classes are put in the table first (one round-trip
        decision each, then the table waited for; bench/table_mode.py)
  noop  JobSubmitPlugins=lua with a job_submit.lua that returns at once: what any Lua plugin costs
        or saves in Slurm itself, apart from swapaware
  rewrite (with table) a job_submit.lua that at once makes the assignments the table makes for the
        job's class (shards, site factor, an AdminComment of the same length), no swapaware code:
        what Slurm itself spends on a job shaped as swapaware shapes it
Each submission is `sbatch --hold --gres=gpu:1 --wrap=true` timed end to end (the user's
view: process start, RPC to slurmctld, plugin, reply). Held jobs are cancelled after each block.

    bash contrib/dev-stack.sh up && .venv/bin/python bench/submit_overhead.py [--per-mode 240 --rounds 4]
    SWAPAWARE_DEV_TABLE=1 bash contrib/dev-stack.sh up &&
        .venv/bin/python bench/submit_overhead.py --modes off,on,table
        .venv/bin/python bench/submit_overhead.py --modes off,noop,rewrite,table --per-mode 400
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table_mode import NOOP_LUA, rewrite_lua, set_table, table_on, table_sets, warm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STACK = ROOT / "contrib" / "dev-stack.sh"
CLUSTER = ROOT / "contrib" / "dev-cluster" / "cluster.sh"
# off: JobSubmitPlugins unset; on: the plugin, every GPU job a round trip to the service; down: the
# plugin with the service stopped; table: the plugin deciding from the service's published table
# (bench/table_mode.py), the jobs' classes in it; noop: a Lua plugin that returns at once; rewrite:
# one that makes the table's assignments at once.
MODES = ("off", "on", "down", "table", "noop", "rewrite")
NAMES = tuple(f"bench{k}" for k in range(10))


def sh(*argv: str, env: dict[str, str]) -> str:
    r = subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {r.stderr.strip()[-500:]}")
    return r.stdout


def switch(mode: str, env: dict[str, str], rewrite: str = "") -> None:
    """set_mode, with swapaware_plugin.conf's table= on in mode table (the service publishing) and
    off in the plugin's other modes (every GPU job takes the round trip); noop / rewrite: NOOP_LUA /
    ``rewrite`` as the whole job_submit.lua."""
    if mode in ("noop", "rewrite"):
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "job_submit.lua").write_text(NOOP_LUA if mode == "noop" else rewrite)
            sh("bash", str(CLUSTER), "plugin", "on", env={**env, "SWAPAWARE_LUA_DIR": d})
        return
    if mode != "off":
        set_table(env, mode == "table")
    set_mode("on" if mode == "table" else mode, env)


def set_mode(mode: str, env: dict[str, str], lua_dir: Path = ROOT / "slurm_plugin") -> None:
    """off: JobSubmitPlugins unset; on / down: the plugin's Lua from ``lua_dir``, the service up /
    stopped. Every switch restarts slurmctld (a new Lua state, swapaware_plugin.conf read anew)."""
    if mode == "off":
        sh("bash", str(CLUSTER), "plugin", "off", env=env)
        return
    sh("bash", str(CLUSTER), "plugin", "on", env={**env, "SWAPAWARE_LUA_DIR": str(lua_dir)})
    sh("bash", str(STACK), "service-start" if mode == "on" else "service-stop", env=env)


def block(n: int, env: dict[str, str]) -> list[float]:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        r = subprocess.run(["sbatch", "--hold", "--gres=gpu:1", f"--job-name={NAMES[i % len(NAMES)]}", "--wrap=true",
                            "--output=/dev/null"], env=env, capture_output=True, text=True, timeout=60)
        times.append(time.perf_counter() - t0)
        if r.returncode != 0:
            raise SystemExit(f"sbatch failed: {r.stderr}")
    subprocess.run(["scancel", "--user=root", "--state=PENDING"], env=env, timeout=60)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-mode", type=int, default=240, help="submissions per mode (all rounds)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--modes", default="off,on,down",
                    help=f"modes to run, from {MODES}, off first; table needs the dev stack up with SWAPAWARE_DEV_TABLE=1")
    args = ap.parse_args()
    env = dict(os.environ)
    for line in sh("bash", str(STACK), "env", env=env).splitlines():
        if line.startswith("export "):
            k, _, v = line[len("export "):].partition("=")
            env[k] = v.strip("'\"")
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if (not modes or modes[0] != "off" or not set(modes) <= set(MODES)
            or ("rewrite" in modes and "table" not in modes)):
        raise SystemExit(f"--modes: off first, then any of {MODES[1:]}, rewrite only with table (got {args.modes!r})")
    after = "table" if table_on(env) else "on"   # the plugin's mode put back at the end
    rewrite = ""
    if "table" in modes:
        switch("on", env)
        keys: dict[str, str] = {}
        print(f"table warm: the published table held the {len(NAMES)} job classes after "
              f"{warm(env, list(NAMES), keys=keys):.1f} s", file=sys.stderr)
        rewrite = rewrite_lua(table_sets(env, keys))
    samples: dict[str, list[float]] = {m: [] for m in modes}
    per_block = max(1, args.per_mode // args.rounds)
    for r in range(args.rounds):
        order = modes if r % 2 == 0 else tuple(reversed(modes))
        for mode in order:
            switch(mode, env, rewrite)
            block(5, env)  # warm-up after the restart, not counted
            samples[mode] += block(per_block, env)
            print(f"round {r + 1}/{args.rounds} {mode:4s}: median {1e3 * statistics.median(samples[mode][-per_block:]):.1f} ms",
                  file=sys.stderr)
    switch(after, env)
    base = statistics.median(samples["off"])
    print(f"sbatch wall time, {per_block * args.rounds} submissions per mode, {args.rounds} interleaved rounds:")
    for mode in modes:
        v = sorted(samples[mode])
        med, p90 = statistics.median(v), v[int(0.9 * len(v))]
        print(f"  {mode:5s} median {1e3 * med:7.2f} ms  p90 {1e3 * p90:7.2f} ms  ratio vs off {med / base:5.3f}")
    print("target: ratio <= 1.15 for 'on' and for 'down'; <= 1.03 for 'table' (jobs of classes the table holds); "
          "noop and rewrite: Slurm's own share, no swapaware code")


if __name__ == "__main__":
    main()
