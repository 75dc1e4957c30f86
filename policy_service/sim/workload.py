"""Workload model: trace jobs -> simulated jobs with classes, memory truth, QoS and arrivals.

What the data records (requests, durations, arrivals) is kept; what it lacks is modelled
explicitly with the parameters of ``SimConfig`` (docs/simulation.md):

* classes (repeated jobs, so the estimator can learn): the trace's tag when it has one (PAI
  ``group``), else pods of one resource signature split at random into classes of about
  ``runs_per_class`` runs;
* memory truth: ``MemoryModel`` (declared share x a class ratio, per-run noise, rare shifts);
* access class and managed-memory use: drawn per class;
* arrivals: re-timed so that the offered load (declared GPU share x duration, over GPUs x
  arrival window) equals the requested load.
"""
from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Sequence

from policy_service.config import AccessClass, GpuConfig
from policy_service.sim.config import MemoryModelConfig, SimConfig, WorkloadConfig
from policy_service.sim.loaders import TraceJob

QOS_TIERS = ("high", "normal", "low")
QOS_FACTOR = (1.0, 0.5, 0.0)  # Slurm QOS priority factor of each tier
_TRACE_QOS = {"guaranteed": 0, "ls": 0, "burstable": 1, "be": 2}
_ACCESS = (AccessClass.STREAMING, AccessClass.RANDOM, AccessClass.COMPUTE_BOUND)


@dataclass(slots=True)
class SimJob:
    """One job of a simulated workload (immutable during a run; the engine keeps run state)."""

    idx: int
    job_id: str
    submit_s: float
    duration_s: float  # solo run time
    num_gpu: int
    gpu_milli: int  # per-GPU declared share
    declared_bytes: int  # per GPU: gpu_milli / 1000 x device memory
    true_peak_bytes: int  # per GPU, this run
    class_id: int
    user: str
    account: str
    job_name: str
    script_fp: str
    qos_tier: int  # index into QOS_TIERS
    access: AccessClass
    managed: bool  # framework uses managed memory (pages instead of failing when short)
    time_limit_s: float
    compute_share: float  # compute demand as a fraction of one GPU (interference weight)
    init_frac: float = 1.0  # this run allocates init_frac x true_peak_bytes at start ...
    grow_at: float = 0.0  # ... and the rest when it has done this fraction of its work
    solo_util: float = 1.0  # GPU utilisation of the job alone on a GPU (0..1; UTIL interference)

    @property
    def single_gpu(self) -> bool:
        return self.num_gpu == 1

    @property
    def declared_share(self) -> float:
        return self.num_gpu if self.num_gpu > 1 else self.gpu_milli / 1000.0


@dataclass
class Workload:
    jobs: list[SimJob]
    load: float
    noise: float
    arrival_window_s: float
    gpus: int
    description: dict  # what was modelled, with counts

    @property
    def declared_gpu_seconds(self) -> float:
        return sum(j.duration_s * j.declared_share for j in self.jobs)

    @property
    def exclusive_gpu_seconds(self) -> float:
        return sum(j.duration_s * j.num_gpu for j in self.jobs)


class MemoryModel:
    """Memory truth of job classes: stable per class, small noise per run, rare shifts."""

    def __init__(self, cfg: MemoryModelConfig, gpu: GpuConfig, run_noise: float | None = None):
        self.cfg = cfg
        self.gpu = gpu
        self.run_noise = cfg.run_noise if run_noise is None else run_noise

    def class_ratio(self, rng: random.Random) -> float:
        c = self.cfg
        r = rng.lognormvariate(math.log(c.ratio_median), c.ratio_sigma) if c.ratio_sigma > 0 else c.ratio_median
        return min(c.ratio_max, max(c.ratio_min, r))

    def clamp(self, nbytes: float) -> int:
        cap = self.cfg.max_peak_frac_of_device * self.gpu.memory_bytes
        return int(min(cap, max(self.cfg.min_peak_bytes, nbytes)))

    def maybe_shift(self, class_peak: float, rng: random.Random) -> float:
        c = self.cfg
        if c.shift_prob > 0 and rng.random() < c.shift_prob:
            return class_peak * math.exp(rng.uniform(math.log(c.shift_min), math.log(c.shift_max)))
        return class_peak

    def run_peak(self, class_peak: float, rng: random.Random) -> int:
        # One draw per run whatever the noise: runs at different noise levels see the same
        # random numbers (common random numbers), so their differences are the noise's.
        c = self.cfg
        jump = rng.random() < c.run_jump_prob
        e = rng.gauss(0.0, c.run_sigma_jump if jump else c.run_sigma_small)
        return self.clamp(class_peak * math.exp(e) * (1.0 + rng.uniform(-1.0, 1.0) * self.run_noise))

    def growth(self, rng: random.Random) -> tuple[float, float]:
        """(init_frac, grow_at) of one run: the fitted growth model, or the fixed one (grow_prob 0)."""
        c = self.cfg
        r, g, t = rng.random(), rng.gauss(c.log_growth_median, c.log_growth_sigma), rng.random()
        if c.grow_prob <= 0:
            return (c.init_frac, c.growth_at_work_frac) if c.growth_at_work_frac > 0 else (1.0, 0.0)
        if r >= c.grow_prob or g <= 0:
            return 1.0, 0.0
        return math.exp(-g), t


