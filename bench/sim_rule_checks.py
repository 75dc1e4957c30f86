"""Do the policy rules tuned on the simulator still pay? Each rule switched off against the
defaults, under the simulator's current models (and optionally a --sim-config, e.g.
bench/configs/legacy_models.toml for the models before the fit, util_declared.toml, hard_caps.toml).

Rules: the queue rule (policy.share_min_queue -> 0), the compute floor (policy.compute_aware ->
false), protected QoS (bench/configs/protect_high_qos.toml: whole GPUs for the top QoS, on vs
off). Printed per load: swapaware's mean JCT, its ratio to the default, the highest-priority jobs'
p95 slowdown, OOMs, shared jobs. Nothing here is tuned; it reports.

    .venv/bin/python bench/sim_rule_checks.py --jobs 3000 --gpus 64
    .venv/bin/python bench/sim_rule_checks.py --jobs 3000 --gpus 64 --sim-config bench/configs/legacy_models.toml
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from policy_service.config import Config, load_config
from policy_service.sim.config import load_sim_config
from policy_service.sim.runner import WORKLOADS, RunSpec, run_matrix

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parents[1] / "shared" / "data"


def variants(base: Config) -> list[tuple[str, Config]]:
    p = base.policy
    return [
        ("defaults", base),
        ("share_min_queue=0", dataclasses.replace(base, policy=dataclasses.replace(p, share_min_queue=0.0))),
        ("compute_aware=false", dataclasses.replace(base, policy=dataclasses.replace(p, compute_aware=False))),
        ("protect high QoS", load_config(HERE / "configs" / "protect_high_qos.toml")),
        # Not a rule tuned on the simulator: what waiting for more runs of a class before it
        # shares buys against OOMs (docs/model.md, the estimator's operating curve).
        *((f"estimator.min_samples={n}", dataclasses.replace(base, estimator=dataclasses.replace(
            base.estimator, min_samples=n))) for n in (4, 8)),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=WORKLOADS, default="alibaba-v2023")
    ap.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--jobs", type=int)
    ap.add_argument("--gpus", type=int)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--sim-config", type=Path)
    args = ap.parse_args(argv)
    sim = load_sim_config(args.sim_config)
    spec = RunSpec(workload=args.workload, data_dir=args.data_dir if args.data_dir.is_dir() else None,
                   loads=(0.5, 0.7, 0.9), noises=(), jobs=args.jobs, gpus=args.gpus, seed=args.seed,
                   policies=("swapaware",))
    print(f"sim config: {args.sim_config or 'defaults'}; {args.workload} jobs={args.jobs} gpus={args.gpus} "
          f"seed={args.seed}; swapaware only")
    base_rows = None
    print(f"{'variant':22s} {'load':>5s} {'JCT s':>9s} {'vs default':>10s} {'hi-prio p95':>11s} {'OOM':>5s} "
          f"{'shared':>7s}")
    for name, cfg in variants(Config()):
        rows = [r for r in run_matrix(spec, cfg, sim, workers=args.workers).rows
                if r["policy"] == "swapaware" and r["block"] == "load"]
        rows.sort(key=lambda r: r["load"])
        base_rows = base_rows or rows
        for r, b in zip(rows, base_rows):
            print(f"{name:22s} {r['load']:>5.0%} {r['jct_mean_s']:>9.0f} {r['jct_mean_s'] / b['jct_mean_s']:>10.3f} "
                  f"{r['high_prio_slowdown_p95']:>11.3f} {r['oom_events']:>5.0f} {r['shared_jobs']:>7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
