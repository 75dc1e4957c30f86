"""The admission policies compared by the simulator, behind one small interface.

* ``Exclusive`` (B0): every job keeps whole GPUs (Slurm's default).
* ``NaiveSharing`` (B1): every single-GPU job gets a fixed number of shards; no memory check.
* ``DeclaredPacking`` (B2): shards sized to the declared memory share; no oversubscription.
* ``SwapAware``: the service's own policy: ``request.job_request`` -> ``request.history_keys`` ->
  ``policy.decide``; finished runs are folded into per-key ``ClassStats`` with
  ``estimator.observe``, exactly as the service does.
  ``interference``: the site's interference models it decides with (None: the configured prior;
  ``sim.interference_policy`` has a learning variant).
* ``Oracle``: ``policy.decide`` told each run's true peak (as a user hint, margin 0): an upper
  bound for what a perfect estimator could do with the same decision logic.

A policy answers at submit time (as job_submit does) with an ``Admission``: the GRES the job
asks Slurm for, its site factor, and whether it is a designated swap victim. ``overflow`` says
what happens on a GPU whose jobs' true memory exceeds the device (see ``execution``).
"""
from __future__ import annotations

import abc
import enum
import math
from dataclasses import dataclass, replace
from typing import Mapping

from policy_service.config import Config
from policy_service.core import estimator, policy, request
from policy_service.core.interference_rule import InterferenceView
from policy_service.core.types import Action, ClassStats, Decision, GresKind, JobObservation, KeyLevel, QueueState
from policy_service.sim.workload import QOS_TIERS, SimJob

PARTITION = "gpu"


class OverflowMode(enum.Enum):
    # Plain allocations fail (out of memory); managed-memory jobs page on demand (swapcost NAIVE).
    NO_SWAP = "no_swap"
    # The service keeps the deficit in host memory, charged to the lowest-priority jobs
    # (designated victims first): swapcost VICTIM.
    VICTIM = "victim"


@dataclass(frozen=True, slots=True)
class Admission:
    kind: GresKind  # GPU (whole GPUs) or SHARD (shards of one GPU)
    count: int  # GPUs or shards
    site_factor: int = 0
    designated_victim: bool = False
    action: str = ""
    sized_bytes: int = 0  # bytes the policy made room for (0: not memory-sized)

    @property
    def gres(self) -> str:
        return f"gres:{self.kind.value}:{self.count}"


@dataclass(frozen=True, slots=True)
class RunOutcome:
    runtime_s: float
    peak_bytes: int
    oom: bool
    shared: bool
    co_runners: int
    util_frac: float | None = None  # GPU utilisation while it ran (None: not measured)
    # Co-runners' summed solo utilisation, averaged over the run's progress (UTIL model; 0: none)
    co_util: float = 0.0


class SimPolicy(abc.ABC):
    name: str = ""
    label: str = ""
    overflow: OverflowMode = OverflowMode.NO_SWAP

    def __init__(self, cfg: Config):
        self.cfg = cfg

    @abc.abstractmethod
    def admit(self, job: SimJob, attempt: int, now: float, queue: QueueState | None = None) -> Admission:
        """Decide at submit time what the job asks Slurm for."""

    def finished(self, job: SimJob, attempt: int, outcome: RunOutcome) -> None:
        """A run ended (completed or failed); learning policies fold it into their history."""

    def knowledge(self, job: SimJob) -> int:
        """Runs learned under the job's history keys (the service's ``handler.knowledge``)."""
        return 0

    def redecide(self, job: SimJob, attempt: int, now: float, queue: QueueState | None) -> Admission | None:
        """A pending job kept whole (policy.redecide_pending): its new admission when it would now
        share, else None."""
        return None

    def _whole(self, job: SimJob, action: str = "whole_gpu") -> Admission:
        return Admission(GresKind.GPU, job.num_gpu, action=action)


class Exclusive(SimPolicy):
    name, label = "b0", "B0 exclusive"

    def admit(self, job: SimJob, attempt: int, now: float, queue: QueueState | None = None) -> Admission:
        return self._whole(job)


