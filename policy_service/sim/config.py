"""Parameters of the simulation's models (workload, memory truth, scheduler, interference).

The policy itself is configured by ``policy_service.config.Config`` (the same object the
service uses). This module holds only what the simulator adds: the models of what the data
does not record. Every parameter is written into every result file.

Sources of the defaults and the reasoning behind them: docs/simulation.md.
"""
from __future__ import annotations

import dataclasses
import enum
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from policy_service.config import ConfigError

GIB = 1024**3
DAY_S = 86400.0


class InterferenceModel(enum.Enum):
    """How co-runners slow each other down on compute (memory aside)."""

    COUNT = "count"  # every co-runner counts 1 (per_corunner each)
    DEMAND = "demand"  # every co-runner counts its compute share (gpu_milli / 1000), linearly
    UTIL = "util"  # knee: 1 + base (any co-runner) + knee_slope x max(0, sum of solo utilisations - 1)


@dataclass(frozen=True)
class MemoryModelConfig:
    """Memory truth: the data records requests, not measured memory.

    true class peak = declared bytes x ratio, ratio ~ LogNormal(ln(ratio_median), ratio_sigma)
    clipped to [ratio_min, ratio_max]; each run deviates uniformly by +-run_noise from its
    class's value; with probability shift_prob a run permanently rescales its class's peak by a
    log-uniform factor in [shift_min, shift_max] (e.g. a new batch size under the same name).
    """

    ratio_median: float = 0.55
    ratio_sigma: float = 0.5
    ratio_min: float = 0.05
    ratio_max: float = 2.0
    # Extra uniform +-run_noise per run (the --noise sensitivity levels set it); the fitted
    # variation below replaces the former default of 0.05.
    run_noise: float = 0.0
    shift_prob: float = 0.02
    shift_min: float = 0.5
    shift_max: float = 2.0
    min_peak_bytes: int = 1 * GIB
    # A job that ran on a whole GPU in the trace fitted it: cap the truth below the device.
    max_peak_frac_of_device: float = 0.98
    # Memory timeline of a run. grow_prob > 0 (the default, fitted): with probability grow_prob a
    # run starts at peak / exp(g), g ~ Normal(log_growth_median, log_growth_sigma) clipped at 0, and
    # reaches its peak at a work fraction ~ U(0, 1); otherwise it holds its peak from the start.
    # grow_prob = 0: every run allocates init_frac of its peak at start and the rest when it has
    # done growth_at_work_frac of its work (the model before the fit; growth_at_work_frac = 0: none).
    # Fitted by ``python -m policy_service.sim.memfit ../shared/data/alibaba-v2026-genai`` (30-min
    # windows, 2,981 runs of 76 containers): 51.1 % of runs grow by > 1 %; log(peak/first) of
    # those: median 0.213 (x1.24), sigma 0.183 (robust); peak reached at quartiles 0.26/0.52/0.77
    # of the window (about uniform).
    grow_prob: float = 0.511
    log_growth_median: float = 0.213
    log_growth_sigma: float = 0.183
    init_frac: float = 0.5
    growth_at_work_frac: float = 0.1
    # Run-to-run variation of a class's peak (on top of run_noise): each run multiplies the class
    # peak by exp(e), e ~ Normal(0, run_sigma_small) or, with probability run_jump_prob,
    # Normal(0, run_sigma_jump). Same fit: log(peak_k / peak_k-1) of adjacent windows (2,900
    # pairs) moves by > 5 % in 36.5 % of pairs (rms of those 0.239), else rms 0.0128; the per-run
    # mixture whose differences reproduce both (memfit.fit_variation_from_diffs): 0.258, 0.0091, 0.202.
    run_jump_prob: float = 0.258
    run_sigma_small: float = 0.0091
    run_sigma_jump: float = 0.202
    # Fraction of job classes whose framework uses managed (unified) memory: under the
    # no-swap baselines they page (thrash) instead of failing with out-of-memory.
    managed_frac: float = 0.2
    # Access classes of job classes (streaming, random, compute_bound), as weights.
    access_weights: tuple[float, float, float] = (0.6, 0.2, 0.2)