def draw_util(quantiles: Sequence[tuple[float, float]], x: float) -> float:
    """Inverse of the piecewise-linear CDF through (probability, utilisation) points at x in [0, 1]."""
    pts = sorted(quantiles)
    if x <= pts[0][0]:
        return pts[0][1]
    for (p0, u0), (p1, u1) in zip(pts, pts[1:]):
        if x <= p1:
            return u0 + (u1 - u0) * ((x - p0) / (p1 - p0) if p1 > p0 else 0.0)
    return pts[-1][1]


def _weighted(rng: random.Random, items: Sequence, weights: Sequence[float]):
    return rng.choices(items, weights=weights, k=1)[0]


def synthetic_trace(n_jobs: int, seed: int, wcfg: WorkloadConfig) -> list[TraceJob]:
    """Jobs of a synthetic cluster for scale tests: classes of ~runs_per_class repeated runs,
    GPU counts and shares after the openb trace's mix, log-normal durations. ``submit_s`` is the
    job's order only: arrivals are timed by ``build_workload`` for the requested load."""
    rng = random.Random(f"{seed}:synthetic")
    n_classes = max(1, round(n_jobs / wcfg.runs_per_class))
    counts, cw = zip(*wcfg.synthetic_gpu_counts)
    millis, mw = zip(*wcfg.synthetic_gpu_milli)
    classes = []
    for c in range(n_classes):
        g = _weighted(rng, counts, cw)
        milli = _weighted(rng, millis, mw) if g == 1 else 1000
        dur = rng.lognormvariate(math.log(wcfg.synthetic_duration_median_s), wcfg.synthetic_duration_sigma)
        dur = min(wcfg.duration_cap_s, max(wcfg.synthetic_duration_min_s, dur))
        qos = _weighted(rng, ("Guaranteed", "Burstable", "BE"), wcfg.synthetic_qos_weights)
        classes.append((g, milli, dur, qos))
    out = []
    noise = wcfg.synthetic_run_duration_noise
    for i in range(n_jobs):
        c = rng.randrange(n_classes)
        g, milli, dur, qos = classes[c]
        d = max(wcfg.synthetic_duration_min_s, dur * (1 + rng.uniform(-noise, noise)))
        out.append(TraceJob(job_id=f"syn-{i:07d}", submit_s=float(i), duration_s=d, num_gpu=g, gpu_milli=milli,
                            qos=qos, class_key=f"syn-class-{c:05d}", signature=f"gpu{g}x{milli}"))
    return out


def _fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def offered_load_share(job: TraceJob) -> float:
    return float(job.num_gpu) if job.num_gpu > 1 else job.gpu_milli / 1000.0


