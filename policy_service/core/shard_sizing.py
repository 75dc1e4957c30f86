"""How many shards a single-GPU job is charged: its estimate raised to the observed peak and to
its learned compute, oversubscribed where the victim's slowdown stays within budget (and the
nodes enforce it), against the shard counts of the GPUs it can land on; and a whole GPU held as
all shards of one GPU. Pure, as all of core/ (used by ``route`` and ``policy.decide``)."""
from __future__ import annotations

import math
from typing import Mapping

from policy_service.config import AccessClass, Config, Oversubscription, WholeGpuAsShards
from policy_service.core.enforcement import EnforcementView
from policy_service.core import estimator, swapcost
from policy_service.core.interference_learn import LearnedModel
from policy_service.core.interference_rule import budget_shards, co_runner_room, model_line
from policy_service.core.dialect import SlurmDialect
from policy_service.core.types import Action, ClassStats, DemandEstimate, JobRequest, KeyLevel, Reason, ReasonCode


def _shards_needed(nbytes: int, shard_bytes: int) -> int:
    return max(1, math.ceil(nbytes / shard_bytes))


def solo_utilisation(stats: Mapping[KeyLevel, ClassStats]) -> tuple[float, KeyLevel] | None:
    """Learned GPU utilisation of the job's runs alone on a GPU (class first, then user+name)."""
    for level in (KeyLevel.CLASS, KeyLevel.USER_NAME):
        s = stats.get(level)
        if s is not None and s.util_runs > 0:
            return s.ewma_solo_util, level
    return None


def _oversubscribe(need_bytes: int, full_shards: int, access: AccessClass, cfg: Config, min_shards: int = 1
                   ) -> tuple[int, float, int] | None:
    """Fewest shards in [min_shards, full_shards) whose worst-case victim slowdown stays within budget."""
    link = cfg.swap_cost.link_bytes_per_s(cfg.gpu.link)
    for k in range(max(1, min_shards), full_shards):
        offloaded = need_bytes - k * cfg.gpu.shard_bytes
        slow = swapcost.victim_slowdown(need_bytes, offloaded, access, link, cfg.swap_cost)
        if slow <= cfg.policy.max_victim_slowdown:
            return k, slow, offloaded
    return None


def oversubscription_gate(cfg: Config, view: EnforcementView | None) -> tuple[bool, Reason | None]:
    """Whether a decision may charge fewer shards than the need, and why not. ``auto``: only where
    the nodes enforce victim semantics (``view``); a caller with no view of the nodes (None: the
    simulator, what-ifs) is not gated."""
    setting = Oversubscription(cfg.policy.allow_oversubscription)
    if setting is Oversubscription.OFF:
        return False, None
    if setting is Oversubscription.ON or view is None or view.victim_enforced:
        return True, None
    return False, Reason(ReasonCode.OVERSUBSCRIPTION_NOT_ENFORCED,
                         f"not oversubscribed: {view.summary} (policy.allow_oversubscription = auto)")


def shard_counts(req: JobRequest, cfg: Config) -> tuple[int, ...]:
    """Shard counts of the GPUs the job can land on, distinct and sorted (gpu.shards_per_gpu where
    the fleet is not known). A shard is gpu.shard_bytes on every GPU: a GPU with more memory has more."""
    return req.gpu_shard_counts if req.gpu_shard_counts is not None else (cfg.gpu.shards_per_gpu,)


def shards_refused_reason(req: JobRequest) -> Reason:
    """Why a job that could share keeps its request: the controller in control refuses shard jobs
    on every GPU it can land on (req.shards_refused, from the live counts: LiveShards)."""
    shown = "; ".join(req.shards_refused[:3]) + (f"; and {len(req.shards_refused) - 3} more nodes"
                                                  if len(req.shards_refused) > 3 else "")
    return Reason(ReasonCode.SHARDS_REFUSED, f"not shared: Slurm would refuse a shard job where it can land "
                                             f"({shown}); the request stays")


def _of_gpus(counts: tuple[int, ...], shard: int) -> str:
    """How the GPUs a job can land on are cut, for reasons: "8 shards" or "4 or 8 shards"."""
    return f"{' or '.join(map(str, counts))} shards of {estimator.fmt_bytes(shard)}"


