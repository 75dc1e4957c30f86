"""Run the comparison matrix: every policy at every load (and every noise level at one load)
on the same workload, and collect the metrics with everything needed to reproduce them."""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import platform
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from policy_service.config import Config
from policy_service.core import policy as core_policy
from policy_service.sim.alibaba import load_alibaba_v2023, load_pai_2020
from policy_service.sim.config import SimConfig, _jsonable
from policy_service.sim.engine import Engine
from policy_service.sim.gavel import calibrate_interference, gavel_pair_slowdowns
from policy_service.sim.interference_fit import fit_knee
from policy_service.sim.loaders import DataNotFound, TraceJob
from policy_service.sim.metrics import summarize
from policy_service.sim.policies import POLICIES, make_policy
from policy_service.sim.site import load_sacct_export
from policy_service.sim.workload import Workload, build_workload, synthetic_trace

WORKLOADS = ("alibaba-v2023", "pai-2020", "synthetic", "sacct")
DEFAULT_GPUS = {"alibaba-v2023": 64, "pai-2020": 512, "synthetic": 200}
DEFAULT_SYNTHETIC_JOBS = 20000


@dataclass(frozen=True)
class RunSpec:
    workload: str = "synthetic"
    data_dir: Path | None = None
    variant: str = "default"
    loads: tuple[float, ...] = (0.5, 0.7, 0.9)
    noises: tuple[float, ...] = (0.1, 0.25, 0.5)
    noise_load: float = 0.7
    jobs: int | None = None
    gpus: int | None = None
    seed: int = 1
    policies: tuple[str, ...] = tuple(POLICIES)
    arrivals: str = "poisson"
    gavel: Path | None = None  # simulation_throughputs.json (default: <data_dir>/gavel)
    sacct_json: Path | None = None  # workload "sacct": a site's `sacct --json` export (sim/site.py)
    history: Path | None = None  # ... and the service's history, for the peaks it observed
    shards_per_gpu: int = 8  # the site's (gpu.shards_per_gpu): a job's k shards are k / this of a GPU

    def resolved_gpus(self) -> int:
        if self.gpus is None and self.workload not in DEFAULT_GPUS:
            raise ValueError(f"give --gpus for the {self.workload} workload: the GPUs of the cluster (or partition) "
                             "the jobs ran on")
        return self.gpus or DEFAULT_GPUS[self.workload]


@dataclass
class MatrixResult:
    meta: dict[str, Any]
    rows: list[dict[str, Any]]
    curves: dict[tuple[str, float, float], dict[str, Any]] = field(default_factory=dict)


def load_trace(spec: RunSpec, sim: SimConfig) -> tuple[list[TraceJob], dict[str, Any]]:
    if spec.workload not in WORKLOADS:
        raise ValueError(f"unknown workload {spec.workload!r}; one of: {', '.join(WORKLOADS)}")
    if spec.workload == "synthetic":
        n = spec.jobs or DEFAULT_SYNTHETIC_JOBS
        return synthetic_trace(n, spec.seed, sim.workload), {
            "name": "synthetic", "jobs": n, "generator": "policy_service.sim.workload.synthetic_trace",
            "parameters": "see sim_config.workload (synthetic_*)"}
    if spec.workload == "sacct":
        if spec.sacct_json is None:
            raise DataNotFound("--sacct-json is required for the sacct workload")
        spec.resolved_gpus()  # before any work: the cluster's size is not in the export
        loaded = load_sacct_export(spec.sacct_json, spec.history, shards_per_gpu=spec.shards_per_gpu,
                                   limit=spec.jobs)
        return loaded.jobs, {**loaded.source, "skipped_rows": dict(loaded.skipped), "jobs": len(loaded.jobs)}
    if spec.data_dir is None:
        raise DataNotFound(f"--data-dir is required for the {spec.workload} workload")
    if spec.workload == "alibaba-v2023":
        loaded = load_alibaba_v2023(spec.data_dir, spec.variant, limit=spec.jobs)
    else:
        loaded = load_pai_2020(spec.data_dir, limit=spec.jobs)
    src = dict(loaded.source)
    src["skipped_rows"] = dict(loaded.skipped)
    src["jobs"] = len(loaded.jobs)
    return loaded.jobs, src


