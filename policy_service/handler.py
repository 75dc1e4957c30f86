"""The one request handler behind both transports (gRPC and the local JSON socket).

It converts messages to core values, calls the pure core, and persists through the history
store. Errors are raised as ``HandlerError`` with a gRPC status code; the transports map them.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import math
import os
import time
from pathlib import Path
from typing import Callable

import grpc

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.adapters.decision_log import DecisionLog, JournalError, RecordText
from policy_service.adapters.history import HistoryStore
from policy_service.adapters.queue import QueueMonitor
from policy_service.adapters.requeue import OomRequeuer
from policy_service.adapters.slurm import SlurmAccess
from policy_service.authz import Owner
from policy_service.config import Config, PolicyMode
from policy_service.core import policy, queue_rules
from policy_service.core.dialect import SLURM_22_05, SlurmDialect
from policy_service.core.enforcement import NodeEnforcementRegistry, NodeReport
from policy_service.core.mode import apply_mode
from policy_service.adapters.partitions import PartitionDefaults
from policy_service.core.request import PER_GPU_OPTIONS, RequestError, history_keys, job_request
from policy_service.core.types import Action, Decision, JobRequest, KeyLevel, LiveShards, QueueState, Reason, ReasonCode
from policy_service.correlation import Correlator
from policy_service.events import MAX_JOB_ID, EventApplier
from policy_service.limits import oversize
from policy_service.metrics import ServiceMetrics
from policy_service.proto_bounds import observation_to_proto
from policy_service.decision_proto import (brief_decision_to_proto, brief_line, decision_record, decision_to_proto,
                                          gres_fields, is_batch, with_id_bytes)

log = logging.getLogger("swapaware.decisions")

# google.rpc code number -> status (an EventResult's code back into a status for the single-event RPCs)
_STATUS = {c.value[0]: c for c in grpc.StatusCode}


class HandlerError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _new_id() -> str:
    return os.urandom(8).hex()  # 16 hex digits, as uuid4().hex[:16] gave, in a ninth of the time


MONITOR = object()  # PolicyHandler._decide: decide with the queue monitor's newest snapshot
REQUEST_MEMO_MAX = 16384  # PolicyHandler._request: the facts remembered (cleared when full)


_PLACEHOLDER_ID = "0" * 16  # a decision id's length: the AdminComment is cut at the same place
_ID_TOKEN = f"id={_PLACEHOLDER_ID}"


def _as_decided(queue: QueueState | None, cfg: Config) -> QueueState | None:
    """The queue as policy.decide reads it: its figures and whether it is fresh (an age of 0, or
    infinite), without the live shards (the request carries what they say). Deciding with this
    instead of the snapshot decides the same, and makes the decision a function of what it holds."""
    if queue is None:
        return None
    return QueueState(pending_gpus=queue.pending_gpus, total_gpus=queue.total_gpus,
                      age_s=0.0 if queue_rules.fresh(queue, cfg) else math.inf, ahead_by_qos=queue.ahead_by_qos)


def _with_id(template: Decision, d_id: str, now: float) -> Decision | None:
    """``template`` (made with _PLACEHOLDER_ID at time 0) as made with ``d_id`` at ``now``; None
    when the id cannot be put in its place (another length; the AdminComment cut inside it)."""
    rw = template.rewrite
    if rw.admin_comment is not None:
        if len(d_id) != len(_PLACEHOLDER_ID) or _ID_TOKEN not in rw.admin_comment:
            return None
        rw = _copied(rw, admin_comment=rw.admin_comment.replace(_ID_TOKEN, f"id={d_id}", 1))
    return _copied(template, decision_id=d_id, decided_at=now, rewrite=rw)


def _note(d: Decision, jr: JobRequest) -> dict:
    """What the writer logs of a decision once it is in the history (``decision {json}``)."""
    return {"decision_id": d.decision_id, "model_version": d.model_version, "user": jr.user, "job_name": jr.job_name,
            "request": jr.gpu.raw, "action": d.action.value, "shards": d.shards, "mode": d.mode.value,
            "site_factor": d.site_factor, "peak_bytes": d.estimate.peak_bytes,
            "reasons": [r.code.value for r in d.reasons]}


def _copied(value, **changes):
    """``dataclasses.replace(value, **changes)`` for a frozen dataclass without __post_init__
    (Decision, Rewrite): its fields copied as they are, in a tenth of the time."""
    out = object.__new__(type(value))
    out.__dict__.update(value.__dict__)
    out.__dict__.update(changes)
    return out


@dataclasses.dataclass(frozen=True)
class PendingRedecision:
    decision: Decision
    request: JobRequest
    keys: dict[KeyLevel, str]
    facts: pb.JobFacts
    replaces: str  # the id of the pending job's previous decision


class PolicyHandler:
    """Admit / JobStarted / JobFinished / ReportEvents / Explain over core + store."""

    def __init__(self, cfg: Config, store: HistoryStore, slurm: SlurmAccess | None,
                 clock: Callable[[], float] = time.time, new_id: Callable[[], str] = _new_id,
                 queue_monitor: QueueMonitor | None = None, dialect: SlurmDialect = SLURM_22_05,
                 authorizer=None, partitions: Callable[[], PartitionDefaults] | None = None):
        self.cfg, self.store, self.slurm = cfg, store, slurm
        # the partitions' per-GPU defaults (adapters/partitions.py: slurm.conf, re-read when it
        # changes); None: none known (tests, the simulator)
        self.partitions = partitions
        # policy_service.access.Authorizer: who may record an Admit and see which Explain (callers
        # come from the transports); None: every caller is trusted (tests, the simulator).
        self.authorizer = authorizer
        self.dialect = dialect  # the running Slurm's, chosen once at start (server.start_service)
        self.queue = queue_monitor
        self.learned: collections.Counter = collections.Counter()  # history key -> observations folded
        self.clock, self.new_id = clock, new_id
        self.mode = cfg.policy.mode  # policy.mode; set_mode() changes it live (SIGHUP)
        self.metrics = ServiceMetrics()  # served on service.metrics_address when set (server.py)
        # Events: job instances and their decisions resolved in bulk from Slurm (correlation.py).
        self.correlation = Correlator(slurm, store, clock=clock, open_run_max_s=cfg.service.open_run_max_s)
        self.events = EventApplier(cfg, store, self.correlation, clock, self.learned, self.metrics)
        self.events.fleet = partitions  # each GPU's gres.conf shards checked against the agents' NVML totals
        if slurm is not None:  # a shared run that ran out of GPU memory is requeued whole (core/requeue.py)
            self.events.on_shared_oom = OomRequeuer(self, slurm)
        # What each node's GPU memory enforcement is (reported with job starts): gates oversubscription.
        self.node_enforcement = NodeEnforcementRegistry()
        # serialized JobFacts -> (partitions view, the live shard counts taken, what _request made of
        # them, the decision last made for them)
        self._requests: dict[bytes, tuple] = {}
        self._decision_counters: dict[tuple, object] = {}  # (action, reason, mode) -> its counter
        # Decisions are journaled before Admit answers and put into SQLite by a writer thread
        # (adapters/decision_log.py): slurmctld waits for Admit holding its locks, and never for
        # SQLite. Readers of decisions call flush() first.
        journal = None if store.path == ":memory:" else Path(f"{store.path}.journal")
        self.decisions = DecisionLog(journal, store.record, fsync=cfg.service.journal_fsync)
        # Two controllers (docs/ha.md, adapters/ha_role.py): what a write is answered while this
        # service is standby (None: it writes); called when slurmctld's Admit arrives on the local socket.
        self.standby: Callable[[], str | None] | None = None
        self.on_local_admit: Callable[[int | None], None] | None = None

    def set_mode(self, mode: PolicyMode) -> None:
        """Switch policy.mode for the next Admit (the service's SIGHUP)."""
        if mode is not self.mode:
            log.warning("policy.mode: %s -> %s", self.mode.value, mode.value)
        self.mode = mode

    def _record(self, d: Decision, jr, keys, job: pb.JobFacts, made: tuple | None = None) -> None:
        """Durable before it returns (HandlerError UNAVAILABLE when it cannot be). ``made``: the memo
        entry ``d`` was made from as it is (_decide_made), whose template's message it records with
        the id, the time and the AdminComment put in."""
        try:
            if made is not None:
                # the template's record, message, journal text and log note, made once: each Admit
                # puts its id and time in (the same record, bytes and note as made afresh)
                slot = made[3]
                if slot[0] is None:
                    template = made[2]
                    rec = decision_record(template, jr, keys, job)
                    slot[:] = [rec, RecordText(rec), _note(template, jr)]
                rec, text, note = slot
                decision_pb = with_id_bytes(rec.decision_pb, d)
                rec = _copied(rec, decision_id=d.decision_id, decided_at=d.decided_at, decision_pb=decision_pb)
                self.decisions.record(rec, note={**note, "decision_id": d.decision_id},
                                      data=text.encode(d.decision_id, d.decided_at, decision_pb) if text.usable else None)
            else:
                self.decisions.record(decision_record(d, jr, keys, job), note=_note(d, jr))
        except JournalError as exc:
            log.error("decision %s not made: %s", d.decision_id, exc)
            raise HandlerError(grpc.StatusCode.UNAVAILABLE, f"the decision cannot be recorded: {exc}") from None

    def flush(self) -> None:
        """Wait until every decision handed out so far is in the history (a standby's wait in its
        journal until it writes: reads see the writer's history meanwhile)."""
        if self.standby is not None and self.standby() is not None:
            return
        self.decisions.flush()

    def close(self) -> None:
        self.decisions.close()

    # ------------------------------------------------------------------ Admit
    def admit(self, req: pb.AdmitRequest, caller=None, encode: Callable[[pb.AdmitResponse], bytes] | None = None):
        """``caller`` (policy_service.authz.Caller, from a transport): an Admit that is not
        slurmctld's is answered as a dry run, recorded nowhere, with a reason saying so. ``encode``
        (the local socket's reply line): ``encode(reply)`` is returned instead of the reply; a
        remembered decision's brief reply is then its template's line with the id put in."""
        job = req.job
        mode = self.mode
        if req.HasField("plugin"):
            for why in ("breaker_open", "service_error"):
                self.metrics.plugin_report(req.plugin.instance, why, getattr(req.plugin, why))
        if mode is PolicyMode.OFF and not req.dry_run:
            reply = pb.AdmitResponse(decision=pb.Decision(
                action=pb.ACTION_PASS_THROUGH, mode=mode.value,
                reasons=[pb.Reason(code=ReasonCode.MODE_OFF.value, message="policy.mode = off: the job passes "
                                                                           "unchanged, nothing is decided")]))
            return reply if encode is None else encode(reply)
        dry_run_why = self._not_slurmctld(caller) if not req.dry_run else None
        if req.plugin.started_at and dry_run_why is None and not req.dry_run and self.queue is not None:
            self.queue.slurmctld_started(req.plugin.instance, req.plugin.started_at)  # slurmctld's alone
        made_d, jr, keys, made = self._decide_made(job)
        d = apply_mode(made_d, mode, self.cfg.policy.admin_comment_max_chars)
        recorded = not req.dry_run and dry_run_why is None
        if recorded:
            # enforce (the decision as made): its record's message is the template's with the id, the
            # time and the AdminComment put in (decision_proto.with_id_bytes)
            self._record(d, jr, keys, job, made if d is made_d else None)
            counted = (d.action.value, d.reasons[0].code.value if d.reasons else "", d.mode.value)
            counter = self._decision_counters.get(counted)
            if counter is None:
                counter = self._decision_counters[counted] = self.metrics.decisions.labels(
                    action=counted[0], reason=counted[1], mode=counted[2])
            counter.inc()
        if encode is not None and req.brief and recorded and made is not None and d is made_d:
            return brief_line(made[4], d, encode)
        if req.brief:  # the full message is built by the writer, off this path
            reply = pb.AdmitResponse(decision=brief_decision_to_proto(d))
        else:
            reply = pb.AdmitResponse(decision=decision_to_proto(d))
        if req.dry_run or dry_run_why is not None:
            reply.decision.CopyFrom(self._shown(reply.decision, job, caller))
        if dry_run_why is not None:
            reply.decision.reasons.add(code=ReasonCode.DRY_RUN_NOT_SLURMCTLD.value, message=dry_run_why)
        return reply if encode is None else encode(reply)

    def _shown(self, decision: pb.Decision, job: pb.JobFacts, caller) -> pb.Decision:
        """A decision that is nobody's record (a dry run, a what-if) in full to the job's user and
        admins; to anyone else only its action and shard count (and its id, never recorded): its
        estimate, reasons and rewrite tell what the model learned from other users' jobs."""
        if caller is None or self.authorizer is None:
            return decision
        if self.authorizer.explain(caller, Owner(job.uid, job.user)).allowed:
            return decision
        return pb.Decision(decision_id=decision.decision_id, action=decision.action, shards=decision.shards,
                           mode=decision.mode)

    def _not_slurmctld(self, caller) -> str | None:
        """Why an Admit from ``caller`` is answered as a dry run (None: it is recorded)."""
        if caller is None or self.authorizer is None:
            return None
        v = self.authorizer.admit(caller)
        if v.code is not None:
            raise HandlerError(v.code, f"Admit refused: {v.reason}")
        if v.allowed:
            return None
        return f"dry run, nothing recorded: only slurmctld's Admit is recorded, and {v.reason}"

    def _decide(self, job: pb.JobFacts, replaces: str = "", whole_because: Reason | None = None, *,
                queue: QueueState | None | object = MONITOR, decision_id: str | None = None,
                stats_of: Callable[[dict], dict] | None = None):
        """(decision, request, history keys) of ``job`` now. ``queue``: the queue snapshot to decide
        with (MONITOR: the queue monitor's newest; None: none); ``decision_id``: the id to give it
        (None: a new one); ``stats_of``: reads the history keys' statistics (None: the store).
        Admit, re-decisions and the admission table (adapters/admission_publish.py) all decide here."""
        d, jr, keys, _made = self._decide_made(job, replaces, whole_because, queue=queue, decision_id=decision_id,
                                               stats_of=stats_of)
        return d, jr, keys

    def _decide_made(self, job: pb.JobFacts, replaces: str = "", whole_because: Reason | None = None, *,
                     queue: QueueState | None | object = MONITOR, decision_id: str | None = None,
                     stats_of: Callable[[dict], dict] | None = None):
        """``_decide``, and the memo entry (statistics, context, template, [its record's bytes], [its
        brief reply line's pieces]) the decision was made from, None where it was decided directly."""
        if queue is MONITOR:
            queue = self.queue.snapshot() if self.queue is not None else None
        jr, access, fields, keys, last = self._request(job, queue)
        stats = (stats_of or self.store.stats)(keys)
        d_id, now = decision_id or self.new_id(), self.clock()
        enforcement = self.node_enforcement.view(self.clock(), self.cfg.policy.enforcement_max_age_s)
        queue = _as_decided(queue, self.cfg)
        # policy.decide is pure: with the same request (this facts entry), the same statistics
        # objects (HistoryStore._checked hands out one per stored text), queue figures, enforcement,
        # config and dialect it decides the same, but for the id and the time. The decision is made
        # once with the placeholder id and time 0, and handed out with the id put in its place.
        context = (self.cfg, self.dialect, queue, enforcement, replaces, whole_because)
        made = last[0]
        if (made is not None and made[1] == context and len(made[0]) == len(stats)
                and all(stats.get(level) is s for level, s in made[0])):
            d = _with_id(made[2], d_id, now)
            if d is not None:
                return d, jr, keys, made
        template = policy.decide(jr, stats, self.cfg, decision_id=_PLACEHOLDER_ID, now=0.0,
                                 job_class=keys[KeyLevel.CLASS], gres_fields=fields, access=access,
                                 queue=queue, replaces=replaces, dialect=self.dialect,
                                 whole_because=whole_because, enforcement=enforcement)
        d = _with_id(template, d_id, now)
        if d is None:  # an id the template cannot take (another length, a comment cut inside it)
            return policy.decide(jr, stats, self.cfg, decision_id=d_id, now=now, job_class=keys[KeyLevel.CLASS],
                                 gres_fields=fields, access=access, queue=queue, replaces=replaces,
                                 dialect=self.dialect, whole_because=whole_because,
                                 enforcement=enforcement), jr, keys, None
        last[0] = made = (tuple(stats.items()), context, template, [None], [None])
        return d, jr, keys, made

    def _request(self, job: pb.JobFacts, queue: QueueState | None) -> tuple[JobRequest, object, dict, dict, list]:
        """(request, access class hint, GRES fields, history keys, the slot of the decision last made
        for them) of ``job``: a pure function of its facts, the partitions' view and the live shard
        counts of its partitions and GPU type, remembered per facts (a class's jobs repeat:
        building them was a fifth of an Admit's CPU). Raises HandlerError."""
        parts = self.partitions() if self.partitions else None
        live = self._live_shards(queue) if parts else None
        facts = job.SerializeToString()
        hit = self._requests.get(facts)
        if hit is not None and hit[0] is parts:
            jr, access, fields, keys = hit[2]
            # each queue poll reads the live shards anew: what the request took from them is compared
            if not parts or parts.live_shard_counts(job.partition, jr.gpu.gpu_type, live) == hit[1]:
                return jr, access, dict(fields), dict(keys), hit[3]  # (copies: a caller may keep or change its dicts)
        fields = gres_fields(job)
        try:
            jr, access = job_request(
                user=job.user, account=job.account, partition=job.partition, job_name=job.job_name,
                script_fingerprint=job.script_fingerprint, gres_fields=fields, min_nodes=job.min_nodes,
                num_tasks=job.num_tasks, time_limit_min=job.time_limit_min, comment=job.comment,
                env_mem_hint=job.env_mem_hint, qos=job.qos, is_batch=is_batch(job),
                het_job=job.het_job, per_gpu={f: getattr(job, f) for f, _ in PER_GPU_OPTIONS},
                exclusive=job.exclusive,
                partition_gpu_defaults=parts.for_job(job.partition) if parts else ())
        except RequestError as exc:
            raise HandlerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        counted = None
        if parts:  # the GPUs its partitions hold, of the type it asks for, where the controller takes shard jobs
            counted = counts, refused = parts.live_shard_counts(job.partition, jr.gpu.gpu_type, live)
            unbilled, whole_unbilled = parts.unbilled(job.partition, jr.gpu.gpu_type)  # its TRESBillingWeights
            jr = dataclasses.replace(jr, gpu_shard_counts=counts, shards_refused=refused, shards_unbilled=unbilled,
                                     whole_shards_unbilled=whole_unbilled)
        keys = history_keys(jr)
        last: list = [None]  # the decision last made for these facts (_decide)
        if len(self._requests) >= REQUEST_MEMO_MAX:
            self._requests.clear()
        # the view is held (not its id): a view is never taken for another one made later
        self._requests[facts] = (parts, counted, (jr, access, dict(fields), dict(keys)), last)
        return jr, access, fields, keys, last

    def _live_shards(self, queue: QueueState | None | object) -> LiveShards | None:
        """The shards the controller in control reports, from the snapshot decided with; while this
        service is standby an Admit comes from a controller taking over, whose counts it has not read
        (counted so on releases whose backup may refuse shards after a takeover: the dialect's
        takeover_zero_shards)."""
        live = queue.live_shards if isinstance(queue, QueueState) else None
        why = self.standby() if self.standby is not None and self.dialect.takeover_zero_shards else None
        if why is None:
            return live
        return dataclasses.replace(live or LiveShards(), unread=f"this service is standby ({why}): the shards of "
                                                                "the controller taking over are not read yet")

    def shards_refused(self, queue: QueueState | None) -> str:
        """Why the admission table may not decide now: nodes with shards where the controller in
        control refuses shard jobs (the table's decisions assume every GPU takes them); "" when none."""
        parts = self.partitions() if self.partitions else None
        refused = parts.shards_refused(self._live_shards(queue)) if parts else ()
        return f"the controller refuses shards on {len(refused)} node(s): {'; '.join(refused[:3])}" if refused else ""

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
        if self.mode is not PolicyMode.ENFORCE or row is None or row.action != Action.WHOLE_GPU.value:
            return None  # shadow: a pending job is never rewritten
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
        self._record(r.decision, r.request, r.keys, r.facts)

    def decide_facts(self, facts: pb.JobFacts, replaces: str, whole_because: Reason):
        """A new whole-GPU decision for a job already decided (a requeue after an OOM, adapters/
        requeue.py): (decision, request, history keys); recorded by ``record_decision``."""
        return self._decide(facts, replaces=replaces, whole_because=whole_because)

    def record_decision(self, d: Decision, jr, keys, facts: pb.JobFacts) -> None:
        self._record(d, jr, keys, facts)

    # ------------------------------------------------------------------ correlation
    def _decision_id_for_job(self, job_id: int) -> str:
        """The decision of the job that has this id now (its newest instance in Slurm)."""
        self.flush()
        return self.correlation.current_decision(job_id)

    # ------------------------------------------------------------------ events
    def _note_enforcement(self, events) -> None:
        for e in events:
            if e.WhichOneof("event") == "started" and e.started.HasField("enforcement"):
                n = e.started.enforcement
                self.node_enforcement.record(NodeReport(e.started.node, n.backend, n.hard_cap, n.victim,
                                                        e.started.started_at or self.clock()))

    def _one_event(self, event: pb.JobEvent) -> pb.EventResult:
        self._note_enforcement([event])
        self.flush()  # decisions handed out so far are in the history before events name them
        (result,) = self.events.apply([event])
        if result.code:
            raise HandlerError(_STATUS.get(result.code, grpc.StatusCode.INTERNAL), result.message)
        return result

    def job_started(self, req: pb.JobStartedRequest) -> pb.JobStartedResponse:
        return pb.JobStartedResponse(decision_id=self._one_event(pb.JobEvent(started=req)).decision_id)

    def job_finished(self, req: pb.JobFinishedRequest) -> pb.JobFinishedResponse:
        result = self._one_event(pb.JobEvent(finished=req))
        return pb.JobFinishedResponse(applied=result.applied, decision_id=result.decision_id)

    def report_events(self, req: pb.ReportEventsRequest) -> pb.ReportEventsResponse:
        """A batch of events (a node agent's spool): applied in order, each once, all job ids
        resolved with one Slurm query; one result per event, a bad one never failing the rest."""
        self._note_enforcement(req.events)
        self.flush()
        return pb.ReportEventsResponse(results=self.events.apply(req.events))

    # ------------------------------------------------------------------ Explain
    def explain(self, req: pb.ExplainRequest, caller=None) -> pb.ExplainResponse:
        """Job facts (a what-if) are explained to anyone (in full to the job's user and admins, else
        only the action and shard count); a recorded decision only to whom ``self.authorizer`` lets
        see it (``caller``: None, from inside the service: all)."""
        which = req.WhichOneof("target")
        if which == "job":
            return pb.ExplainResponse(decision=self.admit(pb.AdmitRequest(job=req.job, dry_run=True), caller).decision,
                                      job=req.job)
        self._may_explain(caller, None)
        job_id = 0
        if which == "job_id":
            job_id = req.job_id
            if job_id > MAX_JOB_ID:
                raise HandlerError(grpc.StatusCode.INVALID_ARGUMENT, f"{job_id} is not a Slurm job id")
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
            if self.store.decision_status(d_id) == "never_held":
                raise HandlerError(grpc.StatusCode.NOT_FOUND, f"decision {d_id!r} was never held by a job in Slurm "
                                   "(a --test-only submission, a job refused after the plugin ran, or an answer "
                                   "slurmctld stopped waiting for): its record was deleted")
            raise HandlerError(grpc.StatusCode.NOT_FOUND, f"decision {d_id!r} is not in the history")
        self._may_explain(caller, row.facts)
        out = pb.ExplainResponse(job_id=job_id)
        out.decision.CopyFrom(row.decision)
        if self.store.decision_status(d_id) == "never_held":
            out.decision.reasons.add(code="never_held", message="no job in Slurm ever held this decision (the job "
                                     "was refused after the plugin ran, or slurmctld stopped waiting for the answer)")
        out.job.CopyFrom(row.facts)
        out.observations.extend(observation_to_proto(o) for o in self.store.observations(decision_id=d_id))
        return out

    def _may_explain(self, caller, facts: pb.JobFacts | None) -> None:
        if caller is None or self.authorizer is None:
            return
        v = self.authorizer.explain(caller, None if facts is None else Owner(facts.uid, facts.user))
        if not v.allowed:
            raise HandlerError(v.code or grpc.StatusCode.PERMISSION_DENIED, f"Explain refused: {v.reason}")


class Method(enum.Enum):
    """The RPCs, by their proto names: one table for both transports."""

    ADMIT = ("Admit", pb.AdmitRequest, "admit")
    JOB_STARTED = ("JobStarted", pb.JobStartedRequest, "job_started")
    JOB_FINISHED = ("JobFinished", pb.JobFinishedRequest, "job_finished")
    EXPLAIN = ("Explain", pb.ExplainRequest, "explain")
    REPORT_EVENTS = ("ReportEvents", pb.ReportEventsRequest, "report_events")

    @classmethod
    def by_name(cls, name: str) -> "Method":
        for m in cls:
            if m.value[0] == name:
                return m
        raise HandlerError(grpc.StatusCode.UNIMPLEMENTED, f"unknown method {name!r}")

    @property
    def is_event(self) -> bool:
        """An event feeds the model (observations): only the cluster's hooks may send one."""
        return self in (Method.JOB_STARTED, Method.JOB_FINISHED, Method.REPORT_EVENTS)

    def call(self, handler: PolicyHandler, request, caller=None, sized: bool = False, **options):
        """``caller``: who sent it (policy_service.authz.Caller), for the methods whose answer
        depends on it (Admit: recorded or a dry run; Explain: whose jobs). ``sized``: ``request``
        is known to be within the size limits (the local socket's parsed lines); ``options``: the
        method's own (Admit's encode)."""
        if self.is_event and handler.standby is not None:  # before anything touches the store
            standby = handler.standby()
            if standby is not None:
                raise HandlerError(grpc.StatusCode.UNAVAILABLE, standby)
        too_big = [] if sized else oversize(request)
        if too_big:
            log.warning("%s refused: %s", self.value[0], "; ".join(too_big))
            raise HandlerError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{self.value[0]} refused, a field is too large: {'; '.join(too_big[:3])}")
        if caller is not None and self in (Method.ADMIT, Method.EXPLAIN):
            return getattr(handler, self.value[2])(request, caller=caller, **options)
        return getattr(handler, self.value[2])(request, **options)
