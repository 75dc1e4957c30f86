"""The memory estimator replayed on measured GPU memory series (alibaba-v2026-genai), as the
service would see a recurring job class.

Each container is one class; its series is cut into consecutive windows (``memtrace.cut_runs``),
each window one run whose peak is the window's largest sample. For every run in order:
``estimator.estimate`` before it, the policy's charge derived from the estimate, then
``estimator.observe`` after it. Definitions (printed by ``bench/estimator_accuracy.py``):

  * scored run: the class has >= 1 prior run (the estimator gives an estimate);
  * charge: what ``core.shard_sizing._size_shards`` sizes the shards for: peak + margin, raised to the
    estimate's observed maximum (``need``), before rounding up to whole shards;
  * whole-GPU run: a scored run the policy keeps on a whole GPU: the estimate is unknown (fewer
    than ``min_samples`` runs), the class is serving its OOM penalty (``whole_gpu_runs_left``) or
    the charge is above the device (GpuConfig memory);
    it cannot over-run, and it is not counted among the shared runs;
  * shared run: every other scored run (charge <= device size);
  * over-run: a shared run whose peak is above its charge. It is fed back as the service would
    see it: the job died at its cap, having reached the charge (``infer_oom`` on a failed run
    with peak = charge), i.e. ``JobObservation(oom=True, shared=True, peak_bytes=charge)``:
    the estimator never learns the run's true peak, only that it needed more than the charge.
    Other runs are fed back with their true peak (shared=True when shared, else False).

Scores: median APE of the point estimate (all scored runs), over-run fraction of shared runs,
mean charge / peak over shared runs.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from policy_service.config import EstimatorConfig, GpuConfig
from policy_service.core import estimator
from policy_service.core.request import job_request
from policy_service.core.types import ClassStats, JobObservation, KeyLevel
from policy_service.sim.memtrace import Run, cut_runs, load_memory

DEFAULT_DIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "alibaba-v2026-genai"


@dataclass(frozen=True)
class Score:
    runs: int
    scored: int
    shared: int
    whole: int
    mape: float
    over: int
    charge_ratio: float

    @property
    def over_frac(self) -> float:
        return self.over / self.shared if self.shared else float("nan")


def _req():
    r, _ = job_request(user="u", account="a", partition="p", job_name="n", script_fingerprint="f",
                       gres_fields={"tres_per_node": "gres:gpu:1"})
    return r


@dataclass(frozen=True)
class Replayed:
    """One scored run as the replay saw it."""

    shared: bool
    ape: float  # |point estimate - peak| / peak
    charge_bytes: int  # max(peak + margin, observed max), before rounding up to shards
    peak_bytes: int
    shards: int  # shards the run holds: ceil(charge / shard), at least 1; 0 when on a whole GPU
    shards_per_gpu: int
    shard_bytes: int
    limit_bytes: int  # where it dies: the charge, or the shards' bytes (cap) with at_cap
    over_at_s: float | None  # first sample above limit_bytes (s from the window start); None: fits
    runtime_s: float  # the window's last sample (s from the window start)

    @property
    def cap_bytes(self) -> int:
        """The bytes of the shards it holds (what a hard cap enforces); 0 on a whole GPU."""
        return self.shards * self.shard_bytes

    @property
    def over(self) -> bool:
        return self.shared and self.over_at_s is not None


def first_above(run: Run, limit_bytes: int) -> float | None:
    """When in the run its memory first went above ``limit_bytes`` (s from the window start)."""
    return next((t for t, v in zip(run.t, run.v) if v > limit_bytes), None)


def replay_outcomes(runs: list[Run], cfg: EstimatorConfig, gpu: GpuConfig, at_cap: bool = False,
                    requeue: bool = False) -> list[Replayed]:
    """One class's runs in order, each scored run's outcome. ``at_cap``: a shared run dies when it
    goes above the bytes of the shards it holds (ceil(charge / shard) x shard, what a hard cap
    enforces) and is fed back as an OOM at that cap; else (the estimator's own score) when it goes
    above its charge, fed back as an OOM at the charge. ``requeue``: a run that died is rerun on a
    whole GPU and that rerun is observed too, as the service observes both runs of a requeued job
    (its true peak, exit 0, not shared: the class learns the peak and serves one penalty run)."""
    req, s, out = _req(), ClassStats(), []
    shard, spg = gpu.shard_bytes, gpu.shards_per_gpu
    for run in runs:
        peak, rec = run.peak_bytes, None
        if s.samples >= 1:
            est = estimator.estimate(req, {KeyLevel.CLASS: s}, cfg, gpu)
            charge = max(est.sized_bytes, est.observed_max_bytes)
            shared = est.known and s.whole_gpu_runs_left == 0 and charge <= spg * shard
            k = max(1, math.ceil(charge / shard)) if shared else 0
            limit = k * shard if at_cap else charge
            rec = Replayed(shared, abs(est.peak_bytes - peak) / peak, charge, peak, k, spg, shard, limit,
                           first_above(run, limit) if shared else None, run.t[-1])
            out.append(rec)
        if rec is not None and rec.over:
            oom, _ = estimator.infer_oom(reported=False, failed=True, peak_bytes=rec.limit_bytes,
                                         charged_bytes=rec.limit_bytes, charge_frac=cfg.oom_charge_frac)
            o = JobObservation(runtime_s=run.t[-1], exit_code=1, peak_bytes=rec.limit_bytes, oom=oom, shared=True,
                               co_runners=0)
            if requeue:
                s = estimator.observe(s, o, cfg)
                o = JobObservation(runtime_s=run.t[-1], exit_code=0, peak_bytes=peak, oom=False, shared=False,
                                   co_runners=0)
        else:
            o = JobObservation(runtime_s=run.t[-1], exit_code=0, peak_bytes=peak, oom=False,
                               shared=bool(rec and rec.shared), co_runners=0)
        s = estimator.observe(s, o, cfg)
    return out


def replay_class(runs: list[Run], cfg: EstimatorConfig, gpu: GpuConfig
                 ) -> list[tuple[str, float, float, int, int, int]]:
    """One class's runs in order: (kind, APE, charge/peak, over, charge bytes, peak bytes) per
    scored run; kind is 'shared' or 'whole'."""
    return [("shared" if r.shared else "whole", r.ape, r.charge_bytes / r.peak_bytes, int(r.over), r.charge_bytes,
             r.peak_bytes) for r in replay_outcomes(runs, cfg, gpu)]


def score(classes: list[list[Run]], cfg: EstimatorConfig, gpu: GpuConfig) -> Score:
    rows = [r for runs in classes for r in replay_class(runs, cfg, gpu)]
    sh = [r for r in rows if r[0] == "shared"]
    return Score(runs=sum(len(c) for c in classes), scored=len(rows), shared=len(sh), whole=len(rows) - len(sh),
                 mape=statistics.median(r[1] for r in rows) if rows else float("nan"),
                 over=sum(r[3] for r in sh),
                 charge_ratio=statistics.fmean(r[2] for r in sh) if sh else float("nan"))


def load_classes(data_dir: Path, window_s: float) -> list[list[Run]]:
    return [runs for runs in (cut_runs(s, window_s) for s in load_memory(data_dir)) if runs]


def above_prior_max(classes: list[list[Run]], factors: tuple[float, ...]) -> dict[float, float]:
    """For each factor k: the fraction of scored runs whose peak is above k x the largest peak of
    all the class's earlier runs. No estimator that charges at most k x that maximum can over-run
    less often: a floor under the over-run fraction that any tight charge must pay."""
    pairs = [(runs[i].peak_bytes, max(r.peak_bytes for r in runs[:i])) for runs in classes
             for i in range(1, len(runs))]
    return {k: sum(p > k * m for p, m in pairs) / len(pairs) if pairs else float("nan") for k in factors}