def calibrate(spec: RunSpec, sim: SimConfig) -> tuple[float, dict[str, Any]]:
    """Compute-interference coefficient: Gavel's measured pairs when available, else the config."""
    icfg = sim.interference
    path = spec.gavel or (spec.data_dir / "gavel" if spec.data_dir else None)
    if icfg.gavel_worker and path is not None:
        try:
            cal = calibrate_interference(path, icfg.gavel_worker)
        except DataNotFound:
            pass
        else:
            info = {"method": f"Gavel measured pairs ({cal.worker})", **dataclasses.asdict(cal)}
            knee = fit_knee(gavel_pair_slowdowns(path, icfg.gavel_worker))
            info["knee_fit"] = {"fit": "policy_service.sim.interference_fit.fit_knee (Gavel pairs; assumption: job types' "
                                       "solo utilisation ~ U[util_lo, 1])", **dataclasses.asdict(knee)}
            return cal.per_corunner, {**info, **_knee_used(sim)}
    return icfg.per_corunner, {"method": "config (no Gavel data given)", "per_corunner": icfg.per_corunner,
                               **_knee_used(sim)}


def _knee_used(sim: SimConfig) -> dict[str, Any]:
    i = sim.interference
    return {"model": i.model.value, "knee_used": {"fit": i.fit, "base": i.knee_base, "slope": i.knee_slope,
                                                  "util_source": i.util_source}}


def memory_fit(spec: RunSpec) -> dict[str, Any]:
    """The memory model's fit to the measured GenAI series when the data folder has them (the
    defaults in MemoryModelConfig hold this fit's figures)."""
    if spec.data_dir is None or not (spec.data_dir / "alibaba-v2026-genai").is_dir():
        return {"source": "defaults of MemoryModelConfig (fit not rerun: no alibaba-v2026-genai folder given)"}
    from policy_service.sim.memfit import fit_trace
    try:
        return fit_trace(spec.data_dir / "alibaba-v2026-genai")
    except DataNotFound as exc:
        return {"source": f"defaults of MemoryModelConfig ({exc})"}


# ---------------------------------------------------------------- one run (also in worker processes)

_STATE: dict[str, Any] = {}


def _init_worker(trace, cfg, sim, spec, per_corunner, counter) -> None:
    _STATE.update(trace=trace, cfg=cfg, sim=sim, spec=spec, per_corunner=per_corunner, counter=counter,
                  workloads={})


def _workload(load: float, noise: float | None) -> Workload:
    key = (load, noise)
    cache = _STATE["workloads"]
    if key not in cache:
        cache.clear()
        spec: RunSpec = _STATE["spec"]
        cache[key] = build_workload(_STATE["trace"], load=load, gpus=spec.resolved_gpus(), seed=spec.seed,
                                    sim=_STATE["sim"], gpu=_STATE["cfg"].gpu, noise=noise,
                                    arrivals="scaled" if spec.arrivals == "recorded" else spec.arrivals,
                                    keep_times=spec.arrivals == "recorded")
    return cache[key]


