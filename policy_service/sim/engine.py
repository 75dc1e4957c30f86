"""Event-driven model of a Slurm GPU partition running one admission policy.

Scheduling (what Slurm does, as modelled):
* priority/multifactor: ``weight_qos x qos_factor + site_factor + weight_age x age/max_age``
  (the age cap is not applied: order by a time-invariant key, FIFO within equal static parts);
* the main scheduler starts jobs in priority order and stops at the first that does not fit;
* sched/backfill every ``bf_interval_s``: EASY backfill: the top pending job gets a reservation
  (the earliest time and resources its request frees up, from running jobs' time limits);
  later jobs start now if they fit and either end (by time limit) before it or leave its
  resources alone; at most ``bf_max_job_test`` jobs are tried per pass;
* select/cons_tres with GRES: nodes of ``gpus_per_node`` GPUs with ``shards_per_gpu`` shards
  each; a ``gpu:N`` job takes N whole GPUs of one node (a GPU with shard jobs is not free);
  a ``shard:k`` job takes k shards of ONE GPU (best fit: the shared GPU with the fewest free
  shards that suffice, else a free GPU on the node with the fewest free GPUs).

Execution: a job has ``duration_s`` of solo work; it progresses at ``1 / slowdown`` where the
slowdown on its GPU is recomputed whenever that GPU's jobs or memory change:
compute interference (UTIL: ``swapcost.interference_slowdown`` of the jobs' solo utilisations,
a knee at one GPU's worth; legacy COUNT / DEMAND: per co-runner, weighted by compute share) plus, when the GPU's true memory exceeds the
device, the swap cost of ``swapcost.predict`` in VICTIM (swapaware, oracle) or NAIVE mode
(managed-memory jobs under the baselines). Memory: a run allocates its own ``init_frac`` of its true
peak at start and the rest after its ``grow_at`` fraction of its work; with ``node.hard_caps`` a
shared job growing past its cap fails alone; else a plain allocation that does not fit the
device fails the job that allocates (out of memory); under VICTIM the deficit goes to host
memory up to ``host_swap_bytes_per_gpu``. Failed jobs are resubmitted up to ``max_attempts``.

Deterministic: no clock, no unseeded randomness, ordered containers only.
"""
from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field, replace
from typing import Callable

from policy_service.config import Config, SwapCostConfig
from policy_service.core import swapcost
from policy_service.core.types import CoJob, GresKind, QueueState
from policy_service.sim.config import InterferenceModel, SimConfig
from policy_service.sim.policies import Admission, OverflowMode, RunOutcome, SimPolicy
from policy_service.sim.workload import QOS_FACTOR, QOS_TIERS, SimJob, Workload

FREE, WHOLE, SHARED = 0, 1, 2
EV_FINISH, EV_GROW, EV_BACKFILL = 0, 1, 3
INF = float("inf")
_VICTIM_BIAS = 1e12  # designated victims rank below every job in the victim order


class SimulationError(RuntimeError):
    """An invariant of the model broke (a bug, not a policy outcome)."""


class Attempt:
    """One run of a job on the cluster (a job that fails out of memory may run again)."""

    __slots__ = ("job", "no", "adm", "gpus", "submit_t", "start_t", "remaining", "slowdown", "last_t", "version",
                 "alloc", "grown", "charge", "prio", "victim_prio", "swapped", "n_co", "corun_int",
                 "shared", "max_slowdown", "offloaded", "max_swap_extra", "checked")

    def __init__(self, job: SimJob, no: int, adm: Admission, submit_t: float):
        self.job, self.no, self.adm, self.submit_t = job, no, adm, submit_t
        self.gpus: tuple[int, ...] = ()
        self.start_t = self.last_t = 0.0
        self.remaining = job.duration_s
        self.slowdown = 1.0
        self.version = 0
        self.alloc = 0
        self.grown = False
        self.charge = 0
        self.prio = 0.0
        self.victim_prio = 0.0
        self.swapped = False
        self.n_co = 0
        self.corun_int = 0.0
        self.shared = adm.kind is GresKind.SHARD
        self.max_slowdown = 1.0
        self.offloaded = 0
        self.max_swap_extra = 0.0
        self.checked: tuple = ()  # what the policy knew when it last re-decided this pending attempt


