"""Re-decide pending jobs that were kept whole, after each queue poll (``policy.redecide_pending``).

A job submitted before its class was ever observed, or while nothing waited, was kept on a
whole GPU; while it still waits the model may have learned its class, or a queue may have built.
After each poll the service takes the pending jobs held as a whole GPU (``gres/gpu:1``, or
``gres:shard:<all of a GPU's>`` where ``policy.whole_gpu_as_shards`` applies; compared parsed, in
any release's spelling), waiting for resources, oldest first. It reads each one's decision record once (AdminComment,
``scontrol show job``: squeue does not show it); it decides again, from the facts recorded with
that decision, only when something was learned under the job's history keys or the queue crossed
``policy.share_min_queue`` since the last time; at most ``policy.redecide_max_per_poll`` reads
and decisions per poll. When the job would now share, it is rewritten in Slurm (``scontrol update
TresPerNode AdminComment``) and the new decision recorded (reason ``redecided``, naming the one it
replaces). A job that starts in between is left alone (Slurm refuses the update).
"""
from __future__ import annotations

import logging
from typing import Collection, Iterable

from policy_service.slurm.queue import WAITING_REASONS
from policy_service.slurm.slurm import PendingJob, SlurmAccess, SlurmError
from policy_service.config import Config
from policy_service.core.policy import whole_gpu_as_shards
from policy_service.core.request import RequestError, parse_gres_entries
from policy_service.core.types import QueueState
from policy_service.serving.handler_error import HandlerError

log = logging.getLogger("swapaware.decisions")


def holds_whole_gpu(tres_per_node: str, whole_shards: Collection[int] = ()) -> bool:
    """Whether a pending job's tres_per_node is how swapaware holds a whole-GPU decision: one GPU
    (``gres/gpu:1``, ``gres/gpu:h100:1``), or all shards of one GPU (``gres:shard:8``,
    ``gres:shard:h100:8``: a count in ``whole_shards``, the GPUs' shard counts where whole GPUs are
    held as shards, else empty). Parsed, so any release's spelling matches."""
    try:
        entries = parse_gres_entries(tres_per_node)
    except RequestError:
        return False
    if len(entries) != 1 or not entries[0].gres:
        return False
    name, count = entries[0].name, entries[0].count
    return (name, count) == ("gpu", 1) or (name == "shard" and count in whole_shards)


def candidates(pending: Iterable[PendingJob], whole_shards: Collection[int] = ()) -> list[PendingJob]:
    """Pending jobs held as one whole GPU (how swapaware holds a whole-GPU decision) that wait
    for resources, oldest first."""
    return sorted((j for j in pending if j.reason in WAITING_REASONS
                   and holds_whole_gpu(j.tres_per_node, whole_shards)
                   and not j.tres_per_job and not j.tres_per_task and j.nodes == 1),
                  key=lambda j: j.job_id)


class PendingRedecider:
    """Called after each queue poll with the pending jobs and the new snapshot."""

    def __init__(self, handler, slurm: SlurmAccess, cfg: Config):
        self.handler, self.slurm, self.cfg = handler, slurm, cfg
        # job id -> (decision id, history keys) of a whole-GPU decision, or None: not ours / not whole
        self._records: dict[int, tuple[str, dict] | None] = {}
        self._checked: dict[int, tuple] = {}  # job id -> what was known when it was last re-decided
        self.rewritten = 0
        self.held_as_shards = whole_gpu_as_shards(cfg, handler.dialect)

    def _whole_shards(self) -> set[int]:
        """The shard counts a whole GPU held as shards can have: the fleet's (gres.conf), else
        gpu.shards_per_gpu."""
        parts = self.handler.partitions() if self.handler.partitions else None
        return (parts.all_shard_counts() if parts else set()) or {self.cfg.gpu.shards_per_gpu}

    def __call__(self, pending: list[PendingJob], state: QueueState) -> None:
        todo = candidates(pending, self._whole_shards() if self.held_as_shards else ())
        live = {j.job_id for j in todo}
        self._records = {k: v for k, v in self._records.items() if k in live}
        self._checked = {k: v for k, v in self._checked.items() if k in live}
        queue_side = state.pressure >= self.cfg.policy.share_min_queue
        budget = self.cfg.policy.redecide_max_per_poll  # Slurm reads and decisions per poll
        for job in todo:
            if budget <= 0:
                break
            if job.job_id not in self._records:
                budget -= 1
                self._records[job.job_id] = self._read_record(job.job_id)
            record = self._records[job.job_id]
            if record is None:
                continue
            d_id, keys = record
            known = (self.handler.knowledge(keys), queue_side)
            if self._checked.get(job.job_id) == known:
                continue
            budget -= 1
            self._checked[job.job_id] = known
            self._one(job.job_id, d_id)

    def _read_record(self, job_id: int) -> tuple[str, dict] | None:
        try:
            comment = self.slurm.job_admin_comment(job_id) or ""
        except SlurmError as exc:
            log.info("pending job %s: cannot read its decision record (%s); left as it is", job_id, exc)
            return None
        return self.handler.whole_decision_keys(comment)

    def _one(self, job_id: int, d_id: str) -> None:
        r = self.handler.redecide(d_id)
        if r is None:
            return
        rewrite = r.decision.rewrite
        try:  # recorded (journaled) before Slurm holds it: a record Slurm has is never lost
            self.handler.adopt(r)
        except HandlerError as exc:
            log.warning("pending job %s: not re-decided (%s)", job_id, exc.message)
            return
        try:
            self.slurm.update_pending_job(job_id, rewrite.tres_per_node or "", rewrite.admin_comment or "")
        except SlurmError as exc:  # it started, or was cancelled or changed, meanwhile
            log.info("pending job %s: not rewritten (%s); decision %s stays unused", job_id, exc,
                     r.decision.decision_id)
            return
        self.rewritten += 1
        log.info("pending job %s re-decided: whole GPU -> %s (decision %s replaces %s)", job_id,
                 rewrite.tres_per_node, r.decision.decision_id, r.replaces)
