"""The route of a job: which requests keep their GPU request or a whole GPU, and why (no GPU,
already shards, exclusive, per-GPU options or defaults, heterogeneous, interactive, multi-node or
multi-GPU, sharing off, unbilled shards, protected QoS, OOM penalty, no history, a short queue),
and which are sized in shards (``shard_sizing``). Pure, as all of core/ (used by ``policy.decide``)."""
from __future__ import annotations

from policy_service.config import AccessClass, Config
from policy_service.core.enforcement import EnforcementView
from policy_service.core import queue_rules
from policy_service.core.interference_rule import InterferenceView, long_queue_lift, observed_slowdown
from policy_service.core.shard_sizing import _size_shards, shard_counts, shards_refused_reason
from policy_service.core.types import (Action, ClassStats, DemandEstimate, GresKind, JobRequest, KeyLevel, QueueState,
                                       Reason, ReasonCode)


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
           enforcement: EnforcementView | None = None, interference: InterferenceView | None = None
           ) -> tuple[Action, int, float, int, list[Reason]]:
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
    budget = cfg.policy.max_interference_slowdown
    observed = observed_slowdown(penalty, cfg.policy.interference_min_shared_runs) if budget > 0 else None
    if observed is not None and observed > budget:
        return *whole, [Reason(ReasonCode.INTERFERENCE_OBSERVED,
                               f"its class's shared runs took {observed:.2f}x its solo runs ({penalty.shared_runs} "
                               f"shared, {penalty.solo_runs} solo), more than policy.max_interference_slowdown "
                               f"{budget:.2f}x: whole GPU")]
    model = interference.model_for(g.gpu_type) if interference is not None else None
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
    action, shards, slow, off, reasons = _size_shards(est, access, cfg, util, enforcement, counts, model)
    long_queue = (queue_rules.compute_overcommit(queue, view, cfg) if util is not None and cfg.policy.compute_aware
                  else None)
    if long_queue is not None:
        by_memory = _size_shards(est, access, cfg, None, enforcement, counts)
        if by_memory[:2] != (action, shards):  # the compute floor binds: the long queue lifts it ...
            lifted, why = long_queue_lift(util[0], util[1], model, cfg, long_queue)  # ... where the budget holds
            if lifted:
                action, shards, slow, off, reasons = by_memory
            reasons.append(why)
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
