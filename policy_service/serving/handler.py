"""The one request handler behind both transports (gRPC and the local JSON socket).

It converts messages to core values, calls the pure core, and persists through the history
store. Errors are raised as ``HandlerError`` with a gRPC status code; the transports map them.
PolicyHandler is made of one part per path: deciding (handler_decide.py), Admit and recording
(handler_admit.py), re-decisions (handler_pending.py), events (handler_events.py) and Explain
(handler_explain.py); this module holds its state, its life cycle and the ``Method`` table.
"""
from __future__ import annotations

import collections
import enum
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

import grpc

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.history.decision_log import DecisionLog
from policy_service.history.store import HistoryStore
from policy_service.interference.learner import InterferenceLearner
from policy_service.slurm.queue import QueueMonitor
from policy_service.slurm.requeue import OomRequeuer
from policy_service.slurm.slurm import SlurmAccess
from policy_service.config import Config, PolicyMode
from policy_service.core.dialect import SLURM_22_05, SlurmDialect
from policy_service.core.enforcement import NodeEnforcementRegistry
from policy_service.slurm.partitions import PartitionDefaults
from policy_service.serving.correlation import Correlator
from policy_service.serving.events import EventApplier
from policy_service.serving.handler_admit import Admitting
from policy_service.serving.handler_decide import Deciding
from policy_service.serving.handler_error import HandlerError
from policy_service.serving.handler_events import EventPath
from policy_service.serving.handler_explain import Explaining
from policy_service.serving.handler_pending import Redeciding
from policy_service.trust.limits import oversize
from policy_service.serving.metrics import ServiceMetrics

log = logging.getLogger("swapaware.decisions")


class RandomIds:
    """Decision ids: 16 hex digits of os.urandom each (as uuid4().hex[:16] gave), read ``batch`` at
    a time: one system call per ``batch`` Admits, not one each (a system call gives up the GIL, and
    another thread then takes it). A forked child reads its own."""

    def __init__(self, batch: int = 256):
        self._batch, self._lock, self._left = batch, threading.Lock(), iter(())
        os.register_at_fork(after_in_child=self._forget)

    def __call__(self) -> str:
        with self._lock:
            d_id = next(self._left, None)
            if d_id is None:
                raw = os.urandom(8 * self._batch).hex()
                self._left = iter([raw[i:i + 16] for i in range(0, len(raw), 16)])
                d_id = next(self._left)
        return d_id

    def _forget(self) -> None:
        self._lock, self._left = threading.Lock(), iter(())


_new_id = RandomIds()


class PolicyHandler(Deciding, Admitting, Redeciding, EventPath, Explaining):
    """Admit / JobStarted / JobFinished / ReportEvents / Explain over core + store."""

    def __init__(self, cfg: Config, store: HistoryStore, slurm: SlurmAccess | None,
                 clock: Callable[[], float] = time.time, new_id: Callable[[], str] = _new_id,
                 queue_monitor: QueueMonitor | None = None, dialect: SlurmDialect = SLURM_22_05,
                 authorizer=None, partitions: Callable[[], PartitionDefaults] | None = None):
        self.cfg, self.store, self.slurm = cfg, store, slurm
        # the partitions' per-GPU defaults (slurm/partitions.py: slurm.conf, re-read when it
        # changes); None: none known (tests, the simulator)
        self.partitions = partitions
        # policy_service.trust.access.Authorizer: who may record an Admit and see which Explain (callers
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
        # The site's interference, learned from its shared runs (interference/learner.py): decisions
        # read its view; each finished shared run teaches it.
        self.interference = InterferenceLearner(cfg, self._gpu_type_of)
        self.events.interference = self.interference
        self.interference.on_refit = self.metrics.interference_view
        if slurm is not None:  # a shared run that ran out of GPU memory is requeued whole (core/requeue.py)
            self.events.on_shared_oom = OomRequeuer(self, slurm)
        # What each node's GPU memory enforcement is (reported with job starts): gates oversubscription.
        self.node_enforcement = NodeEnforcementRegistry()
        # serialized JobFacts -> (partitions view, the live shard counts taken, what _request made of
        # them, the decision last made for them)
        self._requests: dict[bytes, tuple] = {}
        self._decision_counters: dict[tuple, object] = {}  # (action, reason, mode) -> its counter
        # Decisions are journaled before Admit answers and put into SQLite by a writer thread
        # (history/decision_log.py): slurmctld waits for Admit holding its locks, and never for
        # SQLite. Readers of decisions call flush() first.
        journal = None if store.path == ":memory:" else Path(f"{store.path}.journal")
        self.decisions = DecisionLog(journal, store.record, fsync=cfg.service.journal_fsync)
        # Two controllers (docs/ha.md, ha/role.py): what a write is answered while this
        # service is standby (None: it writes); called when slurmctld's Admit arrives on the local socket.
        self.standby: Callable[[], str | None] | None = None
        self.on_local_admit: Callable[[int | None], None] | None = None

    def _gpu_type_of(self, node: str, index: int) -> str:
        """The type gres.conf gives a node's GPU ("": not known)."""
        parts = self.partitions() if self.partitions else None
        for g in (parts.node_gpus.get(node, ()) if parts else ()):
            if g.index == index:
                return (g.type or "").lower()
        return ""

    def set_mode(self, mode: PolicyMode) -> None:
        """Switch policy.mode for the next Admit (the service's SIGHUP)."""
        if mode is not self.mode:
            log.warning("policy.mode: %s -> %s", self.mode.value, mode.value)
        self.mode = mode

    def flush(self) -> None:
        """Wait until every decision handed out so far is in the history (a standby's wait in its
        journal until it writes: reads see the writer's history meanwhile)."""
        if self.standby is not None and self.standby() is not None:
            return
        self.decisions.flush()

    def close(self) -> None:
        self.decisions.close()


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
        """``caller``: who sent it (policy_service.trust.authz.Caller), for the methods whose answer
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
