"""How much GPU work waits: a snapshot of Slurm's pending GPU jobs, refreshed in the background.

The policy shares GPUs only while GPU work waits (``policy.share_min_queue``). Admit must not
call Slurm on slurmctld's path (job_submit holds its locks), so a thread polls ``squeue`` and
``sinfo`` every ``policy.queue_poll_s`` (at once when the controller in control may have changed)
and Admit reads the last snapshot. The sinfo also gives each node's shards as the controller in
control reports them (LiveShards): a GPU there with none is not offered to a shard job. A snapshot older than
three periods is reported with its age and the policy treats the queue as unknown.

The service takes the first snapshot before it answers (``wait_first_poll``): a decision in the
first moments after a start must not treat the queue as unknown and share as if work waited.
That wait is bounded by what one poll's Slurm calls may take; a first poll that fails or does
not finish in time is logged and the service starts without a snapshot.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable, Iterable, Mapping

from policy_service.slurm.slurm import PendingJob, SlurmAccess
from policy_service.config import Config
from policy_service.core.request import RequestError, gpu_request
from policy_service.core.types import GresKind, LiveShards, QueueState, copied

log = logging.getLogger("swapaware.queue")

# Pending reasons of jobs that wait for resources (the cluster is full or others go first).
# Held jobs, dependencies, begin times and limits say nothing about free GPUs.
WAITING_REASONS = frozenset({"Priority", "Resources", "None"})
QOS_REFRESH_POLLS = 40  # QoS priorities change rarely: re-read them every 40 polls (10 min at 15 s)
FIRST_POLL_CALLS = 3  # squeue, sinfo and sacctmgr (QoS): each bounded by service.slurm_timeout_s
# The job_submit plugin's start time is os.time() (whole seconds) where lua-socket is missing.
STARTED_SLACK_S = 1.0
PLUGIN_STATES_KEPT = 64  # Lua states (slurmctld starts) remembered by slurmctld_started


def first_poll_bound_s(cfg: Config) -> float:
    """How long a start waits for the first snapshot: the longest the first poll's Slurm calls take."""
    return FIRST_POLL_CALLS * cfg.service.slurm_timeout_s


def reads_queue(cfg: Config) -> bool:
    """Whether a policy rule uses the queue (the service then polls Slurm for it), or [ha] is
    enabled: the same poll reads the shards the controller in control reports (a Slurm 22.05
    backup after a takeover refuses shard jobs; core/types.LiveShards)."""
    return (cfg.policy.share_min_queue > 0 or cfg.policy.redecide_pending or cfg.ha.enabled
            or (cfg.policy.compute_aware and cfg.policy.overcommit_compute_min_queue > 0))


def gpus_asked(job: PendingJob, shards_per_gpu: int) -> float:
    """GPUs a pending job asks for; a shard counts 1 / shards_per_gpu. 0 for non-GPU jobs."""
    try:
        g = gpu_request({"tres_per_node": job.tres_per_node, "tres_per_job": job.tres_per_job,
                         "tres_per_task": job.tres_per_task})
    except RequestError:
        return 0.0
    if g.kind not in (GresKind.GPU, GresKind.SHARD):
        return 0.0
    per = {"tres_per_node": job.nodes, "tres_per_task": job.tasks}.get(g.source_field, 1)
    count = g.per_node * per
    return float(count) if g.kind is GresKind.GPU else count / max(1, shards_per_gpu)


def queue_state(pending: Iterable[PendingJob], total_gpus: int, shards_per_gpu: int,
                qos_priorities: Mapping[str, int] | None = None) -> QueueState:
    """The snapshot: GPUs asked for by jobs waiting for resources, in all and, with the QoS
    priorities, ahead of each QoS (pending jobs whose QoS priority is at least its own; a pending
    job of a QoS not in the table counts ahead of everyone)."""
    waiting = [(j.qos, gpus_asked(j, shards_per_gpu)) for j in pending if j.reason in WAITING_REASONS]
    total = sum(g for _, g in waiting)
    ahead = ()
    if qos_priorities:
        top = max(qos_priorities.values())
        ahead = tuple((name, sum(g for q, g in waiting if qos_priorities.get(q, top) >= prio))
                      for name, prio in sorted(qos_priorities.items()))
    return QueueState(pending_gpus=total, total_gpus=total_gpus, ahead_by_qos=ahead)