@dataclass(slots=True)
class JobRecord:
    """What happened to one job, over all its attempts."""

    submit_s: float
    end_s: float = -1.0
    completed: bool = False
    failed: bool = False
    fail_reason: str = ""
    attempts: int = 0
    wait_s: float = 0.0
    runtime_s: float = 0.0
    slowdown: float = 0.0
    ooms: int = 0
    neighbour_ooms: int = 0
    designated_victim: bool = False
    swapped: bool = False
    max_swap_extra: float = 0.0  # largest slowdown added by swapping (beyond compute interference)
    max_slowdown: float = 1.0  # largest instantaneous slowdown
    shared: bool = False
    gres: str = ""
    action: str = ""
    sized_bytes: int = 0


@dataclass
class EngineResult:
    policy: str
    records: list[JobRecord]
    makespan_s: float
    first_submit_s: float
    gpu_busy_integral: float  # GPU-seconds allocated (any job on the GPU)
    mem_used_integral: float  # byte-seconds of true memory resident on devices
    gpus: int
    device_bytes: int
    timeline: list[tuple[float, float, float, int, int]]  # t, gpu util, mem util, pending, running
    events: int
    oom_events: int
    neighbour_oom_events: int
    redecided: int = 0  # pending jobs rewritten from a whole GPU to shards (policy.redecide_pending)
    extra: dict = field(default_factory=dict)


def truth_swap_config(cfg: Config, per_corunner: float, sim: SimConfig | None = None) -> SwapCostConfig:
    """The swap-cost parameters used as ground truth: the core's, compute interference calibrated."""
    out = replace(cfg.swap_cost, compute_interference_per_corunner=per_corunner)
    if sim is not None:
        out = replace(out, compute_interference_base=sim.interference.knee_base,
                      compute_interference_knee_slope=sim.interference.knee_slope)
    return out


