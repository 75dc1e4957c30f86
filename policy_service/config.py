"""The one typed configuration of swapaware: TOML file + environment overrides.

Every component (service, hooks, node agent, simulator) reads this same object. It is
validated once at start and logged once (``Config.summary()``).

Sources, later wins:
  1. defaults below;
  2. the TOML file named by ``--config`` / ``SWAPAWARE_CONFIG`` (default
     ``/etc/swapaware/swapaware.toml`` when it exists);
  3. environment variables ``SWAPAWARE_<SECTION>__<KEY>`` (e.g. ``SWAPAWARE_SERVICE__DB_PATH``).
"""
from __future__ import annotations

import dataclasses
import enum
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from policy_service.auth_config import (AuthConfig, MungeMode, TlsConfig, auth_errors, bool_spelling,  # noqa: F401
                                       tls_errors, token_mode_error)
from policy_service.core.dialect import is_release
from policy_service.history_config import HistoryBackend, HistoryConfig, history_errors  # noqa: F401

GIB = 1024**3
DEFAULT_CONFIG_PATH = Path("/etc/swapaware/swapaware.toml")


class ConfigError(ValueError):
    """Raised for a configuration that cannot be used; the message says which key and why."""


class UnsafeTokenFile(ConfigError):
    """A token file that others may read (or that is not a file): never used."""


class LinkKind(enum.Enum):
    """Host link between GPU memory and host memory (where swapped bytes travel)."""

    PCIE_GEN4 = "pcie_gen4"
    PCIE_GEN5 = "pcie_gen5"
    NVLINK_C2C = "nvlink_c2c"


class AccessClass(enum.Enum):
    """How a job touches its working set; decides what swapping costs it."""

    STREAMING = "streaming"  # cyclic sweeps over the working set (training loops)
    RANDOM = "random"  # scattered accesses (embeddings, graph workloads)
    COMPUTE_BOUND = "compute_bound"  # small hot set, long kernels


class SlurmBackend(enum.Enum):
    AUTO = "auto"
    CLI = "cli"
    PYSLURM = "pyslurm"


class NvmlBackend(enum.Enum):
    AUTO = "auto"  # real NVML when it initialises, else none
    NVML = "nvml"
    FAKE = "fake"  # file-backed stateful fake (tests, dev cluster without GPUs)
    NONE = "none"


class Enforcement(enum.Enum):
    """How the TaskProlog fences a shared (shard) job's GPU memory (slurm_plugin/task_prolog.py)."""

    NONE = "none"
    FRAMEWORK_ENV = "framework_env"  # framework allocator settings (TF growth, JAX fraction) + advisory cap
    MPS = "mps"  # framework_env + CUDA MPS per-client pinned memory limit (needs an MPS control daemon)
    HAMI = "hami"  # HAMi-core / SoftMig-compatible preloaded library limit (site installs libvgpu.so)
    NVML_CGROUP = "nvml-cgroup"  # cgroup v2 dmem max/low (kernel 6.14+, driver r615+): hard cap + victim
    AUTO = "auto"  # the strongest of nvml-cgroup, hami, mps the node has; else framework_env (advisory)


class Oversubscription(enum.Enum):
    """policy.allow_oversubscription: auto (only where every node that reported enforces victim
    semantics, slurm_plugin/enforce), true (always: the admin knows the jobs use managed memory),
    false (never). Booleans are accepted in any TOML / environment spelling."""

    AUTO = "auto"
    ON = "true"
    OFF = "false"

    @classmethod
    def _missing_(cls, value: object) -> "Oversubscription | None":
        return {True: cls.ON, False: cls.OFF}.get(bool_spelling(value))


class PolicyMode(enum.Enum):
    """policy.mode: enforce (decisions change jobs), shadow (every job decided and recorded, its
    AdminComment says what would have been done, nothing else about the job changes), off (jobs
    pass unchanged, nothing recorded). Changed live with SIGHUP (`systemctl reload swapaware`)."""

    ENFORCE = "enforce"
    SHADOW = "shadow"
    OFF = "off"


