"""Applying the hooks' events (JobStarted, JobFinished, and batches of both: ReportEvents) to the
history: each event once (event ids), in order, its job instance and decision resolved through
``correlation.Correlator`` (one Slurm query per batch), one ``EventResult`` per event. A bad event
gets its own code (3, INVALID_ARGUMENT) and never fails the others."""
from __future__ import annotations

import collections
import contextlib
import json
import logging
from typing import Callable, ContextManager, Sequence

import grpc

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.slurm.fleet import shard_memory_mismatch
from policy_service.history.store import HistoryStore, ObservationRow, RunRow
from policy_service.config import Config
from policy_service.core import estimator
from policy_service.core.request import node_count
from policy_service.core.types import Action, JobObservation
from policy_service.serving.correlation import Correlator, EventRef, Resolution
from policy_service.trust.event_bounds import MAX_JOB_ID, Refusal, check_event, runtime_refusal  # noqa: F401  (API)

log = logging.getLogger("swapaware.decisions")

_SHARED_ACTIONS = {Action.SHARE.value, Action.SHARE_OVERSUBSCRIBED.value}
OK = grpc.StatusCode.OK.value[0]
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]


def gpu_utilisation(req: pb.JobFinishedRequest) -> float | None:
    """Mean utilisation (0..1) of the job's GPUs as the node agent sampled it; None without
    telemetry. Device-wide: the estimator uses it only for runs without co-runners."""
    measured = [g.util_mean_pct for g in req.gpus if g.HasField("util_mean_pct")]
    if not measured or req.telemetry_source in ("", "none"):
        return None
    return min(1.0, max(0.0, sum(measured) / len(measured) / 100.0))


def event_ref(kind: str, req, now: float) -> EventRef:
    if kind == "started":
        return EventRef(req.job_id, req.node, req.sluid, started_at=req.started_at or now)
    return EventRef(req.job_id, req.node, req.sluid, started_at=req.started_at, finished_at=req.finished_at or now)


def learn_keys(row) -> dict:
    """The class keys an observation of ``row``'s job is folded into: none without a decision, and
    none for a multi-node job (each node reports its own part; the policy never shares such jobs,
    and folding three per-node peaks would teach the class three runs that never were)."""
    if row is None or node_count(row.facts.min_nodes) > 1:
        return {}
    return dict(row.keys)


