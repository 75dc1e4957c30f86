"""GPU memory demand: predict a job's peak from its history, and learn from each run.

Prediction (per key, narrowest first, see ``KeyLevel``):
  * exact class / user+name: peak = EWMA of observed peaks; margin = max(min_margin_frac *
    peak, deviation_k * EWMA(|peak - EWMA|)) * margin_multiplier;
  * account / partition (only with ``wide_key_min_samples`` runs, each other user's counting
    at most ``wide_key_min_samples - 1``): peak = the largest per-user peak, another user's held
    to ``wide_key_user_cap`` x the largest of the rest, margin = min_margin_frac * peak * 2 (a
    wide key says little about one job; ``core/wide_key.py``: no single user's runs, however
    large, move the estimate others get past that bound);
  * nothing: unknown -> the policy keeps the whole GPU.
The margin is decoupled from the point estimate: an OOM of a shared job raises the class's
(and user+name's) margin multiplier (compounding, capped, fading) and forces whole-GPU runs; the
point estimate is only raised to at least the failed run's own peak (it needed at least that).
Learning (``observe_key``) folds a run into each of its keys; a wide key also keeps the run in its
user's figure and takes no OOM multiplier.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping

from policy_service.config import EstimatorConfig, GpuConfig
from policy_service.core import wide_key
from policy_service.core.types import (
    ClassStats,
    DemandEstimate,
    EstimateSource,
    JobObservation,
    JobRequest,
    KeyLevel,
    Reason,
    ReasonCode,
)

_NARROW = (KeyLevel.CLASS, KeyLevel.USER_NAME)
GIB = 1024**3


def fmt_bytes(n: float) -> str:
    return f"{n / GIB:.1f}GiB"


_LEVELS = tuple(KeyLevel)  # narrowest first (iterating the Enum itself costs a call per Admit)


def _usable(level: KeyLevel, stats: ClassStats | None, cfg: EstimatorConfig, user: str) -> bool:
    if stats is None:
        return False
    if level in _NARROW:
        return stats.samples >= cfg.min_samples
    return wide_key.evidence(stats, user, cfg) >= cfg.wide_key_min_samples


def usable_level(stats: Mapping[KeyLevel, ClassStats], cfg: EstimatorConfig, user: str) -> KeyLevel | None:
    """The narrowest key whose history the estimate for a job of ``user`` is taken from (None:
    none has enough runs)."""
    return next((lv for lv in _LEVELS if _usable(lv, stats.get(lv), cfg, user)), None)


def _conformal_ratio(ratios: tuple[float, ...], q: float) -> float:
    """The ceil((n+1)q)-th smallest of n ratios (split-conformal quantile); the largest when n
    is too small for q."""
    ordered = sorted(ratios)
    k = math.ceil((len(ordered) + 1) * q)
    return ordered[min(k, len(ordered)) - 1]


def _quantile_ready(s: ClassStats, cfg: EstimatorConfig) -> bool:
    return cfg.recent_runs > 0 and len(s.recent_ratios) >= max(1, cfg.quantile_min_runs)


def _from_stats(level: KeyLevel, s: ClassStats, cfg: EstimatorConfig, user: str) -> tuple[int, int, str]:
    """(peak, margin, how the margin was derived) for a job of ``user``."""
    if level in _NARROW:
        peak = s.ewma_peak_bytes
        if _quantile_ready(s, cfg):
            n = len(s.recent_ratios)
            ratio = max(1 + cfg.quantile_floor_frac, _conformal_ratio(s.recent_ratios, cfg.margin_quantile))
            margin = (ratio - 1) * peak
            how = (f"margin from the {cfg.margin_quantile:.0%} quantile of {n} recent runs' peak/estimate "
                   f"ratios (x{ratio:.2f})")
        else:
            margin = max(cfg.min_margin_frac * peak, cfg.deviation_k * s.ewma_absdev_bytes)
            how = f"margin max({cfg.min_margin_frac:.0%} of peak, {cfg.deviation_k:g} x mean deviation)"
            if s.samples < cfg.cold_samples:
                margin = max(margin, cfg.cold_margin_frac * peak)
                how += f", at least the cold margin {cfg.cold_margin_frac:.0%} ({s.samples} run(s))"
    else:
        wide_peak, which = wide_key.bounded_peak(s, user, cfg)
        peak = float(wide_peak)
        margin = 2 * cfg.min_margin_frac * peak
        how = f"margin {2 * cfg.min_margin_frac:.0%} of the largest peak of {which}"
    if s.margin_multiplier > 1:
        how += f", x{s.margin_multiplier:.2f} after out-of-memory run(s)"
    return int(math.ceil(peak)), int(math.ceil(margin * s.margin_multiplier)), how


def _observed_max(s: ClassStats, cfg: EstimatorConfig) -> int:
    """The largest peak the charge must cover: of the recent runs once the quantile margin is in
    use (an old spike says little about the next run), else of all runs."""
    if _quantile_ready(s, cfg) and s.recent_peaks:
        return max(s.recent_peaks)
    return s.max_peak_bytes


def estimate(req: JobRequest, stats: Mapping[KeyLevel, ClassStats], cfg: EstimatorConfig,
             gpu: GpuConfig) -> DemandEstimate:
    """Predict the job's peak GPU memory with a safety margin, and say why."""
    reasons: list[Reason] = []
    level = usable_level(stats, cfg, req.user)
    class_stats = stats.get(KeyLevel.CLASS)
    observed_max = max((_observed_max(s, cfg) for s in (class_stats, stats.get(KeyLevel.USER_NAME)) if s),
                       default=0)
    if level is None:
        peak, margin, source, samples = 0, 0, EstimateSource.UNKNOWN, 0
    else:
        chosen = stats[level]
        peak, margin, how = _from_stats(level, chosen, cfg, req.user)
        source, samples = level.source, chosen.samples
        code = ReasonCode.ESTIMATE_FROM_HISTORY if level in _NARROW else ReasonCode.ESTIMATE_FROM_WIDER_KEY
        reasons.append(Reason(code, f"peak {fmt_bytes(peak)} + margin {fmt_bytes(margin)} from {samples} "
                                    f"run(s) of key '{level.value}' ({how})"))
    if req.hint_text:
        reasons.append(Reason(ReasonCode.HINT_INVALID, f"ignored hint(s) it could not read: {req.hint_text}"))
    if req.hint_bytes is not None:
        peak, margin, source, hint_reasons = _apply_hint(req.hint_bytes, peak, margin, source, observed_max, cfg, gpu)
        reasons.extend(hint_reasons)
    class_samples = class_stats.samples if class_stats else 0
    if source is EstimateSource.UNKNOWN:
        reasons.append(Reason(ReasonCode.NO_HISTORY, no_history_text(class_samples, cfg)))
    return DemandEstimate(peak_bytes=peak, margin_bytes=margin, source=source, samples=samples,
                          observed_max_bytes=observed_max, reasons=tuple(reasons), class_samples=class_samples)


