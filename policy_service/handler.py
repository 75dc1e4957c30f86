"""The one request handler behind both transports (gRPC and the local JSON socket).

It converts messages to core values, calls the pure core, and persists through the history
store. Errors are raised as ``HandlerError`` with a gRPC status code; the transports map them.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import json
import logging
import queue
import threading
import time
import uuid
from typing import Callable

import grpc

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.adapters.history import HistoryStore, ObservationRow
from policy_service.adapters.queue import QueueMonitor
from policy_service.adapters.slurm import SlurmAccess, SlurmError
from policy_service.config import Config
from policy_service.core import estimator, policy
from policy_service.core.dialect import SLURM_22_05, SlurmDialect
from policy_service.core.request import RequestError, history_keys, job_request
from policy_service.core.types import Action, Decision, JobObservation, JobRequest, KeyLevel
from policy_service.limits import oversize

log = logging.getLogger("swapaware.decisions")

_ACTION = {
    Action.PASS_THROUGH: pb.ACTION_PASS_THROUGH,
    Action.WHOLE_GPU: pb.ACTION_WHOLE_GPU,
    Action.SHARE: pb.ACTION_SHARE,
    Action.SHARE_OVERSUBSCRIBED: pb.ACTION_SHARE_OVERSUBSCRIBED,
}
_SHARED_ACTIONS = {Action.SHARE.value, Action.SHARE_OVERSUBSCRIBED.value}


class HandlerError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _new_id() -> str:
    return uuid.uuid4().hex[:16]


def gres_fields(job: pb.JobFacts) -> dict[str, str]:
    return {"tres_per_node": job.tres_per_node, "tres_per_job": job.tres_per_job,
            "tres_per_task": job.tres_per_task, "tres_per_socket": job.tres_per_socket}


def is_batch(job: pb.JobFacts) -> bool:
    """Whether the job has a batch script; facts from a client that does not say count as batch."""
    return job.is_batch if job.HasField("is_batch") else True


def gpu_utilisation(req: pb.JobFinishedRequest) -> float | None:
    """Mean utilisation (0..1) of the job's GPUs as the node agent sampled it; None without
    telemetry. Device-wide: the estimator uses it only for runs without co-runners."""
    measured = [g.util_mean_pct for g in req.gpus if g.HasField("util_mean_pct")]
    if not measured or req.telemetry_source in ("", "none"):
        return None
    return min(1.0, max(0.0, sum(measured) / len(measured) / 100.0))


def decision_to_proto(d: Decision) -> pb.Decision:
    est = d.estimate
    msg = pb.Decision(
        decision_id=d.decision_id, model_version=d.model_version, action=_ACTION[d.action], shards=d.shards,
        site_factor=d.site_factor, job_class=d.job_class, decided_at=d.decided_at,
        estimate=pb.DemandEstimate(peak_bytes=est.peak_bytes, margin_bytes=est.margin_bytes,
                                   source=pb.EstimateSource.Value(f"ESTIMATE_SOURCE_{est.source.name}"),
                                   samples=est.samples, observed_max_bytes=est.observed_max_bytes),
        swap_cost=pb.SwapCostEstimate(slowdown=d.swap_slowdown, offloaded_bytes=d.offloaded_bytes, risk=d.risk),
        reasons=[pb.Reason(code=r.code.value, message=r.message) for r in d.reasons],
    )
    msg.rewrite.CopyFrom(rewrite_to_proto(d.rewrite))
    return msg


def rewrite_to_proto(rewrite) -> pb.JobRewrite:
    """Only the fields the decision sets are present (None = leave the job's field alone)."""
    return pb.JobRewrite(**{f.name: getattr(rewrite, f.name) for f in dataclasses.fields(rewrite)
                            if getattr(rewrite, f.name) is not None})


@dataclasses.dataclass(frozen=True)
class PendingRedecision:
    decision: Decision
    request: JobRequest
    keys: dict[KeyLevel, str]
    facts: pb.JobFacts
    replaces: str  # the id of the pending job's previous decision


class PolicyHandler:
    """Admit / JobStarted / JobFinished / Explain over core + store."""

    def __init__(self, cfg: Config, store: HistoryStore, slurm: SlurmAccess | None,
                 clock: Callable[[], float] = time.time, new_id: Callable[[], str] = _new_id,
                 queue_monitor: QueueMonitor | None = None, dialect: SlurmDialect = SLURM_22_05):
        self.cfg, self.store, self.slurm = cfg, store, slurm
        self.dialect = dialect  # the running Slurm's, chosen once at start (server.start_service)
        self.queue = queue_monitor
        self.learned: collections.Counter = collections.Counter()  # history key -> observations folded
        self.clock, self.new_id = clock, new_id
        # Decisions are recorded by a writer thread, off the reply's path: slurmctld waits
        # for Admit while holding its locks. Readers of decisions call flush() first.
        self._writes: queue.Queue = queue.Queue(maxsize=10_000)
        self._writer = threading.Thread(target=self._write_loop, name="decision-writer", daemon=True)
        self._writer.start()

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                self._record(*item)
            except Exception:
                log.exception("could not record a decision")
            finally:
                self._writes.task_done()

    def _record(self, d: Decision, jr, keys, job: pb.JobFacts) -> None:
        msg = decision_to_proto(d)
        self.store.record_decision(
            decision_id=d.decision_id, decided_at=d.decided_at, job_class=d.job_class, user=jr.user,
            account=jr.account, partition=jr.partition, job_name=jr.job_name, action=d.action.value,
            shards=d.shards, model_version=d.model_version, keys=keys,
            facts_pb=job.SerializeToString(), decision_pb=msg.SerializeToString())
        log.info("decision %s", json.dumps({
            "decision_id": d.decision_id, "model_version": d.model_version, "user": jr.user,
            "job_name": jr.job_name, "request": jr.gpu.raw, "action": d.action.value, "shards": d.shards,
            "site_factor": d.site_factor, "peak_bytes": d.estimate.peak_bytes,
            "reasons": [r.code.value for r in d.reasons]}, sort_keys=True))

    def flush(self) -> None:
        """Wait until every decision handed out so far is in the history."""
        self._writes.join()

    def close(self) -> None:
        self.flush()
        self._writes.put(None)
        self._writer.join(5)

    # ------------------------------------------------------------------ Admit
    def admit(self, req: pb.AdmitRequest) -> pb.AdmitResponse:
        job = req.job
        d, jr, keys = self._decide(job)
        if not req.dry_run:
            self._writes.put((d, jr, keys, job))
        if req.brief:  # the full message is built by the writer, off this path
            return pb.AdmitResponse(decision=pb.Decision(decision_id=d.decision_id, action=_ACTION[d.action],
                                                         shards=d.shards, rewrite=rewrite_to_proto(d.rewrite)))
        return pb.AdmitResponse(decision=decision_to_proto(d))

    def _decide(self, job: pb.JobFacts, replaces: str = ""):
        fields = gres_fields(job)
        try:
            jr, access = job_request(
                user=job.user, account=job.account, partition=job.partition, job_name=job.job_name,
                script_fingerprint=job.script_fingerprint, gres_fields=fields, min_nodes=job.min_nodes,
                num_tasks=job.num_tasks, time_limit_min=job.time_limit_min, comment=job.comment,
                env_mem_hint=job.env_mem_hint, qos=job.qos, is_batch=is_batch(job),
                het_job=job.het_job)
        except RequestError as exc:
            raise HandlerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        keys = history_keys(jr)
        stats = self.store.stats(keys)
        d = policy.decide(jr, stats, self.cfg, decision_id=self.new_id(), now=self.clock(),
                          job_class=keys[KeyLevel.CLASS], gres_fields=fields, access=access,
                          queue=self.queue.snapshot() if self.queue is not None else None, replaces=replaces,
                          dialect=self.dialect)
        return d, jr, keys

    # ------------------------------------------------------------------ pending jobs
    def whole_decision_keys(self, admin_comment: str) -> tuple[str, dict] | None:
        """(decision id, history keys) when a job's record (its AdminComment) is a whole-GPU
        decision of this service; None otherwise."""
        d_id = policy.parse_admin_comment(admin_comment).get("id", "")
        if not d_id:
            return None
        self.flush()
        row = self.store.decision(d_id)
        if row is None or row.action != Action.WHOLE_GPU.value:
            return None
        return d_id, row.keys

    def knowledge(self, keys: dict) -> int:
        """Observations this process has learned under a job's ``policy.REDECIDE_KEYS``: when it
        changes, a re-decision may differ."""
        return sum(self.learned[keys[level]] for level in policy.REDECIDE_KEYS if level in keys)

    def redecide(self, d_id: str) -> PendingRedecision | None:
        """A new decision for a pending job kept whole by decision ``d_id``, when it would now
        share; None otherwise. Nothing is recorded until ``adopt``."""
        row = self.store.decision(d_id)
        if row is None or row.action != Action.WHOLE_GPU.value:
            return None
        facts = row.facts
        try:
            d, jr, keys = self._decide(facts, replaces=d_id)
        except HandlerError:
            return None
        if not policy.replaces_pending(row.action, d):
            return None
        return PendingRedecision(d, jr, keys, facts, d_id)

    def adopt(self, r: PendingRedecision) -> None:
        """Record a re-decision once Slurm holds it."""
        self._writes.put((r.decision, r.request, r.keys, r.facts))

    # ------------------------------------------------------------------ correlation
    def _decision_id_for_job(self, job_id: int) -> str:
        self.flush()
        run = self.store.run(job_id)
        if run is not None and run.decision_id:
            return run.decision_id
        if self.slurm is None:
            return ""
        try:
            comment = self.slurm.job_admin_comment(job_id) or ""
        except SlurmError as exc:
            log.warning("job %s: cannot read its decision from Slurm: %s", job_id, exc)
            return ""
        d_id = policy.parse_admin_comment(comment).get("id", "")
        return d_id if d_id and self.store.decision(d_id) is not None else ""

    # ------------------------------------------------------------------ JobStarted
    def job_started(self, req: pb.JobStartedRequest) -> pb.JobStartedResponse:
        if req.job_id == 0:
            raise HandlerError(grpc.StatusCode.INVALID_ARGUMENT, "job_id is required")
        d_id = self._decision_id_for_job(req.job_id)
        started = req.started_at or self.clock()
        self.store.record_start(event_id=req.event_id, job_id=req.job_id, decision_id=d_id, node=req.node,
                                gpus=list(req.gpu_indices), started_at=started, received_at=self.clock())
        return pb.JobStartedResponse(decision_id=d_id)

    # ------------------------------------------------------------------ JobFinished
    def job_finished(self, req: pb.JobFinishedRequest) -> pb.JobFinishedResponse:
        if req.job_id == 0:
            raise HandlerError(grpc.StatusCode.INVALID_ARGUMENT, "job_id is required")
        if not req.event_id:
            raise HandlerError(grpc.StatusCode.INVALID_ARGUMENT, "event_id is required (replays must be idempotent)")
        now = self.clock()
        finished = req.finished_at or now
        run = self.store.run(req.job_id)
        started = req.started_at or (run.started_at if run else None)
        gpus = tuple(req.gpu_indices) or (run.gpu_indices if run else ())
        d_id = self._decision_id_for_job(req.job_id)
        row = self.store.decision(d_id) if d_id else None
        shared = row is not None and row.action in _SHARED_ACTIONS
        co = self.store.overlapping_runs(req.node, gpus, started or finished, finished, req.job_id)
        peak = req.peak_gpu_bytes if req.HasField("peak_gpu_bytes") else None
        oom, evidence = estimator.infer_oom(
            reported=req.oom_detected, failed=req.exit_code != 0 or req.exit_signal != 0, peak_bytes=peak,
            charged_bytes=row.shards * self.cfg.gpu.shard_bytes if shared else 0,
            charge_frac=self.cfg.estimator.oom_charge_frac)
        obs = ObservationRow(
            event_id=req.event_id, job_id=req.job_id, decision_id=d_id, node=req.node, gpu_indices=gpus,
            started_at=started, finished_at=finished, runtime_s=(finished - started) if started else None,
            exit_code=req.exit_code, peak_bytes=peak, oom=oom, co_runners=len(co), shared=shared,
            telemetry_source=req.telemetry_source or "none", received_at=now)
        core_obs = JobObservation(runtime_s=obs.runtime_s or 0.0, exit_code=obs.exit_code, peak_bytes=peak,
                                  oom=obs.oom, shared=shared, co_runners=obs.co_runners,
                                  util_frac=gpu_utilisation(req))
        keys = row.keys if row is not None else {}
        applied = self.store.record_finish(obs, keys, lambda s: estimator.observe(s, core_obs, self.cfg.estimator))
        if applied and keys:
            self.learned.update(keys.values())  # pending jobs of these keys may share now
        log.info("observation %s", json.dumps({
            "job_id": req.job_id, "decision_id": d_id, "applied": applied, "runtime_s": obs.runtime_s,
            "peak_bytes": peak, "oom": obs.oom, "oom_evidence": evidence or req.oom_evidence,
            "co_runners": obs.co_runners, "exit_code": obs.exit_code,
            "learned_keys": len(keys) if applied else 0}, sort_keys=True))
        if row is None and applied:
            log.warning("job %s finished without a known decision: observation kept, nothing learned", req.job_id)
        return pb.JobFinishedResponse(applied=applied, decision_id=d_id)

    # ------------------------------------------------------------------ Explain
    def explain(self, req: pb.ExplainRequest) -> pb.ExplainResponse:
        which = req.WhichOneof("target")
        if which == "job":
            return pb.ExplainResponse(decision=self.admit(pb.AdmitRequest(job=req.job, dry_run=True)).decision,
                                      job=req.job)
        job_id = 0
        if which == "job_id":
            job_id = req.job_id
            d_id = self._decision_id_for_job(job_id)
            if not d_id:
                raise HandlerError(grpc.StatusCode.NOT_FOUND, f"no swapaware decision is known for job {job_id}")
        elif which == "decision_id":
            d_id = req.decision_id
        else:
            raise HandlerError(grpc.StatusCode.INVALID_ARGUMENT, "give a job_id, a decision_id or job facts")
        self.flush()
        row = self.store.decision(d_id)
        if row is None:
            raise HandlerError(grpc.StatusCode.NOT_FOUND, f"decision {d_id!r} is not in the history")
        out = pb.ExplainResponse(job_id=job_id)
        out.decision.CopyFrom(row.decision)
        out.job.CopyFrom(row.facts)
        for o in self.store.observations(decision_id=d_id):
            ob = out.observations.add(job_id=o.job_id, decision_id=o.decision_id, node=o.node,
                                      started_at=o.started_at or 0.0, finished_at=o.finished_at,
                                      runtime_s=o.runtime_s or 0.0, exit_code=o.exit_code, oom_detected=o.oom,
                                      co_runners=o.co_runners, gpu_indices=list(o.gpu_indices))
            if o.peak_bytes is not None:
                ob.peak_gpu_bytes = o.peak_bytes
        return out


class Method(enum.Enum):
    """The RPCs, by their proto names: one table for both transports."""

    ADMIT = ("Admit", pb.AdmitRequest, "admit")
    JOB_STARTED = ("JobStarted", pb.JobStartedRequest, "job_started")
    JOB_FINISHED = ("JobFinished", pb.JobFinishedRequest, "job_finished")
    EXPLAIN = ("Explain", pb.ExplainRequest, "explain")

    @classmethod
    def by_name(cls, name: str) -> "Method":
        for m in cls:
            if m.value[0] == name:
                return m
        raise HandlerError(grpc.StatusCode.UNIMPLEMENTED, f"unknown method {name!r}")

    @property
    def is_event(self) -> bool:
        """An event feeds the model (observations): only the cluster's hooks may send one."""
        return self in (Method.JOB_STARTED, Method.JOB_FINISHED)

    def call(self, handler: PolicyHandler, request):
        too_big = oversize(request)
        if too_big:
            log.warning("%s refused: %s", self.value[0], "; ".join(too_big))
            raise HandlerError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{self.value[0]} refused, a field is too large: {'; '.join(too_big[:3])}")
        return getattr(handler, self.value[2])(request)
