"""What the engine records: the mutable state of one run (``Attempt``), each job's outcome
(``JobRecord``) and a simulation's result (``EngineResult``), with the GPU modes, event kinds and
``SimulationError`` that the engine's parts share.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from policy_service.core.types import GresKind
from policy_service.sim.policies import Admission
from policy_service.sim.workload import SimJob

FREE, WHOLE, SHARED = 0, 1, 2
EV_FINISH, EV_GROW, EV_BACKFILL = 0, 1, 3
INF = float("inf")


class SimulationError(RuntimeError):
    """An invariant of the model broke (a bug, not a policy outcome)."""


class Attempt:
    """One run of a job on the cluster (a job that fails out of memory may run again)."""

    __slots__ = ("job", "no", "adm", "gpus", "submit_t", "start_t", "remaining", "slowdown", "last_t", "version",
                 "alloc", "grown", "charge", "prio", "victim_prio", "swapped", "n_co", "corun_int",
                 "shared", "max_slowdown", "offloaded", "max_swap_extra", "checked", "u_co", "co_util_work")

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
        self.u_co = 0.0  # co-runners' summed solo utilisation now (UTIL model)
        self.co_util_work = 0.0  # its integral over the work done (solo seconds)


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