def _interference_floor(u: float, level: KeyLevel, k: int, spg: int, model: LearnedModel | None, cfg: Config
                        ) -> tuple[int | None, Reason | None]:
    """The shards the interference budget asks for (interference_rule.budget_shards): (k, None)
    when k keeps it within budget or there is no budget or model; (k', reason) when more; (None,
    reason) when only a whole GPU does."""
    budget = cfg.policy.max_interference_slowdown
    if model is None or budget <= 0 or k >= spg:
        return k, None
    kk, slow = budget_shards(u, k, spg, model, budget)
    if kk == k:
        return k, None
    if kk is None:
        return None, Reason(ReasonCode.INTERFERENCE_BUDGET,
                            f"alone on a GPU it kept it {u:.0%} busy ({level.value} history): beside even one shard's "
                            f"co-runner the site's model predicts it {slow:.2f}x slower, more than "
                            f"policy.max_interference_slowdown {budget:.2f}x: whole GPU ({model_line(model)})")
    return kk, Reason(ReasonCode.INTERFERENCE_SHARDS,
                      f"charged {kk} of {spg} shards (not {k}) so that co-runners keep the GPU at most "
                      f"{co_runner_room(kk, spg):.0%} busy: predicted {slow:.2f}x slower <= "
                      f"policy.max_interference_slowdown {budget:.2f}x ({model_line(model)})")


def _size_shards(est: DemandEstimate, access: AccessClass, cfg: Config,
                 util: tuple[float, KeyLevel] | None, enforcement: EnforcementView | None,
                 counts: tuple[int, ...], model: LearnedModel | None = None
                 ) -> tuple[Action, int, float, int, list[Reason]]:
    """(action, shards, slowdown, offloaded bytes, reasons) for a single-GPU job with an estimate.
    ``counts``: the shard counts of the GPUs it can land on (shard_counts, not empty). The job is
    sized against the largest of them; Slurm places k shards only on a GPU that has k free.
    ``model``: the site's interference model for the job's GPU type (None: no interference budget)."""
    reasons = []
    may_oversubscribe, not_enforced = oversubscription_gate(cfg, enforcement)
    need = est.sized_bytes
    if est.observed_max_bytes > need:
        reasons.append(Reason(ReasonCode.RAISED_TO_OBSERVED_MAX,
                              f"raised to the largest observed peak {estimator.fmt_bytes(est.observed_max_bytes)}"))
        need = est.observed_max_bytes
    spg, shard = max(counts), cfg.gpu.shard_bytes
    if need > spg * shard:
        where = "the device's" if len(counts) == 1 else "the largest GPU it can land on,"
        reasons.append(Reason(ReasonCode.TOO_LARGE_TO_SHARE,
                              f"{estimator.fmt_bytes(need)} is more than {where} "
                              f"{estimator.fmt_bytes(spg * shard)}: whole GPU"))
        return Action.WHOLE_GPU, 0, 1.0, 0, reasons
    k = _shards_needed(need, shard)
    k_compute = 1
    if util is not None and cfg.policy.compute_aware:
        u, level = util
        k_compute = max(1, math.ceil(u * spg - 1e-9))
        if k_compute >= spg:
            reasons.append(Reason(ReasonCode.COMPUTE_BOUND,
                                  f"alone on a GPU it kept it {u:.0%} busy ({level.value} history): it needs the "
                                  "whole GPU's compute"))
            return Action.WHOLE_GPU, 0, 1.0, 0, reasons
        if k_compute > k:
            reasons.append(Reason(ReasonCode.COMPUTE_SHARDS,
                                  f"alone on a GPU it kept it {u:.0%} busy ({level.value} history): charged "
                                  f"{k_compute} of {spg} shards so the jobs on a GPU ask for no more than its compute"))
            k = k_compute
    if util is not None and cfg.policy.compute_aware:  # co-runners charged for their compute: v is bounded
        k_interference, why = _interference_floor(util[0], util[1], max(k, k_compute), spg, model, cfg)
        if k_interference is None:
            reasons.append(why)
            return Action.WHOLE_GPU, 0, 1.0, 0, reasons
        if why is not None:
            reasons.append(why)
            k = k_compute = k_interference
    over = _oversubscribe(need, min(k, spg), access, cfg, k_compute) if may_oversubscribe else None
    if not_enforced is not None and _oversubscribe(need, min(k, spg), access, cfg, k_compute) is not None:
        reasons.append(not_enforced)  # it would have been oversubscribed: sized to the need instead
    if over is not None:
        k2, slow, off = over
        reasons.append(Reason(ReasonCode.OVERSUBSCRIBED,
                              f"charged {k2} shard(s) for {estimator.fmt_bytes(need)}: as designated victim it "
                              f"keeps {estimator.fmt_bytes(off)} in host memory, predicted slowdown {slow:.2f}x "
                              f"<= budget {cfg.policy.max_victim_slowdown:.2f}x ({access.value})"))
        return Action.SHARE_OVERSUBSCRIBED, k2, slow, off, reasons
    if k < spg:
        on = (f"{k} of {spg} shards" if len(counts) == 1 else
              f"{k} shards, on a GPU that has at least {k} (the GPUs it can land on have {_of_gpus(counts, shard)})")
        reasons.append(Reason(ReasonCode.FITS_IN_SHARDS,
                              f"{estimator.fmt_bytes(need)} fits {on} ({estimator.fmt_bytes(k * shard)})"))
        return Action.SHARE, k, 1.0, 0, reasons
    if may_oversubscribe:
        reasons.append(Reason(ReasonCode.OVERSUBSCRIPTION_TOO_COSTLY,
                              f"sharing would need host memory beyond the {cfg.policy.max_victim_slowdown:.2f}x "
                              "slowdown budget"))
    reasons.append(Reason(ReasonCode.TOO_LARGE_TO_SHARE,
                          f"{estimator.fmt_bytes(need)} needs the whole GPU ({spg} shards)"))
    return Action.WHOLE_GPU, 0, 1.0, 0, reasons


