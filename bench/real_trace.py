"""The memory estimator replayed on measured GPU memory series (alibaba-v2026-genai), as the
service would see a recurring job class.

Each container is one class; its series is cut into consecutive windows (``memtrace.cut_runs``),
each window one run whose peak is the window's largest sample. For every run in order:
``estimator.estimate`` before it, the policy's charge derived from the estimate, then
``estimator.observe`` after it. Definitions (printed by ``bench/estimator_accuracy.py``):

  * scored run: the class has >= 1 prior run (the estimator gives an estimate);
  * charge: what ``core.policy._size_shards`` sizes the shards for: peak + margin, raised to the
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


def replay_class(runs: list[Run], cfg: EstimatorConfig, gpu: GpuConfig
                 ) -> list[tuple[str, float, float, int, int, int]]:
    """One class's runs in order: (kind, APE, charge/peak, over, charge bytes, peak bytes) per
    scored run; kind is 'shared' or 'whole'."""
    req, s, out = _req(), ClassStats(), []
    for run in runs:
        peak = run.peak_bytes
        shared, charge = False, 0
        if s.samples >= 1:
            est = estimator.estimate(req, {KeyLevel.CLASS: s}, cfg, gpu)
            charge = max(est.sized_bytes, est.observed_max_bytes)
            ape = abs(est.peak_bytes - peak) / peak
            shared = est.known and s.whole_gpu_runs_left == 0 and charge <= gpu.memory_bytes
            over = int(shared and peak > charge)
            out.append(("shared" if shared else "whole", ape, charge / peak, over, charge, peak))
        if shared and peak > charge:
            oom, _ = estimator.infer_oom(reported=False, failed=True, peak_bytes=charge, charged_bytes=charge,
                                         charge_frac=cfg.oom_charge_frac)
            o = JobObservation(runtime_s=run.t[-1], exit_code=1, peak_bytes=charge, oom=oom, shared=True, co_runners=0)
        else:
            o = JobObservation(runtime_s=run.t[-1], exit_code=0, peak_bytes=peak, oom=False, shared=shared,
                               co_runners=0)
        s = estimator.observe(s, o, cfg)
    return out


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