class WholeGpuAsShards(enum.Enum):
    """policy.whole_gpu_as_shards: auto (where the running Slurm has the gpu-beside-shard bug),
    true or false. Booleans are accepted in any TOML / environment spelling."""

    AUTO = "auto"
    ON = "true"
    OFF = "false"

    @classmethod
    def _missing_(cls, value: object) -> "WholeGpuAsShards | None":
        return {True: cls.ON, False: cls.OFF}.get(bool_spelling(value))


@dataclass(frozen=True)
class GpuConfig:
    """The GPUs of the (homogeneous) partition the policy sizes shards for."""

    memory_bytes: int = 80 * GIB
    shards_per_gpu: int = 8
    link: LinkKind = LinkKind.PCIE_GEN5

    @property
    def shard_bytes(self) -> int:
        return self.memory_bytes // self.shards_per_gpu


@dataclass(frozen=True)
class EstimatorConfig:
    # Weight of the newest observation in the class's moving averages.
    ewma_alpha: float = 0.3
    # Margin floor as a fraction of the predicted peak.
    min_margin_frac: float = 0.10
    # Margin in units of the class's mean absolute deviation.
    deviation_k: float = 3.0
    # While a class has fewer than cold_samples observations its deviation is not known yet:
    # the margin is at least cold_margin_frac of the peak.
    cold_margin_frac: float = 0.25
    cold_samples: int = 3
    # After an OOM of a shared job: multiply the class's margin by this (compounds, capped).
    oom_margin_multiplier: float = 1.5
    max_margin_multiplier: float = 4.0
    # After an OOM of a shared job: this many next runs of the class get a whole GPU.
    oom_whole_gpu_runs: int = 2
    # A shared run that failed after using this fraction of its charged shards counts as OOM.
    oom_charge_frac: float = 0.95
    # Wider keys (account, partition) are only used with at least this many samples.
    wide_key_min_samples: int = 5
    # Minimum samples for the exact class / user+name keys. 3 and quantile_floor_frac 0.55: the
    # point of the measured operating curve with the most GPU-hours saved less lost to requeues
    # among those with <= 1 % of shared runs requeued (bench/operating_curve.py, docs/model.md).
    min_samples: int = 3
    # Quantile margin (docs/model.md, estimator): a class keeps its last recent_runs runs' ratios
    # peak / point estimate; with at least quantile_min_runs of them the charge is the point
    # estimate times the conformal margin_quantile of those ratios (the ceil((n+1)q)-th smallest,
    # the largest when n is too small for q), at least (1 + quantile_floor_frac) x the estimate,
    # and the observed maximum is that of the recent runs only. 0 recent_runs: EWMA + k x dev.
    recent_runs: int = 24
    quantile_min_runs: int = 4
    margin_quantile: float = 0.95
    quantile_floor_frac: float = 0.55
    # Each run that did not over-run its charge divides the OOM margin multiplier by this
    # (never below 1): the penalty fades after the class is sized right again. 1: never fades.
    margin_multiplier_decay: float = 1.25


@dataclass(frozen=True)
class SwapCostConfig:
    """Parameters of the swap-cost model. Sources: docs/model.md."""

    # Effective host<->device bandwidth per link kind (bytes/s), one direction.
    pcie_gen4_bytes_per_s: float = 25e9
    pcie_gen5_bytes_per_s: float = 50e9
    nvlink_c2c_bytes_per_s: float = 400e9
    # Cost of one demand-paging fault batch (s) and the bytes it brings.
    fault_latency_s: float = 30e-6
    fault_granularity_bytes: int = 64 * 1024
    # Compute interference when jobs merely share SMs (no oversubscription), per co-runner.
    # Superseded by the utilisation knee below (swapcost.compute_slowdown); kept for the
    # simulator's legacy COUNT/DEMAND interference models.
    compute_interference_per_corunner: float = 0.15
    # Utilisation knee (swapcost.interference_slowdown): a job with solo utilisation u next to
    # co-runners summing v is slowed 1 + base x v + knee_slope x max(0, u + v - 1). Fitted to
    # Gavel's V100 pairs (policy_service.sim.loaders.fit_knee: base 0.58, slope 2.9, quantile
    # rms 0.097; docs/simulation.md). default_solo_util: a job with no learned utilisation.
    compute_interference_base: float = 0.58
    compute_interference_knee_slope: float = 2.9
    default_solo_util: float = 0.5
    # Default traffic intensity: how many times per second a job sweeps its working set.
    default_sweeps_per_s: float = 2.0
    default_working_set_frac: float = 0.8
    default_access_class: AccessClass = AccessClass.STREAMING

    def link_bytes_per_s(self, link: LinkKind) -> float:
        return {
            LinkKind.PCIE_GEN4: self.pcie_gen4_bytes_per_s,
            LinkKind.PCIE_GEN5: self.pcie_gen5_bytes_per_s,
            LinkKind.NVLINK_C2C: self.nvlink_c2c_bytes_per_s,
        }[link]


