"""The queue rules of the policy: whether a fresh queue snapshot says a job should keep its GPU
whole (nothing waits ahead of it), may be sized by memory alone (the queue ahead is long), or
neither, and which of those branches a queue view takes (the admission table's gate states)."""
from __future__ import annotations

from policy_service.config import Config
from policy_service.core.types import QueueState, Reason, ReasonCode


def fresh(queue: QueueState | None, cfg: Config) -> bool:
    return queue is not None and queue.age_s <= 3 * cfg.policy.queue_poll_s


def _ahead(queue: QueueState, qos: str) -> str:
    return f"pending GPU jobs at or above QoS {qos!r}" if qos and any(
        name == qos for name, _ in queue.ahead_by_qos) else "pending GPU jobs"


def queue_gate(queue: QueueState | None, qos: str, cfg: Config) -> Reason | None:
    """A reason to keep the GPU whole because nothing waits ahead of the job; None when sharing
    may go ahead (also when the queue is unknown: the caller records why)."""
    threshold = cfg.policy.share_min_queue
    if threshold <= 0 or not fresh(queue, cfg) or queue.pressure_for(qos) >= threshold:
        return None
    return Reason(ReasonCode.QUEUE_SHORT,
                  f"{_ahead(queue, qos)} ask for {queue.pending_for(qos):.2f} of {queue.total_gpus} GPUs "
                  f"({queue.pressure_for(qos):.1%} < policy.share_min_queue {threshold:.1%}): the job can start "
                  "on a whole GPU, where no co-runner slows it down")


def compute_overcommit(queue: QueueState | None, qos: str, cfg: Config) -> Reason | None:
    """A reason to size by memory alone (several compute-heavy jobs on one GPU): the queue ahead
    of the job is so long that waiting costs more than the co-runners' interference."""
    threshold = cfg.policy.overcommit_compute_min_queue
    if threshold <= 0 or not fresh(queue, cfg) or queue.pressure_for(qos) < threshold:
        return None
    return Reason(ReasonCode.COMPUTE_OVERCOMMITTED,
                  f"{_ahead(queue, qos)} ask for {queue.pressure_for(qos):.0%} of the cluster's GPUs (>= "
                  f"policy.overcommit_compute_min_queue {threshold:.0%}): sized by memory alone, co-runners may "
                  "slow each other down")


def queue_gate_state(queue: QueueState | None, view: str, cfg: Config) -> str:
    """Which branch of the queue rules a job of queue view ``view`` takes (the same predicates
    ``route._route`` applies): "unknown" (no fresh snapshot), "short" (kept whole), "long" (sized by
    memory alone where the compute floor binds) or "normal"."""
    if not fresh(queue, cfg):
        return "unknown"
    if queue_gate(queue, view, cfg) is not None:
        return "short"
    if compute_overcommit(queue, view, cfg) is not None:
        return "long"
    return "normal"
