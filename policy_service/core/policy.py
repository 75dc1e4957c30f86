"""The admission policy: estimate -> GRES rewrite, priority and a decision record.

``decide`` is pure: the caller injects the decision id, the clock reading and the history.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict
from typing import Mapping

from policy_service.config import AccessClass, Config, Oversubscription, WholeGpuAsShards
from policy_service.core.enforcement import EnforcementView
from policy_service.core import estimator, queue_rules, swapcost
from policy_service.core.dialect import SLURM_22_05, SlurmDialect
from policy_service.core.request import shard_rewrite
from policy_service.core.types import (
    Action,
    ClassStats,
    Decision,
    DemandEstimate,
    GresKind,
    JobRequest,
    KeyLevel,
    QueueState,
    Reason,
    ReasonCode,
    Rewrite,
)

MODEL_VERSION = "swapaware-model/1"
COMMENT_PREFIX = "swapaware:v1"


_VERSIONS: dict[int, tuple[Config, str]] = {}  # id(cfg) -> (cfg, its version), a few configs at most


def model_version(cfg: Config) -> str:
    """Model name plus a digest of the parameters that shape decisions (for replays). Remembered
    per config object: hashing a whole frozen Config (what an lru_cache does on every call) cost
    each Admit ~20 us."""
    known = _VERSIONS.get(id(cfg))
    if known is not None and known[0] is cfg:
        return known[1]
    params = {k: asdict(getattr(cfg, k)) for k in ("gpu", "estimator", "swap_cost", "policy")}
    digest = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:8]
    if len(_VERSIONS) >= 16:  # tests and the simulator make many configs; a service has one
        _VERSIONS.clear()
    version = f"{MODEL_VERSION}+{digest}"
    _VERSIONS[id(cfg)] = (cfg, version)
    return version


def contention_degree(s: ClassStats | None, min_runs: int) -> float | None:
    """Seed paper: W = (C(N) - C(1)) / C(1) / n, with n the mean number of co-runners."""
    if s is None or s.solo_runs < min_runs or s.shared_runs < min_runs or s.ewma_solo_runtime_s <= 0:
        return None
    n = max(1.0, s.ewma_corunners)
    return max(0.0, (s.ewma_shared_runtime_s - s.ewma_solo_runtime_s) / s.ewma_solo_runtime_s / n)


def site_factor(s: ClassStats | None, cfg: Config) -> tuple[int, Reason]:
    w = contention_degree(s, cfg.policy.contention_min_runs)
    if w is None:
        return 0, Reason(ReasonCode.PRIORITY_DEFAULT, "no shared-vs-solo runtimes yet: site factor 0")
    value = int(min(cfg.policy.site_factor_max, round(cfg.policy.site_factor_scale * w)))
    return value, Reason(ReasonCode.PRIORITY_CONTENTION,
                         f"contention degree {w:.3f} (shared {s.ewma_shared_runtime_s:.0f}s vs solo "
                         f"{s.ewma_solo_runtime_s:.0f}s): site factor {value} (cap {cfg.policy.site_factor_max})")


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


def _size_shards(est: DemandEstimate, access: AccessClass, cfg: Config,
                 util: tuple[float, KeyLevel] | None, enforcement: EnforcementView | None,
                 counts: tuple[int, ...]) -> tuple[Action, int, float, int, list[Reason]]:
    """(action, shards, slowdown, offloaded bytes, reasons) for a single-GPU job with an estimate.
    ``counts``: the shard counts of the GPUs it can land on (shard_counts, not empty). The job is
    sized against the largest of them; Slurm places k shards only on a GPU that has k free."""
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


def _single_gpu(req: JobRequest) -> bool:
    """A request shards of one GPU can serve: one GPU, one node, one task if per task."""
    g = req.gpu
    if g.kind is not GresKind.GPU or g.per_node != 1 or req.min_nodes > 1:
        return False
    if g.source_field == "tres_per_task":
        return req.num_tasks == 1
    return g.source_field in ("tres_per_node", "tres_per_job")


def _route(req: JobRequest, est: DemandEstimate, penalty: ClassStats | None, access: AccessClass,
           cfg: Config, queue: QueueState | None = None, util: tuple[float, KeyLevel] | None = None,
           enforcement: EnforcementView | None = None) -> tuple[Action, int, float, int, list[Reason]]:
    g = req.gpu
    if g.kind is GresKind.NONE:
        return Action.PASS_THROUGH, 0, 1.0, 0, [Reason(ReasonCode.NO_GPU, "the job asks for no GPU")]
    if g.kind is GresKind.SHARD:
        return Action.PASS_THROUGH, 0, 1.0, 0, [Reason(ReasonCode.ALREADY_SHARDS, f"the job already asks for {g.raw}")]
    if g.kind is GresKind.OTHER:
        return Action.PASS_THROUGH, 0, 1.0, 0, [Reason(ReasonCode.UNSUPPORTED_REQUEST,
                                                       f"request {g.raw!r} is left as it is")]
    whole = Action.WHOLE_GPU, 0, 1.0, 0
    if req.exclusive:
        return *whole, [Reason(ReasonCode.EXCLUSIVE, f"--exclusive={req.exclusive}: Slurm never starts an exclusive job "
                                                     "that holds shards; the job keeps its request")]
    if req.partition_gpu_defaults:
        return *whole, [Reason(ReasonCode.PER_GPU_DEFAULT,
                               f"partition {req.partition or '(default)'} gives each GPU "
                               f"{', '.join(req.partition_gpu_defaults)}: a job that holds shards holds no GPU and "
                               "would get none of it; the job keeps its request")]
    if req.per_gpu_options:
        return *whole, [Reason(ReasonCode.PER_GPU_OPTION,
                               f"{' '.join(req.per_gpu_options)} is expressed per GPU and has no faithful "
                               "translation to shards (the job and its steps would be refused or lose their "
                               "GPU binding); the job keeps its request")]
    if req.het_job:
        return *whole, [Reason(ReasonCode.HET_JOB, "a component of a heterogeneous job: its steps name their "
                                                   "component's GPUs (srun --het-group), which shards of one "
                                                   "component cannot serve; the job keeps its request")]
    if not req.is_batch:
        return *whole, [Reason(ReasonCode.INTERACTIVE, "no batch script (an srun or salloc allocation): its own "
                                                       "steps ask for GPUs by name, which a shard allocation cannot "
                                                       "serve; the job keeps its request")]
    if req.min_nodes > 1:
        return *whole, [Reason(ReasonCode.MULTI_NODE, "multi-node jobs keep whole GPUs")]
    if not _single_gpu(req):
        return *whole, [Reason(ReasonCode.MULTI_GPU, f"{g.raw} in {g.source_field} (tasks: {req.num_tasks}) may need "
                                                     "more than one GPU: shards of one GPU cannot serve it")]
    if not cfg.policy.enable_sharing:
        return *whole, [Reason(ReasonCode.SHARING_DISABLED, "sharing is disabled by configuration")]
    if req.shards_unbilled:
        return *whole, [Reason(ReasonCode.SHARDS_UNBILLED,
                               f"not shared: {req.shards_unbilled}; the job keeps its request")]
    if req.qos and req.qos in cfg.policy.whole_gpu_qos:
        return *whole, [Reason(ReasonCode.PROTECTED_QOS, f"QoS {req.qos!r} is in policy.whole_gpu_qos: whole GPU")]
    if penalty is not None and penalty.whole_gpu_runs_left > 0:
        return *whole, [Reason(ReasonCode.OOM_PENALTY,
                               f"this job class ran out of memory while shared; whole GPU for "
                               f"{penalty.whole_gpu_runs_left} more run(s)")]
    if not est.known:
        return *whole, [Reason(ReasonCode.NO_HISTORY,
                               f"no history: whole GPU until estimator.min_samples = {cfg.estimator.min_samples} "
                               f"runs of its class are observed ({est.class_samples} so far)")]
    view = req.qos if cfg.policy.queue_per_qos else ""  # "": the whole queue
    short = queue_rules.queue_gate(queue, view, cfg)
    if short is not None:
        return *whole, [short]
    counts = shard_counts(req, cfg)
    if not counts and req.shards_refused:
        return *whole, [shards_refused_reason(req)]
    if not counts:
        return *whole, [Reason(ReasonCode.NO_SHARD_GPUS,
                               f"no {g.gpu_type + ' ' if g.gpu_type else ''}GPU of partition "
                               f"{req.partition or '(default)'} has shards (gres.conf): whole GPU")]
    action, shards, slow, off, reasons = _size_shards(est, access, cfg, util, enforcement, counts)
    long_queue = (queue_rules.compute_overcommit(queue, view, cfg) if util is not None and cfg.policy.compute_aware
                  else None)
    if long_queue is not None:
        by_memory = _size_shards(est, access, cfg, None, enforcement, counts)
        if by_memory[:2] != (action, shards):  # the compute floor binds: the long queue lifts it
            action, shards, slow, off, reasons = by_memory
            reasons.append(long_queue)
    if action is not Action.WHOLE_GPU and cfg.policy.share_min_queue > 0 and not queue_rules.fresh(queue, cfg):
        reasons.append(Reason(ReasonCode.QUEUE_UNKNOWN, "the pending GPU jobs are unknown (no recent snapshot from "
                                                        "Slurm): shared as if GPU work were waiting"))
    return action, shards, slow, off, reasons


def _keeps_request(req: JobRequest) -> bool:
    """A GPU request never rewritten, not even to hold a whole GPU as shards (no batch script, part
    of a heterogeneous job, exclusive, with options expressed per GPU, or in a partition that gives
    each GPU CPUs or memory by default)."""
    return (not req.is_batch or req.het_job or bool(req.exclusive) or bool(req.per_gpu_options)
            or bool(req.partition_gpu_defaults))


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


# The history keys whose learning can change a pending job's decision (class, user+name); the
# wide keys (account, partition) change with every job and rarely decide alone.
REDECIDE_KEYS = (KeyLevel.CLASS, KeyLevel.USER_NAME)


def replaces_pending(prev_action: str, new: Decision) -> bool:
    """Whether a re-decision replaces a pending job's decision: only a whole GPU turned into
    shards (a waiting job is never made to ask for more)."""
    return prev_action == Action.WHOLE_GPU.value and new.action in (Action.SHARE, Action.SHARE_OVERSUBSCRIBED)


def admin_comment(d_id: str, version: str, action: Action, shards: int, est: DemandEstimate, sf: int,
                  reasons: tuple[Reason, ...], max_chars: int) -> str:
    """The decision record sacct shows (AdminComment). Stable, greppable key=value text."""
    why = ",".join(dict.fromkeys(r.code.value for r in reasons))
    text = (f"{COMMENT_PREFIX} id={d_id} model={version} action={action.value} shards={shards} "
            f"pred={estimator.fmt_bytes(est.peak_bytes)}+{estimator.fmt_bytes(est.margin_bytes)} "
            f"src={est.source.value} n={est.samples} sf={sf} why={why}")
    return text[:max_chars]


def parse_admin_comment(text: str) -> dict[str, str]:
    """Inverse of ``admin_comment`` for the fields it carries; {} when not ours."""
    if not text or COMMENT_PREFIX not in text:
        return {}
    body = text[text.index(COMMENT_PREFIX) + len(COMMENT_PREFIX):]
    return dict(tok.split("=", 1) for tok in body.split() if "=" in tok)


def decide(req: JobRequest, stats: Mapping[KeyLevel, ClassStats], cfg: Config, *, decision_id: str,
           now: float, job_class: str, gres_fields: Mapping[str, str],
           access: AccessClass | None = None, queue: QueueState | None = None, replaces: str = "",
           dialect: SlurmDialect = SLURM_22_05, enforcement: EnforcementView | None = None,
           whole_because: Reason | None = None) -> Decision:
    """Decide how a job runs. Pure: same inputs, same decision. ``replaces``: the id of the
    decision a still-pending job had (a re-decision). ``dialect``: the running Slurm's (the
    rewrite's GRES spelling, whether a whole GPU is held as shards). ``enforcement``: the nodes'
    reported GPU memory enforcement (gates oversubscription under ``auto``; None: not gated).
    ``whole_because``: the job gets a whole GPU for this reason (a requeue after an OOM), whatever
    the route would say."""
    access = access or cfg.swap_cost.default_access_class
    est = estimator.estimate(req, stats, cfg.estimator, cfg.gpu)
    class_stats = stats.get(KeyLevel.CLASS)
    # An OOM penalty lives with the class; a class never seen yet inherits its user+name's.
    penalty = class_stats if class_stats is not None else stats.get(KeyLevel.USER_NAME)
    action, shards, slow, off, route_reasons = _route(req, est, penalty, access, cfg, queue, solo_utilisation(stats),
                                                      enforcement)
    if whole_because is not None:
        action, shards, slow, off, route_reasons = Action.WHOLE_GPU, 0, 1.0, 0, [whole_because]
    sf, prio_reason = site_factor(class_stats, cfg)
    if (action is Action.WHOLE_GPU and _single_gpu(req) and not _keeps_request(req) and cfg.policy.enable_sharing
            and whole_gpu_as_shards(cfg, dialect)):
        shards, held = _whole_as_shards(req, cfg, dialect)
        if held.code not in {r.code for r in route_reasons}:  # shards_refused said once
            route_reasons.append(held)
    if replaces and whole_because is None:
        route_reasons.insert(0, Reason(ReasonCode.REDECIDED, f"re-decided while the job was pending: replaces "
                                                             f"decision {replaces}"))
    route_codes = {r.code for r in route_reasons}
    reasons = (*route_reasons, *(r for r in est.reasons if r.code not in route_codes), prio_reason)
    version = model_version(cfg)
    fields = {}
    user_message = None
    if shards:
        fields = shard_rewrite(dict(gres_fields), req.gpu.source_field, shards, dialect, req.gpu.gpu_type)
    if action in (Action.SHARE, Action.SHARE_OVERSUBSCRIBED) and cfg.policy.tell_users:
        of_gpu = f"one {req.gpu.gpu_type} GPU" if req.gpu.gpu_type else "one GPU"
        user_message = (f"swapaware: gpu request rewritten to {shards} shard(s) of {of_gpu} "
                        f"(predicted peak {estimator.fmt_bytes(est.peak_bytes)})")
    comment = admin_comment(decision_id, version, action, shards, est, sf, reasons,
                            cfg.policy.admin_comment_max_chars)
    rewrite = Rewrite(
        tres_per_node=fields.get("tres_per_node"), tres_per_job=fields.get("tres_per_job"),
        tres_per_task=fields.get("tres_per_task"), tres_per_socket=fields.get("tres_per_socket"),
        tres_bind="" if shards and req.implicit_gpu_bind else None,
        site_factor=sf if action is not Action.PASS_THROUGH or req.gpu.kind is GresKind.SHARD else None,
        admin_comment=comment if req.gpu.kind is not GresKind.NONE else None,
        user_message=user_message,
    )
    risk = min(1.0, off / est.sized_bytes) if est.sized_bytes and off else 0.0
    return Decision(decision_id=decision_id, model_version=version, action=action, shards=shards,
                    site_factor=sf, estimate=est, swap_slowdown=slow, offloaded_bytes=off, risk=risk,
                    reasons=reasons, rewrite=rewrite, job_class=job_class, decided_at=now)