class Engine:
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

    def _static_prio(self, a: Attempt) -> float:
        return self.s.weight_qos * QOS_FACTOR[a.job.qos_tier] + a.adm.site_factor

    def _prio_at(self, a: Attempt, t: float) -> float:
        age = min(1.0, max(0.0, t - a.submit_t) / self.s.max_age_s)
        return self._static_prio(a) + self.s.weight_age * age

    def _gpus_asked(self, a: Attempt) -> float:
        return a.adm.count if a.adm.kind is GresKind.GPU else a.adm.count / self.spg

    def _queue_state(self) -> QueueState:
        """What the service's queue snapshot would say now (exact here; the service polls)."""
        ahead, acc = [], 0.0
        for tier, name in enumerate(QOS_TIERS):  # QoS dominates priority: tiers at or above
            acc += self.pending_tier[tier]
            ahead.append((name, max(0.0, acc)))
        return QueueState(pending_gpus=max(0.0, acc), total_gpus=self.G, ahead_by_qos=tuple(ahead))

    def _count_pending(self, a: Attempt, sign: int) -> None:
        self.pending_tier[a.job.qos_tier] += sign * self._gpus_asked(a)

    def _enqueue(self, a: Attempt) -> None:
        self._count_pending(a, +1)
        self.rd_dirty = True
        key = -self._static_prio(a) + self.s.weight_age * a.submit_t / self.s.max_age_s
        self.seq += 1
        bisect.insort(self.queue, (key, self.seq, a))
        self.sched_dirty = True
        self.bf_dirty = True
        if not self.bf_pending:
            self.bf_pending = True
            self._push(self.now + self.s.bf_interval_s, EV_BACKFILL, None, 0)

    # ------------------------------------------------------------------ placement

    def _find(self, adm: Admission, excluded: frozenset | set = frozenset()):
        """Resources for ``adm`` now, or None. SHARD -> gpu id; GPU -> tuple of gpu ids."""
        if adm.kind is GresKind.SHARD:
            k = adm.count
            for f in range(k, self.spg):
                for g in self.shared_by_free[f]:
                    if g not in excluded:
                        return g
            for f in range(1, self.gpn + 1):
                for n in self.nodes_by_free[f]:
                    for g in self.node_free[n]:
                        if g not in excluded:
                            return g
            return None
        need = adm.count
        for f in range(need, self.gpn + 1):
            for n in self.nodes_by_free[f]:
                if excluded:
                    avail = [g for g in self.node_free[n] if g not in excluded]
                    if len(avail) < need:
                        continue
                else:
                    avail = self.node_free[n]
                return tuple(sorted(avail)[:need])
        return None

    def _take_free_gpu(self, g: int) -> None:
        n = self.g_node[g]
        fs = self.node_free[n]
        self.nodes_by_free[len(fs)].discard(n)
        fs.discard(g)
        self.nodes_by_free[len(fs)].add(n)
        self.alloc_gpus += 1

    def _release_gpu(self, g: int) -> None:
        n = self.g_node[g]
        fs = self.node_free[n]
        self.nodes_by_free[len(fs)].discard(n)
        fs.add(g)
        self.nodes_by_free[len(fs)].add(n)
        self.g_mode[g] = FREE
        self.g_free[g] = self.spg
        self.alloc_gpus -= 1

    # ------------------------------------------------------------------ start / end

    def _start(self, a: Attempt, where, t: float) -> None:
        job = a.job
        rec = self.records[job.idx]
        rec.wait_s += t - a.submit_t
        self._count_pending(a, -1)
        a.start_t = a.last_t = t
        a.prio = self._prio_at(a, t)
        a.victim_prio = a.prio - (_VICTIM_BIAS if a.adm.designated_victim else 0.0)
        self.running += 1
        self.bf_dirty = True
        a.grown = job.init_frac >= 1.0
        first_alloc = job.true_peak_bytes if a.grown else int(job.true_peak_bytes * job.init_frac)
        if a.adm.kind is GresKind.GPU:
            a.gpus = tuple(where)
            a.charge = self.device
            for g in a.gpus:
                self._take_free_gpu(g)
                self.g_mode[g] = WHOLE
                self.g_free[g] = 0
                self.g_jobs[g] = [a]
            self._set_alloc_whole(a, first_alloc)
            self._schedule_next(a)
            return
        g = where
        k = a.adm.count
        if self.g_mode[g] == FREE:
            self._take_free_gpu(g)
            self.g_mode[g] = SHARED
        else:
            self.shared_by_free[self.g_free[g]].discard(g)
        self.g_free[g] -= k
        if self.g_free[g] < 0:
            raise SimulationError(f"GPU {g} over its shard count")
        self.shared_by_free[self.g_free[g]].add(g)
        a.gpus = (g,)
        a.charge = k * self.shard_bytes
        self.g_jobs[g].append(a)
        if self._allocate(a, g, first_alloc):
            self._recompute(g)

    def _set_alloc_whole(self, a: Attempt, nbytes: int) -> None:
        delta = nbytes - a.alloc
        a.alloc = nbytes
        for g in a.gpus:
            self.g_res[g] += delta
            used = min(self.g_res[g], self.device)
            self.used_sum += used - self.g_used[g]
            self.g_used[g] = used

    def _allocate(self, a: Attempt, g: int, nbytes: int) -> bool:
        """The job's allocation on shared GPU ``g`` grows to ``nbytes``; False if it failed (OOM)."""
        delta = nbytes - a.alloc
        plain = not a.job.managed
        if self.hard_caps and plain and nbytes > self._cap(a):
            self._oom(a, g, nbytes)  # the node's cap stops this job alone; its neighbours are safe
            return False
        if self.policy.overflow is OverflowMode.VICTIM:
            fails = self.g_res[g] + delta - self.device > self.host_cap
        else:
            fails = plain and self.g_plain[g] + delta > self.device
        if fails:
            self._oom(a, g, nbytes)
            return False
        a.alloc = nbytes
        self.g_res[g] += delta
        if plain:
            self.g_plain[g] += delta
        return True

    def _cap(self, a: Attempt) -> int:
        """Hard cap of a shared job: its shards, or for an oversubscribed job the need it was sized
        for (the part beyond its shards lives in host memory by design)."""
        return max(a.charge, a.adm.sized_bytes or 0)

    def _oom(self, a: Attempt, g: int, wanted: int) -> None:
        rec = self.records[a.job.idx]
        self.oom_events += 1
        rec.ooms += 1
        # It stayed within what it was charged: the device was full because others grew.
        if wanted <= a.charge:
            rec.neighbour_ooms += 1
            self.neighbour_ooms += 1
        self._end(a, self.now, oom=True)

    def _end(self, a: Attempt, t: float, oom: bool) -> None:
        job = a.job
        rec = self.records[job.idx]
        self.running -= 1
        self.bf_dirty = True
        self.sched_dirty = True
        a.version += 1
        peak = a.alloc  # what the node agent saw (resident + kept in host memory)
        if a.adm.kind is GresKind.GPU:
            self._set_alloc_whole(a, 0)
            for g in a.gpus:
                self.g_jobs[g] = []
                self._release_gpu(g)
        else:
            g = a.gpus[0]
            self._advance(a, t)
            jobs = self.g_jobs[g]
            jobs.remove(a)
            self.g_res[g] -= a.alloc
            if not job.managed:
                self.g_plain[g] -= a.alloc
            self.shared_by_free[self.g_free[g]].discard(g)
            self.g_free[g] += a.adm.count
            if jobs:
                self.shared_by_free[self.g_free[g]].add(g)
                self._recompute(g)
            else:
                if self.g_res[g] != 0 or self.g_plain[g] != 0 or self.g_free[g] != self.spg:
                    raise SimulationError(f"GPU {g} not empty after its last job: {self.g_res[g]} bytes")
                self.used_sum -= self.g_used[g]
                self.g_used[g] = 0
                self._release_gpu(g)
        runtime = t - a.start_t
        co = int(round(a.corun_int / runtime)) if runtime > 0 else a.n_co
        # The node agent's utilisation figure is device-wide: the job's own compute demand only
        # for a run that never had a co-runner (the service folds only those).
        util = (a.job.solo_util if self.imodel is InterferenceModel.UTIL else a.job.compute_share
                ) if a.corun_int == 0 else None
        self.rd_dirty = True  # the policy learns from this run
        self.policy.finished(job, a.no, RunOutcome(runtime_s=runtime, peak_bytes=peak,
                                                   oom=oom, shared=a.shared, co_runners=co, util_frac=util))
        rec.attempts = a.no
        rec.gres, rec.action, rec.sized_bytes = a.adm.gres, a.adm.action, a.adm.sized_bytes
        rec.designated_victim = rec.designated_victim or a.adm.designated_victim
        rec.swapped = rec.swapped or a.swapped
        rec.max_swap_extra = max(rec.max_swap_extra, a.max_swap_extra)
        rec.max_slowdown = max(rec.max_slowdown, a.max_slowdown)
        rec.shared = rec.shared or a.shared
        if not oom:
            rec.completed, rec.end_s = True, t
            rec.runtime_s = runtime
            rec.slowdown = runtime / job.duration_s if job.duration_s > 0 else 1.0
            self.done += 1
        elif a.no < self.max_attempts:
            nxt = Attempt(job, a.no + 1, self.policy.admit(job, a.no + 1, t, self._queue_state()), t)
            self._enqueue(nxt)
        else:
            rec.failed, rec.end_s, rec.fail_reason = True, t, "out of memory"
            self.done += 1
        if self.progress is not None and not (self.done & 255):
            self.progress(self.done)

    # ------------------------------------------------------------------ rates

    def _advance(self, a: Attempt, t: float) -> None:
        dt = t - a.last_t
        if dt > 0:
            a.remaining -= dt / a.slowdown
            a.corun_int += a.n_co * dt
            a.last_t = t

    def _schedule_next(self, a: Attempt) -> None:
        a.version += 1
        if not a.grown:
            milestone = a.job.duration_s * (1.0 - a.job.grow_at)
            self._push(self.now + max(0.0, a.remaining - milestone) * a.slowdown, EV_GROW, a, a.version)
        else:
            self._push(self.now + max(0.0, a.remaining) * a.slowdown, EV_FINISH, a, a.version)

    def _recompute(self, g: int) -> None:
        """New slowdowns for the jobs on shared GPU ``g`` after a change of its jobs or memory."""
        jobs = self.g_jobs[g]
        t = self.now
        n = len(jobs)
        for a in jobs:
            self._advance(a, t)
        truth = self.truth
        res = self.g_res[g]
        extra: dict[Attempt, tuple[float, int]] = {}
        if self.policy.overflow is OverflowMode.VICTIM:
            if res > self.device:
                extra = self._swap_extra(jobs, self.device, swapcost.SwapMode.VICTIM)
        else:
            managed = [a for a in jobs if a.job.managed]
            room = self.device - self.g_plain[g]
            if managed and sum(a.alloc for a in managed) > room:
                extra = self._swap_extra(managed, max(0, room), swapcost.SwapMode.NAIVE)
        im = self.imodel
        if im is InterferenceModel.UTIL:
            total_u = sum(a.job.solo_util for a in jobs)
        else:
            total_u = sum(a.job.compute_share for a in jobs) if im is InterferenceModel.DEMAND else 0.0
        per = truth.compute_interference_per_corunner
        for a in jobs:
            if im is InterferenceModel.UTIL:
                base = swapcost.interference_slowdown(a.job.solo_util, total_u - a.job.solo_util, truth)
            elif im is InterferenceModel.DEMAND:
                base = 1.0 + per * (total_u - a.job.compute_share)
            else:
                base = 1.0 + per * (n - 1)
            add, off = extra.get(a, (0.0, 0)) if extra else (0.0, 0)
            a.slowdown = base + add
            a.offloaded = off
            if off > 0:
                a.swapped = True
            if add > a.max_swap_extra:
                a.max_swap_extra = add
            if a.slowdown > a.max_slowdown:
                a.max_slowdown = a.slowdown
            a.n_co = n - 1
            self._schedule_next(a)
        used = min(res, self.device)
        self.used_sum += used - self.g_used[g]
        self.g_used[g] = used

    def _swap_extra(self, jobs: list[Attempt], device_bytes: int, mode) -> dict[Attempt, tuple[float, int]]:
        co = []
        for a in jobs:
            job = a.job
            co.append(CoJob(name=f"{job.idx}.{a.no}", footprint_bytes=a.alloc, working_set_bytes=int(a.alloc * self.ws_frac),
                            access=job.access, priority=a.victim_prio, solo_time_s=job.duration_s,
                            sweeps_per_s=swapcost.sweeps_for(job.access, self.truth)))
        cost = swapcost.predict(co, device_bytes, self.link, self.truth, mode)
        base = swapcost.compute_slowdown(len(co), self.truth)
        out = {}
        for a, s in zip(jobs, cost.jobs):
            out[a] = (max(0.0, s.slowdown - base), s.offloaded_bytes)
        return out

    # ------------------------------------------------------------------ scheduling passes

    def _schedule(self) -> None:
        """Main scheduler: priority order, stop at the first job that does not fit."""
        self.sched_dirty = False
        q = self.queue
        while q:
            a = q[0][2]
            where = self._find(a.adm)
            if where is None:
                return
            q.pop(0)
            self._start(a, where, self.now)

    def _est_end(self, a: Attempt) -> float:
        return max(self.now, a.start_t + a.job.time_limit_s)

    def _reservation(self, head: Attempt) -> tuple[float, frozenset]:
        """EASY: when and where the top pending job will start, from running jobs' time limits."""
        best_t, best = INF, frozenset()
        if head.adm.kind is GresKind.SHARD:
            k = head.adm.count
            for g in range(self.G):
                mode = self.g_mode[g]
                if mode == WHOLE:
                    t = self._est_end(self.g_jobs[g][0])
                elif mode == SHARED:
                    free = self.g_free[g]
                    t = self.now
                    if free < k:
                        for end, shards in sorted((self._est_end(a), a.adm.count) for a in self.g_jobs[g]):
                            free += shards
                            t = end
                            if free >= k:
                                break
                else:
                    t = self.now
                if t < best_t:
                    best_t, best = t, frozenset((g,))
            return best_t, best
        need = head.adm.count
        for n in range(self.n_nodes):
            avail = []
            for g in range(n * self.gpn, (n + 1) * self.gpn):
                mode = self.g_mode[g]
                if mode == FREE:
                    avail.append((self.now, g))
                else:
                    avail.append((max(self._est_end(a) for a in self.g_jobs[g]), g))
            avail.sort()
            t = avail[need - 1][0]
            if t < best_t:
                best_t, best = t, frozenset(g for _, g in avail[:need])
        return best_t, best

    def _backfill(self) -> None:
        self.bf_dirty = False
        q = self.queue
        if self.sched_dirty:
            self._schedule()
        if len(q) < 2:
            return
        head = q[0][2]
        shadow, reserved = None, frozenset()
        i, tested = 1, 0
        while i < len(q) and tested < self.s.bf_max_job_test:
            tested += 1
            a = q[i][2]
            where = self._find(a.adm)
            if where is None:
                i += 1
                continue
            if shadow is None:
                shadow, reserved = self._reservation(head)
            if self.now + a.job.time_limit_s > shadow:
                where = self._find(a.adm, reserved)
                if where is None:
                    i += 1
                    continue
            q.pop(i)
            self._start(a, where, self.now)

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
        """The service's re-decision of pending jobs kept whole (adapters/redecide.py), at each
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

    def _grow(self, a: Attempt) -> None:
        a.grown = True
        if a.adm.kind is GresKind.GPU:
            self._set_alloc_whole(a, a.job.true_peak_bytes)
            a.remaining = a.job.duration_s * (1.0 - a.job.grow_at)
            a.last_t = self.now
            self._schedule_next(a)
            return
        g = a.gpus[0]
        self._advance(a, self.now)
        if self._allocate(a, g, a.job.true_peak_bytes):
            self._recompute(g)

    def _finish(self, a: Attempt) -> None:
        if a.adm.kind is GresKind.SHARD:
            self._advance(a, self.now)
            if a.remaining > 1e-6 * max(1.0, a.job.duration_s):
                raise SimulationError(f"job {a.job.job_id} finished with {a.remaining:.3f}s of work left")
        self._end(a, self.now, oom=False)

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
