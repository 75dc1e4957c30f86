"""Whole-GPU requeue of a shared job that ran out of GPU memory (core/requeue.py says when).

Called by the event applier once per applied JobFinished of a shared run with OOM evidence. In
order: Slurm requeues the job held (``scontrol requeuehold``: refused for --no-requeue,
JobRequeue=0, an interactive job, a job it no longer knows, and then nothing else happens but a
note in the finished run's AdminComment); the new whole-GPU decision is recorded (journaled).
The JobFinished answers then: it comes from the epilog, and the job completes (its GRES are
freed) only once the epilog ends. A worker thread waits for that (the job no longer COMPLETING,
at most ``COMPLETING_WAIT_S``), gives the held job its GPU request back as submitted with the
new decision's AdminComment, and releases it. Changing the GRES of a job that was still
completing left Slurm 22.05 with GPUs allocated to no job on an idle node (measured: every later
GPU job pended). A failure after the hold releases the job as it is (logged); a service that
stops in that window leaves it held (``scontrol release`` frees it; the log names the job).
The rerun's TaskProlog writes one line to the job's stderr (slurm_plugin/task_prolog.py).
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time

from policy_service.history.schema import DecisionRow
from policy_service.slurm.slurm import SlurmAccess, SlurmError
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


# How long the worker waits for a requeued job's epilogs to end before it sets its request anyway.
COMPLETING_WAIT_S = 300.0
POLL_S = 0.5


class OomRequeuer:
    def __init__(self, handler, slurm: SlurmAccess, sleep=time.sleep, clock=time.monotonic):
        self.handler, self.slurm, self.cfg = handler, slurm, handler.cfg
        self.sleep, self.clock = sleep, clock
        self.requeued = 0
        self._todo: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()

    def _submit(self, item: tuple) -> None:
        with self._lock:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name="oom-requeue", daemon=True)
                self._worker.start()
        self._todo.put(item)

    def _work(self) -> None:
        while True:
            item = self._todo.get()
            try:
                self.complete(*item)
            except Exception:  # noqa: BLE001  (the worker outlives one job's failure)
                log.exception("job %s: completing its requeue failed", item[0])
            finally:
                self._todo.task_done()

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every requeue handed to the worker is done (tests)."""
        deadline = time.monotonic() + timeout_s
        while self._todo.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self._todo.unfinished_tasks

    def _wait_completed(self, job_id: int) -> None:
        deadline = self.clock() + COMPLETING_WAIT_S
        while self.clock() < deadline:
            try:
                if "COMPLETING" not in self.slurm.job_state(job_id):
                    return
            except SlurmError as exc:
                log.info("job %s: state not read (%s); its request is set now", job_id, exc)
                return
            self.sleep(POLL_S)
        log.warning("job %s: still completing after %.0fs; its request is set now", job_id, COMPLETING_WAIT_S)

    def complete(self, job_id: int, fields: dict, comment: str, note: str) -> None:
        """Once the job's epilogs ended: its request as submitted, the new record, released."""
        self._wait_completed(job_id)
        try:
            self.slurm.update_held_job(job_id, fields, comment)
        except SlurmError as exc:
            log.error("job %s: requeued after running out of GPU memory, but its request could not be set "
                      "back (%s): released as it is", job_id, exc)
            self._release(job_id)
            return
        self._release(job_id)
        self.requeued += 1
        log.warning("%s", note)

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
        except Exception as exc:  # noqa: BLE001  (whatever failed, the job must not stay held)
            log.error("job %s: requeued after running out of GPU memory, but no whole-GPU decision could be "
                      "recorded (%s): released as it is", job_id, exc)
            self._release(job_id)
            return "failed"
        note = (f"job {job_id} ran out of GPU memory on a shared GPU ({evidence}): requeued on a whole GPU, "
                f"{' '.join(f'{k}={v!r}' for k, v in fields.items())}, decision {d.decision_id} replaces "
                f"{row.decision_id}")
        log.info("job %s: requeued and held until its epilogs end, then released with its request as submitted",
                 job_id)
        self._submit((job_id, fields, d.rewrite.admin_comment or "", note))
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
