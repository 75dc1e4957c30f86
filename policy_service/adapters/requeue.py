"""Whole-GPU requeue of a shared job that ran out of GPU memory (core/requeue.py says when).

Called by the event applier once per applied JobFinished of a shared run with OOM evidence. In
order: Slurm requeues the job held (``scontrol requeuehold``: refused for --no-requeue,
JobRequeue=0, an interactive job, a job it no longer knows, and then nothing else happens but a
note in the finished run's AdminComment); the new whole-GPU decision is recorded (journaled);
the held job gets its GPU request back as submitted and the new decision's AdminComment; it is
released. A failure after the hold releases the job as it is (logged): it is never left held.
The rerun's TaskProlog writes one line to the job's stderr (slurm_plugin/task_prolog.py).
"""
from __future__ import annotations

import dataclasses
import logging

from policy_service.adapters.history_schema import DecisionRow
from policy_service.adapters.slurm import SlurmAccess, SlurmError
from policy_service.core import requeue
from policy_service.core.types import Action

log = logging.getLogger(__name__)


def shared_fields(row: DecisionRow) -> dict[str, str]:
    """The GPU fields the shared decision set on the job."""
    rewrite = row.decision.rewrite
    return {f: getattr(rewrite, f) for f in requeue.GPU_FIELDS if rewrite.HasField(f)}


def submitted_fields(row: DecisionRow) -> dict[str, str]:
    """The GPU fields as the user submitted them (the decision's facts)."""
    facts = row.facts
    return {f: getattr(facts, f) for f in requeue.GPU_FIELDS}


class OomRequeuer:
    def __init__(self, handler, slurm: SlurmAccess):
        self.handler, self.slurm, self.cfg = handler, slurm, handler.cfg
        self.requeued = 0

    def __call__(self, job_id: int, row: DecisionRow, evidence: str, age_s: float) -> str:
        """Requeue job ``job_id`` (its shared run, decided by ``row``, just ended out of memory);
        returns the outcome token the AdminComment carries."""
        facts = row.facts
        check = requeue.requeue_check(enabled=self.cfg.policy.requeue_after_oom,
                                      is_batch=facts.is_batch if facts.HasField("is_batch") else True,
                                      age_s=age_s, evidence=evidence)
        if not check.requeue:
            return self._note(job_id, row, check.token, check.reason.message)
        try:
            self.slurm.requeue_hold(job_id)
        except SlurmError as exc:
            token = requeue.slurm_refusal_token(str(exc))
            return self._note(job_id, row, token, f"Slurm refused the requeue: {exc}")
        try:
            why = dataclasses.replace(check.reason, message=f"{check.reason.message} (replaces decision "
                                                            f"{row.decision_id})")
            d, jr, keys = self.handler.decide_facts(facts, replaces=row.decision_id, whole_because=why)
            if d.action is not Action.WHOLE_GPU:  # cannot happen (whole_because): never requeue it shared
                raise RuntimeError(f"decision {d.decision_id} is {d.action.value}, not whole_gpu")
            fields = requeue.restore_fields(submitted_fields(row), shared_fields(row), d.rewrite)
            self.handler.record_decision(d, jr, keys, facts)
            self.slurm.update_held_job(job_id, fields, d.rewrite.admin_comment or "")
        except Exception as exc:  # noqa: BLE001  (whatever failed, the job must not stay held)
            log.error("job %s: requeued after running out of GPU memory, but its request could not be set "
                      "back (%s): released as it was", job_id, exc)
            self._release(job_id)
            return "failed"
        self._release(job_id)
        self.requeued += 1
        log.warning("job %s ran out of GPU memory on a shared GPU (%s): requeued on a whole GPU, %s, decision "
                    "%s replaces %s", job_id, evidence, " ".join(f"{k}={v!r}" for k, v in fields.items()),
                    d.decision_id, row.decision_id)
        return "requeued"

    def _release(self, job_id: int) -> None:
        try:
            self.slurm.release_job(job_id)
        except SlurmError as exc:
            log.error("job %s: could not be released after its requeue (%s): `scontrol release %s` frees it",
                      job_id, exc, job_id)

    def _note(self, job_id: int, row: DecisionRow, token: str, why: str) -> str:
        log.warning("job %s ran out of GPU memory on a shared GPU and is not requeued: %s", job_id, why)
        comment = requeue.noted_comment(row.decision.rewrite.admin_comment, token,
                                        self.cfg.policy.admin_comment_max_chars)
        try:
            self.slurm.set_admin_comment(job_id, comment)
        except SlurmError as exc:
            log.info("job %s: AdminComment not updated (%s)", job_id, exc)
        return token
