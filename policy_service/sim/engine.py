"""Event-driven model of a Slurm GPU partition running one admission policy: the event loop
(arrivals, memory growth, finish and backfill events), the re-decision of pending jobs and the
model's invariants. Slurm's scheduling is in ``scheduling``, a job's execution in ``execution``,
and what is recorded in ``records``.

Deterministic: no clock, no unseeded randomness, ordered containers only.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import replace
from typing import Callable

from policy_service.config import Config, SwapCostConfig
from policy_service.core.types import GresKind
from policy_service.sim.config import SimConfig
from policy_service.sim.execution import Execution
from policy_service.sim.policies import SimPolicy
from policy_service.sim.records import (
    EV_BACKFILL,
    EV_GROW,
    FREE,
    INF,
    SHARED,
    WHOLE,
    Attempt,
    EngineResult,
    JobRecord,
    SimulationError,
)
from policy_service.sim.scheduling import Scheduling
from policy_service.sim.workload import QOS_TIERS, SimJob, Workload


def truth_swap_config(cfg: Config, per_corunner: float, sim: SimConfig | None = None) -> SwapCostConfig:
    """The swap-cost parameters used as ground truth: the core's, compute interference calibrated."""
    out = replace(cfg.swap_cost, compute_interference_per_corunner=per_corunner)
    if sim is not None:
        out = replace(out, compute_interference_base=sim.interference.knee_base,
                      compute_interference_knee_slope=sim.interference.knee_slope)
    return out


