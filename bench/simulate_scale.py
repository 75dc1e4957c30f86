"""Scale target: simulating 100k jobs on 1,000 GPUs takes under 60 s on this machine.

Times, for each policy, one simulation of the synthetic workload (100,000 jobs, 1,000 GPUs,
70 % offered load): building the workload + running the engine, in this process, one core.

    .venv/bin/python bench/simulate_scale.py [--jobs 100000] [--gpus 1000] [--policies b0,swapaware]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from policy_service.config import Config
from policy_service.sim.config import SimConfig
from policy_service.sim.engine import Engine
from policy_service.sim.metrics import summarize
from policy_service.sim.policies import POLICIES, make_policy
from policy_service.sim.report import Progress
from policy_service.sim.workload import build_workload, synthetic_trace

LIMIT_S = 60.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=100_000)
    ap.add_argument("--gpus", type=int, default=1000)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--per-corunner", type=float, default=0.474, help="compute interference (Gavel v100 median)")
    args = ap.parse_args(argv)
    cfg, sim = Config(), SimConfig()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{sys.version.split()[0]}, {platform.platform()}")
    t0 = time.perf_counter()
    trace = synthetic_trace(args.jobs, args.seed, sim.workload)
    t_trace = time.perf_counter() - t0
    print(f"synthetic trace: {args.jobs} jobs in {t_trace:.1f}s; {args.gpus} GPUs; offered load {args.load:.0%}")
    print(f"{'policy':10s} {'build s':>8s} {'run s':>8s} {'total s':>8s} {'events':>9s} {'jobs/s':>8s} "
          f"{'completed':>9s} {'failed':>7s}  < {LIMIT_S:.0f} s")
    ok_all = True
    for name in [p.strip() for p in args.policies.split(",") if p.strip()]:
        t1 = time.perf_counter()
        w = build_workload(trace, load=args.load, gpus=args.gpus, seed=args.seed, sim=sim, gpu=cfg.gpu)
        t_build = time.perf_counter() - t1
        bar = Progress(sys.stderr.isatty(), label=name)
        pol = make_policy(name, cfg)
        t2 = time.perf_counter()
        res = Engine(w, pol, cfg, sim, per_corunner=args.per_corunner,
                     progress=lambda d: bar(d, len(w.jobs))).run()
        t_run = time.perf_counter() - t2
        bar.close()
        s = summarize(res, w)
        total = t_build + t_run
        ok = total < LIMIT_S
        ok_all &= ok
        print(f"{name:10s} {t_build:8.1f} {t_run:8.1f} {total:8.1f} {res.events:9d} {len(w.jobs) / total:8.0f} "
              f"{s['completed']:9d} {s['failed']:7d}  {'PASS' if ok else 'FAIL'}")
    print(f"\nscale target (each simulation < {LIMIT_S:.0f} s): {'PASS' if ok_all else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
