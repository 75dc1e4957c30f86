"""Interference truth from two sources: the UTIL model fitted to Gavel's and to Lucid's measured
co-located pairs, each fit scored on both sources, and the simulator's headline figures under
each fit side by side (docs/model.md, "Interference: two sources").

Fits (policy_service.sim.interference_fit): per source, the knee (base and slope free) and the
family linear in the summed utilisation (base 0), plus max(1, u1 + u2) and the named fits of
sim.config.INTERFERENCE_FITS. Gavel records no utilisations: it is fitted and scored by
distribution (solo utilisations assumed ~ U[0, 1]); Lucid measured them: per pair. Held out:
each source split in two halves (Lucid by pair row, Gavel by pair), fitted on one, scored on the other.

Headline: B0 (Slurm's whole GPUs) and swapaware (defaults, and with policy.compute_aware off) at
each load, under each named fit as the truth; the policy's configuration is the service's
defaults in every column. Refusals of the compute rule: decisions kept whole because the job's
learned utilisation needs the whole GPU (compute_bound); compute_shards: charged more shards.

    .venv/bin/python bench/interference_sources.py --lucid <folder with Lucid's colocate_info.csv
        and single_data.csv, or Lucid's repository>        # Lucid's files are not shipped (licence)
    .venv/bin/python bench/interference_sources.py --lucid ... --sim-config bench/configs/util_declared.toml
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from policy_service.config import Config
from policy_service.sim.colocation import PairSource, load_gavel_pairs, load_lucid_pairs
from policy_service.sim.config import INTERFERENCE_FITS, SimConfig, load_sim_config, with_interference_fit
from policy_service.sim.interference_fit import KneeParams, Score, fit_knee, fit_pairs, score_distribution, \
    score_pairs
from policy_service.sim.runner import WORKLOADS, RunSpec, run_matrix

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def fit_source(src: PairSource, half: int | None = None) -> dict[str, KneeParams]:
    """The knee and the linear family fitted to one source (or to one half: 0 or 1)."""
    if src.pairs:
        pairs = src.pairs if half is None else [p for i, p in enumerate(src.pairs) if (i // 2) % 2 == half]
        return {"knee": fit_pairs(pairs).params, "linear": fit_pairs(pairs, fix_base=0.0).params}
    slow = src.slowdowns if half is None else [s for i, s in enumerate(src.slowdowns) if i % 2 == half]
    extra = [s - 1.0 for s in slow]
    knee, lin = fit_knee(extra), fit_knee(extra, fix_base=0.0)
    return {"knee": KneeParams(knee.base, knee.slope), "linear": KneeParams(lin.base, lin.slope)}


def score(params: KneeParams, src: PairSource, half: int | None = None) -> Score:
    if src.pairs:
        pairs = src.pairs if half is None else [p for i, p in enumerate(src.pairs) if (i // 2) % 2 == half]
        return score_pairs(params, pairs)
    slow = src.slowdowns if half is None else [s for i, s in enumerate(src.slowdowns) if i % 2 == half]
    return score_distribution(params, slow)


def _fmt(s: Score) -> str:
    rho = f"{s.spearman:5.2f}" if s.spearman is not None else "  n/a"
    return f"{s.mae:6.3f} {rho} {s.mean_predicted:5.2f}/{s.mean_measured:4.2f}"


def fits_table(sources: list[PairSource]) -> list[str]:
    cands: list[tuple[str, KneeParams]] = [(f"named:{k}", KneeParams(*v)) for k, v in INTERFERENCE_FITS.items()]
    cands.append(("max(1,u1+u2)", KneeParams(0.0, 1.0)))
    for src in sources:
        cands += [(f"{src.name}:{form}", p) for form, p in fit_source(src).items()]
    head = f"{'fit':22s} {'base':>6s} {'slope':>6s}  " + "  ".join(
        f"{src.name + ': MAE   rho  mean pred/meas':>33s}" for src in sources)
    lines = [head]
    for name, p in cands:
        lines.append(f"{name:22s} {p.base:6.3f} {p.slope:6.3f}  " + "  ".join(f"{_fmt(score(p, s)):>33s}"
                                                                         for s in sources))
    lines.append("held out (fit on one half, scored on the other; mean of both ways):")
    for src in sources:
        for form in ("knee", "linear"):
            sc = [score(fit_source(src, h)[form], src, 1 - h) for h in (0, 1)]
            rho = [s.spearman for s in sc if s.spearman is not None]
            lines.append(f"  {src.name}:{form:8s} MAE {sum(s.mae for s in sc) / 2:.3f}"
                         + (f" rho {sum(rho) / 2:.2f}" if rho else ""))
    return lines


def variants() -> list[tuple[str, Config]]:
    base = Config()
    return [("defaults", base),
            ("compute_aware=false", dataclasses.replace(base, policy=dataclasses.replace(base.policy,
                                                                                         compute_aware=False))),
            ("overcommit_compute_min_queue=0.5", dataclasses.replace(base, policy=dataclasses.replace(
                base.policy, overcommit_compute_min_queue=0.5)))]


def mean_cells(per_seed: list[dict[tuple[str, float], dict]]) -> dict[tuple[str, float], dict]:
    """Per cell, the mean over seeds of the numbers the table shows (reason counts included)."""
    out = {}
    for key in per_seed[0]:
        rows = [cells[key] for cells in per_seed]
        codes = {c for r in rows for c in r.get("decision_reasons", {})}
        out[key] = {**{k: sum(r[k] for r in rows) / len(rows) for k in _SHOWN},
                    "decision_reasons": {c: sum(r.get("decision_reasons", {}).get(c, 0) for r in rows) / len(rows)
                                         for c in codes}}
    return out


_SHOWN = ("jct_mean_s", "slowdown_mean", "high_prio_slowdown_p95", "shared_jobs")


def headline(spec: RunSpec, sim: SimConfig, workers: int, seeds: int = 1) -> list[str]:
    by_fit: dict[str, dict[tuple[str, float], dict]] = {}
    for fit in INTERFERENCE_FITS:
        truth = with_interference_fit(sim, fit)
        per_seed = []
        for seed in range(spec.seed, spec.seed + seeds):
            cells: dict[tuple[str, float], dict] = {}
            for vname, cfg in variants():
                pols = spec.policies if vname == "defaults" else ("swapaware",)
                run = dataclasses.replace(spec, policies=pols, seed=seed)
                for r in run_matrix(run, cfg, truth, workers=workers).rows:
                    if r["block"] == "load":
                        cells[("b0" if r["policy"] == "b0" else vname, r["load"])] = r
            per_seed.append(cells)
        by_fit[fit] = mean_cells(per_seed)
    fits = list(INTERFERENCE_FITS)
    lines = ["  ".join([f"{'load':>4s} {'metric':30s}"] + [f"{f:>12s}" for f in fits])]
    for load in spec.loads:
        def row(label: str, fn) -> str:
            return "  ".join([f"{load:>4.0%} {label:30s}"] + [f"{fn(by_fit[f]):>12s}" for f in fits])

        def jct(c, v: str) -> float:
            return c[(v, load)]["jct_mean_s"]

        def why(c, code: str) -> str:
            return f"{c[('defaults', load)]['decision_reasons'].get(code, 0):.0f}"

        lines += [
            row("B0 JCT mean s", lambda c: f"{jct(c, 'b0'):.0f}"),
            row("swapaware JCT mean s", lambda c: f"{jct(c, 'defaults'):.0f}"),
            row("swapaware / B0 JCT", lambda c: f"{jct(c, 'defaults') / jct(c, 'b0'):.3f}"),
            row("swapaware slowdown mean", lambda c: f"{c[('defaults', load)]['slowdown_mean']:.3f}"),
            row("hi-prio slowdown p95", lambda c: f"{c[('defaults', load)]['high_prio_slowdown_p95']:.3f}"),
            row("shared jobs", lambda c: f"{c[('defaults', load)]['shared_jobs']:.0f}"),
            row("compute_bound (kept whole)", lambda c: why(c, "compute_bound")),
            row("compute_shards (charged up)", lambda c: why(c, "compute_shards")),
            row("JCT compute_aware off / dflt", lambda c: f"{jct(c, 'compute_aware=false') / jct(c, 'defaults'):.3f}"),
            row("JCT overcommit at 0.5 / dflt",
                lambda c: f"{jct(c, 'overcommit_compute_min_queue=0.5') / jct(c, 'defaults'):.3f}"),
            "",
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lucid", type=Path, help="folder with Lucid's colocate_info.csv and single_data.csv")
    ap.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--workload", choices=WORKLOADS, default="alibaba-v2023")
    ap.add_argument("--jobs", type=int)
    ap.add_argument("--gpus", type=int)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seeds", type=int, default=1, help="mean over this many seeds from --seed")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--sim-config", type=Path)
    ap.add_argument("--no-sim", action="store_true", help="fits only")
    args = ap.parse_args(argv)
    sources = [load_gavel_pairs(args.data_dir / "gavel")]
    if args.lucid:
        sources.append(load_lucid_pairs(args.lucid))
    else:
        print("no --lucid: Gavel only (Lucid's pairs are not shipped: S-Lab License 1.0, non-commercial)")
    for s in sources:
        files = "; ".join(f"{f['path']} sha256 {f['sha256'][:12]}" + (
            "" if f.get("matches_published", True) else " (NOT the published file)") for f in s.source["files"])
        print(f"{s.name}: {len(s.slowdowns)} measured jobs in pairs ({files}); utilisation {s.source['utilisation']}")
    print("\n".join(fits_table(sources)))
    if args.no_sim:
        return 0
    sim = load_sim_config(args.sim_config)
    spec = RunSpec(workload=args.workload, data_dir=args.data_dir if args.data_dir.is_dir() else None,
                   loads=(0.5, 0.7, 0.9), noises=(), jobs=args.jobs, gpus=args.gpus, seed=args.seed,
                   policies=("b0", "swapaware"))
    print(f"\nheadline: {args.workload} jobs={args.jobs or 'all'} gpus={args.gpus or 'default'} "
          f"seeds {args.seed}..{args.seed + args.seeds - 1} (mean); "
          f"sim config {args.sim_config or 'defaults'} (utilisation: {sim.interference.util_source}); the defaults "
          f"assume fit {SimConfig().interference.fit!r}; policy: the service's defaults")
    print("\n".join(headline(spec, sim, args.workers, args.seeds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