def no_history_text(class_samples: int, cfg: EstimatorConfig) -> str:
    """Why nothing sizes the job, naming the settings that decide when something will."""
    return (f"{class_samples} observed run(s) of this class, estimator.min_samples = {cfg.min_samples} needed "
            f"(its user+name likewise; its account or partition: estimator.wide_key_min_samples = "
            f"{cfg.wide_key_min_samples})")


def _apply_hint(hint: int, peak: int, margin: int, source: EstimateSource, observed_max: int,
                cfg: EstimatorConfig, gpu: GpuConfig) -> tuple[int, int, EstimateSource, list[Reason]]:
    reasons = []
    if hint > gpu.memory_bytes:
        reasons.append(Reason(ReasonCode.HINT_CAPPED_AT_DEVICE,
                              f"hint {fmt_bytes(hint)} is above the device's {fmt_bytes(gpu.memory_bytes)}; "
                              "capped at the device size"))
        hint = gpu.memory_bytes
    # Only the job's own history (class, user+name) outranks a hint; an account or partition
    # figure says too little about this job to overrule its user.
    narrow = source in (EstimateSource.CLASS, EstimateSource.USER_NAME)
    if narrow and hint < max(peak, observed_max):
        reasons.append(Reason(ReasonCode.HINT_BELOW_HISTORY,
                              f"hint {fmt_bytes(hint)} is below what history shows "
                              f"({fmt_bytes(max(peak, observed_max))}); history wins"))
        return peak, margin, source, reasons
    reasons.append(Reason(ReasonCode.HINT_USED, f"user hint {fmt_bytes(hint)} used as the peak"))
    return hint, int(math.ceil(cfg.min_margin_frac * hint)), EstimateSource.HINT, reasons


