"""How a started job runs in the engine's model: start and end, memory allocation and out-of-memory
failures, and the slowdowns that set its progress. Mixed into ``engine.Engine``, whose ``__init__``
sets the state these methods use.

A job has ``duration_s`` of solo work; it progresses at ``1 / slowdown`` where the
slowdown on its GPU is recomputed whenever that GPU's jobs or memory change:
compute interference (UTIL: ``swapcost.interference_slowdown`` of the jobs' solo utilisations,
a knee at one GPU's worth; legacy COUNT / DEMAND: per co-runner, weighted by compute share) plus, when the GPU's true memory exceeds the
device, the swap cost of ``swapcost.predict`` in VICTIM (swapaware, oracle) or NAIVE mode
(managed-memory jobs under the baselines). Memory: a run allocates its own ``init_frac`` of its true
peak at start and the rest after its ``grow_at`` fraction of its work; with ``node.hard_caps`` a
shared job growing past its cap fails alone; else a plain allocation that does not fit the
device fails the job that allocates (out of memory); under VICTIM the deficit goes to host
memory up to ``host_swap_bytes_per_gpu``. Failed jobs are resubmitted up to ``max_attempts``.
"""
from __future__ import annotations

from policy_service.core import swapcost
from policy_service.core.types import CoJob, GresKind
from policy_service.sim.config import InterferenceModel
from policy_service.sim.policies import OverflowMode, RunOutcome
from policy_service.sim.records import EV_FINISH, EV_GROW, FREE, SHARED, WHOLE, Attempt, SimulationError

_VICTIM_BIAS = 1e12  # designated victims rank below every job in the victim order


class Execution:
    """The start, memory, slowdown and end of the runs of ``engine.Engine``."""

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
        done = job.duration_s - a.remaining
        co_util = a.co_util_work / done if done > 0 else a.u_co
        self.policy.finished(job, a.no, RunOutcome(runtime_s=runtime, peak_bytes=peak, oom=oom, shared=a.shared,
                                                   co_runners=co, util_frac=util, co_util=co_util))
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
            a.co_util_work += a.u_co * dt / a.slowdown
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
            a.u_co = total_u - a.job.solo_util if im is InterferenceModel.UTIL else 0.0
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

    # ------------------------------------------------------------------ growth and finish events

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