@dataclass(frozen=True)
class PolicyConfig:
    # enforce | shadow | off (PolicyMode); the one setting a running service re-reads on SIGHUP.
    mode: PolicyMode = PolicyMode.ENFORCE
    enable_sharing: bool = True
    # Hold a whole-GPU decision for a single-GPU job as all shards of one GPU: on Slurm 22.05 a
    # gpu job can be placed on a GPU whose shards are in use, a job holding every shard cannot.
    # auto: only on releases with that bug (SlurmDialect.gpu_beside_shard_bug); true; false.
    whole_gpu_as_shards: WholeGpuAsShards = WholeGpuAsShards.AUTO
    # Charge fewer shards than the predicted peak only when the predicted slowdown of the
    # job, as designated victim, stays within this budget, and (auto) only when the nodes enforce
    # victim semantics: every node that reported its enforcement within enforcement_max_age_s says
    # so (soft limits with eviction first, nvml-cgroup). true / false: always / never.
    allow_oversubscription: Oversubscription = Oversubscription.AUTO
    enforcement_max_age_s: float = 3600.0
    max_victim_slowdown: float = 1.25
    # Priority: site_factor = round(scale * contention_degree), clamped to [0, max].
    site_factor_scale: float = 1000.0
    site_factor_max: int = 1000
    # Contention degree is only learned from at least this many shared and solo runs.
    contention_min_runs: int = 1
    # Share only while GPU work waits: when the pending GPU jobs ask for less than this
    # fraction of the cluster's GPUs, a job that would start at once keeps its whole GPU
    # (sharing then only adds compute interference). 0 shares regardless of the queue.
    share_min_queue: float = 0.05
    # Count only the pending jobs ahead of a job of a given --qos (QoS priority at least its
    # own; Slurm starts those first). false: every job sees the whole queue (more sharing of
    # high-QoS jobs, more throughput when the cluster is overloaded).
    queue_per_qos: bool = True
    # Charge a shared job at least its learned solo GPU utilisation in shards
    # (ceil(util x shards_per_gpu)), so the jobs on a GPU ask for no more than its compute.
    compute_aware: bool = True
    # ...except while the pending GPU jobs ask for at least this fraction of the cluster's GPUs:
    # then waiting costs more than co-runners' interference and jobs are sized by memory alone.
    # 0 never overcommits compute.
    overcommit_compute_min_queue: float = 1.0
    # Re-decide pending jobs that were kept whole (nothing known yet, short queue, ...) once
    # what the policy knows, or the queue, changed, and rewrite them to shards while they still
    # wait (scontrol update TresPerNode + AdminComment). It helps most when bursts of new jobs
    # queue, and costs a little when the queue is short (docs/simulation.md). At most
    # redecide_max_per_poll jobs per queue poll (one scontrol show + update each).
    redecide_pending: bool = True
    redecide_max_per_poll: int = 20
    # A shared job that ends out of GPU memory is requeued once on a whole GPU (Slurm's requeue:
    # batch jobs that allow it; --no-requeue, JobRequeue=0 and interactive jobs fail as before,
    # the reason in their AdminComment). Off: every such job fails as before.
    requeue_after_oom: bool = True
    # QoS names whose jobs always keep whole GPUs (no co-runner can slow them down).
    whole_gpu_qos: tuple[str, ...] = ()
    # How often the service reads the pending GPU jobs from Slurm; a snapshot older than three
    # periods counts as unknown (the queue rule is then skipped, with a reason).
    queue_poll_s: float = 15.0
    # Admin comment length cap (Slurm stores it as text; keep sacct output readable).
    admin_comment_max_chars: int = 400


