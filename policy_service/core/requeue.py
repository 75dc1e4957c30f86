"""Whole-GPU requeue after a shared run's GPU out-of-memory (pure).

A job that shared a GPU and ended out of GPU memory (the node's evidence, as
``estimator.infer_oom`` reads it) would not have failed on the whole GPU its user asked for.
It is requeued once, with its GPU request set back to what the user typed: Slurm's own requeue
(``scontrol requeuehold``, the request restored, ``scontrol release``), so it keeps its job id,
``sacct`` shows the shared run as REQUEUED, and ``--no-requeue`` (or ``JobRequeue=0``) is
Slurm's to enforce. The rerun is whole, so it is never requeued again by this rule.

Not requeued (the job fails as before, the reason in its AdminComment): the site turned it off
(``policy.requeue_after_oom``), an interactive job (Slurm requeues batch jobs only), an event
that arrives long after the job ended (``REQUEUE_MAX_AGE_S``: the user has moved on), and
whatever Slurm refuses (``--no-requeue``, the job gone from slurmctld).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from policy_service.core.types import Reason, ReasonCode, Rewrite

# The GPU fields a shard rewrite changes (Rewrite's and JobRewrite's names).
GPU_FIELDS = ("tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket", "tres_bind")
# A JobFinished older than this (from a node's spool, say) requeues nothing.
REQUEUE_MAX_AGE_S = 600.0
# scontrol's words for Slurm's refusals (ESLURM_DISABLED, ESLURM_BATCH_ONLY, ...), as the token
# the AdminComment carries.
_SLURM_REFUSALS = (("disabled", "no-requeue"), ("batch", "not-batch"), ("invalid job id", "job-gone"),
                   ("pending", "already-pending"))


@dataclass(frozen=True)
class RequeueCheck:
    requeue: bool
    reason: Reason
    token: str  # what the AdminComment says: requeued, off, not-batch, late, no-requeue, ...


def requeue_check(*, enabled: bool, is_batch: bool, age_s: float, evidence: str) -> RequeueCheck:
    """Whether a shared run that ended out of GPU memory is requeued on a whole GPU."""
    why = f"the shared run ran out of GPU memory ({evidence or 'node evidence'})"
    if not enabled:
        return _refused(f"{why}; policy.requeue_after_oom is off: the job stays failed", "off")
    if not is_batch:
        return _refused(f"{why}; an interactive job (srun/salloc) cannot be requeued: it stays failed", "not-batch")
    if age_s > REQUEUE_MAX_AGE_S:
        return _refused(f"{why}; reported {age_s:.0f}s after it ended (over {REQUEUE_MAX_AGE_S:.0f}s): "
                        "not requeued", "late")
    return RequeueCheck(True, Reason(ReasonCode.OOM_REQUEUED, f"{why}: requeued once on a whole GPU, "
                                                              "the GPU request as submitted"), "requeued")


def _refused(message: str, token: str) -> RequeueCheck:
    return RequeueCheck(False, Reason(ReasonCode.OOM_NOT_REQUEUED, message), token)


def slurm_refusal_token(message: str) -> str:
    """The AdminComment token for a requeue Slurm refused (scontrol's message)."""
    low = message.lower()
    return next((token for words, token in _SLURM_REFUSALS if words in low), "slurm-refused")


def restore_fields(submitted: Mapping[str, str], shared: Mapping[str, str], whole: Rewrite) -> dict[str, str]:
    """The GPU fields to set on the requeued job: what the whole-GPU decision sets (22.05 holds a
    whole GPU as all its shards), else, for each field the shared decision changed, what the user
    submitted ("" clears). Fields neither changed are left alone."""
    out: dict[str, str] = {}
    for field in GPU_FIELDS:
        value = getattr(whole, field)
        if value is not None:
            out[field] = value
        elif field in shared:
            out[field] = submitted.get(field, "")
    return out


def noted_comment(comment: str, token: str, max_chars: int) -> str:
    """The finished job's AdminComment with the requeue outcome appended (sacct shows it)."""
    note = f" oom_requeue={token}"
    return (comment[:max(0, max_chars - len(note))] + note) if comment else note.strip()
