"""The enum-valued settings of the configuration (link kinds, access classes, backends,
enforcement, oversubscription, policy mode, whole GPU as shards): what a key may say."""
from __future__ import annotations

import enum

from policy_service.trust.auth_config import bool_spelling


class Choice(enum.Enum):
    """An enum hashed by identity, in C: its members are singletons compared by identity (Enum
    defines no __eq__), and enum.Enum's own __hash__, hash(name) in Python, was a call per dict
    look-up (17 per Admit of KeyLevel alone)."""

    __hash__ = object.__hash__


class LinkKind(Choice):
    """Host link between GPU memory and host memory (where swapped bytes travel)."""

    PCIE_GEN4 = "pcie_gen4"
    PCIE_GEN5 = "pcie_gen5"
    NVLINK_C2C = "nvlink_c2c"


class AccessClass(Choice):
    """How a job touches its working set; decides what swapping costs it."""

    STREAMING = "streaming"  # cyclic sweeps over the working set (training loops)
    RANDOM = "random"  # scattered accesses (embeddings, graph workloads)
    COMPUTE_BOUND = "compute_bound"  # small hot set, long kernels


class SlurmBackend(Choice):
    AUTO = "auto"
    CLI = "cli"
    PYSLURM = "pyslurm"


class NvmlBackend(Choice):
    AUTO = "auto"  # real NVML when it initialises, else none
    NVML = "nvml"
    FAKE = "fake"  # file-backed stateful fake (tests, dev cluster without GPUs)
    NONE = "none"


class Enforcement(Choice):
    """How the TaskProlog fences a shared (shard) job's GPU memory (slurm_plugin/task_prolog.py)."""

    NONE = "none"
    FRAMEWORK_ENV = "framework_env"  # framework allocator settings (TF growth, JAX fraction) + advisory cap
    MPS = "mps"  # framework_env + CUDA MPS per-client pinned memory limit (needs an MPS control daemon)
    HAMI = "hami"  # HAMi-core / SoftMig-compatible preloaded library limit (site installs libvgpu.so)
    NVML_CGROUP = "nvml-cgroup"  # cgroup v2 dmem max/low (kernel 6.14+, driver r615+): hard cap + victim
    AUTO = "auto"  # the strongest of nvml-cgroup, hami, mps the node has; else framework_env (advisory)


class Oversubscription(Choice):
    """policy.allow_oversubscription: auto (only where every node that reported enforces victim
    semantics, slurm_plugin/enforce), true (always: the admin knows the jobs use managed memory),
    false (never). Booleans are accepted in any TOML / environment spelling."""

    AUTO = "auto"
    ON = "true"
    OFF = "false"

    @classmethod
    def _missing_(cls, value: object) -> "Oversubscription | None":
        return {True: cls.ON, False: cls.OFF}.get(bool_spelling(value))


class PolicyMode(Choice):
    """policy.mode: enforce (decisions change jobs), shadow (every job decided and recorded, its
    AdminComment says what would have been done, nothing else about the job changes), off (jobs
    pass unchanged, nothing recorded). Changed live with SIGHUP (`systemctl reload swapaware`)."""

    ENFORCE = "enforce"
    SHADOW = "shadow"
    OFF = "off"


class WholeGpuAsShards(Choice):
    """policy.whole_gpu_as_shards: auto (where the running Slurm has the gpu-beside-shard bug),
    true or false. Booleans are accepted in any TOML / environment spelling."""

    AUTO = "auto"
    ON = "true"
    OFF = "false"

    @classmethod
    def _missing_(cls, value: object) -> "WholeGpuAsShards | None":
        return {True: cls.ON, False: cls.OFF}.get(bool_spelling(value))
