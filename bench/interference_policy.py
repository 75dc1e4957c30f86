"""Replay, issue 35 item 3: swapaware deciding with a learned interference model against a fixed
prior and against an oracle that knows the truth, under each truth, at 50/70/90 % load
(docs/model.md, "Replay: learned vs prior vs oracle").

Truths (bench/interference_learning.py's): gavel (a 0.58, b 2.9), lucid (a 0.025, b 0.515), tally
(through tally-bench's time-slicing medians); each is the simulator's interference truth in turn
(UTIL model, ``[interference] knee_*``). Policies, all the service's defaults otherwise:

* b0: Slurm's default, whole GPUs (shares nothing: the truth does not touch it; run once per load);
* prior: ``policy.decide`` with a fixed wrong prior: the configured one (Gavel's; ``interference``
  None), or Lucid's fit under the gavel truth (``interference_policy.fixed_view``);
* learned: from the same prior, folding every completed shared run and refitting every
  ``--refit-every`` runs (``interference_policy.LearningSwapAware``);
* warm: learned, from the evidence of earlier replays of the same site (other seeds of the same
  load, until --warm-runs shared runs were folded; its class statistics start empty as every
  other variant's): the policy once the model has seen that many shared runs;
* oracle: the truth as the model (``interference_policy.oracle_view``).

The learning variants observe each shared run's slowdown times lognormal noise sized to the
truth's own fitting error (bench/interference_learning.py's; --no-obs-noise: exact slowdowns);
the runs themselves follow the truth exactly.

Measured per cell (mean over seeds): GPU-hours held by the jobs' runs (runtime x GPUs, or shards /
shards per GPU, every attempt: ``swapaware report``'s gpu_hours_used) and saved = B0's - the
policy's; mean JCT over B0's; jobs slowed past the budget by interference (completed, never
swapped, runtime / solo runtime > policy.max_interference_slowdown); the learned model's error
against the truth (``model_error``, 10 x 10 grid of [0.1, 1]^2) and the shared runs after which
it stays <= --target (checked at each refit; "never": not within the run); the same error over
the (u_self, u_others) of the shared runs the model folded (``site_points``: where the site's
decisions read it); and, per seed, the warm variant's GPU-hours saved less the oracle's.

    .venv/bin/python bench/interference_policy.py                      # alibaba-v2023, 1 seed
    .venv/bin/python bench/interference_policy.py --jobs 1500 --workers 2
    .venv/bin/python bench/interference_policy.py --no-overcommit --loads 0.9   # what-if: no long-queue lift
    .venv/bin/python bench/interference_policy.py --seeds 3 --workers 2         # docs/model.md's table
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interference_learning import grid_mean, truths  # noqa: E402  (bench/interference_learning.py)

from policy_service.config import Config  # noqa: E402
from policy_service.core.interference import KneeParams  # noqa: E402
from policy_service.core.interference_learn import Evidence, Prior, model_error  # noqa: E402
from policy_service.sim.config import SimConfig, load_sim_config, validate_sim_config  # noqa: E402
from policy_service.sim.engine import Engine  # noqa: E402
from policy_service.sim.interference_policy import (LearningSwapAware, Metered, Refit, fixed_view,  # noqa: E402
                                                    oracle_view)
from policy_service.sim.policies import Exclusive, SimPolicy, SwapAware  # noqa: E402
from policy_service.sim.runner import WORKLOADS, RunSpec, calibrate, load_trace  # noqa: E402
from policy_service.sim.workload import Workload, build_workload  # noqa: E402

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DEFAULT_SIM = Path(__file__).resolve().parent / "configs" / "util_declared.toml"
TRUTHS = ("gavel", "lucid", "tally")
VARIANTS = ("prior", "learned", "warm", "oracle")
WARM_SEED = 1000  # warm-up replays use seeds WARM_SEED * seed + pass: never a measured seed
MAX_WARM_PASSES = 12
CONFIGURED = "gavel"  # the service's configured prior (swap_cost.compute_interference_*)


def prior_for(truth: str) -> str:
    """The wrong prior each truth starts from: the configured (Gavel's), or Lucid's under Gavel's truth."""
    return "lucid" if truth == CONFIGURED else CONFIGURED


def truth_sim(sim: SimConfig, name: str, p: KneeParams) -> SimConfig:
    out = dataclasses.replace(sim, interference=dataclasses.replace(
        sim.interference, fit=name if name in ("gavel", "lucid") else "custom", knee_base=p.base, knee_slope=p.slope))
    validate_sim_config(out)
    return out


def obs_sigma(truth: str) -> float:
    """The lognormal sigma whose noise has the truth's own fitting error as its mean absolute error
    (bench/interference_learning.py's Site)."""
    t = truths()[truth]
    return t.noise_mae / grid_mean(t.params) * math.sqrt(math.pi / 2.0)


def make_policy(variant: str, cfg: Config, truth: str, refit_every: int, sigma: float = 0.0, seed: int = 0,
                evidence: Evidence | None = None) -> SimPolicy:
    ts = truths()
    pname = prior_for(truth)
    prior = Prior(pname, ts[pname].params)
    if variant == "b0":
        return Exclusive(cfg)
    if variant == "prior":
        return SwapAware(cfg, None if pname == CONFIGURED else fixed_view(prior, cfg.interference))
    if variant in ("learned", "warm"):
        return LearningSwapAware(cfg, prior, refit_every, sigma, seed, evidence)
    if variant == "oracle":
        return SwapAware(cfg, oracle_view(ts[truth].params, truth))
    raise ValueError(f"unknown variant {variant!r}")


def runs_within(refits: list[Refit], truth: KneeParams, target: float) -> int | None:
    """The folded runs from whose refit on the error stays <= target; None if it never does."""
    errs = [(r.runs, model_error(r.params, truth)) for r in refits]
    for i, (n, _) in enumerate(errs):
        if all(e <= target for _, e in errs[i:]):
            return n
    return None


_STATE: dict[str, Any] = {}


def _workload(seed: int, load: float) -> Workload:
    cache = _STATE.setdefault("workloads", {})
    if (seed, load) not in cache:
        cache.clear()
        spec: RunSpec = _STATE["spec"]
        cache[(seed, load)] = build_workload(_STATE["trace"], load=load, gpus=spec.resolved_gpus(), seed=seed,
                                             sim=_STATE["sim"], gpu=_STATE["cfg"].gpu, noise=None)
    return cache[(seed, load)]


def warm_evidence(seed: int, load: float, truth: str, sim: SimConfig, sigma: float) -> tuple[Evidence, int]:
    """The evidence a learning policy folded over replays of other seeds at ``load`` (a fresh policy
    each, carrying only the evidence on), until _STATE["warm_runs"] shared runs: (evidence, passes)."""
    cfg: Config = _STATE["cfg"]
    ev, passes = None, 0
    while (ev is None or len(ev.obs) < _STATE["warm_runs"]) and passes < MAX_WARM_PASSES:
        pol = make_policy("learned", cfg, truth, _STATE["refit_every"], sigma, WARM_SEED * seed + passes, ev)
        Engine(_workload(WARM_SEED * seed + passes, load), pol, cfg, sim, per_corunner=_STATE["per_corunner"]).run()
        ev, passes = pol.evidence, passes + 1
    return ev, passes


def run_cell(task: tuple[int, float, str, str]) -> dict[str, Any]:
    seed, load, truth, variant = task
    cfg: Config = _STATE["cfg"]
    ts = truths()
    params = ts[truth].params if truth in ts else KneeParams(0.0, 0.0)
    sim = truth_sim(_STATE["sim"], truth, params) if truth in ts else _STATE["sim"]
    sigma = obs_sigma(truth) if truth in ts and _STATE["obs_noise"] else 0.0
    t0 = time.perf_counter()
    ev, passes = warm_evidence(seed, load, truth, sim, sigma) if variant == "warm" else (None, 0)
    pol = make_policy(variant, cfg, truth, _STATE["refit_every"], sigma, seed, ev)
    start = pol.model.params if isinstance(pol, LearningSwapAware) else None  # (the warm evidence's fit)
    meter = Metered(pol)
    w = _workload(seed, load)
    res = Engine(w, meter, cfg, sim, per_corunner=_STATE["per_corunner"]).run()
    budget = cfg.policy.max_interference_slowdown
    done = [r for r in res.records if r.completed]
    reasons = getattr(pol, "reasons", {})
    out = {"task": task, "wall_s": time.perf_counter() - t0, "held_h": meter.gpu_s / 3600.0,
           "jct": statistics.fmean(r.end_s - r.submit_s for r in done) if done else 0.0,
           "over": sum(1 for r in done if r.slowdown > budget and not r.swapped),
           "failed": sum(1 for r in res.records if r.failed), "shared": sum(1 for r in res.records if r.shared),
           "budget_whole": reasons.get("interference_budget", 0),
           "budget_shards": reasons.get("interference_shards", 0),
           "budget_lift": reasons.get("long_queue_over_budget", 0),
           "overcommit": reasons.get("compute_overcommitted", 0)}
    if isinstance(pol, LearningSwapAware):
        site = site_points(pol.evidence) or None  # (None: no shared run, no error to show)
        out.update(folded=pol.folded, within=runs_within(pol.refits, params, _STATE["target"]),
                   err_final=model_error(pol.model.params, params), err_prior=model_error(pol.prior.params, params),
                   warm_runs=len(ev.obs) if ev is not None else 0, warm_passes=passes,
                   err_start=model_error(start, params) if ev else None,
                   site_final=site and model_error(pol.model.params, params, site),
                   site_prior=site and model_error(pol.prior.params, params, site),
                   site_start=site and ev and model_error(start, params, site))
    return out


def site_points(ev: Evidence) -> tuple[tuple[float, float], ...]:
    """The (u_self, u_others) of every shared run the model folded: where this site shares, each
    as often as it did (``model_error`` over them: the error of the predictions its decisions use,
    where the 10 x 10 grid also weighs what its runs never reach)."""
    return tuple((o.u_self, o.u_others) for o in ev.obs)


def _init(state: dict[str, Any]) -> None:
    _STATE.clear()
    _STATE.update(state)


def _mean(cells: list[dict], key: str) -> float:
    return statistics.fmean(c[key] for c in cells)


HEADER = ("| truth | prior | load | B0 GPU-h held | B0 mean JCT s | GPU-h saved vs B0: prior / learned / warm / oracle | "
          "learned vs oracle saved | warm vs oracle saved | mean JCT / B0: prior / learned / warm / oracle | jobs over "
          "budget: prior / learned / warm / oracle | budget decisions (whole or more shards + long queue not lifted): "
          "prior / learned / warm / oracle | long-queue lifts: learned | shared runs learned | runs to err <= target | "
          "model error: prior -> learned | warm: runs before (passes), error at start -> end | error over the site's "
          "shared runs: prior -> learned; warm start -> end | warm - oracle saved, per seed |")


def _opt(cells: list[dict], key: str) -> str:
    """The mean of ``key`` over the cells that have it ("-": none)."""
    have = [c[key] for c in cells if c[key] is not None]
    return f"{statistics.fmean(have):.3f}" if have else "-"


def _all(v: dict[str, list[dict]], fmt) -> str:
    return " / ".join(fmt(v[x]) for x in VARIANTS)


def _vs(saved: dict[str, float], x: str) -> str:
    gap = saved[x] - saved["oracle"]
    return f"{gap:+,.0f}" + (f" ({gap / abs(saved['oracle']):+.0%})" if abs(saved["oracle"]) > 1e-9 else "")


def row(truth: str, load: float, b0: list[dict], v: dict[str, list[dict]]) -> str:
    """One table row: the variants under one truth at one load, against B0."""
    saved = {x: _mean(b0, "held_h") - _mean(v[x], "held_h") for x in VARIANTS}
    lv, wv = v["learned"], v["warm"]
    within = [c["within"] for c in lv]
    cells = [
        truth, prior_for(truth), f"{load:.0%}", f"{_mean(b0, 'held_h'):,.0f}", f"{_mean(b0, 'jct'):,.0f}",
        " / ".join(f"{saved[x]:,.0f}" for x in VARIANTS), _vs(saved, "learned"), _vs(saved, "warm"),
        _all(v, lambda c: f"{_mean(c, 'jct') / _mean(b0, 'jct'):.3f}"),
        _all(v, lambda c: f"{_mean(c, 'over'):.0f}"),
        _all(v, lambda c: f"{_mean(c, 'budget_whole') + _mean(c, 'budget_shards'):.0f} + {_mean(c, 'budget_lift'):.0f}"),
        f"{_mean(lv, 'overcommit'):,.0f}", f"{_mean(lv, 'folded'):,.0f}",
        "never" if None in within else f"{statistics.fmean(within):.0f} ({max(within)})",
        f"{_mean(lv, 'err_prior'):.3f} -> {_mean(lv, 'err_final'):.3f}",
        f"{_mean(wv, 'warm_runs'):,.0f} ({_mean(wv, 'warm_passes'):.1f}), {_mean(wv, 'err_start'):.3f} -> "
        f"{_mean(wv, 'err_final'):.3f}",
        f"{_opt(lv, 'site_prior')} -> {_opt(lv, 'site_final')}; {_opt(wv, 'site_start')} -> {_opt(wv, 'site_final')}",
        " / ".join(f"{o['held_h'] - w['held_h']:+,.0f}" for w, o in zip(wv, v["oracle"]))]
    return "| " + " | ".join(cells) + " |"


def table(cells: dict[tuple, list[dict]], loads: tuple[float, ...]) -> list[str]:
    lines = [HEADER, "|---" * HEADER.count(" | ") + "|---|"]
    for truth in TRUTHS:
        for load in loads:
            lines.append(row(truth, load, cells[(load, "-", "b0")], {x: cells[(load, truth, x)] for x in VARIANTS}))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--workload", choices=WORKLOADS, default="alibaba-v2023")
    ap.add_argument("--jobs", type=int, help="the trace's first N jobs (quick runs)")
    ap.add_argument("--gpus", type=int)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seeds", type=int, default=1, help="mean over this many seeds from --seed")
    ap.add_argument("--loads", type=lambda s: tuple(float(x) for x in s.split(",")), default=(0.5, 0.7, 0.9))
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--sim-config", default=str(DEFAULT_SIM),
                    help="the simulator's config (default: util_declared.toml; 'defaults': measured duty utilisations)")
    ap.add_argument("--refit-every", type=int, default=25)
    ap.add_argument("--target", type=float, default=0.05)
    ap.add_argument("--warm-runs", type=int, default=500, help="shared runs the warm variant learned from first")
    ap.add_argument("--no-obs-noise", action="store_true",
                    help="the learning variants observe exact slowdowns (default: the truth's own fitting error)")
    ap.add_argument("--no-overcommit", action="store_true",
                    help="what-if: policy.overcommit_compute_min_queue = 0 (a long queue no longer lifts the compute "
                         "and interference floors)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cfg = Config()
    if args.no_overcommit:
        cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, overcommit_compute_min_queue=0.0))
    sim = load_sim_config(None if args.sim_config == "defaults" else Path(args.sim_config))
    spec = RunSpec(workload=args.workload, data_dir=args.data_dir if args.data_dir.is_dir() else None,
                   jobs=args.jobs, gpus=args.gpus, seed=args.seed)
    trace, _ = load_trace(spec, sim)
    per_corunner, _ = calibrate(spec, sim)
    state = {"cfg": cfg, "sim": sim, "spec": spec, "trace": trace, "per_corunner": per_corunner,
             "refit_every": args.refit_every, "target": args.target, "warm_runs": args.warm_runs,
             "obs_noise": not args.no_obs_noise}
    seeds = range(args.seed, args.seed + args.seeds)
    tasks = [(s, load, "-", "b0") for s in seeds for load in args.loads]
    tasks += [(s, load, t, v) for s in seeds for load in args.loads for t in TRUTHS for v in VARIANTS]
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers, initializer=_init, initargs=(state,)) as pool:
            results = list(pool.map(run_cell, tasks))
    else:
        _init(state)
        results = [run_cell(t) for t in tasks]
    cells: dict[tuple, list[dict]] = {}
    for r in results:
        cells.setdefault(r["task"][1:], []).append(r)
    ts = truths()
    print("truths: " + "; ".join(f"{n} a {ts[n].params.base:.3f} b {ts[n].params.slope:.3f}" for n in TRUTHS))
    shown = os.path.relpath(args.sim_config) if args.sim_config != "defaults" else "defaults"
    print(f"{args.workload} jobs={len(trace)} gpus={spec.resolved_gpus()} seeds {args.seed}.."
          f"{args.seed + args.seeds - 1} (mean); sim config {shown} (utilisation: {sim.interference.util_source}); "
          f"budget "
          f"policy.max_interference_slowdown {cfg.policy.max_interference_slowdown:g}; refit every "
          f"{args.refit_every} shared runs; target error {args.target:g}; observed slowdowns "
          f"{'exact' if args.no_obs_noise else 'with the truth’s own fitting error'}; warm: {args.warm_runs} runs "
          f"first; [interference] min_runs "
          f"{cfg.interference.min_runs}, min_users {cfg.interference.min_users}, prior_weight "
          f"{cfg.interference.prior_weight:g}; policy.overcommit_compute_min_queue "
          f"{cfg.policy.overcommit_compute_min_queue:g}")
    print()
    print("\n".join(table(cells, args.loads)))
    failed = sum(r["failed"] for r in results)
    print(f"\nfailed jobs over all runs: {failed}; wall {time.perf_counter() - t0:.0f} s "
          f"({sum(r['wall_s'] for r in results):.0f} s of simulation, {args.workers} worker(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