def _run_one(task: tuple[str, float, float | None, str]) -> tuple[dict, dict]:
    block, load, noise, name = task
    cfg, sim = _STATE["cfg"], _STATE["sim"]
    w = _workload(load, noise)
    counter = _STATE["counter"]
    last = [0]

    def progress(done: int) -> None:
        delta, last[0] = done - last[0], done
        if delta <= 0:
            return
        if counter is not None:
            with counter.get_lock():
                counter.value += delta
        elif _STATE.get("callback") is not None:
            _STATE["callback"](delta)

    pol = make_policy(name, cfg, naive_shards=sim.baselines.naive_shards)
    t0 = time.perf_counter()
    result = Engine(w, pol, cfg, sim, per_corunner=_STATE["per_corunner"], progress=progress).run()
    wall = time.perf_counter() - t0
    progress(len(w.jobs))
    summary = summarize(result, w, victim_budget=cfg.policy.max_victim_slowdown)
    if hasattr(pol, "decisions"):
        summary["decisions"] = dict(pol.decisions)
    if hasattr(pol, "reasons"):
        summary["decision_reasons"] = dict(pol.reasons)
    row = {"block": block, "policy": name, "label": pol.label, "load": load, "noise": w.noise,
           "wall_s": round(wall, 3), **summary, "workload_model": w.description}
    jct = sorted(r.end_s - r.submit_s for r in result.records if r.completed)
    step = max(1, len(jct) // 2000)
    curve = {"jct_s": jct[::step] + ([jct[-1]] if jct else []), "timeline": result.timeline[::max(1, len(
        result.timeline) // 1000)]}
    return row, curve


def plan(spec: RunSpec, base_noise: float) -> list[tuple[str, float, float | None, str]]:
    tasks = [("load", load, None, p) for load in spec.loads for p in spec.policies]
    for nz in spec.noises:
        if abs(nz - base_noise) < 1e-12 and spec.noise_load in spec.loads:
            continue  # same as a load run
        tasks.extend(("noise", spec.noise_load, nz, p) for p in spec.policies)
    return tasks


def run_matrix(spec: RunSpec, cfg: Config, sim: SimConfig, *, workers: int = 1,
               progress: Callable[[int, int], None] | None = None, argv: Sequence[str] | None = None
               ) -> MatrixResult:
    """Run every task; ``progress(done_jobs, total_jobs)`` is called as runs advance."""
    for p in spec.policies:
        if p not in POLICIES:
            raise ValueError(f"unknown policy {p!r}; one of: {', '.join(POLICIES)}")
    t_start = time.perf_counter()
    trace, source = load_trace(spec, sim)
    per_corunner, calibration = calibrate(spec, sim)
    tasks = plan(spec, sim.memory.run_noise)
    n_jobs = len(trace)
    total = n_jobs * len(tasks)
    rows: list[dict] = []
    curves: dict = {}
    done_jobs = [0]

    def report(delta: int) -> None:
        done_jobs[0] += delta
        if progress is not None:
            progress(min(done_jobs[0], total), total)

    workers = max(1, min(workers, len(tasks)))
    if workers == 1:
        _init_worker(trace, cfg, sim, spec, per_corunner, None)
        _STATE["callback"] = report
        try:
            for task in tasks:
                row, curve = _run_one(task)
                rows.append(row)
                curves[(row["policy"], row["load"], row["noise"])] = curve
        finally:
            _STATE.clear()
    else:
        ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
        counter = ctx.Value("q", 0)
        results: dict[int, tuple[dict, dict]] = {}
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                                 initargs=(trace, cfg, sim, spec, per_corunner, counter)) as pool:
            pending = {pool.submit(_run_one, t): i for i, t in enumerate(tasks)}
            while pending:
                finished, _ = wait(list(pending), timeout=0.5, return_when=FIRST_COMPLETED)
                for fut in finished:
                    results[pending.pop(fut)] = fut.result()
                if progress is not None:
                    progress(min(counter.value, total), total)
        for i in range(len(tasks)):
            row, curve = results[i]
            rows.append(row)
            curves[(row["policy"], row["load"], row["noise"])] = curve
    meta = {
        "tool": "swapaware simulate",
        "command": list(argv) if argv is not None else None,
        "seed": spec.seed,
        "workload": spec.workload,
        "data_source": source,
        "run_spec": _jsonable(dataclasses.asdict(spec)),
        "gpus": spec.resolved_gpus(),
        "interference": calibration,
        "memory_fit": memory_fit(spec),
        "node": {"hard_caps": sim.node.hard_caps},
        "model_version": core_policy.model_version(cfg),
        "config": _jsonable({k: dataclasses.asdict(getattr(cfg, k)) for k in ("gpu", "estimator", "swap_cost",
                                                                               "policy")}),
        "config_source": cfg.source,
        "sim_config": sim.to_dict(),
        "load_definition": "offered load = sum(declared GPU share x duration) / (GPUs x arrival window); "
                           "declared share = gpu_milli/1000 for single-GPU jobs, GPU count otherwise",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "workers": workers,
        "wall_s": round(time.perf_counter() - t_start, 3),
    }
    return MatrixResult(meta=meta, rows=rows, curves=curves)
