"""Catch-up: the decisions the job_submit plugin made from the published table, learned from
Slurm and recorded in the history once (issue 21; docs/admission-table.md).

A job the plugin decided from the class table carries ``tbl=<version>:<i><g>`` and its own
decision id in its AdminComment, and the service has no record of it. Catch-up reads every job's
AdminComment from Slurm and, for each table-made decision the history does not hold, looks up the
template the service published for (version, entry, gate state) in the archive
(admission/archive.py), fills in the job's decision id (in the record, its decision and
that decision's AdminComment), its submit time as the decision's time and the job's uid from
Slurm (a hook event's job, which correlation reads without it: the template's, 0, which
authz.owns reads as "no uid": the job's user is then its user name), and records it through the handler's DecisionLog: journaled, then in the history, like every decision.

Sources: after every queue poll, the jobs that poll read (``squeue -t all``, one for the queue
monitor and the catch-up: QueueMonitor.take_live; pending, running, and jobs that ended within
MinJobAge), or ``from_live`` where no monitor reads them; ``sweep`` at start and with every reconcile round (the same squeue and
``sacct`` over the window since the last sweep: jobs that started and ended between polls, or
while the service was down); ``of_instances`` when a hook event names a job whose decision is not
in the history yet (the event then ties to it as to any decision).

Exactly once: an id is recorded only when the history does not hold it and this process has not
recorded it yet; HistoryStore.record keeps one row per decision id (a journal replayed after a
crash, or a record made twice, is the same row).

A version no longer archived: the decision is recorded from its AdminComment fields alone
(action, shards, sf, model, why codes) with reason ``table_gone``, and no class keys (nothing is
learned for its class from its run).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import re
import threading
import time
from typing import Callable, Iterable, NamedTuple, Sequence

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.history.decision_log import DecisionLog, JournalError
from policy_service.history.journal_records import DecisionRecord
from policy_service.history.store import HistoryStore
from policy_service.slurm.slurm_comments import CommentedJob
from policy_service.slurm.slurm_text import JobInstance, SlurmError
from policy_service.core.admission import PLACEHOLDER_ID, TableRef, table_ref_of
from policy_service.core.policy import parse_admin_comment
from policy_service.core.types import Action, ReasonCode

log = logging.getLogger("swapaware.decisions")

_ID = re.compile(r"[0-9a-f]{8,32}")
KNOWN_MAX = 200_000  # decision ids this process knows are recorded (beyond: asked of the history again)
PARSED_MAX = 65_536  # AdminComments whose table_made() is remembered (forgotten all at once when full)
_UNPARSED = object()
SWEEP_OVERLAP_S = 600.0  # a sweep's sacct reaches this far before the previous sweep began


def table_made(admin_comment: str) -> tuple[str, TableRef] | None:
    """(decision id, table reference) of a decision the plugin made from the table; None for any
    other AdminComment."""
    fields = parse_admin_comment(admin_comment)
    ref = table_ref_of(fields)
    if ref is None:
        return None
    d_id = fields.get("id", "")
    return (d_id, ref) if _ID.fullmatch(d_id) else None


def _learned_reason(ref: TableRef, source: str, lag_s: float) -> pb.Reason:
    return pb.Reason(code=ReasonCode.TABLE_DECIDED.value,
                     message=f"decided by the job_submit plugin from table {ref.version} (entry {ref.entry}, gate "
                             f"state {ref.state}); learned from Slurm ({source}) {lag_s:.0f} s after submission")


def filled(template: DecisionRecord, d_id: str, decided_at: float, uid: int | None, reason: pb.Reason,
           time_limit_min: int | None = None) -> DecisionRecord:
    """The archived template as the job's own decision: its id (record, decision, AdminComment),
    its time, its uid (None: the template's) and its time limit (None: not known, recorded as 0;
    never the template's: the class key leaves the limit out, so the template's is another job's)."""
    facts = pb.JobFacts.FromString(template.facts_pb)
    if uid is not None:
        facts.uid = uid
    facts.time_limit_min = time_limit_min or 0
    decision = pb.Decision.FromString(template.decision_pb)
    decision.decision_id, decision.decided_at = d_id, decided_at
    placeholder = f"id={PLACEHOLDER_ID}"
    if placeholder in decision.rewrite.admin_comment:
        decision.rewrite.admin_comment = decision.rewrite.admin_comment.replace(placeholder, f"id={d_id}", 1)
    decision.reasons.append(reason)
    return dataclasses.replace(template, decision_id=d_id, decided_at=decided_at, facts_pb=facts.SerializeToString(),
                               decision_pb=decision.SerializeToString())


def _int(text: str) -> int:
    return int(text) if re.fullmatch(r"-?\d{1,9}", text or "") else 0


def from_comment(job: CommentedJob, d_id: str, ref: TableRef, decided_at: float) -> DecisionRecord:
    """A decision of a table version no longer archived, from its AdminComment alone."""
    f = parse_admin_comment(job.admin_comment)
    action = f.get("action", "")
    known = {a.value: a for a in Action}
    pb_action = pb.Action.Value(f"ACTION_{known[action].name}") if action in known else pb.ACTION_UNSPECIFIED
    why = [c for c in f.get("why", "").split(",") if c]
    reasons = [pb.Reason(code=c, message="read from the job's AdminComment") for c in why]
    reasons.append(pb.Reason(code=ReasonCode.TABLE_GONE.value, message=(
        f"table version {ref.version} is no longer archived: recorded from the job's AdminComment alone (action, "
        "shards, site factor, reason codes); no estimate, facts or class keys, so its run teaches no class")))
    decision = pb.Decision(decision_id=d_id, model_version=f.get("model", ""), action=pb_action,
                           shards=max(0, _int(f.get("shards", ""))), site_factor=_int(f.get("sf", "")),
                           decided_at=decided_at, mode="shadow" if f.get("mode") == "shadow" else "enforce",
                           reasons=reasons)
    decision.rewrite.admin_comment = job.admin_comment
    facts = pb.JobFacts(user=job.user, uid=job.uid or 0, account=job.account, partition=job.partition,
                        time_limit_min=job.time_limit_min or 0)
    return DecisionRecord(decision_id=d_id, decided_at=decided_at, job_class="", user=job.user, account=job.account,
                          partition=job.partition, job_name="", action=action, shards=decision.shards,
                          model_version=decision.model_version, keys={}, facts_pb=facts.SerializeToString(),
                          decision_pb=decision.SerializeToString())


class Caught(NamedTuple):
    """A table-made decision about to be recorded: its job, its record and what its log line and
    metrics say."""

    job: CommentedJob
    d_id: str
    rec: DecisionRecord
    note: dict
    archived: bool  # its table version was archived (else: recorded from the AdminComment alone)
    lag: float  # seconds from the job's submission until the service learned of it
    reason: str  # its first reason code
    mode: str


def instance_job(inst: JobInstance) -> CommentedJob:
    """A hook event's job as correlation read it (no uid or user: the template's stand)."""
    return CommentedJob(inst.job_id, inst.submit_time, None, "", "", "", inst.state, inst.admin_comment, "event")


class AdmissionCatchup:
    """Records the table-made decisions Slurm shows and the history lacks (module doc)."""

    def __init__(self, store: HistoryStore, decisions: DecisionLog, archive, slurm, *, metrics=None,
                 clock: Callable[[], float] = time.time, window_s: float = 86400.0,
                 overlap_s: float = SWEEP_OVERLAP_S):
        self.store, self.decisions, self.archive, self.slurm = store, decisions, archive, slurm
        self.metrics, self.clock, self.window_s, self.overlap_s = metrics, clock, window_s, overlap_s
        self._known: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._parsed: dict[str, tuple[str, TableRef] | None] = {}  # AdminComment -> table_made(it)
        self.live_from: Callable[[], list[CommentedJob] | None] | None = None  # the queue poll's jobs
        self._lock = threading.Lock()
        self._swept_at: float | None = None  # when the last sweep that read Slurm began
        self._failing = ""
        self.recorded = collections.Counter()  # source -> decisions caught up by this process

    # ------------------------------------------------------------------ recording
    def learn(self, jobs: Iterable[CommentedJob]) -> int:
        """Record each table-made decision among ``jobs`` the history lacks; how many were."""
        candidates: dict[str, tuple[CommentedJob, TableRef]] = {}
        parsed = self._parsed
        for job in jobs:
            # every poll reads every job Slurm holds again: each AdminComment is parsed once
            made = parsed.get(job.admin_comment, _UNPARSED)
            if made is _UNPARSED:
                made = table_made(job.admin_comment)
                if len(parsed) >= PARSED_MAX:
                    parsed.clear()
                parsed[job.admin_comment] = made
            if made is not None and made[0] not in self._known:
                candidates.setdefault(made[0], (job, made[1]))
        if not candidates:
            return 0
        with self._lock:
            in_history = self.store.known_decisions(candidates)
            todo = []
            for d_id, (job, ref) in candidates.items():
                if d_id in self._known:
                    continue
                if d_id in in_history:
                    self._remember(d_id)
                else:
                    todo.append(self._caught(job, d_id, ref))
            return self._record_all(todo)

    def _caught(self, job: CommentedJob, d_id: str, ref: TableRef) -> Caught:
        now = self.clock()
        decided_at = float(job.submit_time) if job.submit_time > 0 else now
        lag = max(0.0, now - decided_at)
        template = self.archive.lookup(ref.version, ref.entry, ref.state) if self.archive is not None else None
        if template is not None:
            rec = filled(template, d_id, decided_at, job.uid, _learned_reason(ref, job.source, lag),
                         job.time_limit_min)
        else:
            rec = from_comment(job, d_id, ref, decided_at)
        decision = pb.Decision.FromString(rec.decision_pb)
        reasons = [r.code for r in decision.reasons]
        note = {"decision_id": d_id, "job_id": job.job_id, "caught_up_from": job.source, "table": ref.version,
                "entry": ref.entry, "state": ref.state, "archived": template is not None, "lag_s": round(lag, 3),
                "user": rec.user, "action": rec.action, "shards": rec.shards, "mode": decision.mode, "reasons": reasons}
        return Caught(job, d_id, rec, note, template is not None, lag, reasons[0] if reasons else "", decision.mode)

    def _record_all(self, todo: list[Caught]) -> int:
        """Journal ``todo`` in one write and hand it to the history's writer; how many were (those
        not are offered again by the next round)."""
        if not todo:
            return 0
        try:
            n = self.decisions.record_many([(c.rec, c.note) for c in todo])
        except JournalError as exc:
            log.error("%d table-made decision(s) not recorded yet (the first %s, of job %s): %s", len(todo),
                      todo[0].d_id, todo[0].job.job_id, exc)
            return 0
        if n < len(todo):
            log.error("%d table-made decision(s) not recorded yet (the first %s, of job %s): the history's writer "
                      "is behind", len(todo) - n, todo[n].d_id, todo[n].job.job_id)
        done = todo[:n]
        for c in done:
            self._remember(c.d_id)
            self.recorded[c.job.source] += 1
        if self.metrics is not None:
            self._count(done)
        return n

    def _count(self, done: list[Caught]) -> None:
        """The metrics of ``done``: one increment per label set, not one per decision."""
        m = self.metrics
        for (source, archived), k in collections.Counter((c.job.source, c.archived) for c in done).items():
            m.caught_up.labels(source=source, archived=str(archived).lower()).inc(k)
        lag_of: dict = {}
        for c in done:
            child = lag_of.get(c.job.source)
            if child is None:
                child = lag_of[c.job.source] = m.catchup_lag.labels(source=c.job.source)
            child.observe(c.lag)
        for (action, reason, mode), k in collections.Counter((c.rec.action, c.reason, c.mode) for c in done).items():
            m.decisions.labels(action=action, reason=reason, mode=mode).inc(k)

    def _remember(self, d_id: str) -> None:
        self._known[d_id] = None
        while len(self._known) > KNOWN_MAX:
            self._known.popitem(last=False)

    # ------------------------------------------------------------------ sources
    def _read(self, what: str, read: Callable[[], list[CommentedJob]]) -> list[CommentedJob] | None:
        try:
            jobs = read()
        except (SlurmError, AttributeError) as exc:
            if str(exc) != self._failing:  # one line per outage
                log.warning("catch-up of table-made decisions: cannot read %s: %s", what, exc)
            self._failing = str(exc)
            return None
        if self._failing:
            log.info("catch-up of table-made decisions: Slurm read again")
        self._failing = ""
        return jobs

    def from_live(self) -> int:
        """The jobs slurmctld holds (one squeue)."""
        jobs = self._read("the jobs from squeue", lambda: self.slurm.live_commented_jobs())
        return 0 if jobs is None else self.learn(jobs)

    def on_queue_poll(self, _pending=None, _state=None) -> None:
        """QueueMonitor.on_poll: after every queue poll, from the jobs that poll read with their
        AdminComments (``live_from``: QueueMonitor.take_live), else from an squeue of its own."""
        jobs = self.live_from() if self.live_from is not None else None
        if jobs is None:
            self.from_live()
        else:
            self.learn(jobs)

    def sweep(self, since: float | None = None) -> set[str]:
        """The jobs slurmctld holds and the accounting's since ``since`` (None: since the previous
        sweep began, less ``overlap_s``; the first: ``window_s`` ago). Returns the decision ids
        their AdminComments name; raises SlurmError when Slurm could not be read."""
        began = self.clock()
        if since is None:
            since = began - self.window_s if self._swept_at is None else self._swept_at - self.overlap_s
        jobs = self.slurm.live_commented_jobs() + self.slurm.accounted_commented_jobs(since)
        self.learn(jobs)
        self._swept_at = began if self._swept_at is None else max(self._swept_at, began)
        return {d for j in jobs if (d := parse_admin_comment(j.admin_comment).get("id", "")) and _ID.fullmatch(d)}

    def of_instances(self, instances: Sequence[JobInstance | None]) -> int:
        """Hook events' jobs (correlation.py): their decisions are in the history when this returns.
        Whoever recorded one (this call, or a queue poll a moment before, whose record may still
        wait for the writer: the id is then known here and not recorded again), it is flushed."""
        jobs = [instance_job(i) for i in instances if i is not None]
        count = self.learn(jobs)
        if count or (self.decisions.pending() and any(self._made(j.admin_comment) for j in jobs)):
            self.decisions.flush()
        return count

    def _made(self, admin_comment: str) -> tuple[str, TableRef] | None:
        made = self._parsed.get(admin_comment, _UNPARSED)
        return table_made(admin_comment) if made is _UNPARSED else made

    # ------------------------------------------------------------------ running
    def start(self, poll_s: float | None, stop: threading.Event) -> threading.Thread:
        """A first sweep at once (what happened while the service was down), then ``from_live``
        every ``poll_s`` (None: the queue monitor calls ``on_queue_poll``)."""
        def loop() -> None:
            first = True
            while first or (poll_s is not None and not stop.wait(poll_s)):
                try:
                    if first:
                        t0 = time.monotonic()
                        n = sum(self.recorded.values())
                        self.sweep()
                        log.info("catch-up at start: %d table-made decision(s) recorded in %.2f s",
                                 sum(self.recorded.values()) - n, time.monotonic() - t0)
                    else:
                        self.from_live()
                except SlurmError as exc:
                    log.warning("catch-up at start: cannot read Slurm (%s); the next reconcile round sweeps", exc)
                except Exception:  # noqa: BLE001 - the loop must go on
                    log.exception("catch-up of table-made decisions failed")
                first = False

        t = threading.Thread(target=loop, name="admission-catchup", daemon=True)
        t.start()
        return t


def chain(*calls: Callable | None) -> Callable:
    """One QueueMonitor.on_poll that calls each of ``calls`` (None skipped) in turn."""
    todo = [c for c in calls if c is not None]

    def on_poll(pending, state) -> None:
        for call in todo:
            try:
                call(pending, state)
            except Exception:  # noqa: BLE001 - one failing does not stop the others
                log.exception("after the queue poll")
    return on_poll


def attach(handler, slurm, monitor, archive, stop: threading.Event, *, poll_s: float,
           window_s: float, gate: Callable[[Callable], Callable] | None = None) -> AdmissionCatchup:
    """Catch-up wired into the service (server.start_service, when a table is published): hook
    events (the handler's correlator), the queue poll (``monitor``; None: a poll of its own every
    ``poll_s``) and a first sweep now; the caller passes it to the Reconciler for the rounds.
    ``gate``: wraps what records decisions (two controllers: only the writer records, docs/ha.md)."""
    catchup = AdmissionCatchup(handler.store, handler.decisions, archive, slurm, metrics=handler.metrics,
                               window_s=window_s)
    if gate is not None:
        catchup.learn = gate(catchup.learn)
    handler.correlation.catch_up = catchup.of_instances
    if monitor is not None:  # first: a pending job's re-decision (serving/redecide.py) reads its decision
        monitor.live_wanted, catchup.live_from = True, monitor.take_live  # one squeue per poll for both
        monitor.on_poll = chain(catchup.on_queue_poll, monitor.on_poll)
    catchup.start(None if monitor is not None else poll_s, stop)
    return catchup
