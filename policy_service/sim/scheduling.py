"""Slurm's scheduling as the engine models it: the pending queue and its priorities, placement on
nodes, GPUs and shards, and the main and backfill passes. Mixed into ``engine.Engine``, whose
``__init__`` sets the state these methods use.

What Slurm does, as modelled:
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
"""
from __future__ import annotations

import bisect

from policy_service.core.types import GresKind, QueueState
from policy_service.sim.policies import Admission
from policy_service.sim.records import EV_BACKFILL, FREE, INF, SHARED, WHOLE, Attempt
from policy_service.sim.workload import QOS_FACTOR, QOS_TIERS


class Scheduling:
    """The queue, placement and scheduling passes of ``engine.Engine``."""

    # ------------------------------------------------------------------ queue

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
