"""Swap-cost model: the slowdown of each job when co-located jobs share one GPU.

Without oversubscription (sum of footprints <= device) jobs only interfere on compute:
``interference_slowdown`` (a knee in the GPU's summed solo utilisation).

With oversubscription the deficit ``D = sum(footprint) - device`` must live in host memory.
Two ways to place it:

* ``SwapMode.VICTIM`` (the seed paper's rule): the lowest-priority jobs absorb the deficit,
  each keeping a fraction ``a_j = min(1, D_left / MEM_j)`` of its footprint off the device.
  The offloaded bytes stay in host memory and are read over the host link on each sweep of
  the working set (``preferred location = host``): no page faults, link bandwidth only.
  Higher-priority jobs see no swap cost at all.
* ``SwapMode.NAIVE`` (plain demand paging / shared UVM): every job loses a share of the
  device proportional to its footprint. Random access misses in proportion to that share;
  cyclic (streaming) access over a working set larger than its resident part misses on every
  access under LRU, so streaming jobs fall off a cliff as soon as the ratio passes 1.0x.

Cost of moving ``b`` bytes: ``b / link_bytes_per_s`` plus, for demand paging, one fault per
``fault_granularity_bytes`` at ``fault_latency_s`` each. Parameters and their sources are in
``SwapCostConfig`` and docs/model.md.
"""
from __future__ import annotations

import enum
from typing import Sequence

from policy_service.config import AccessClass, SwapCostConfig
from policy_service.core.interference import knee_slowdown
from policy_service.core.types import CoJob, JobSlowdown, SwapCost


class SwapMode(enum.Enum):
    VICTIM = "victim"
    NAIVE = "naive"


def interference_slowdown(own_util: float, others_util: float, cfg: SwapCostConfig) -> float:
    """Slowdown of a job with solo GPU utilisation ``own_util`` (0..1) next to co-runners whose
    solo utilisations sum to ``others_util``, memory aside: little while the GPU's summed
    utilisation stays within one GPU, steep above it (docs/model.md, interference)."""
    if others_util <= 0:
        return 1.0
    return knee_slowdown(own_util, others_util, cfg.compute_interference_base, cfg.compute_interference_knee_slope)


def compute_slowdown(n_jobs: int, cfg: SwapCostConfig, own_util: float | None = None,
                     others_util: float | None = None) -> float:
    """Slowdown from sharing SMs with ``n_jobs - 1`` co-runners, memory aside. Utilisations not
    given (not learned yet) count ``cfg.default_solo_util`` per job."""
    if n_jobs <= 1:
        return 1.0
    own = cfg.default_solo_util if own_util is None else own_util
    others = cfg.default_solo_util * (n_jobs - 1) if others_util is None else others_util
    return interference_slowdown(own, others, cfg)


def transfer_seconds(nbytes: float, link_bytes_per_s: float, cfg: SwapCostConfig, faulting: bool) -> float:
    """Seconds to bring ``nbytes`` over the host link, with demand-paging faults if ``faulting``."""
    seconds = nbytes / link_bytes_per_s
    if faulting:
        seconds += (nbytes / cfg.fault_granularity_bytes) * cfg.fault_latency_s
    return seconds


def traffic(job: CoJob, offloaded_bytes: float, mode: SwapMode) -> tuple[float, bool]:
    """(bytes moved over the host link per second of solo run time, whether they fault in)."""
    if offloaded_bytes <= 0 or job.footprint_bytes <= 0:
        return 0.0, False
    frac = min(1.0, offloaded_bytes / job.footprint_bytes)
    if mode is SwapMode.VICTIM:
        return job.sweeps_per_s * frac * job.working_set_bytes, False
    if job.access is AccessClass.STREAMING:
        return job.sweeps_per_s * job.working_set_bytes, True  # LRU over a cyclic sweep: every access misses
    return job.sweeps_per_s * frac * job.working_set_bytes, True


def offload_penalty(job: CoJob, offloaded_bytes: float, link_bytes_per_s: float, cfg: SwapCostConfig,
                    mode: SwapMode) -> float:
    """Extra seconds per second of solo run time when ``offloaded_bytes`` of ``job`` live off the device."""
    moved, faulting = traffic(job, offloaded_bytes, mode)
    return transfer_seconds(moved, link_bytes_per_s, cfg, faulting) if moved else 0.0


def victim_shares(jobs: Sequence[CoJob], deficit_bytes: int) -> dict[str, int]:
    """Seed paper's victim rule: bytes each job keeps off the device, lowest priority first."""
    left = deficit_bytes
    shares: dict[str, int] = {}
    for job in sorted(jobs, key=lambda j: (j.priority, j.name)):
        if left <= 0:
            break
        take = int(min(1.0, left / job.footprint_bytes) * job.footprint_bytes) if job.footprint_bytes else 0
        shares[job.name] = take
        left -= take
    return shares


def naive_shares(jobs: Sequence[CoJob], deficit_bytes: int) -> dict[str, int]:
    total = sum(j.footprint_bytes for j in jobs)
    if deficit_bytes <= 0 or total <= 0:
        return {}
    return {j.name: int(deficit_bytes * j.footprint_bytes / total) for j in jobs}


def predict(jobs: Sequence[CoJob], device_bytes: int, link_bytes_per_s: float, cfg: SwapCostConfig,
            mode: SwapMode = SwapMode.VICTIM) -> SwapCost:
    """Predict each co-located job's slowdown on one GPU."""
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise ValueError("co-located jobs need distinct names")
    total = sum(j.footprint_bytes for j in jobs)
    deficit = max(0, total - device_bytes)
    shares = (victim_shares if mode is SwapMode.VICTIM else naive_shares)(jobs, deficit)
    base = compute_slowdown(len(jobs), cfg)
    out = []
    for job in jobs:
        off = shares.get(job.name, 0)
        extra = offload_penalty(job, off, link_bytes_per_s, cfg, mode)
        out.append(JobSlowdown(name=job.name, slowdown=base + extra, offloaded_bytes=off, victim=off > 0))
    risk = min(1.0, deficit / total) if total else 0.0
    return SwapCost(deficit_bytes=deficit, jobs=tuple(out), risk=risk)


def total_response_s(cost: SwapCost, jobs: Sequence[CoJob]) -> float:
    """Sum of response times: each job's solo time times its slowdown."""
    by_name = {j.name: j for j in jobs}
    return sum(by_name[s.name].solo_time_s * s.slowdown for s in cost.jobs)


def victim_slowdown(footprint_bytes: int, offloaded_bytes: int, access: AccessClass, link_bytes_per_s: float,
                    cfg: SwapCostConfig) -> float:
    """Slowdown, from swapping alone, of one job kept ``offloaded_bytes`` off the device as victim."""
    job = CoJob(name="job", footprint_bytes=footprint_bytes,
                working_set_bytes=int(footprint_bytes * cfg.default_working_set_frac), access=access,
                priority=0.0, sweeps_per_s=sweeps_for(access, cfg))
    return 1.0 + offload_penalty(job, offloaded_bytes, link_bytes_per_s, cfg, SwapMode.VICTIM)


def sweeps_for(access: AccessClass, cfg: SwapCostConfig) -> float:
    """Working-set sweeps per second by access class (compute-bound jobs touch memory rarely)."""
    factor = {AccessClass.STREAMING: 1.0, AccessClass.RANDOM: 1.0, AccessClass.COMPUTE_BOUND: 0.1}[access]
    return cfg.default_sweeps_per_s * factor