class EventApplier:
    def __init__(self, cfg: Config, store: HistoryStore, correlator: Correlator, clock: Callable[[], float],
                 learned: collections.Counter, metrics=None):
        self.cfg, self.store, self.correlation, self.clock = cfg, store, correlator, clock
        self.learned = learned  # history key -> observations folded (pending jobs may be re-decided)
        self.metrics = metrics  # policy_service.serving.metrics.ServiceMetrics, or None
        # (job id, decision row, OOM evidence, seconds since it ended) -> outcome: called once per
        # applied finish of a shared run that ran out of GPU memory (slurm/requeue.py); None: none.
        self.on_shared_oom: Callable[[int, object, str, float], str] | None = None
        # The history keys an observation is about to be folded into -> a context held while it is
        # recorded and counted in ``learned`` (the admission table drops the classes it decided
        # from them, and writes none of them meanwhile: admission/publish.py); None: none.
        self.learning: Callable[[tuple[str, ...]], ContextManager] | None = None
        # The partitions' GPUs as gres.conf declares them (slurm/partitions.py); each GPU's shards
        # are checked against the memory the node's NVML reports for it, warned once. None: not checked.
        self.fleet: Callable[[], object] | None = None
        self.interference = None  # interference/learner.InterferenceLearner: each shared run teaches it
        self._fleet_warned: set[tuple] = set()

    def apply(self, events: Sequence[pb.JobEvent]) -> list[pb.EventResult]:
        now = self.clock()
        results: list[pb.EventResult | None] = [None] * len(events)
        valid = []
        for i, ev in enumerate(events):
            kind = ev.WhichOneof("event")
            req = getattr(ev, kind) if kind else None
            refusal = check_event(kind, req, now=now, gpu_memory_bytes=self.cfg.gpu.memory_bytes)
            if refusal is not None:
                results[i] = self._refuse(kind, req, refusal)
            else:
                valid.append((i, kind, req))
        seen = self.store.events_seen(req.event_id for _, _, req in valid)
        todo = []
        for i, kind, req in valid:
            if req.event_id in seen:  # a replay: nothing to resolve or apply
                results[i] = pb.EventResult(event_id=req.event_id, code=OK, applied=False, message="already applied")
            else:
                todo.append((i, kind, req))
        refs = [event_ref(kind, req, now) for _, kind, req in todo]
        found = self.correlation.instances(refs)  # one Slurm query for the batch
        for (i, kind, req), ref, inst in zip(todo, refs, found):
            try:
                res = self.correlation.resolution(ref, inst)  # after the batch's earlier events are in
                results[i] = self._started(req, res) if kind == "started" else self._finished(req, res)
            except Exception:
                log.exception("job %s: %s event %s could not be applied", req.job_id, kind, req.event_id)
                results[i] = pb.EventResult(event_id=req.event_id, code=INTERNAL,
                                            message="the event could not be applied; see the service's log")
        return results  # type: ignore[return-value]

    def _refuse(self, kind: str | None, req, refusal: Refusal) -> pb.EventResult:
        """An event that never reaches the model: logged, counted, answered INVALID_ARGUMENT."""
        event_id = req.event_id if req is not None else ""
        log.warning("job %s: %s event %s refused (%s): %s", req.job_id if req is not None else "?", kind or "unknown",
                    event_id or "(no id)", refusal.why.value, refusal.message)
        if self.metrics is not None:
            self.metrics.events_refused.labels(why=refusal.why.value).inc()
        return pb.EventResult(event_id=event_id, code=INVALID, message=refusal.message)

    # ------------------------------------------------------------------ JobStarted
    def _started(self, req: pb.JobStartedRequest, res: Resolution) -> pb.EventResult:
        now = self.clock()
        applied = self.store.record_start(
            event_id=req.event_id, job_id=req.job_id, decision_id=res.decision_id, node=req.node,
            gpus=list(req.gpu_indices), started_at=req.started_at or now, received_at=now, instance=res.instance,
            submit_time=res.submit_time)
        if not res.decision_id:
            log.info("job %s started on %s (instance %s) with no known decision: %s", req.job_id, req.node,
                     res.instance, res.note or "none recorded")
        return pb.EventResult(event_id=req.event_id, code=OK, applied=applied, decision_id=res.decision_id)

    def _count(self, row, obs: ObservationRow, shared: bool) -> None:
        """Metrics of one finished run (applied once)."""
        m = self.metrics
        if obs.oom:
            m.ooms.labels(shared=str(shared).lower()).inc()
        if row is None or not obs.peak_bytes:
            return
        predicted = row.decision.estimate.peak_bytes
        if predicted > 0:
            m.peak_error.observe((predicted - obs.peak_bytes) / obs.peak_bytes)
        if shared and obs.peak_bytes > row.shards * self.cfg.gpu.shard_bytes:
            m.overruns.inc()

    def _check_fleet(self, req: pb.JobFinishedRequest) -> None:
        """A GPU whose gres.conf shards hold more than the node agent's NVML total: a warning (once)."""
        fleet = self.fleet() if self.fleet is not None else None
        declared = getattr(fleet, "gpu_shards", None) or {}
        for g in req.gpus:
            shards = declared.get((req.node, g.gpu_index))
            key = (req.node, g.gpu_index, shards, g.total_bytes)
            if shards is None or key in self._fleet_warned:
                continue
            why = shard_memory_mismatch(req.node, g.gpu_index, shards, self.cfg.gpu.shard_bytes, g.total_bytes)
            if why:
                self._fleet_warned.add(key)
                log.warning("fleet: %s", why)

    # ------------------------------------------------------------------ JobFinished
    def _finished(self, req: pb.JobFinishedRequest, res: Resolution) -> pb.EventResult:
        now = self.clock()
        self._check_fleet(req)
        finished = req.finished_at or now
        run = self.store.run_of(res.instance, req.node) or self.store.run_of(res.instance)
        started = req.started_at or (run.started_at if run else None)
        refusal = runtime_refusal(started, finished, "recorded start") if started and not req.started_at else None
        if refusal is not None:
            return self._refuse("finished", req, refusal)
        gpus = tuple(req.gpu_indices) or (run.gpu_indices if run else ())
        # The run is this instance's (never another job of the same id): its decision may stand in.
        d_id = res.decision_id or (run.decision_id if run else "")
        row = self.store.decision(d_id) if d_id else None
        # A shadow decision's job ran as submitted (whole), whatever the decision says.
        shared = row is not None and row.action in _SHARED_ACTIONS and row.decision.mode != "shadow"
        co = self.co_runners(req.node, gpus, started or finished, finished, res.instance)
        peak = req.peak_gpu_bytes if req.HasField("peak_gpu_bytes") else None
        oom, evidence = estimator.infer_oom(
            reported=req.oom_detected, failed=req.exit_code != 0 or req.exit_signal != 0, peak_bytes=peak,
            charged_bytes=row.shards * self.cfg.gpu.shard_bytes if shared else 0,
            charge_frac=self.cfg.estimator.oom_charge_frac)
        obs = ObservationRow(
            event_id=req.event_id, job_id=req.job_id, decision_id=d_id, node=req.node, gpu_indices=gpus,
            started_at=started, finished_at=finished, runtime_s=(finished - started) if started else None,
            exit_code=req.exit_code, peak_bytes=peak, oom=oom, co_runners=len(co), shared=shared,
            telemetry_source=req.telemetry_source or "none", received_at=now, instance=res.instance,
            submit_time=res.submit_time)
        core_obs = JobObservation(runtime_s=obs.runtime_s or 0.0, exit_code=obs.exit_code, peak_bytes=peak,
                                  oom=obs.oom, shared=shared, co_runners=obs.co_runners,
                                  util_frac=gpu_utilisation(req))
        keys = learn_keys(row)
        user = row.user if row is not None else ""
        with self.learning(tuple(keys.values())) if keys and self.learning else contextlib.nullcontext():
            applied = self.store.record_finish(
                obs, keys, lambda level, s: estimator.observe_key(level, s, core_obs, self.cfg.estimator, user))
            if applied and keys:
                self.learned.update(keys.values())  # pending jobs of these keys may share now
        if applied and self.metrics is not None:
            self._count(row, obs, shared)
        if applied and keys and co and self.interference is not None:
            self._teach_interference(row, obs, co)
        requeued = ""
        if applied and obs.oom and shared and row is not None and self.on_shared_oom is not None:
            requeued = self.on_shared_oom(req.job_id, row, req.oom_evidence or evidence, now - finished)
        log.info("observation %s", json.dumps({
            "job_id": req.job_id, "instance": res.instance, "decision_id": d_id, "applied": applied,
            "runtime_s": obs.runtime_s, "peak_bytes": peak, "oom": obs.oom,
            "oom_evidence": evidence or req.oom_evidence, "co_runners": obs.co_runners, "exit_code": obs.exit_code,
            "learned_keys": len(keys) if applied else 0, **({"oom_requeue": requeued} if requeued else {})},
            sort_keys=True))
        if row is not None and not keys and applied:
            log.info("job %s: a %d-node job's per-node observation from %s is kept, not learned (the policy keeps "
                     "multi-node jobs whole, and one node's peak is not the job's)", req.job_id,
                     node_count(row.facts.min_nodes), req.node)
        if row is None and applied:
            log.warning("job %s (instance %s) finished without a known decision (%s): observation kept, nothing "
                        "learned", req.job_id, res.instance, res.note or "none recorded")
        return pb.EventResult(event_id=req.event_id, code=OK, applied=applied, decision_id=d_id)

    def _teach_interference(self, row, obs: ObservationRow, co: list[RunRow]) -> None:
        """A run that shared its GPU(s) with others: an observation of the site's interference."""
        try:
            run = self.interference.shared_run(self.store, row, obs.gpu_indices, obs.node, obs.runtime_s or 0.0,
                                               obs.exit_code, co)
            if run is not None:
                self.interference.add(run)
        except Exception:  # noqa: BLE001 - the observation is recorded; the model learns from the next
            log.exception("job %s: the interference learner could not read its run", obs.job_id)

    def co_runners(self, node: str, gpus, start: float, end: float, instance: str) -> list[RunRow]:
        """Other runs on these GPUs during [start, end] (HistoryStore.co_runners)."""
        return self.store.co_runners(node, gpus, start, end, instance, self.cfg.service.open_run_max_s)
