"""Accuracy of the memory estimator, replayed online over a history of job runs.

For every run in submit order: ``estimator.estimate`` (before the run), then
``estimator.observe`` (after it), on the same history keys the service uses
(``request.history_keys``). Scored on runs whose class has at least one prior run:
  * median absolute percentage error of the predicted peak      (target <= 10 %)
  * fraction under-predicted beyond the safety margin,
    i.e. true peak > predicted peak + margin                      (target <= 2 %)

Beside it, the same estimator on MEASURED series: ../shared/data/alibaba-v2026-genai, each
container a recurring class, cut into 30-minute and 2-hour runs (bench/real_trace.py gives the
exact definitions: scored, shared and whole-GPU runs, charge, over-run and its OOM feedback).
Before = the previous estimator (EWMA + 3 x mean deviation, all-time observed max, OOM multiplier
that never fades: ``LEGACY``); after = the current defaults. Targets on the real trace: <= 0.5 %
of shared runs over their charge, mean charge <= 1.3 x the run's peak.

The synthetic history is a documented SYNTHETIC model (policy_service.sim.workload.MemoryModel): the data
shipped with the project has no per-job measured GPU memory. The PAI 2020 trace's sensor table
has it (max_gpu_wrk_mem per instance); with the full trace, pass --pai-dir to score on it.

    .venv/bin/python bench/estimator_accuracy.py [--jobs 50000] [--seed 1] [--pai-dir DIR] [--genai-dir DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

from policy_service.config import Config, EstimatorConfig
from policy_service.core import estimator, request
from policy_service.core.types import ClassStats, JobObservation, KeyLevel
from policy_service.sim.alibaba import load_pai_2020
from policy_service.sim.config import SimConfig
from policy_service.sim.loaders import DataNotFound
from policy_service.sim.memtrace import hindsight_charge_floor
from policy_service.sim.workload import build_workload, synthetic_trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import operating_curve as operating_curve_bench  # noqa: E402  (bench/operating_curve.py)
import real_trace  # noqa: E402  (bench/real_trace.py, beside this file)

TARGET_MAPE = 0.10
TARGET_UNDER = 0.02
TARGET_REAL_OVER = 0.005
TARGET_REAL_CHARGE = 1.3
HINDSIGHT_OVER = (0.005, 0.01, 0.02)
# The estimator before the quantile margin (kept to print before/after side by side).
LEGACY = EstimatorConfig(recent_runs=0, margin_multiplier_decay=1.0)


def real_rows(data_dir: Path, variants: list[tuple[str, Config]]) -> None:
    print("Measured series (alibaba-v2026-genai): each container one class, consecutive windows = runs.")
    print("  scored: runs with >= 1 prior run of the class; charge: max(peak + margin, observed max), as")
    print("  core.policy sizes shards (before rounding up to shards); shared: scored runs not on a whole GPU")
    print("  (whole GPU = fewer than min_samples runs, OOM penalty runs, or charge > device memory); over: shared")
    print("  runs whose peak > charge,")
    print("  fed back as an OOM that reached its charge (JobObservation oom=True, shared=True, peak=charge).")
    print("  APE: median over scored runs; charge/peak: mean over shared runs; halves: even/odd containers.")
    try:
        series = real_trace.load_memory(data_dir)
    except DataNotFound as exc:
        print(f"  not scored: {exc}\n")
        return
    print(f"{'window':7s} {'estimator':9s} {'runs':>5s} {'scored':>6s} {'shared':>6s} {'whole':>5s} {'APE':>6s} "
          f"{'over':>6s} {'chg/pk':>6s}  {'over even/odd':>14s} {'chg/pk even/odd':>16s}  verdicts")
    for window in (1800, 7200):
        classes = [r for r in (real_trace.cut_runs(s, window) for s in series) if r]
        for name, cfg in variants:
            r = real_trace.score(classes, cfg.estimator, cfg.gpu)
            halves = [real_trace.score(classes[i::2], cfg.estimator, cfg.gpu) for i in (0, 1)]
            v1, v2 = r.over_frac <= TARGET_REAL_OVER, r.charge_ratio <= TARGET_REAL_CHARGE
            print(f"{window // 60:4d}min {name:9s} {r.runs:5d} {r.scored:6d} {r.shared:6d} {r.whole:5d} "
                  f"{r.mape:6.1%} {r.over_frac:6.2%} {r.charge_ratio:6.2f}  "
                  f"{halves[0].over_frac:6.2%}/{halves[1].over_frac:6.2%} "
                  f"{halves[0].charge_ratio:7.2f}/{halves[1].charge_ratio:5.2f}    "
                  f"over<=0.5%: {verdict(v1)}  chg<=1.3: {verdict(v2)}")
        above = real_trace.above_prior_max(classes, (1.0, 1.3, 1.5))
        print(f"{window // 60:4d}min scored runs above k x the class's largest earlier peak: "
              + ", ".join(f"k={k:g}: {f:.2%}" for k, f in above.items()))
        scored_peaks = [[r.peak_bytes for r in runs[1:]] for runs in classes]
        print(f"{window // 60:4d}min least mean charge/peak of one charge per class chosen in hindsight, "
              "at most x of the runs over: "
              + ", ".join(f"x={f:.1%}: {hindsight_charge_floor(scored_peaks, f):.3f}" for f in HINDSIGHT_OVER))
        operating_curve(classes, variants[-1][1], window)
    print()


def operating_curve(classes, cfg: Config, window: int) -> None:
    """What the defaults trade: the margin floor and the runs a class needs before it shares, in
    over-runs of the charge and in GPU-hours at the shards' cap (bench/operating_curve.py)."""
    print(f"{window // 60:4d}min operating curve (after; only the named settings changed; requeued: shared runs over "
          f"their {cfg.gpu.shard_bytes >> 30} GiB shards' cap, saved/lost GPU-h with requeue_wait_h "
          f"{operating_curve_bench.REQUEUE_WAIT_H:g}):")
    for min_samples in (1, 3, 8):
        cells = []
        for floor in (0.2, 0.35, 0.55):
            setting = operating_curve_bench.Setting(floor, min_samples, cfg.gpu.shard_bytes >> 30)
            est, gpu = operating_curve_bench.configs(setting, cfg)
            r = real_trace.score(classes, est, gpu)
            p = operating_curve_bench.summarise(setting, window, operating_curve_bench.replay(classes, setting, cfg),
                                                operating_curve_bench.REQUEUE_WAIT_H)
            cells.append(f"floor {floor:.2f}: shared {r.shared:4d} over {r.over_frac:5.2%} chg/pk {r.charge_ratio:.2f}"
                         f" requeued {p.requeued_frac:5.2%} saved {p.saved_h:5.1f} lost {p.lost_h:4.1f}")
        print(f"        min_samples {min_samples}: " + " | ".join(cells))