class QueueMonitor:
    """Polls Slurm for the queue snapshot; ``snapshot()`` never blocks on Slurm."""

    def __init__(self, slurm: SlurmAccess, cfg: Config, clock: Callable[[], float] = time.monotonic,
                 on_poll: Callable[[list[PendingJob], QueueState], None] | None = None,
                 wall: Callable[[], float] = time.time):
        self.slurm, self.cfg, self.clock, self.on_poll, self.wall = slurm, cfg, clock, on_poll, wall
        # prepare(state): called in the poll thread with each new snapshot before Admits can read it
        # (work they would otherwise do on their first read: partitions.warm_live)
        self.prepare: Callable[[QueueState], object] | None = None
        self._lock = threading.Lock()
        self._state: QueueState | None = None
        self._taken_at = 0.0
        self._failing = False
        self._qos: dict[str, int] = {}
        self._polls = 0
        self._attempted = threading.Event()  # set once the first poll succeeded or failed
        # live_wanted: a follower of each poll (the admission catch-up) reads every job Slurm holds
        # with its AdminComment: the poll then reads them with the pending jobs in one squeue
        # (Slurm's queue_with_comments), and take_live() hands them over once
        self.live_wanted = False
        self._live: list | None = None
        self._last_error = ""
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # controller_changed: how often, and why last; a snapshot from a poll begun before the
        # last change has its shard counts marked unread
        self._changes = 0
        self._polled_change = 0
        self._change_why = ""
        self._hold_until = float("-inf")
        self._changed_at = 0.0
        self._logged_change = 0  # the last change whose first read of the shards was logged
        self._began_wall = float("-inf")  # wall clock: when the last successful poll began
        self._plugin_states: dict[str, None] = {}  # slurmctld_started: the Lua states seen, oldest first

    def controller_changed(self, why: str, hold_s: float = 0.0) -> None:
        """The controller in control may have changed (this service's role changed): its nodes'
        shards are not known until a poll begun after now, and for ``hold_s`` at least (a 22.05
        backup that took over was seen to show its nodes' shards for seconds before it showed
        them as 0); poll at once."""
        with self._lock:
            self._changes += 1
            self._change_why = why
            self._changed_at = self.clock()
            self._hold_until = max(self._hold_until, self.clock() + hold_s)
        self._wake.set()

    def slurmctld_started(self, instance: str, started_at: float) -> bool:
        """The slurmctld whose job_submit plugin runs Lua state ``instance`` started at ``started_at``
        (wall clock, from its /proc start time; 23.11+ restarts on a reconfigure). A snapshot from a poll
        begun before then cannot show that its nodes have not registered with it yet (State=UNKNOWN;
        measured on 24.11 and 26.05: typed shard jobs are refused until they register), so the
        shards count as unread until a poll begun after now (controller_changed, which polls at
        once). Looked at once per Lua state; True when the shards were marked unread."""
        with self._lock:
            if not instance or instance in self._plugin_states:
                return False
            self._plugin_states[instance] = None
            while len(self._plugin_states) > PLUGIN_STATES_KEPT:
                del self._plugin_states[next(iter(self._plugin_states))]
            began = self._began_wall
        if started_at <= 0 or started_at + STARTED_SLACK_S <= began:
            return False
        self.controller_changed(f"slurmctld started at {time.strftime('%H:%M:%S', time.localtime(started_at))}, "
                                "after the last queue poll began (its nodes may not have registered with it yet)")
        return True

    def poll_once(self) -> QueueState | None:
        with self._lock:
            change = self._changes
        began_wall = self.wall()
        live = None
        try:
            if self.live_wanted:
                pending, live = self.slurm.queue_with_comments()
            else:
                pending = self.slurm.pending_jobs()
            nodes = self.slurm.cluster_nodes()
            state = queue_state(pending, nodes.gpus, self.cfg.gpu.shards_per_gpu, self._qos_priorities())
            state = dataclasses.replace(state, live_shards=LiveShards(nodes.shards, unregistered=nodes.unregistered))
        except Exception as exc:  # noqa: BLE001  (the monitor thread must outlive any Slurm surprise)
            if not self._failing:  # one line per outage, not one per poll
                log.warning("cannot read the queue from Slurm (%s); decisions treat it as unknown once the "
                            "last snapshot is older than %.0f s", exc, 3 * self.cfg.policy.queue_poll_s)
            self._failing = True
            self._last_error = str(exc)[:300]
            self._attempted.set()
            return None
        if self._failing:
            log.info("queue snapshot from Slurm available again")
        self._failing = False
        if self.prepare is not None:
            try:
                self.prepare(state)
            except Exception:  # noqa: BLE001 - the snapshot is served all the same
                log.exception("preparing the queue snapshot")
        with self._lock:
            self._state, self._taken_at, self._polled_change = state, self.clock(), change
            self._live = live
            self._began_wall = max(self._began_wall, began_wall)
            first_read = self._first_read_after_change(change)
        if first_read:
            log.info("%s", first_read)
        self._attempted.set()  # before on_poll: re-deciding pending jobs does not hold up a start
        log.debug("queue: %.2f GPUs pending of %d", state.pending_gpus, state.total_gpus)
        if self.on_poll is not None:
            try:
                self.on_poll(pending, state)
            except Exception:  # noqa: BLE001 - the poll loop must go on
                log.exception("after the queue poll")
        return state

    def _first_read_after_change(self, change: int) -> str:
        """Once per controller change (under the lock, after a poll begun after it): how long after
        the change the shards of the controller in control were read, and from when they are used
        (after the hold where one was asked for). How long shard jobs went to whole GPUs after a
        takeover can be read from the log."""
        if change == 0 or change != self._changes or change == self._logged_change:
            return ""
        self._logged_change = change
        read_s = self._taken_at - self._changed_at
        held = self._hold_until - self._changed_at
        return (f"shards of the controller in control read {read_s:.1f} s after the role change "
                f"({self._change_why})" + (f"; used from {held:.1f} s on (held after the change)"
                                          if held > read_s else ""))

    def _qos_priorities(self) -> dict[str, int]:
        """QoS priorities, re-read every ``QOS_REFRESH_POLLS`` polls; {} (every job sees the whole
        queue) when accounting cannot be read."""
        if self._polls % QOS_REFRESH_POLLS == 0 or not self._qos:
            try:
                self._qos = self.slurm.qos_priorities()
            except Exception as exc:  # noqa: BLE001
                log.debug("QoS priorities unavailable (%s): every job sees the whole queue", exc)
                self._qos = {}
        self._polls += 1
        return self._qos

    def take_live(self) -> list | None:
        """Every job the last poll read with its AdminComment (live_wanted), once; None when that
        poll did not read them or they were taken."""
        with self._lock:
            live, self._live = self._live, None
        return live

    def snapshot(self) -> QueueState | None:
        """The last snapshot with its age; None before the first successful poll."""
        with self._lock:
            state, taken = self._state, self._taken_at
            unread = (self._change_why if self._polled_change != self._changes or self.clock() < self._hold_until
                      else "")
        if state is None:
            return None
        if unread:
            live = state.live_shards or LiveShards()
            state = dataclasses.replace(state, live_shards=dataclasses.replace(
                live, unread=f"{unread}: the shards of the controller now in control are not read yet"))
        return copied(state, age_s=max(0.0, self.clock() - taken))  # (QueueState: no __post_init__)

    def wait_first_poll(self, timeout_s: float | None = None) -> QueueState | None:
        """Wait for the first poll to succeed or fail, at most ``timeout_s`` (default
        ``first_poll_bound_s``); the snapshot, or None after saying why there is none."""
        bound_s = first_poll_bound_s(self.cfg) if timeout_s is None else timeout_s
        if not self._attempted.wait(bound_s):
            log.warning("no queue snapshot: Slurm did not answer the first poll within %.1f s; answering "
                        "anyway; decisions treat the queue as unknown until a poll succeeds", bound_s)
            return None
        state = self.snapshot()
        if state is None:
            log.warning("no queue snapshot: the first poll failed (%s); answering anyway; decisions treat "
                        "the queue as unknown until a poll succeeds (next in %.0f s)", self._last_error,
                        self.cfg.policy.queue_poll_s)
            return None
        log.info("first queue snapshot taken before answering: %.2f GPUs pending of %d",
                 state.pending_gpus, state.total_gpus)
        return state

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self.poll_once()
            self._wake.wait(self.cfg.policy.queue_poll_s)

    def start(self) -> QueueMonitor:
        self._thread = threading.Thread(target=self._loop, name="queue-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(2 * self.cfg.service.slurm_timeout_s + 1)
