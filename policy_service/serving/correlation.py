"""Which job instance an event belongs to, and which decision it carries.

A Slurm job id is not a job: ids restart at 1 after a state reset, and a requeue gives the job a
new submit time. The hooks' events name a job id (and, on 25.11+, its SLUID); the service asks
Slurm which instances of those ids exist and picks the one whose run [start, end] holds the
event's times (or whose SLUID matches). The instance's AdminComment (``swapaware:v1 id=...``,
written by job_submit.lua) is the authoritative link to its decision; a decision made after the
instance was submitted is never attached (a stale or copied comment).

Cost: one Slurm query resolves a whole batch of events (``squeue -j a,b,c`` for live jobs, or
``sacct -D -j a,b,c`` for ended ones; the other source only for what the first could not place).
Ended instances, and instances known by SLUID, never change: they are kept in a bounded LRU.
"""
from __future__ import annotations

import collections
import logging
import math
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from policy_service.history.store import HistoryStore, unresolved_key
from policy_service.slurm.slurm import SlurmAccess, SlurmError
from policy_service.slurm.slurm_text import ENDED_STATES, JobInstance, sluid_key
from policy_service.core.policy import parse_admin_comment
from policy_service.core.types import ReasonCode

log = logging.getLogger("swapaware.correlation")

# Events newer than this are looked up among live jobs first (slurmctld keeps an ended job for
# MinJobAge, 300 s by default); older ones in accounting first.
LIVE_WINDOW_S = 300.0
# An event is placed in the instance whose run is nearest its times, if no farther than this
# (an epilog runs after Slurm's end time; node and controller clocks differ a little).
MATCH_GRACE_S = 600.0
# A finish this long after its run's end still counts as inside it (the epilog runs after the end).
SETTLED_S = 5.0
# A decision is attached to an instance submitted at most this long before it was decided
# (decided_at: the service's clock; submit time: slurmctld's, whole seconds, set after the plugin ran).
SUBMIT_SLACK_S = 10.0
# Without Slurm's answer a finish joins an open run of its job id on its node that started within
# this of the start the node agent reports (the newest open one when the agent reports none).
ADOPT_START_S = 120.0
_REPLACES = re.compile(r"replaces decision (\S+)")


@dataclass(frozen=True)
class EventRef:
    """What an event says about its job: id, node, SLUID, and its times (0: not known)."""

    job_id: int
    node: str
    sluid: str = ""
    started_at: float = 0.0
    finished_at: float = 0.0

    @property
    def times(self) -> tuple[float, ...]:
        return tuple(t for t in (self.started_at, self.finished_at) if t > 0)

    @property
    def at(self) -> float:
        return max(self.times, default=0.0)


@dataclass(frozen=True)
class Resolution:
    instance: str  # the key runs and observations are stored under (history_schema)
    submit_time: int = 0
    decision_id: str = ""
    how: str = "unresolved"  # "slurm", "sluid" (Slurm had no record; the event's SLUID), "run", "unresolved"
    note: str = ""  # why no decision is attached, for the log


def _open_end(inst: JobInstance) -> float:
    """Where the instance's run ends for matching: a live job not yet done (running, or completing:
    its epilog is what reports) runs on."""
    if inst.end_time <= 0 or (inst.source == "squeue" and inst.state not in ENDED_STATES - {"COMPLETING"}):
        return math.inf
    return float(inst.end_time)


def distance(ref: EventRef, inst: JobInstance) -> float:
    """Seconds between the event's times and the instance's run (0: inside); inf when it cannot be
    that instance (another id or SLUID, never started)."""
    if inst.job_id != ref.job_id or (ref.sluid and inst.sluid and inst.sluid != ref.sluid) or inst.start_time <= 0:
        return math.inf
    lo, hi = float(inst.start_time), _open_end(inst)
    return max((lo - t if t < lo else t - hi if t > hi else 0.0 for t in ref.times), default=math.inf)


def match_instance(ref: EventRef, candidates: Iterable[JobInstance],
                   grace_s: float = MATCH_GRACE_S) -> tuple[JobInstance | None, float]:
    """The instance an event belongs to and its distance: the SLUID's, else the nearest run (the
    newest submit among equals) within ``grace_s``; (None, inf) when none is."""
    mine = [c for c in candidates if c.job_id == ref.job_id]
    if ref.sluid:
        same = [c for c in mine if c.sluid == ref.sluid]
        if same:
            return max(same, key=lambda c: c.submit_time), 0.0
    best, best_d = None, math.inf
    for c in mine:
        d = distance(ref, c)
        if d < best_d or (d == best_d and best is not None and c.submit_time > best.submit_time):
            best, best_d = c, d
    return (best, best_d) if best is not None and best_d <= grace_s else (None, math.inf)