@dataclass(frozen=True)
class ServiceConfig:
    grpc_address: str = "127.0.0.1:50551"
    socket_path: Path = Path("/run/swapaware/policy.sock")
    db_path: Path = Path("/var/lib/swapaware/history.sqlite3")
    log_level: str = "INFO"
    slurm_backend: SlurmBackend = SlurmBackend.AUTO
    # Bound on concurrent gRPC handler threads.
    max_workers: int = 16
    # Deadline for each Slurm CLI call the service makes (job id -> decision lookups).
    slurm_timeout_s: float = 5.0
    # The controller's slurm.conf, read for the partitions' DefCpuPerGPU / DefMemPerGPU (a GPU job
    # of such a partition keeps its request). "": $SLURM_CONF, else /etc/slurm/slurm.conf.
    slurm_conf: str = ""
    # File holding a shared secret; when set, JobStarted/JobFinished over gRPC must carry it
    # ("authorization: Bearer <secret>"), so only the nodes' hooks can feed the model.
    # Empty: no check (single-node setups, gRPC bound to 127.0.0.1).
    token_file: str = ""
    # The running Slurm's release ("24.11"), for hosts where `scontrol --version` does not work
    # (no scontrol, no slurm.conf). Empty: ask scontrol at start.
    slurm_release: str = ""
    # A run whose JobFinished never came (node died, epilog never ran) stops counting as a co-runner
    # this long after its start (sooner where its decision's facts give a time limit: limit + 1 h).
    open_run_max_s: float = 7 * 86400.0
    # Each decision is journaled beside the history before Admit answers (it survives a crash of
    # the service); true adds an fdatasync per decision, so that it survives a power loss too.
    journal_fsync: bool = False
    # How often the service checks that its history file is still there (and restores it).
    history_check_s: float = 10.0
    # Decisions are checked against the AdminComments Slurm holds (adapters/reconcile.py) every
    # reconcile_s, those made between reconcile_window_s and reconcile_settle_s ago.
    reconcile_s: float = 300.0
    reconcile_window_s: float = 86400.0
    reconcile_settle_s: float = 600.0
    # host:port of the Prometheus endpoint (/metrics, policy_service/metrics.py); empty: not served.
    metrics_address: str = ""


@dataclass(frozen=True)
class AdmissionConfig:
    """The admission table (docs/admission-table.md): the service publishes what it would decide,
    and the job_submit plugin decides from it without asking (adapters/admission_publish.py)."""

    # Where the class table is written (the queue gate beside it, "<table_path>.gate"). Empty: no
    # table is published and every job takes the Admit round trip.
    table_path: str = ""
    # The class table is rebuilt at most this often, when anything it depends on changed.
    refresh_s: float = 30.0
    # A class table older than this is never used by the plugin (it is re-published sooner).
    valid_s: float = 300.0
    # Keys of the decisions recorded in this last period are published ...
    horizon_s: float = 604800.0
    # ... the newest first, at most this many.
    max_entries: int = 100000
    # Published versions kept for catch-up (at least; each is also kept valid_s +
    # service.reconcile_window_s after it was last published).
    archive_keep: int = 20


@dataclass(frozen=True)
class HookConfig:
    """Prolog / epilog: where the service is, how long to wait, where to spool."""

    service_address: str = "127.0.0.1:50551"
    deadline_s: float = 2.0
    spool_dir: Path = Path("/var/spool/swapaware")
    agent_socket: Path = Path("/run/swapaware/agent.sock")
    agent_timeout_s: float = 1.0
    # Replay at most this many spooled events per hook run (bounded work in the hook).
    replay_batch: int = 50
    # The service's shared secret (same file content as service.token_file); empty: none.
    token_file: str = ""


