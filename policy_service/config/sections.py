"""The sections of swapaware's one configuration: the service's, admission's, the hooks', the
agent's and HA's frozen dataclasses with their defaults, and ``Config`` that gathers every
section (the policy's sections: ``policy_sections``; the enums: ``choices``; how they are read
and validated: ``policy_service.config.load``)."""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policy_service.trust.auth_config import AuthConfig, TlsConfig
from policy_service.history.config import HistoryConfig
from policy_service.config.choices import Enforcement, NvmlBackend, SlurmBackend
from policy_service.config.policy_sections import (EstimatorConfig, GpuConfig, InterferenceConfig, PolicyConfig,
                                                   SwapCostConfig)

DEFAULT_CONFIG_PATH = Path("/etc/swapaware/swapaware.toml")


class ConfigError(ValueError):
    """Raised for a configuration that cannot be used; the message says which key and why."""


class UnsafeTokenFile(ConfigError):
    """A token file that others may read (or that is not a file): never used."""


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
    # The class table is rebuilt at most this often, when anything it depends on changed (a table
    # whose build is costly less often: builds take at most 2 % of a core, a change waiting at most
    # 30 s or refresh_s; admission/publish.py _build_every).
    refresh_s: float = 5.0
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
    interference: InterferenceConfig = field(default_factory=InterferenceConfig)
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
