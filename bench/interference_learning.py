"""Replay: how fast the site's learned interference model (core.interference_learn) reaches the
truth when it starts from the wrong prior (docs/model.md, "Learning the site's interference").

Truths, each the family s(u, v) = 1 + a v + b max(0, u + v - 1):

* gavel: the defaults (a 0.58, b 2.9), Gavel's knee fit; noise: its own fitting error, 0.206;
* lucid: Lucid's per-pair fit (a 0.025, b 0.515); noise: its own fitting MAE, 0.086 (Lucid's
  pairs are not shipped: observations are drawn from the fitted truth);
* tally: derived from tally-bench's medians on one A100 under time-slicing: a training job
  (u = 0.9) next to an inference job (u = 0.3) keeps 0.51 of its solo throughput (s = 1 / 0.51),
  and the inference job's p99 latency grows 2.9x, taken as its slowdown (a pessimistic reading:
  p99 is above the mean); the two equations give (a, b). No per-pair data: the noise is Gavel's
  relative error (0.206 / Gavel's mean 1.77 over the grid below).

Observations: a site of ``--users`` users owning 200 job classes, each class's solo utilisation
drawn uniform on [0.1, 1]; each shared run pairs a random class with one random co-runner class
(v = the co-runner's u); its slowdown is the truth's times lognormal noise (median 1), sized so
that its mean absolute error is the truth's own fitting error (the measured one is printed).
Error: the learned model's mean absolute slowdown difference from the truth over a 10 x 10 grid
of (u, v) midpoints of [0.1, 1]^2 (``model_error``); "within" = that error <= --target (0.05)
at that checkpoint and every later one (checkpoints every 25 runs). Excess: the learned model's
MAE on 2,000 held-out noisy runs less the truth's own MAE on them. Mean (and max) over seeds.

Adversary: one user makes --adv-frac of the runs (0.1 and 0.5) and reports slowdowns inflated --adv-inflate x;
the learned model's error against the truth, that user's influence (``user_influence``), and the
same with the per-user bound off (max_user_share 0.9).

    .venv/bin/python bench/interference_learning.py            # --seeds 3 --runs 1000
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from dataclasses import dataclass

from policy_service.core.interference import KneeParams, knee_slowdown
from policy_service.core.interference_learn import (COMPARE_GRID, Evidence, InterferenceObs, LearnConfig, Prior,
                                                    learn, model_error, observe, user_influence)
from policy_service.sim.interference_policy import runtime_noise

CHECKPOINTS = (25, 50, 100, 200, 500, 1000)
STEP = 25
GAVEL_MEAN = 1.77  # Gavel's mean predicted slowdown under its fit (docs/model.md's table)

# tally-bench, one A100, 12 training x inference pairs, medians under time-slicing
TALLY_U_TRAIN, TALLY_U_INFER = 0.9, 0.3
TALLY_TRAIN_KEEP, TALLY_INFER_P99 = 0.51, 2.9


def tally_params() -> KneeParams:
    """(a, b) through s(0.9, 0.3) = 1 / 0.51 and s(0.3, 0.9) = 2.9 (both above the knee)."""
    over = TALLY_U_TRAIN + TALLY_U_INFER - 1.0
    s_train, s_infer = 1.0 / TALLY_TRAIN_KEEP, TALLY_INFER_P99
    a = (s_infer - s_train) / (TALLY_U_TRAIN - TALLY_U_INFER)
    b = (s_train - 1.0 - a * TALLY_U_INFER) / over
    return KneeParams(a, b)


@dataclass(frozen=True)
class Truth:
    name: str
    params: KneeParams
    noise_mae: float  # the truth's own fitting error (absolute slowdown)


def truths() -> dict[str, Truth]:
    t = tally_params()
    tally_noise = 0.206 / GAVEL_MEAN * grid_mean(t)
    return {"gavel": Truth("gavel", KneeParams(0.58, 2.9), 0.206),
            "lucid": Truth("lucid", KneeParams(0.025, 0.515), 0.086),
            "tally": Truth("tally", t, tally_noise)}


def grid_mean(p: KneeParams) -> float:
    return statistics.fmean(knee_slowdown(u, v, p.base, p.slope) for u, v in COMPARE_GRID)


ROWS = (("gavel", "lucid"), ("lucid", "gavel"), ("tally", "gavel"), ("tally", "lucid"))


class Site:
    """Draws shared runs of one site under one truth."""

    def __init__(self, truth: Truth, seed: int, users: int):
        self.rng = random.Random(seed)
        self.truth = truth
        self.sigma = truth.noise_mae / grid_mean(truth.params) * math.sqrt(math.pi / 2.0)
        self.classes = [(f"user{self.rng.randrange(users)}", f"class{i}", self.rng.uniform(0.1, 1.0))
                        for i in range(200)]

    def run(self, adversary: str = "", adv_frac: float = 0.0, inflate: float = 1.0) -> InterferenceObs:
        other = self.rng.choice(self.classes)
        k = 1.0
        if adversary and self.rng.random() < adv_frac:
            me, k = (adversary, f"{adversary}-{self.rng.randrange(10)}", self.rng.uniform(0.1, 1.0)), inflate
        else:
            me = self.rng.choice(self.classes)
        p = self.truth.params
        s = k * knee_slowdown(me[2], other[2], p.base, p.slope) * runtime_noise(self.rng, self.sigma)
        return InterferenceObs("a100", me[0], me[1], me[2], other[2], s)


def held_out_excess(site: Site, params: KneeParams, n: int = 2000) -> tuple[float, float]:
    """(the truth's own MAE, the learned model's MAE less it) on n fresh noisy runs."""
    runs = [site.run() for _ in range(n)]
    t = site.truth.params
    own = statistics.fmean(abs(knee_slowdown(o.u_self, o.u_others, t.base, t.slope) - o.slowdown) for o in runs)
    mine = statistics.fmean(abs(knee_slowdown(o.u_self, o.u_others, params.base, params.slope) - o.slowdown)
                            for o in runs)
    return own, mine - own


def replay(truth: Truth, prior: Prior, seed: int, runs: int, users: int, cfg: LearnConfig) -> dict:
    site = Site(truth, seed, users)
    ev = Evidence("a100")
    errors: dict[int, float] = {}
    excess = own = None
    fit_ms = 0.0
    for n in range(1, runs + 1):
        ev, _ = observe(ev, site.run(), cfg)
        if n % STEP == 0 or n in CHECKPOINTS:
            t0 = time.perf_counter()
            m = learn(ev, prior, cfg)
            fit_ms = 1000.0 * (time.perf_counter() - t0)
            errors[n] = model_error(m.params, truth.params)
            if n == 500:
                own, excess = held_out_excess(site, m.params)
    return {"errors": errors, "own": own, "excess": excess, "fit_ms": fit_ms, "final": m}


def runs_within(errors: dict[int, float], target: float) -> int | None:
    """The first checkpoint from which the error stays <= target; None if it never does."""
    ns = sorted(errors)
    for i, n in enumerate(ns):
        if all(errors[k] <= target for k in ns[i:]):
            return n
    return None


def adversary(truth: Truth, prior: Prior, seeds: int, runs: int, users: int, cfg: LearnConfig, frac: float,
              inflate: float) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"err": [], "infl": [], "err_loose": [], "infl_loose": []}
    loose = LearnConfig(max_user_share=0.9, max_class_share=0.9)
    for seed in range(1, seeds + 1):
        site = Site(truth, seed, users)
        ev = Evidence("a100")
        for _ in range(runs):
            ev, _ = observe(ev, site.run("mallory", frac, inflate), cfg)
        for tag, c in (("", cfg), ("_loose", loose)):
            out["err" + tag].append(model_error(learn(ev, prior, c).params, truth.params))
            out["infl" + tag].append(user_influence(ev, "mallory", prior, c))
    return out


def _mm(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.3f} ({max(xs):.3f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--users", type=int, default=40)
    ap.add_argument("--target", type=float, default=0.05)
    ap.add_argument("--adv-frac", type=lambda x: [float(f) for f in x.split(",")], default=[0.1, 0.5],
                    help="the adversary's shares of the runs, comma-separated")
    ap.add_argument("--adv-inflate", type=float, default=10.0)
    args = ap.parse_args(argv)
    cfg = LearnConfig()
    ts = truths()
    print("truths: " + "; ".join(f"{t.name} a {t.params.base:.3f} b {t.params.slope:.3f} noise {t.noise_mae:.3f}"
                                  for t in ts.values()))
    print(f"config: prior_weight {cfg.prior_weight:g}, min_runs {cfg.min_runs}, min_users {cfg.min_users}, "
          f"max_user_share {cfg.max_user_share:g}, max_class_share {cfg.max_class_share:g}; "
          f"{args.users} users, {args.seeds} seeds; error: mean (max) over seeds")
    cps = [c for c in CHECKPOINTS if c <= args.runs]
    print()
    print("| truth | prior | prior's error | " + " | ".join(f"{c} runs" for c in cps)
          + f" | runs to <= {args.target:g} | truth's own MAE | excess MAE at 500 | fit ms |")
    print("|---" * (len(cps) + 7) + "|")
    for tname, pname in ROWS:
        truth, prior = ts[tname], Prior(pname, ts[pname].params)
        res = [replay(truth, prior, seed, args.runs, args.users, cfg) for seed in range(1, args.seeds + 1)]
        cells = [_mm([r["errors"][c] for r in res]) for c in cps]
        within = [runs_within(r["errors"], args.target) for r in res]
        within_s = "never" if None in within else f"{statistics.fmean(within):.0f} ({max(within)})"
        own = [r["own"] for r in res if r["own"] is not None]
        exc = [r["excess"] for r in res if r["excess"] is not None]
        print(f"| {tname} | {pname} | {model_error(prior.params, truth.params):.3f} | " + " | ".join(cells)
              + f" | {within_s} | {_mm(own) if own else 'n/a'} | {_mm(exc) if exc else 'n/a'} | "
              f"{statistics.fmean(r['fit_ms'] for r in res):.0f} |")
    print()
    print(f"adversary: one user makes a share of {args.runs} runs, slowdowns x{args.adv_inflate:g}")
    print("| truth | prior | user's share | error, bounded | user's influence, bounded | error, unbounded | "
          "influence, unbounded |")
    print("|---|---|---|---|---|---|---|")
    for frac in args.adv_frac:
        for tname, pname in ROWS[:3]:
            truth, prior = ts[tname], Prior(pname, ts[pname].params)
            a = adversary(truth, prior, args.seeds, args.runs, args.users, cfg, frac, args.adv_inflate)
            print(f"| {tname} | {pname} | {frac:.0%} | {_mm(a['err'])} | {_mm(a['infl'])} | {_mm(a['err_loose'])} | "
                  f"{_mm(a['infl_loose'])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