@dataclass(frozen=True)
class AgentConfig:
    socket_path: Path = Path("/run/swapaware/agent.sock")
    sample_period_s: float = 1.0
    nvml_backend: NvmlBackend = NvmlBackend.AUTO
    fake_nvml_dir: Path = Path("/var/lib/swapaware/fake-nvml")
    enforcement: Enforcement = Enforcement.AUTO
    # enforcement = hami: HAMi-core's library (preloaded through LD_PRELOAD unless hami_preload =
    # false, e.g. where /etc/ld.so.preload does it), its shared usage cache directory, and where the
    # prolog writes a root-owned per-job limit file (SoftMig-style; empty: none).
    hami_library: Path = Path("/usr/local/vgpu/libvgpu.so")
    hami_cache_dir: Path = Path("/tmp/vgpu")
    hami_config_dir: str = ""
    hami_preload: bool = True
    # enforcement = nvml-cgroup: the cgroup v2 mount and the job's cgroup below it.
    cgroup_root: Path = Path("/sys/fs/cgroup")
    job_cgroup: str = "system.slice/slurmstepd.scope/job_{job_id}"
    # CUDA_MPS_PIPE_DIRECTORY of the site's nvidia-cuda-mps-control daemon (enforcement = mps).
    mps_pipe_dir: Path = Path("/tmp/nvidia-mps")
    # The agent delivers the hooks' spooled events itself (slurm_plugin/replayer.py): it looks at
    # hooks.spool_dir every replay_interval_s; while the service cannot take them, the wait doubles
    # up to replay_max_backoff_s (with jitter).
    replay: bool = True
    replay_interval_s: float = 5.0
    replay_max_backoff_s: float = 30.0
    # host:port of the agent's Prometheus endpoint (slurm_plugin/agent_metrics.py); empty: not served.
    metrics_address: str = ""


@dataclass(frozen=True)
class HaConfig:
    """Two controllers, one history (docs/ha.md): a service on each controller host, the one whose
    slurmctld is in control writes, fenced by the store's writer lease."""

    enabled: bool = False
    # This service's name in the lease; "": the host name.
    holder: str = ""
    # A lease not renewed for this long is free for the other service; renewed every renew_s.
    lease_ttl_s: float = 10.0
    renew_s: float = 2.0
    # host:port of every controller host's service (hooks, agents, the CLI try them in turn); empty:
    # hooks.service_address alone.
    controllers: tuple[str, ...] = ()
    # Written by `swapaware ha primary-on|primary-off` (SlurmctldPrimaryOnProg / OffProg).
    role_file: Path = Path("/run/swapaware/role")