def whole_gpu_as_shards(cfg: Config, dialect: SlurmDialect) -> bool:
    """Whether a whole-GPU decision is held as all shards of one GPU (``auto``: only where the
    release can place a gpu job beside shard jobs on one GPU)."""
    setting = WholeGpuAsShards(cfg.policy.whole_gpu_as_shards)
    return dialect.gpu_beside_shard_bug if setting is WholeGpuAsShards.AUTO else setting is WholeGpuAsShards.ON


def _as_shards_reason(shards: int, dialect: SlurmDialect, gpu_type: str = "") -> Reason:
    held = f"held as all {shards} shards of one {gpu_type + ' ' if gpu_type else ''}GPU"
    if dialect.gpu_beside_shard_bug:
        why = (f"on Slurm {dialect.name} a gpu job can land on a GPU whose shards are in use, all of its shards "
               "cannot")
    else:
        why = f"policy.whole_gpu_as_shards = true on Slurm {dialect.name}: no shard job can land on it"
    return Reason(ReasonCode.WHOLE_GPU_AS_SHARDS, f"{held}: {why}")


def _whole_as_shards(req: JobRequest, cfg: Config, dialect: SlurmDialect) -> tuple[int, Reason]:
    """(shards, reason) of a whole GPU held as shards: all shards of one GPU, where every GPU the job
    can land on has the same count; else 0 (the request stays: a GPU with fewer shards would hold
    the job's whole GPU in part, and one with more would go to it in part)."""
    counts = shard_counts(req, cfg)
    if not counts and req.shards_refused:
        return 0, shards_refused_reason(req)
    unbilled = req.shards_unbilled or req.whole_shards_unbilled  # all shards of a GPU would not bill the GPU
    if len(counts) == 1 and unbilled:
        return 0, Reason(ReasonCode.SHARDS_UNBILLED, f"not held as shards: {unbilled}; the gpu request stays as typed")
    if len(counts) == 1:
        return counts[0], _as_shards_reason(counts[0], dialect, req.gpu.gpu_type)
    of = f"{req.gpu.gpu_type} GPUs" if req.gpu.gpu_type else "GPUs"
    return 0, Reason(ReasonCode.WHOLE_GPU_SIZES_DIFFER,
                     f"not held as shards: the {of} it can land on have "
                     f"{' or '.join(map(str, counts)) or 'no'} shards, so no one shard count is a whole GPU; the job "
                     f"keeps its request (on Slurm {dialect.name} a shard job may then land on its GPU)")