def infer_oom(*, reported: bool, failed: bool, peak_bytes: int | None, charged_bytes: int,
              charge_frac: float) -> tuple[bool, str]:
    """Was a finished run out of GPU memory? The node's own evidence counts; otherwise a run
    that failed after growing to ``charge_frac`` of what it was charged (its shards) is taken
    as having hit its cap (a CUDA OOM is an error inside the job: NVML never sees it)."""
    if reported:
        return True, "reported by the node"
    if failed and peak_bytes and charged_bytes and peak_bytes >= charge_frac * charged_bytes:
        return True, (f"failed after reaching {peak_bytes / charged_bytes:.0%} of its "
                      f"{fmt_bytes(charged_bytes)} charge")
    return False, ""


def _ewma(old: float, new: float, alpha: float) -> float:
    return (1 - alpha) * old + alpha * new


def observe_key(level: KeyLevel, s: ClassStats, obs: JobObservation, cfg: EstimatorConfig, user: str) -> ClassStats:
    """Fold one finished run of ``user``'s into the statistics of its key at ``level``: a wide key
    (account, partition) also keeps it in the user's figure and takes no OOM penalty
    (``core/wide_key.py``)."""
    if level not in wide_key.WIDE:
        return observe(s, obs, cfg)
    out = observe(s, obs, cfg, penalize=False)
    if obs.peak_bytes is not None and obs.peak_bytes > 0:
        out = replace(out, users=wide_key.add_run(s, user, obs.peak_bytes))
    return out


def observe(s: ClassStats, obs: JobObservation, cfg: EstimatorConfig, *, penalize: bool = True) -> ClassStats:
    """Fold one finished run into a key's statistics (online learning). ``penalize``: an OOM of a
    shared run raises the margin multiplier and forces whole-GPU runs (False: it is only counted)."""
    a = cfg.ewma_alpha
    ch: dict = {"runs": s.runs + 1}
    ewma, absdev = s.ewma_peak_bytes, s.ewma_absdev_bytes
    if obs.peak_bytes is not None and obs.peak_bytes > 0:
        p = obs.peak_bytes
        if s.samples == 0:
            ewma, absdev = float(p), 0.0
            ratios, peaks = (), ()
        else:
            ratios = s.recent_ratios + ((p / ewma,) if ewma > 0 else ())
            peaks = s.recent_peaks
            absdev, ewma = _ewma(absdev, abs(p - ewma), a), _ewma(ewma, p, a)
        keep = max(0, cfg.recent_runs)
        ch.update(samples=s.samples + 1, max_peak_bytes=max(s.max_peak_bytes, p), last_peak_bytes=p,
                  ewma_peak_bytes=ewma, ewma_absdev_bytes=absdev,
                  recent_ratios=ratios[-keep:] if keep else (), recent_peaks=(peaks + (p,))[-keep:] if keep else ())
        if not obs.oom and s.margin_multiplier > 1:
            ch["margin_multiplier"] = max(1.0, s.margin_multiplier / cfg.margin_multiplier_decay)
    if obs.oom:
        ch["oom_count"] = s.oom_count + 1
        if obs.shared and penalize:
            ch.update(margin_multiplier=min(cfg.max_margin_multiplier, s.margin_multiplier * cfg.oom_margin_multiplier),
                      whole_gpu_runs_left=cfg.oom_whole_gpu_runs,
                      # It needed at least what it had when it died.
                      ewma_peak_bytes=max(ewma, float(obs.peak_bytes or 0)))
        return replace(s, **ch)
    if not obs.shared and s.whole_gpu_runs_left > 0 and obs.exit_code == 0:
        ch["whole_gpu_runs_left"] = s.whole_gpu_runs_left - 1
    if obs.exit_code == 0 and obs.runtime_s > 0:
        if obs.co_runners > 0:
            first = s.shared_runs == 0
            ch.update(shared_runs=s.shared_runs + 1,
                      ewma_shared_runtime_s=obs.runtime_s if first else _ewma(s.ewma_shared_runtime_s, obs.runtime_s, a),
                      ewma_corunners=float(obs.co_runners) if first else _ewma(s.ewma_corunners, obs.co_runners, a))
        else:
            first = s.solo_runs == 0
            ch.update(solo_runs=s.solo_runs + 1,
                      ewma_solo_runtime_s=obs.runtime_s if first else _ewma(s.ewma_solo_runtime_s, obs.runtime_s, a))
            if obs.util_frac is not None:
                u = min(1.0, max(0.0, obs.util_frac))
                ch.update(util_runs=s.util_runs + 1,
                          ewma_solo_util=u if s.util_runs == 0 else _ewma(s.ewma_solo_util, u, a))
    return replace(s, **ch)