@dataclass(frozen=True)
class Config:
    gpu: GpuConfig = field(default_factory=GpuConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    swap_cost: SwapCostConfig = field(default_factory=SwapCostConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    service: ServiceConfig = field(default_factory=ServiceConfig)
    hooks: HookConfig = field(default_factory=HookConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    ha: HaConfig = field(default_factory=HaConfig)
    history: HistoryConfig = field(default_factory=HistoryConfig)
    source: str = "defaults"

    def summary(self) -> str:
        """One line per section, for the start-up log."""
        parts = [f"config source: {self.source}"]
        for f in dataclasses.fields(self):
            if f.name == "source":
                continue
            section = getattr(self, f.name)
            items = ", ".join(f"{k.name}={_show(getattr(section, k.name))}" for k in dataclasses.fields(section))
            parts.append(f"[{f.name}] {items}")
        return "\n".join(parts)


def _show(value: Any) -> str:
    return value.value if isinstance(value, enum.Enum) else str(value)


def _coerce(section: str, key: str, typ: Any, raw: Any) -> Any:
    where = f"{section}.{key}"
    try:
        if isinstance(typ, type) and issubclass(typ, enum.Enum):
            try:
                return typ(str(raw).lower())
            except ValueError:
                allowed = ", ".join(m.value for m in typ)
                raise ConfigError(f"{where}: {raw!r} is not one of: {allowed}") from None
        if typ is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{where}: {raw!r} is not a boolean")
        if typ is int:
            if isinstance(raw, bool):
                raise ConfigError(f"{where}: expected an integer, got a boolean")
            return int(raw)
        if typ is float:
            return float(raw)
        if typ is Path:
            return Path(str(raw))
        if typ is str:
            return str(raw)
        if typing.get_origin(typ) is tuple:  # tuple[str, ...]: a TOML list or "a,b" in the environment
            items = raw if isinstance(raw, (list, tuple)) else str(raw).split(",")
            return tuple(str(x).strip() for x in items if str(x).strip())
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {raw!r} is not a valid {getattr(typ, '__name__', typ)}: {exc}") from None
    raise ConfigError(f"{where}: unsupported type {typ}")


def _build_section(name: str, cls: type, values: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"[{name}]: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**{k: _coerce(name, k, hints[k], v) for k, v in values.items()})


def _validate(cfg: Config) -> None:
    checks = [
        (cfg.gpu.memory_bytes > 0, "gpu.memory_bytes must be > 0"),
        (1 <= cfg.gpu.shards_per_gpu <= 1024, "gpu.shards_per_gpu must be in 1..1024"),
        (0 < cfg.estimator.ewma_alpha <= 1, "estimator.ewma_alpha must be in (0, 1]"),
        (cfg.estimator.min_margin_frac >= 0, "estimator.min_margin_frac must be >= 0"),
        (cfg.estimator.oom_margin_multiplier >= 1, "estimator.oom_margin_multiplier must be >= 1"),
        (cfg.estimator.max_margin_multiplier >= 1, "estimator.max_margin_multiplier must be >= 1"),
        (cfg.estimator.oom_whole_gpu_runs >= 0, "estimator.oom_whole_gpu_runs must be >= 0"),
        (0 < cfg.estimator.oom_charge_frac <= 1, "estimator.oom_charge_frac must be in (0, 1]"),
        (cfg.estimator.min_samples >= 1, "estimator.min_samples must be >= 1"),
        (0 <= cfg.estimator.cold_margin_frac <= 4, "estimator.cold_margin_frac must be in [0, 4]"),
        (cfg.estimator.cold_samples >= 0, "estimator.cold_samples must be >= 0"),
        (0 <= cfg.estimator.recent_runs <= 256, "estimator.recent_runs must be in 0..256"),
        (cfg.estimator.quantile_min_runs >= 1, "estimator.quantile_min_runs must be >= 1"),
        (0 < cfg.estimator.margin_quantile <= 1, "estimator.margin_quantile must be in (0, 1]"),
        (cfg.estimator.quantile_floor_frac >= 0, "estimator.quantile_floor_frac must be >= 0"),
        (cfg.estimator.margin_multiplier_decay >= 1, "estimator.margin_multiplier_decay must be >= 1"),
        (cfg.policy.max_victim_slowdown >= 1, "policy.max_victim_slowdown must be >= 1"),
        (0 <= cfg.policy.site_factor_max < 2**31 - 2, "policy.site_factor_max must fit Slurm's site factor"),
        (0 <= cfg.policy.share_min_queue <= 100, "policy.share_min_queue must be in [0, 100]"),
        (cfg.policy.queue_poll_s > 0, "policy.queue_poll_s must be > 0"),
        (cfg.policy.overcommit_compute_min_queue >= 0, "policy.overcommit_compute_min_queue must be >= 0"),
        (cfg.policy.redecide_max_per_poll >= 1, "policy.redecide_max_per_poll must be >= 1"),
        (cfg.policy.admin_comment_max_chars >= 80, "policy.admin_comment_max_chars must be >= 80"),
        (cfg.service.open_run_max_s > 0, "service.open_run_max_s must be > 0"),
        (cfg.service.history_check_s > 0, "service.history_check_s must be > 0"),
        (cfg.service.reconcile_s > 0, "service.reconcile_s must be > 0"),
        (cfg.service.reconcile_window_s > cfg.service.reconcile_settle_s >= 0,
         "service.reconcile_window_s must be > service.reconcile_settle_s >= 0"),
        (not cfg.service.metrics_address or _host_port(cfg.service.metrics_address),
         f"service.metrics_address must be host:port (e.g. 127.0.0.1:9851), not {cfg.service.metrics_address!r}"),
        (not cfg.agent.metrics_address or _host_port(cfg.agent.metrics_address),
         f"agent.metrics_address must be host:port (e.g. 0.0.0.0:9852), not {cfg.agent.metrics_address!r}"),
        (cfg.hooks.deadline_s > 0, "hooks.deadline_s must be > 0"),
        (cfg.admission.refresh_s > 0, "admission.refresh_s must be > 0"),
        (cfg.admission.valid_s > cfg.admission.refresh_s, "admission.valid_s must be > admission.refresh_s"),
        (cfg.admission.horizon_s > 0, "admission.horizon_s must be > 0"),
        (1 <= cfg.admission.max_entries <= 9_999_999, "admission.max_entries must be in 1..9999999"),
        (cfg.admission.archive_keep >= 1, "admission.archive_keep must be >= 1"),
        (0 < cfg.ha.renew_s * 2 <= cfg.ha.lease_ttl_s, "ha.renew_s must be > 0 and at most half of ha.lease_ttl_s"),
        (all(_host_port(a) for a in cfg.ha.controllers), f"ha.controllers must be host:port addresses, not {cfg.ha.controllers!r}"),
        (cfg.agent.sample_period_s > 0, "agent.sample_period_s must be > 0"),
        (0 < cfg.agent.replay_interval_s <= cfg.agent.replay_max_backoff_s,
         "agent.replay_interval_s must be > 0 and <= agent.replay_max_backoff_s"),
        (cfg.swap_cost.fault_granularity_bytes > 0, "swap_cost.fault_granularity_bytes must be > 0"),
        (cfg.service.max_workers >= 1, "service.max_workers must be >= 1"),
        (not cfg.service.slurm_release or is_release(cfg.service.slurm_release),
         f"service.slurm_release: {cfg.service.slurm_release!r} is not a Slurm release (use e.g. 24.11, or empty)"),
    ]
    errors = [msg for ok, msg in checks if not ok] + auth_errors(cfg.auth) + tls_errors(cfg.tls)
    errors += history_errors(cfg.history)
    if errors:
        raise ConfigError("; ".join(errors))


def read_token(path: str) -> str | None:
    """The shared secret in ``path`` (stripped), None when no file is configured. A file that
    group or others may read raises UnsafeTokenFile (the mode is that of the file opened)."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            unsafe = token_mode_error(path, os.fstat(f.fileno()).st_mode)
            if unsafe:
                raise UnsafeTokenFile(unsafe)
            token = f.read().decode().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"token file {path}: {exc}") from None
    if not token:
        raise ConfigError(f"token file {path} is empty")
    return token


def split_host_port(address: str) -> tuple[str, int]:
    """'127.0.0.1:9851' -> ('127.0.0.1', 9851); '[::1]:9851' too; ':9851' binds every address.
    ValueError when it is not host:port."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"address {address!r} is not host:port")
    return host.strip("[]") or "0.0.0.0", int(port)


def _host_port(address: str) -> bool:
    try:
        split_host_port(address)
    except ValueError:
        return False
    return True


def load_config(path: Path | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Build and validate the configuration. ``env`` defaults to ``os.environ``."""
    env = os.environ if env is None else env
    explicit = path or (Path(env["SWAPAWARE_CONFIG"]) if env.get("SWAPAWARE_CONFIG") else None)
    data: dict[str, Any] = {}
    source = "defaults"
    if explicit is not None:
        if not explicit.is_file():
            raise ConfigError(f"config file {explicit} does not exist")
        chosen: Path | None = explicit
    else:
        chosen = DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.is_file() else None
    if chosen is not None:
        try:
            data = tomllib.loads(chosen.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{chosen}: not valid TOML: {exc}") from None
        source = str(chosen)
    sections = {f.name: f for f in dataclasses.fields(Config) if f.name != "source"}
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise ConfigError(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(sorted(sections))}")
    merged: dict[str, dict[str, Any]] = {name: dict(data.get(name, {})) for name in sections}
    env_used = False
    for key, value in env.items():
        if not key.startswith("SWAPAWARE_") or "__" not in key:
            continue
        section, _, item = key[len("SWAPAWARE_"):].lower().partition("__")
        if section not in merged:
            raise ConfigError(f"{key}: unknown section {section!r}")
        merged[section][item] = value
        env_used = True
    built = {name: _build_section(name, typing.get_type_hints(Config)[name], merged[name]) for name in sections}
    cfg = Config(**built, source=source + (" + environment" if env_used else ""))
    _validate(cfg)
    return cfg