@dataclass(frozen=True)
class WorkloadConfig:
    # Trace workloads: classes are not in the data. Pods with the same resource signature
    # (cpu, memory, GPUs, GPU share) are split into classes of ~runs_per_class runs each.
    runs_per_class: int = 20
    classes_per_user: int = 3
    users_per_account: int = 8
    duration_cap_s: float = 2 * DAY_S
    min_duration_s: float = 1.0
    # Time limit users give = duration x U(time_limit_factor_min, time_limit_factor_max);
    # the scheduler uses it only to plan backfill (limits are not enforced).
    time_limit_factor_min: float = 1.5
    time_limit_factor_max: float = 4.0
    # Synthetic generator.
    synthetic_duration_median_s: float = 900.0
    synthetic_duration_sigma: float = 1.6
    synthetic_duration_min_s: float = 60.0
    synthetic_run_duration_noise: float = 0.1
    # GPUs per job for synthetic classes: (count, weight) pairs.
    synthetic_gpu_counts: tuple[tuple[int, float], ...] = ((1, 0.90), (2, 0.04), (4, 0.03), (8, 0.03))
    # GPU share of single-GPU synthetic classes in milli-GPU, weights after the openb default
    # trace's counts (1000: 3986, 810: 1078, 470: 750, 320: 328, 650: 253, 230: 140, 460: 128, ...).
    synthetic_gpu_milli: tuple[tuple[int, float], ...] = (
        (1000, 0.57), (810, 0.155), (470, 0.107), (320, 0.047), (650, 0.036), (230, 0.02),
        (460, 0.018), (590, 0.011), (160, 0.011), (550, 0.01), (220, 0.009), (110, 0.006))
    # QoS tiers of synthetic classes: (high, normal, low) weights.
    synthetic_qos_weights: tuple[float, float, float] = (0.2, 0.5, 0.3)


@dataclass(frozen=True)
class SchedulerConfig:
    """Model of Slurm's scheduling (select/cons_tres + sched/backfill + priority/multifactor)."""

    gpus_per_node: int = 8
    bf_interval_s: float = 30.0
    bf_max_job_test: int = 500
    weight_age: float = 1000.0
    max_age_s: float = 7 * DAY_S
    weight_qos: float = 10000.0
    # A job that failed out of memory is resubmitted (by its user) up to this many attempts.
    max_attempts: int = 3
    # Host memory available per GPU for bytes kept off the device (swapaware / oracle).
    host_swap_bytes_per_gpu: int = 160 * GIB
    # Utilisation samples kept for the plots.
    timeline_points: int = 400


# Named fits of the UTIL model's (knee_base, knee_slope) to measured co-located pairs
# (bench/interference_sources.py prints them; docs/model.md, "Interference: two sources"):
# gavel: loaders' fit_knee to Gavel's 636 V100 pairs (no utilisations recorded; assumption: solo
#   utilisations ~ U[0, 1]); quantile rms 0.097. On Lucid's pairs: MAE 0.558, mean 1.64 vs 1.09.
# lucid: interference_fit.fit_pairs to Lucid's 1,388 pairs (2,776 jobs, measured solo
#   utilisations): MAE 0.086, Spearman 0.57. On Gavel's pairs: quantile MAE 0.81, mean 1.10 vs 1.91.
INTERFERENCE_FITS: dict[str, tuple[float, float]] = {"gavel": (0.58, 2.9), "lucid": (0.025, 0.515)}


@dataclass(frozen=True)
class InterferenceConfig:
    """Compute interference of co-located jobs, fitted to measured pairs (INTERFERENCE_FITS)."""

    model: InterferenceModel = InterferenceModel.UTIL
    # Which fit knee_base / knee_slope hold: a name in INTERFERENCE_FITS (a sim config that names
    # one and leaves knee_* out gets its values) or "custom" (knee_* as given).
    fit: str = "gavel"
    # Which Gavel worker type to calibrate from; "" or a missing file -> per_corunner below.
    gavel_worker: str = "v100"
    # Used when no Gavel data is given (the core's default).
    per_corunner: float = 0.15
    # UTIL model: slowdown = 1 + knee_base x (co-runners' summed solo utilisation)
    #   + knee_slope x max(0, the GPU's summed solo utilisation - 1).
    # Default: the "gavel" fit, interference_fit.fit_knee(gavel_pair_slowdowns(shared/data/gavel,
    # "v100")) (636 pairs; assumption: Gavel job types' solo utilisation ~ U[0, 1], fitted
    # util_lo = 0); the runner refits it and records the fit in the results.
    knee_base: float = INTERFERENCE_FITS["gavel"][0]
    knee_slope: float = INTERFERENCE_FITS["gavel"][1]
    # Where a job class's solo utilisation comes from: "duty" draws it from util_quantiles;
    # "declared" takes the declared GPU share (gpu_milli / 1000).
    util_source: str = "duty"
    # (probability, utilisation) points of the per-container mean GPU duty cycle measured in
    # alibaba-v2026-genai (76 containers; python -m policy_service.sim.memfit, "duty"; deciles).
    util_quantiles: tuple[tuple[float, float], ...] = (
        (0.0, 0.0002), (0.1, 0.0062), (0.2, 0.053), (0.3, 0.056), (0.4, 0.0576), (0.5, 0.0586),
        (0.6, 0.0597), (0.7, 0.0624), (0.8, 0.098), (0.9, 0.1222), (1.0, 0.2787))