def settled(ref: EventRef, inst: JobInstance | None) -> bool:
    """Whether the event lies inside the instance's run (its SLUID, or its start inside the run
    and its finish at most ``SETTLED_S`` after the end): no other job of the id can hold it, so
    nothing more needs asking."""
    if inst is None or inst.start_time <= 0:
        return False
    if ref.sluid and inst.sluid == ref.sluid:
        return True
    lo, hi = float(inst.start_time), _open_end(inst)
    if ref.started_at > 0 and not lo <= ref.started_at <= hi:
        return False
    return ref.finished_at <= 0 or lo <= ref.finished_at <= hi + SETTLED_S


def merge(*sources: Iterable[JobInstance]) -> list[JobInstance]:
    """One record per instance (cluster, id, submit time); the first source's wins (squeue's: its
    AdminComment is the current one and it has the SLUID)."""
    out: dict[tuple, JobInstance] = {}
    for source in sources:
        for inst in source:
            out.setdefault((inst.cluster, inst.job_id, inst.submit_time), inst)
    return list(out.values())


class InstanceCache:
    """Bounded LRU of instances that no longer change (ended, or known by SLUID), by job id."""

    def __init__(self, max_jobs: int = 4096):
        self.max_jobs = max_jobs
        self._jobs: collections.OrderedDict[int, dict[str, JobInstance]] = collections.OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def keeps(inst: JobInstance) -> bool:
        return bool(inst.sluid) or (inst.end_time > 0 and inst.state != "COMPLETING"
                                    and (inst.source == "sacct" or inst.state in ENDED_STATES))

    def add(self, instances: Iterable[JobInstance]) -> None:
        with self._lock:
            for inst in instances:
                if not self.keeps(inst):
                    continue
                self._jobs.setdefault(inst.job_id, {})[inst.key] = inst
                self._jobs.move_to_end(inst.job_id)
            while len(self._jobs) > self.max_jobs:
                self._jobs.popitem(last=False)

    def find(self, ref: EventRef) -> JobInstance | None:
        with self._lock:
            known = list(self._jobs.get(ref.job_id, {}).values())
            if known:
                self._jobs.move_to_end(ref.job_id)
        inst = match_instance(ref, known)[0]
        return inst if settled(ref, inst) else None

    def __len__(self) -> int:
        return len(self._jobs)


