"""The sections of swapaware's one configuration: enums and frozen dataclasses with their
defaults (how they are read and validated: ``policy_service.config.load``)."""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policy_service.trust.auth_config import AuthConfig, TlsConfig, bool_spelling
from policy_service.history.config import HistoryConfig

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
    # Wider keys (account, partition) are only used with at least this many samples (another
    # user's counting at most this - 1), and another user's peak counts at most wide_key_user_cap
    # x the largest peak of the rest of the key (core/wide_key.py).
    wide_key_min_samples: int = 5
    wide_key_user_cap: float = 1.5
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
    # Tell the submitting user, on sbatch/srun's stderr, when a request was rewritten to shards
    # (slurm.log_user). Off: users see exactly what they see without swapaware (scripts that
    # capture `sbatch --parsable ... 2>&1` get the job id alone); the rewrite is in the
    # AdminComment and `swapaware explain`.
    tell_users: bool = False


@dataclass(frozen=True)
class ServiceConfig:
    # Port 455: privileged (< 1024), so no user of the host can take it while the service restarts
    # (docs/admin-guide.md, "The service's port"); the systemd unit gives CAP_NET_BIND_SERVICE.
    grpc_address: str = "127.0.0.1:455"
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
    # Decisions are checked against the AdminComments Slurm holds (slurm/reconcile.py) every
    # reconcile_s, those made between reconcile_window_s and reconcile_settle_s ago.
    reconcile_s: float = 300.0
    reconcile_window_s: float = 86400.0
    reconcile_settle_s: float = 600.0
    # host:port of the Prometheus endpoint (/metrics, policy_service/serving/metrics.py); empty: not served.
    metrics_address: str = ""


@dataclass(frozen=True)
class AdmissionConfig:
    """The admission table (docs/admission-table.md): the service publishes what it would decide,
    and the job_submit plugin decides from it without asking (admission/publish.py)."""

    # Where the class table is written (the queue gate beside it, "<table_path>.gate"). "auto":
    # admission.json beside service.socket_path, where the job_submit plugin reads it by default
    # (swapaware_plugin.conf table=auto, beside its socket=). Empty: no table is published and every
    # job takes the Admit round trip. Read it as Config.table_path.
    table_path: str = "auto"
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

    service_address: str = "127.0.0.1:455"  # service.grpc_address's port
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
    # The agent delivers the hooks' spooled events itself (slurm_plugin/hooks/replayer.py): it looks at
    # hooks.spool_dir every replay_interval_s; while the service cannot take them, the wait doubles
    # up to replay_max_backoff_s (with jitter).
    replay: bool = True
    replay_interval_s: float = 5.0
    replay_max_backoff_s: float = 30.0
    # host:port of the agent's Prometheus endpoint (slurm_plugin/agent/metrics.py); empty: not served.
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

    @property
    def table_path(self) -> str:
        """[admission] table_path with "auto" resolved (beside the socket); "": no table."""
        if self.admission.table_path == "auto":
            return str(Path(self.service.socket_path).parent / "admission.json")
        return self.admission.table_path

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