def build_workload(trace: Sequence[TraceJob], *, load: float, gpus: int, seed: int, sim: SimConfig,
                   gpu: GpuConfig, noise: float | None = None, arrivals: str = "poisson",
                   keep_times: bool = False) -> Workload:
    """Turn trace jobs into simulated jobs at the requested offered ``load`` on ``gpus`` GPUs.

    ``arrivals``: "poisson" keeps the trace's job order and draws exponential gaps at the rate
    the load needs; "scaled" keeps the trace's relative submit times, compressed or stretched to
    the window the load needs. ``keep_times`` uses the submit times as given (scenarios).
    """
    if load <= 0 and not keep_times:
        raise ValueError("load must be > 0")
    wcfg, mcfg = sim.workload, sim.memory
    gpn = sim.scheduler.gpus_per_node
    desc: dict = {"skipped": {}}
    kept: list[TraceJob] = []
    for j in trace:
        if j.num_gpu > gpn:
            desc["skipped"]["more GPUs than a node has"] = desc["skipped"].get("more GPUs than a node has", 0) + 1
            continue
        kept.append(j)
    durations = [min(wcfg.duration_cap_s, max(wcfg.min_duration_s, j.duration_s)) for j in kept]
    desc["durations_capped"] = sum(1 for j in kept if j.duration_s > wcfg.duration_cap_s)

    # Classes.
    rng_cls = random.Random(f"{seed}:classes")
    class_of: list[str] = []
    by_sig: dict[str, list[int]] = {}
    for i, j in enumerate(kept):
        if j.class_key:
            class_of.append(j.class_key)
        else:
            class_of.append("")
            by_sig.setdefault(j.signature or f"gpu{j.num_gpu}x{j.gpu_milli}", []).append(i)
    for sig, members in sorted(by_sig.items()):
        k = max(1, round(len(members) / wcfg.runs_per_class))
        for i in members:
            class_of[i] = f"{sig}#{rng_cls.randrange(k)}"
    class_ids: dict[str, int] = {}
    for key in class_of:
        class_ids.setdefault(key, len(class_ids))
    desc["classes"] = len(class_ids)

    memory = MemoryModel(mcfg, gpu, run_noise=noise)
    rng_attr = random.Random(f"{seed}:class-attributes")
    class_attr = []
    for key, cid in class_ids.items():
        user_idx = cid // wcfg.classes_per_user
        class_attr.append({
            "user": f"u{user_idx:05d}", "account": f"acct{user_idx // wcfg.users_per_account:04d}",
            "job_name": f"job-{cid:05d}", "script_fp": _fingerprint(f"{seed}:{key}"),
            "ratio": memory.class_ratio(rng_attr),
            "access": _weighted(rng_attr, _ACCESS, mcfg.access_weights),
            "managed": rng_attr.random() < mcfg.managed_frac,
            "qos": _weighted(rng_attr, (0, 1, 2), wcfg.synthetic_qos_weights),
        })

    # Memory truth per run, in trace order (shifts persist for the class's later runs).
    rng_mem = random.Random(f"{seed}:memory")
    class_peak: dict[int, float] = {}
    measured = 0
    peaks = []
    for i, j in enumerate(kept):
        cid = class_ids[class_of[i]]
        declared = j.gpu_milli / 1000.0 * gpu.memory_bytes
        if j.measured_peak_bytes:
            peaks.append(memory.clamp(j.measured_peak_bytes))
            measured += 1
            continue
        base = class_peak.get(cid)
        base = declared * class_attr[cid]["ratio"] if base is None else memory.maybe_shift(base, rng_mem)
        class_peak[cid] = base
        peaks.append(memory.run_peak(base, rng_mem))
    desc["measured_memory_jobs"] = measured

    rng_grow = random.Random(f"{seed}:growth")
    growth = [memory.growth(rng_grow) for _ in kept]
    icfg = sim.interference
    rng_util = random.Random(f"{seed}:utilisation")
    class_util = [draw_util(icfg.util_quantiles, rng_util.random()) for _ in class_attr]

    # Arrivals for the requested load.
    work = sum(d * offered_load_share(j) for d, j in zip(durations, kept))
    rng_arr = random.Random(f"{seed}:arrivals")
    if keep_times:
        submits = [j.submit_s for j in kept]
        window = (max(submits) - min(submits)) if submits else 0.0
    else:
        window = work / (load * gpus) if gpus > 0 else 0.0
        n = len(kept)
        if arrivals == "scaled" and n > 1 and kept[-1].submit_s > kept[0].submit_s:
            t0, span = kept[0].submit_s, kept[-1].submit_s - kept[0].submit_s
            submits = [(j.submit_s - t0) * window / span for j in kept]
        elif arrivals in ("poisson", "scaled"):
            mean_gap = window / max(1, n)
            t, submits = 0.0, []
            for _ in kept:
                submits.append(t)
                t += rng_arr.expovariate(1.0) * mean_gap  # same pattern at every load, rescaled
        else:
            raise ValueError(f"unknown arrivals mode {arrivals!r}: poisson or scaled")
    desc.update(arrivals="given" if keep_times else arrivals, offered_load=load,
                declared_gpu_seconds=work, exclusive_gpu_seconds=sum(d * j.num_gpu for d, j in zip(durations, kept)))

    rng_lim = random.Random(f"{seed}:limits")
    jobs: list[SimJob] = []
    for i, j in enumerate(kept):
        cid = class_ids[class_of[i]]
        a = class_attr[cid]
        q = _TRACE_QOS.get(j.qos.lower(), a["qos"]) if j.qos else a["qos"]
        d = durations[i]
        limit = math.ceil(d * rng_lim.uniform(wcfg.time_limit_factor_min, wcfg.time_limit_factor_max) / 60.0) * 60.0
        jobs.append(SimJob(
            idx=i, job_id=j.job_id, submit_s=submits[i], duration_s=d, num_gpu=j.num_gpu, gpu_milli=j.gpu_milli,
            declared_bytes=int(j.gpu_milli / 1000.0 * gpu.memory_bytes), true_peak_bytes=peaks[i], class_id=cid,
            user=a["user"], account=a["account"], job_name=a["job_name"], script_fp=a["script_fp"], qos_tier=q,
            access=a["access"], managed=a["managed"], time_limit_s=limit,
            compute_share=1.0 if j.num_gpu > 1 else j.gpu_milli / 1000.0,
            init_frac=growth[i][0], grow_at=growth[i][1],
            solo_util=(class_util[cid] if icfg.util_source == "duty" else
                       (1.0 if j.num_gpu > 1 else j.gpu_milli / 1000.0))))
    jobs.sort(key=lambda s: (s.submit_s, s.idx))
    for new_idx, s in enumerate(jobs):
        s.idx = new_idx
    desc["jobs"] = len(jobs)
    desc["qos_jobs"] = {QOS_TIERS[t]: sum(1 for s in jobs if s.qos_tier == t) for t in range(3)}
    desc["jobs_over_declared"] = sum(1 for s in jobs if s.true_peak_bytes > s.declared_bytes)
    desc["runs_growing"] = sum(1 for s in jobs if s.init_frac < 1.0)
    return Workload(jobs=jobs, load=load, noise=memory.run_noise, arrival_window_s=window, gpus=gpus,
                    description=desc)