class Engine(Scheduling, Execution):
    def __init__(self, workload: Workload, policy: SimPolicy, cfg: Config, sim: SimConfig, *,
                 per_corunner: float, progress: Callable[[int], None] | None = None, check: bool = False):
        self.w, self.policy, self.cfg, self.sim = workload, policy, cfg, sim
        self.s = sim.scheduler
        self.truth = truth_swap_config(cfg, per_corunner, sim)
        self.link = cfg.swap_cost.link_bytes_per_s(cfg.gpu.link)
        self.imodel = sim.interference.model
        self.hard_caps = sim.node.hard_caps
        self.check = check
        self.progress = progress
        self.device = cfg.gpu.memory_bytes
        self.spg = cfg.gpu.shards_per_gpu
        self.shard_bytes = cfg.gpu.shard_bytes
        self.gpn = self.s.gpus_per_node
        self.n_nodes = max(1, math.ceil(workload.gpus / self.gpn))
        self.G = self.n_nodes * self.gpn
        G = self.G
        self.g_node = [g // self.gpn for g in range(G)]
        self.g_mode = [FREE] * G
        self.g_free = [self.spg] * G
        self.g_jobs: list[list[Attempt]] = [[] for _ in range(G)]
        self.g_res = [0] * G  # true bytes allocated by the GPU's jobs
        self.g_plain = [0] * G  # of which plain (not managed) allocations
        self.g_used = [0] * G  # min(res, device): bytes resident on the device
        self.node_free: list[set[int]] = [set(range(n * self.gpn, (n + 1) * self.gpn)) for n in range(self.n_nodes)]
        self.nodes_by_free: list[set[int]] = [set() for _ in range(self.gpn + 1)]
        self.nodes_by_free[self.gpn] = set(range(self.n_nodes))
        self.shared_by_free: list[set[int]] = [set() for _ in range(self.spg + 1)]
        self.heap: list = []
        self.seq = 0
        self.queue: list[tuple[float, int, Attempt]] = []  # sorted by (key, seq)
        # GPUs the queued attempts ask for (a shard: 1 / shards per GPU), per QoS tier (0 = highest)
        self.pending_tier = [0.0] * len(QOS_TIERS)
        self.redecide = cfg.policy.redecide_pending
        self.redecided = 0  # pending attempts rewritten from a whole GPU to shards
        self.rd_dirty, self.rd_side = True, False  # something to re-check; the queue side last pass
        self.now = 0.0
        self.records = [JobRecord(submit_s=j.submit_s) for j in workload.jobs]
        self.alloc_gpus = 0
        self.used_sum = 0
        self.busy_int = 0.0
        self.mem_int = 0.0
        self.last_tick = workload.jobs[0].submit_s if workload.jobs else 0.0
        self.running = 0
        self.events = 0
        self.oom_events = 0
        self.neighbour_ooms = 0
        self.bf_pending = False
        self.bf_dirty = True
        self.sched_dirty = False
        self.done = 0
        span = max(1.0, workload.arrival_window_s * 1.3, max((j.duration_s for j in workload.jobs), default=0.0))
        self.sample_step = span / max(1, self.s.timeline_points)
        self.next_sample = self.last_tick
        self.timeline: list[tuple[float, float, float, int, int]] = []
        self.max_attempts = self.s.max_attempts
        self.host_cap = self.s.host_swap_bytes_per_gpu
        self.ws_frac = cfg.swap_cost.default_working_set_frac

    # ------------------------------------------------------------------ time and bookkeeping

    def _tick(self, t: float) -> None:
        dt = t - self.last_tick
        if dt > 0:
            self.busy_int += self.alloc_gpus * dt
            self.mem_int += self.used_sum * dt
            self.last_tick = t
        while t >= self.next_sample:
            self.timeline.append((self.next_sample, self.alloc_gpus / self.G, self.used_sum / (self.G * self.device),
                                  len(self.queue), self.running))
            self.next_sample += self.sample_step
            if len(self.timeline) >= 2 * self.s.timeline_points:  # ran longer than planned: halve the resolution
                self.timeline = self.timeline[::2]
                self.sample_step *= 2
                self.next_sample = self.timeline[-1][0] + self.sample_step
        self.now = t

    def _push(self, t: float, kind: int, obj, version: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, obj, version))

    # ------------------------------------------------------------------ main loop

    def _admit(self, job: SimJob) -> None:
        a = Attempt(job, 1, self.policy.admit(job, 1, self.now, self._queue_state()), job.submit_s)
        if a.adm.kind is GresKind.GPU and a.adm.count > self.gpn:
            rec = self.records[job.idx]
            rec.failed, rec.end_s, rec.fail_reason = True, self.now, "larger than a node"
            self.done += 1
            return
        self._enqueue(a)

    def run(self) -> EngineResult:
        jobs = self.w.jobs
        n = len(jobs)
        ai = 0
        heap = self.heap
        while True:
            t_arr = jobs[ai].submit_s if ai < n else INF
            t_ev = heap[0][0] if heap else INF
            if t_arr == INF and t_ev == INF:
                break
            if t_ev <= t_arr:
                t, kind, _, a, version = heapq.heappop(heap)
                if kind != EV_BACKFILL and version != a.version:
                    continue  # superseded by a later rate change
                self.events += 1
                self._tick(t)
                if kind == EV_BACKFILL:
                    self.bf_pending = False
                    if self.queue and self.redecide:
                        self._redecide_pending(t)
                    if self.queue:
                        if self.bf_dirty:
                            self._backfill()
                        if self.queue and not self.bf_pending:
                            self.bf_pending = True
                            self._push(t + self.s.bf_interval_s, EV_BACKFILL, None, 0)
                elif kind == EV_GROW:
                    self._grow(a)
                else:
                    self._finish(a)
            else:
                self.events += 1
                self._tick(t_arr)
                self._admit(jobs[ai])
                ai += 1
            if self.sched_dirty and self.queue:
                t_next = min(jobs[ai].submit_s if ai < n else INF, heap[0][0] if heap else INF)
                if t_next > self.now:
                    self._schedule()
            if self.check:
                self.check_invariants()
        if self.queue:
            raise SimulationError(f"{len(self.queue)} job(s) still pending with nothing running")
        ends = [r.end_s for r in self.records if r.end_s >= 0]
        first = jobs[0].submit_s if jobs else 0.0
        makespan = (max(ends) - first) if ends else 0.0
        return EngineResult(policy=self.policy.name, records=self.records, makespan_s=makespan, first_submit_s=first,
                            gpu_busy_integral=self.busy_int, mem_used_integral=self.mem_int, gpus=self.G,
                            device_bytes=self.device, timeline=self.timeline, events=self.events,
                            oom_events=self.oom_events, neighbour_oom_events=self.neighbour_ooms,
                            redecided=self.redecided)

    def _redecide_pending(self, t: float) -> None:
        """The service's re-decision of pending jobs kept whole (serving/redecide.py), at each
        backfill pass: in queue order, those whose history keys learned something, or whose
        queue side of share_min_queue changed, since they were last decided; at most
        ``policy.redecide_max_per_poll`` decisions per pass."""
        state = self._queue_state()
        side = state.pressure >= self.cfg.policy.share_min_queue
        if not self.rd_dirty and side == self.rd_side:
            return  # nothing learned, queued or crossed since the last pass: every check would repeat
        self.rd_dirty, self.rd_side = False, side
        budget = self.cfg.policy.redecide_max_per_poll
        for _, _, a in self.queue:
            if budget <= 0:
                self.rd_dirty = True  # the rest next pass
                break
            if a.adm.kind is not GresKind.GPU or a.adm.action != "whole_gpu" or not a.job.single_gpu:
                continue
            known = (self.policy.knowledge(a.job), side)
            if a.checked == known:
                continue
            budget -= 1
            a.checked = known
            adm = self.policy.redecide(a.job, a.no, t, state)
            if adm is None:
                continue
            self._count_pending(a, -1)
            a.adm = replace(adm, site_factor=a.adm.site_factor)  # scontrol update leaves the priority alone
            a.shared = True
            self._count_pending(a, +1)
            self.redecided += 1
            self.sched_dirty = self.bf_dirty = True
            state = self._queue_state()
            side = state.pressure >= self.cfg.policy.share_min_queue

    # ------------------------------------------------------------------ invariants (tests)

    def check_invariants(self) -> None:
        for g in range(self.G):
            mode, jobs = self.g_mode[g], self.g_jobs[g]
            if self.g_free[g] < 0:
                raise SimulationError(f"GPU {g} over its shard count")
            if mode == FREE and (jobs or self.g_free[g] != self.spg or g not in self.node_free[self.g_node[g]]):
                raise SimulationError(f"free GPU {g} inconsistent")
            if mode == WHOLE and len(jobs) != 1:
                raise SimulationError(f"whole GPU {g} has {len(jobs)} jobs")
            if mode == SHARED:
                used = sum(a.adm.count for a in jobs)
                if not jobs or used + self.g_free[g] != self.spg or used > self.spg:
                    raise SimulationError(f"shared GPU {g}: {used} shards used, {self.g_free[g]} free")
                if g not in self.shared_by_free[self.g_free[g]]:
                    raise SimulationError(f"shared GPU {g} missing from its bucket")
        for n in range(self.n_nodes):
            if n not in self.nodes_by_free[len(self.node_free[n])]:
                raise SimulationError(f"node {n} missing from its bucket")