@dataclass(frozen=True)
class NodeConfig:
    """What a node enforces. hard_caps: a shared job's GPU memory is capped at what it was charged
    (its shards; an oversubscribed job: its sized need): growing past it fails that job alone.
    Without hard caps a job takes memory from the GPU's free pool and whichever plain (non-managed)
    job allocates when the device is full fails (under swapaware/oracle the excess goes to host
    memory instead, up to host_swap_bytes_per_gpu)."""

    hard_caps: bool = False


@dataclass(frozen=True)
class BaselineConfig:
    # B1 naive sharing: every single-GPU job gets this many shards (0 -> half a GPU's shards).
    naive_shards: int = 0


@dataclass(frozen=True)
class SimConfig:
    memory: MemoryModelConfig = field(default_factory=MemoryModelConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    interference: InterferenceConfig = field(default_factory=InterferenceConfig)
    baselines: BaselineConfig = field(default_factory=BaselineConfig)
    node: NodeConfig = field(default_factory=NodeConfig)

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(dataclasses.asdict(self))


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def _coerce(where: str, typ: Any, raw: Any) -> Any:
    origin = typing.get_origin(typ)
    try:
        if isinstance(typ, type) and issubclass(typ, enum.Enum):
            return typ(str(raw).lower())
        if origin is tuple:
            args = typing.get_args(typ)
            items = list(raw)
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(_coerce(where, args[0], v) for v in items)
            if len(items) != len(args):
                raise ConfigError(f"{where}: expected {len(args)} values, got {len(items)}")
            return tuple(_coerce(where, a, v) for a, v in zip(args, items))
        if typ is bool:
            return bool(raw)
        if typ is int:
            return int(raw)
        if typ is float:
            return float(raw)
        if typ is str:
            return str(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {raw!r} is not valid: {exc}") from None
    raise ConfigError(f"{where}: unsupported type {typ}")


def _with_named_fit(values: dict[str, Any]) -> dict[str, Any]:
    """[interference] naming a fit takes its knee_base / knee_slope where they are not given."""
    if "fit" not in values and ("knee_base" in values or "knee_slope" in values):
        return {"fit": "custom", **values}  # a config written before the named fits
    fit = str(values.get("fit", InterferenceConfig.fit))
    if fit in INTERFERENCE_FITS:
        base, slope = INTERFERENCE_FITS[fit]
        return {"knee_base": base, "knee_slope": slope, **values}
    return values


def with_interference_fit(cfg: SimConfig, fit: str) -> SimConfig:
    """``cfg`` with the UTIL model's parameters of a named fit (INTERFERENCE_FITS)."""
    if fit not in INTERFERENCE_FITS:
        raise ConfigError(f"unknown interference fit {fit!r}; one of: {', '.join(INTERFERENCE_FITS)}")
    base, slope = INTERFERENCE_FITS[fit]
    out = dataclasses.replace(cfg, interference=dataclasses.replace(cfg.interference, fit=fit, knee_base=base,
                                                                    knee_slope=slope))
    validate_sim_config(out)
    return out


def sim_config_from_mapping(data: Mapping[str, Any]) -> SimConfig:
    """Build a SimConfig from a mapping ``{section: {key: value}}`` (e.g. parsed TOML)."""
    hints = typing.get_type_hints(SimConfig)
    unknown = sorted(set(data) - set(hints))
    if unknown:
        raise ConfigError(f"sim config: unknown section(s) {', '.join(unknown)}; known: {', '.join(sorted(hints))}")
    built = {}
    for name, cls in hints.items():
        values = dict(data.get(name, {}))
        if name == "interference":
            values = _with_named_fit(values)
        sec_hints = typing.get_type_hints(cls)
        bad = sorted(set(values) - set(sec_hints))
        if bad:
            raise ConfigError(f"sim config [{name}]: unknown key(s) {', '.join(bad)}; known: {', '.join(sorted(sec_hints))}")
        built[name] = cls(**{k: _coerce(f"{name}.{k}", sec_hints[k], v) for k, v in values.items()})
    cfg = SimConfig(**built)
    validate_sim_config(cfg)
    return cfg


def load_sim_config(path: Path | None) -> SimConfig:
    if path is None:
        return SimConfig()
    try:
        data = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return sim_config_from_mapping(data)


def validate_sim_config(cfg: SimConfig) -> None:
    m, w, s = cfg.memory, cfg.workload, cfg.scheduler
    checks = [
        (m.ratio_median > 0 and m.ratio_sigma >= 0, "memory.ratio_median must be > 0, ratio_sigma >= 0"),
        (0 < m.ratio_min <= m.ratio_max, "memory.ratio_min must be in (0, ratio_max]"),
        (0 <= m.run_noise < 1, "memory.run_noise must be in [0, 1)"),
        (0 <= m.shift_prob <= 1, "memory.shift_prob must be in [0, 1]"),
        (0 < m.shift_min <= m.shift_max, "memory.shift_min must be in (0, shift_max]"),
        (0 < m.init_frac <= 1, "memory.init_frac must be in (0, 1]"),
        (0 <= m.grow_prob <= 1 and m.log_growth_sigma >= 0, "memory.grow_prob must be in [0, 1], log_growth_sigma >= 0"),
        (0 <= m.run_jump_prob <= 1 and m.run_sigma_small >= 0 and m.run_sigma_jump >= 0,
         "memory.run_jump_prob must be in [0, 1], run sigmas >= 0"),
        (0 <= m.growth_at_work_frac < 1, "memory.growth_at_work_frac must be in [0, 1)"),
        (0 <= m.managed_frac <= 1, "memory.managed_frac must be in [0, 1]"),
        (0 < m.max_peak_frac_of_device <= 1, "memory.max_peak_frac_of_device must be in (0, 1]"),
        (sum(m.access_weights) > 0 and min(m.access_weights) >= 0, "memory.access_weights must be >= 0, not all 0"),
        (w.runs_per_class >= 1, "workload.runs_per_class must be >= 1"),
        (w.classes_per_user >= 1 and w.users_per_account >= 1, "workload.classes_per_user/users_per_account >= 1"),
        (1 <= w.time_limit_factor_min <= w.time_limit_factor_max, "workload.time_limit_factor_min must be in [1, max]"),
        (s.gpus_per_node >= 1, "scheduler.gpus_per_node must be >= 1"),
        (s.bf_interval_s > 0, "scheduler.bf_interval_s must be > 0"),
        (s.max_attempts >= 1, "scheduler.max_attempts must be >= 1"),
        (s.max_age_s > 0, "scheduler.max_age_s must be > 0"),
        (cfg.interference.per_corunner >= 0, "interference.per_corunner must be >= 0"),
        (cfg.interference.knee_base >= 0 and cfg.interference.knee_slope >= 0, "interference.knee_* must be >= 0"),
        (cfg.interference.fit == "custom" or INTERFERENCE_FITS.get(cfg.interference.fit) == (
            cfg.interference.knee_base, cfg.interference.knee_slope),
         f"interference.fit must be custom or one of {', '.join(INTERFERENCE_FITS)} with its knee_base/knee_slope "
         f"{INTERFERENCE_FITS.get(cfg.interference.fit)} (other values: fit = \"custom\")"),
        (cfg.interference.util_source in ("duty", "declared"), "interference.util_source must be duty or declared"),
        (len(cfg.interference.util_quantiles) >= 2 and all(0 <= p <= 1 and 0 <= u <= 1 for p, u in
                                                           cfg.interference.util_quantiles),
         "interference.util_quantiles: at least two (probability, utilisation) points in [0, 1]"),
        (cfg.baselines.naive_shards >= 0, "baselines.naive_shards must be >= 0"),
    ]
    errors = [msg for ok, msg in checks if not ok]
    if errors:
        raise ConfigError("; ".join(errors))