class Correlator:
    """Resolves events to job instances and decisions, many per Slurm query."""

    def __init__(self, slurm: SlurmAccess | None, store: HistoryStore, *, clock: Callable[[], float] = time.time,
                 cache_jobs: int = 4096, open_run_max_s: float = 7 * 86400.0):
        self.slurm, self.store, self.clock = slurm, store, clock
        self.open_run_max_s = open_run_max_s  # an open run older than this is over (never joined)
        self.cache = InstanceCache(cache_jobs)
        self.queries = 0  # Slurm queries made (squeue or sacct runs)
        # Called with the instances found for a batch of events, before their decisions are read:
        # records the decisions the job_submit plugin made from the published table that the history
        # lacks (admission/catchup.py). None: no table is published.
        self.catch_up: Callable[[Sequence[JobInstance | None]], object] | None = None

    # ------------------------------------------------------------------ Slurm
    def _ask(self, live: bool, job_ids: Iterable[int]) -> list[JobInstance]:
        ids = sorted(set(job_ids))
        if not ids or self.slurm is None:
            return []
        self.queries += 1
        try:
            found = self.slurm.live_instances(ids) if live else self.slurm.ended_instances(ids)
        except SlurmError as exc:
            log.warning("cannot read %d job(s) from Slurm (%s): %s", len(ids), "squeue" if live else "sacct", exc)
            return []
        self.cache.add(found)
        return found

    def instances(self, refs: Sequence[EventRef]) -> list[JobInstance | None]:
        """The instance of each event (None: Slurm has none that fits): cached ones first, then one
        query for the rest (live jobs if any event is recent, else accounting), then the other
        source for the events the first left unsettled. Their table-made decisions are caught up."""
        out = self._instances(refs)
        if self.catch_up is not None:
            self.catch_up(out)
        return out

    def _instances(self, refs: Sequence[EventRef]) -> list[JobInstance | None]:
        out: list[JobInstance | None] = [self.cache.find(r) for r in refs]
        todo = [i for i, inst in enumerate(out) if inst is None]
        if not todo or self.slurm is None:
            return out
        now = self.clock()
        live_first = any(refs[i].at >= now - LIVE_WINDOW_S for i in todo)
        seen = self._ask(live_first, (refs[i].job_id for i in todo))
        for i in todo:
            out[i] = match_instance(refs[i], seen)[0]
        unsettled = [i for i in todo if not settled(refs[i], out[i])]
        if unsettled:
            seen = merge(seen, self._ask(not live_first, (refs[i].job_id for i in unsettled)))
            for i in unsettled:
                out[i] = match_instance(refs[i], seen)[0]
        return out

    # ------------------------------------------------------------------ decisions
    def decision_of(self, inst: JobInstance) -> tuple[str, str]:
        """(decision id, "") named by the instance's AdminComment, or ("", why not)."""
        d_id = parse_admin_comment(inst.admin_comment).get("id", "")
        if not d_id:
            return "", "its AdminComment carries no swapaware decision"
        row = self.store.decision(d_id)
        if row is None:
            return "", f"decision {d_id} is not in the history"
        decided_at = self._first_decided_at(row)
        if inst.submit_time > 0 and inst.submit_time + SUBMIT_SLACK_S < decided_at:
            log.warning("job %s submitted at %d names decision %s made at %.0f, after it: not attached (a stale "
                        "or copied AdminComment)", inst.job_id, inst.submit_time, d_id, decided_at)
            return "", f"decision {d_id} was made after the job was submitted"
        return d_id, ""

    def _first_decided_at(self, row) -> float:
        """When the job's first decision was made: a re-decision (of a pending job) names the one it
        replaced; the first one was made at submit."""
        decided_at = row.decided_at
        for _ in range(8):
            replaced = [m.group(1) for r in row.decision.reasons if r.code == ReasonCode.REDECIDED.value
                        for m in [_REPLACES.search(r.message)] if m]
            row = self.store.decision(replaced[0]) if replaced else None
            if row is None:
                break
            decided_at = row.decided_at
        return decided_at

    # ------------------------------------------------------------------ events
    def resolve(self, refs: Sequence[EventRef]) -> list[Resolution]:
        """One ``Resolution`` per event, in order (a batch applying its events one by one calls
        ``instances`` once, then ``resolution`` for each just before applying it)."""
        return [self.resolution(ref, inst) for ref, inst in zip(refs, self.instances(refs))]

    def resolution(self, ref: EventRef, inst: JobInstance | None) -> Resolution:
        """The event's instance key and decision, given what Slurm said of it (``instances``)."""
        if inst is None:
            return self._without_slurm(ref)
        d_id, note = self.decision_of(inst)
        key = sluid_key(ref.sluid) if ref.sluid else inst.key
        return Resolution(key, inst.submit_time, d_id, "slurm", note)

    def _without_slurm(self, ref: EventRef) -> Resolution:
        """No instance from Slurm: the event's SLUID names it; else a finish joins the open run of
        its job id on its node that started when the node agent says the job started (the newest
        one that started before the finish, when the agent says nothing); else the run stays
        unresolved (nothing is learned from it)."""
        if ref.sluid:
            key = sluid_key(ref.sluid)
            run = self.store.run_of(key)
            return Resolution(key, run.submit_time if run else 0, run.decision_id if run else "", "sluid",
                              "" if run and run.decision_id else "Slurm has no record of the job")
        if ref.finished_at > 0:
            for run in self.store.open_runs_of(ref.job_id, ref.node):  # newest first
                began = run.started_at or 0.0
                if ref.started_at > 0 and abs(began - ref.started_at) > ADOPT_START_S:
                    continue
                if ref.started_at <= 0 and not ref.finished_at - self.open_run_max_s <= began <= ref.finished_at:
                    continue
                return Resolution(run.instance, run.submit_time, run.decision_id, "run")
        start = ref.started_at or ref.at
        return Resolution(unresolved_key(ref.job_id, ref.node, start), 0, "", "unresolved",
                          "Slurm has no record of the job")

    def current_decision(self, job_id: int) -> str:
        """The decision of the job that has this id now (the newest instance Slurm knows); without
        Slurm, the newest run recorded under the id."""
        if self.slurm is None:
            run = self.store.run(job_id)
            return run.decision_id if run is not None else ""
        found = [i for i in self._ask(True, [job_id]) if i.job_id == job_id] \
            or [i for i in self._ask(False, [job_id]) if i.job_id == job_id]
        if not found:
            return ""
        newest = max(found, key=lambda i: i.submit_time)
        if self.catch_up is not None:
            self.catch_up([newest])
        return self.decision_of(newest)[0]