class NaiveSharing(SimPolicy):
    name, label = "b1", "B1 naive sharing"

    def __init__(self, cfg: Config, shards: int = 0):
        super().__init__(cfg)
        self.shards = shards or max(1, cfg.gpu.shards_per_gpu // 2)

    def admit(self, job: SimJob, attempt: int, now: float, queue: QueueState | None = None) -> Admission:
        if not job.single_gpu or self.shards >= self.cfg.gpu.shards_per_gpu:
            return self._whole(job)
        return Admission(GresKind.SHARD, self.shards, action="share")


class DeclaredPacking(SimPolicy):
    name, label = "b2", "B2 declared-memory packing"

    def admit(self, job: SimJob, attempt: int, now: float, queue: QueueState | None = None) -> Admission:
        spg = self.cfg.gpu.shards_per_gpu
        k = max(1, math.ceil(job.declared_bytes / self.cfg.gpu.shard_bytes))
        if not job.single_gpu or k >= spg:
            return self._whole(job)
        return Admission(GresKind.SHARD, k, action="share", sized_bytes=job.declared_bytes)


def _admission(d: Decision, job: SimJob) -> Admission:
    if d.action in (Action.SHARE, Action.SHARE_OVERSUBSCRIBED):
        return Admission(GresKind.SHARD, d.shards, site_factor=d.site_factor,
                         designated_victim=d.action is Action.SHARE_OVERSUBSCRIBED, action=d.action.value,
                         sized_bytes=max(d.estimate.sized_bytes, d.estimate.observed_max_bytes))
    return Admission(GresKind.GPU, job.num_gpu, site_factor=d.site_factor, action=d.action.value)


class SwapAware(SimPolicy):
    """The service's policy objects, driven the way the service drives them."""

    name, label = "swapaware", "swapaware"
    overflow = OverflowMode.VICTIM

    def __init__(self, cfg: Config, interference: InterferenceView | None = None):
        super().__init__(cfg)
        self.interference = interference  # passed to policy.decide (None: the configured prior)
        self.stats: dict[KeyLevel, dict[str, ClassStats]] = {lv: {} for lv in KeyLevel}
        self._keys: dict[tuple, tuple] = {}
        self._learned: dict[str, int] = {}  # history key -> runs folded
        self.decisions: dict[str, int] = {}
        self.reasons: dict[str, int] = {}  # reason code -> decisions that carried it

    def _request(self, job: SimJob, hint: str = ""):
        fields = {"tres_per_node": f"gres:gpu:{job.num_gpu}"}
        req, access = request.job_request(
            user=job.user, account=job.account, partition=PARTITION, job_name=job.job_name,
            script_fingerprint=job.script_fp, gres_fields=fields, min_nodes=1,
            time_limit_min=int(math.ceil(job.time_limit_s / 60.0)), env_mem_hint=hint,
            qos=QOS_TIERS[job.qos_tier])
        ck = (job.class_id, job.num_gpu)
        keys = self._keys.get(ck)
        if keys is None:
            keys = tuple(request.history_keys(req).items())
            self._keys[ck] = keys
        return req, access, fields, keys

    def _stats_for(self, keys) -> Mapping[KeyLevel, ClassStats]:
        out = {}
        for level, key in keys:
            s = self.stats[level].get(key)
            if s is not None:
                out[level] = s
        return out

    def _decide(self, job: SimJob, attempt: int, now: float, stats, req, access, fields, keys, cfg,
                queue: QueueState | None) -> Admission:
        d = policy.decide(req, stats, cfg, decision_id=f"sim-{job.idx}-{attempt}", now=now,
                          job_class=keys[0][1], gres_fields=fields, access=access, queue=queue,
                          interference=self.interference)
        self.decisions[d.action.value] = self.decisions.get(d.action.value, 0) + 1
        for code in {r.code.value for r in d.reasons}:
            self.reasons[code] = self.reasons.get(code, 0) + 1
        return _admission(d, job)

    def admit(self, job: SimJob, attempt: int, now: float, queue: QueueState | None = None) -> Admission:
        req, access, fields, keys = self._request(job)
        return self._decide(job, attempt, now, self._stats_for(keys), req, access, fields, keys, self.cfg, queue)

    def redecide(self, job: SimJob, attempt: int, now: float, queue: QueueState | None) -> Admission | None:
        adm = self.admit(job, attempt, now, queue)
        # policy.replaces_pending: the pending job was kept whole; only a share replaces that
        return adm if adm.kind is GresKind.SHARD else None

    def knowledge(self, job: SimJob) -> int:
        keys = self._keys.get((job.class_id, job.num_gpu))
        if keys is None:
            return 0
        learned = self._learned
        return sum(learned.get(key, 0) for level, key in keys if level in policy.REDECIDE_KEYS)

    def finished(self, job: SimJob, attempt: int, outcome: RunOutcome) -> None:
        obs = JobObservation(runtime_s=outcome.runtime_s, exit_code=1 if outcome.oom else 0,
                             peak_bytes=outcome.peak_bytes or None, oom=outcome.oom, shared=outcome.shared,
                             co_runners=outcome.co_runners, util_frac=outcome.util_frac)
        keys = self._keys.get((job.class_id, job.num_gpu))
        if keys is None:
            keys = self._request(job)[3]
        for level, key in keys:
            table = self.stats[level]
            table[key] = estimator.observe_key(level, table.get(key, ClassStats()), obs, self.cfg.estimator, job.user)
            self._learned[key] = self._learned.get(key, 0) + 1  # as the service's handler.learned


class Oracle(SwapAware):
    """``policy.decide`` given each run's true peak as a hint, with no safety margin."""

    name, label = "oracle", "oracle (true memory)"

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.oracle_cfg = replace(cfg, estimator=replace(cfg.estimator, min_margin_frac=0.0))

    def admit(self, job: SimJob, attempt: int, now: float, queue: QueueState | None = None) -> Admission:
        req, access, fields, keys = self._request(job, hint=str(job.true_peak_bytes))
        stats = {}
        cls = self.stats[KeyLevel.CLASS].get(keys[0][1])
        if cls is not None:
            # Keep what drives priority (shared vs solo runtimes); drop the memory history so
            # that the hint (the truth) is the estimate.
            stats[KeyLevel.CLASS] = replace(cls, samples=0, max_peak_bytes=0, last_peak_bytes=0,
                                            ewma_peak_bytes=0.0, ewma_absdev_bytes=0.0,
                                            whole_gpu_runs_left=0, margin_multiplier=1.0)
        return self._decide(job, attempt, now, stats, req, access, fields, keys, self.oracle_cfg, queue)


POLICIES: dict[str, type[SimPolicy]] = {
    "b0": Exclusive, "b1": NaiveSharing, "b2": DeclaredPacking, "swapaware": SwapAware, "oracle": Oracle,
}


def make_policy(name: str, cfg: Config, naive_shards: int = 0) -> SimPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; one of: {', '.join(POLICIES)}") from None
    if cls is NaiveSharing:
        return NaiveSharing(cfg, shards=naive_shards)
    return cls(cfg)
