"""What the job_submit plugin adds to `sbatch`, measured side by side on the real dev cluster.

Three modes, interleaved in rounds so machine noise hits all of them alike:
  off   JobSubmitPlugins unset
  on    JobSubmitPlugins=lua, policy service up (every GPU job gets a decision)
  down  JobSubmitPlugins=lua, policy service stopped (fail-open path + circuit breaker)
Each submission is `sbatch --hold --gres=gpu:1 --wrap=true` timed end to end (the user's
view: process start, RPC to slurmctld, plugin, reply). Held jobs are cancelled after each block.

    bash contrib/dev-stack.sh up && .venv/bin/python bench/submit_overhead.py [--per-mode 240 --rounds 4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STACK = ROOT / "contrib" / "dev-stack.sh"
CLUSTER = ROOT / "contrib" / "dev-cluster" / "cluster.sh"


def sh(*argv: str, env: dict[str, str]) -> str:
    r = subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {r.stderr.strip()[-500:]}")
    return r.stdout


def set_mode(mode: str, env: dict[str, str]) -> None:
    if mode == "off":
        sh("bash", str(CLUSTER), "plugin", "off", env=env)
        return
    sh("bash", str(CLUSTER), "plugin", "on", env={**env, "SWAPAWARE_LUA_DIR": str(ROOT / "slurm_plugin")})
    sh("bash", str(STACK), "service-start" if mode == "on" else "service-stop", env=env)


def block(n: int, env: dict[str, str]) -> list[float]:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        r = subprocess.run(["sbatch", "--hold", "--gres=gpu:1", f"--job-name=bench{i % 10}", "--wrap=true",
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
    args = ap.parse_args()
    env = dict(os.environ)
    for line in sh("bash", str(STACK), "env", env=env).splitlines():
        if line.startswith("export "):
            k, _, v = line[len("export "):].partition("=")
            env[k] = v.strip("'\"")
    modes = ("off", "on", "down")
    samples: dict[str, list[float]] = {m: [] for m in modes}
    per_block = max(1, args.per_mode // args.rounds)
    for r in range(args.rounds):
        order = modes if r % 2 == 0 else tuple(reversed(modes))
        for mode in order:
            set_mode(mode, env)
            block(5, env)  # warm-up after the restart, not counted
            samples[mode] += block(per_block, env)
            print(f"round {r + 1}/{args.rounds} {mode:4s}: median {1e3 * statistics.median(samples[mode][-per_block:]):.1f} ms",
                  file=sys.stderr)
    set_mode("on", env)
    base = statistics.median(samples["off"])
    print(f"sbatch wall time, {per_block * args.rounds} submissions per mode, {args.rounds} interleaved rounds:")
    for mode in modes:
        v = sorted(samples[mode])
        med, p90 = statistics.median(v), v[int(0.9 * len(v))]
        print(f"  {mode:5s} median {1e3 * med:7.2f} ms  p90 {1e3 * p90:7.2f} ms  ratio vs off {med / base:5.3f}")
    print("target: ratio <= 1.15 for 'on' and for 'down'")


if __name__ == "__main__":
    main()