def replay(jobs, cfg: Config) -> dict:
    stats: dict[KeyLevel, dict[str, ClassStats]] = {lv: {} for lv in KeyLevel}
    keys_of: dict[tuple, dict] = {}
    ape: list[float] = []
    under = 0
    scored = 0
    for j in jobs:
        fields = {"tres_per_node": f"gres:gpu:{j.num_gpu}"}
        req, _ = request.job_request(user=j.user, account=j.account, partition="gpu", job_name=j.job_name,
                                     script_fingerprint=j.script_fp, gres_fields=fields)
        ck = (j.user, j.job_name, j.script_fp, j.num_gpu)
        keys = keys_of.get(ck) or keys_of.setdefault(ck, request.history_keys(req))
        have = {lv: stats[lv][k] for lv, k in keys.items() if k in stats[lv]}
        cls = have.get(KeyLevel.CLASS)
        true = j.true_peak_bytes
        if cls is not None and cls.samples >= 1:
            est = estimator.estimate(req, have, cfg.estimator, cfg.gpu)
            scored += 1
            ape.append(abs(est.peak_bytes - true) / true)
            if true > est.peak_bytes + est.margin_bytes:
                under += 1
        obs = JobObservation(runtime_s=j.duration_s, exit_code=0, peak_bytes=true, oom=False, shared=False,
                             co_runners=0)
        for lv, k in keys.items():
            stats[lv][k] = estimator.observe(stats[lv].get(k, ClassStats()), obs, cfg.estimator)
    return {"runs": len(jobs), "scored": scored, "mape": statistics.median(ape) if ape else float("nan"),
            "under_frac": under / scored if scored else float("nan"), "under": under}


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=50000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--noise", default="0.05,0.1,0.25,0.5",
                    help="per-run noise levels (+- fraction of the class's peak); the first is the default model")
    ap.add_argument("--pai-dir", type=Path, help="folder with the full PAI 2020 tables (optional)")
    ap.add_argument("--genai-dir", type=Path, default=real_trace.DEFAULT_DIR,
                    help="folder with alibaba-v2026-genai's pod_gpu_memory_used_bytes_anon.csv")
    args = ap.parse_args(argv)
    cfg, sim = Config(), SimConfig()
    variants = [("before", dataclasses.replace(cfg, estimator=LEGACY)), ("after", cfg)]
    noises = [float(x) for x in args.noise.split(",") if x.strip()]
    print("Estimator accuracy, online replay (estimate before each run, observe after it)")
    print("History: SYNTHETIC (no per-job measured GPU memory in the shipped data; PAI 2020's sensor table has it,")
    print("         see --pai-dir). Model: class peak = declared share x LogNormal(median "
          f"{sim.memory.ratio_median}, sigma {sim.memory.ratio_sigma}) ratio;")
    print(f"         per-run noise +-n uniform; class shift with p={sim.memory.shift_prob} by x"
          f"[{sim.memory.shift_min}, {sim.memory.shift_max}] (log-uniform); seed {args.seed}, {args.jobs} runs.")
    print(f"Estimator config (after): {dataclasses.asdict(cfg.estimator)}")
    print(f"Before: the same with {dict(recent_runs=0, margin_multiplier_decay=1.0)}")
    print()
    real_rows(args.genai_dir, variants)
    print("Synthetic history (under margin = true peak > peak + margin, no observed-max raise):")
    print(f"{'model':34s} {'est':6s} {'runs':>7s} {'scored':>7s} {'median APE':>11s} {'under margin':>13s}  verdicts")
    trace = synthetic_trace(args.jobs, args.seed, sim.workload)
    ok_default = True
    rows = []
    for i, n in enumerate(noises):
        for shift in ((True, False) if i == 0 else (True,)):
            s = sim if shift else dataclasses.replace(sim, memory=dataclasses.replace(sim.memory, shift_prob=0.0))
            w = build_workload(trace, load=0.7, gpus=1000, seed=args.seed, sim=s, gpu=cfg.gpu, noise=n)
            name = f"noise +-{n:.0%}" + ("" if shift else ", no class shifts") + (" (default)" if i == 0 and shift
                                                                                     else "")
            for label, c in (variants if i == 0 and shift else variants[1:]):
                t0 = time.perf_counter()
                r = replay(w.jobs, c)
                v1, v2 = r["mape"] <= TARGET_MAPE, r["under_frac"] <= TARGET_UNDER
                if i == 0 and shift and c is cfg:
                    ok_default = v1 and v2
                rows.append((name, r))
                print(f"{name:34s} {label:6s} {r['runs']:7d} {r['scored']:7d} {r['mape']:10.2%} "
                      f"{r['under_frac']:12.2%}  APE<=10%: {verdict(v1)}  under<=2%: {verdict(v2)}  "
                      f"({time.perf_counter() - t0:.1f}s)")
    if args.pai_dir:
        try:
            loaded = load_pai_2020(args.pai_dir)
        except DataNotFound as exc:
            print(f"\nPAI 2020: {exc}")
        else:
            measured = [j for j in loaded.jobs if j.measured_peak_bytes]
            w = build_workload(measured, load=0.7, gpus=1000, seed=args.seed, sim=sim, gpu=cfg.gpu)
            r = replay(w.jobs, cfg)
            print(f"{'PAI 2020 measured max_gpu_wrk_mem':34s} {r['runs']:7d} {r['scored']:7d} {r['mape']:10.2%} "
                  f"{r['under_frac']:12.2%}  APE<=10%: {verdict(r['mape'] <= TARGET_MAPE)}  "
                  f"under<=2%: {verdict(r['under_frac'] <= TARGET_UNDER)}")
    else:
        print("\nPAI 2020 measured memory: not scored (no --pai-dir; only the table headers ship with the project).")
    print(f"\nTarget (issue 3) on the default synthetic model: {verdict(ok_default)}. The verdict depends on the "
          "assumed run-to-run noise: see the rows above.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
