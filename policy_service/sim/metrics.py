"""Per-run metrics of a simulation (one policy, one load, one noise level)."""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from policy_service.sim.records import EngineResult
from policy_service.sim.workload import Workload

SLOWDOWN_LIMIT = 2.0


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return float(s[k])


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def summarize(result: EngineResult, workload: Workload, victim_budget: float = 1.25) -> dict:
    """Metrics of one run; ``victim_budget`` is the policy's max_victim_slowdown (swap share only)."""
    recs = result.records
    jobs = workload.jobs
    n = len(recs)
    done = [r for r in recs if r.completed]
    jct = [r.end_s - r.submit_s for r in done]
    waits = [r.wait_s for r in recs if r.completed or r.failed]
    makespan = result.makespan_s
    denom_t = result.gpus * makespan if makespan > 0 else 1.0
    slow = [r.slowdown for r in done]
    over = [i for i, r in enumerate(recs) if r.completed and r.slowdown > SLOWDOWN_LIMIT]
    hi = [recs[i].slowdown for i, j in enumerate(jobs) if j.qos_tier == 0 and recs[i].completed]
    failed = Counter(r.fail_reason for r in recs if r.failed)
    gres = Counter(r.gres.split(":")[1] if r.gres else "none" for r in recs)
    actions = Counter(r.action for r in recs if r.action)
    return {
        "jobs": n,
        "completed": len(done),
        "failed": sum(failed.values()),
        "failed_by_reason": dict(failed),
        "makespan_s": makespan,
        "jct_mean_s": _mean(jct),
        "jct_p50_s": percentile(jct, 50),
        "jct_p95_s": percentile(jct, 95),
        "wait_mean_s": _mean(waits),
        "gpu_util": result.gpu_busy_integral / denom_t,
        "mem_util": result.mem_used_integral / (denom_t * result.device_bytes),
        "oom_events": result.oom_events,
        "oom_jobs": sum(1 for r in recs if r.ooms > 0),
        "oom_rate": result.oom_events / n if n else 0.0,
        "neighbour_oom_events": result.neighbour_oom_events,
        "slowdown_mean": _mean(slow),
        "slowdown_p95": percentile(slow, 95),
        "slowdown_over_2x": len(over),
        "slowdown_over_2x_designated_victims": sum(1 for i in over if recs[i].designated_victim),
        "slowdown_over_2x_swapped_not_designated": sum(1 for i in over if recs[i].swapped
                                                       and not recs[i].designated_victim),
        "slowdown_over_2x_compute_only": sum(1 for i in over if not recs[i].swapped),
        "high_prio_jobs": len(hi),
        "high_prio_slowdown_p95": percentile(hi, 95),
        "high_prio_slowdown_mean": _mean(hi),
        "swap_extra_p95_of_swapped": percentile([r.max_swap_extra for r in recs if r.swapped], 95),
        "swap_extra_over_budget": sum(1 for r in recs if r.max_swap_extra > victim_budget - 1.0 + 1e-9),
        "swap_extra_over_budget_designated": sum(1 for r in recs if r.designated_victim
                                                 and r.max_swap_extra > victim_budget - 1.0 + 1e-9),
        "high_prio_swapped": sum(1 for i, j in enumerate(jobs) if j.qos_tier == 0 and recs[i].swapped),
        "shared_jobs": sum(1 for r in recs if r.shared),
        "redecided_jobs": result.redecided,
        "swapped_jobs": sum(1 for r in recs if r.swapped),
        "designated_victim_jobs": sum(1 for r in recs if r.designated_victim),
        "requests": dict(gres),
        "actions": dict(actions),
        "events": result.events,
        "gpus": result.gpus,
        "offered_load_declared": workload.declared_gpu_seconds / (result.gpus * workload.arrival_window_s)
        if workload.arrival_window_s > 0 else 0.0,
        "offered_load_exclusive": workload.exclusive_gpu_seconds / (result.gpus * workload.arrival_window_s)
        if workload.arrival_window_s > 0 else 0.0,
        **lower_bounds(workload),
    }


def lower_bounds(workload: Workload) -> dict:
    """What no policy can beat (a job runs at best at its solo speed, from its submission on):
    mean JCT >= mean solo duration; makespan >= the latest submission + solo duration."""
    jobs = workload.jobs
    if not jobs:
        return {"jct_mean_lower_bound_s": 0.0, "makespan_lower_bound_s": 0.0}
    first = min(j.submit_s for j in jobs)
    return {"jct_mean_lower_bound_s": _mean([j.duration_s for j in jobs]),
            "makespan_lower_bound_s": max(j.submit_s + j.duration_s for j in jobs) - first}
