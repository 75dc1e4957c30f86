"""Which backend fences this node's shared jobs: the configured one, or (auto) the strongest
the node has, advisory when none is."""
from __future__ import annotations

from policy_service.config import Config, Enforcement
from slurm_plugin.enforce import Backend, Capability
from slurm_plugin.enforce.advisory import AdvisoryBackend
from slurm_plugin.enforce.hami import HamiBackend
from slurm_plugin.enforce.mps import MpsBackend
from slurm_plugin.enforce.nvml_cgroup import NvmlCgroupBackend

AUTO_ORDER = (Enforcement.NVML_CGROUP, Enforcement.HAMI, Enforcement.MPS)


def backend_for(mode: Enforcement, cfg: Config, nvml_module=None) -> Backend:
    a = cfg.agent
    if mode is Enforcement.MPS:
        return MpsBackend(a.mps_pipe_dir)
    if mode is Enforcement.HAMI:
        return HamiBackend(a.hami_library, a.hami_cache_dir, a.hami_config_dir or None, a.hami_preload)
    if mode is Enforcement.NVML_CGROUP:
        return NvmlCgroupBackend(a.cgroup_root, a.job_cgroup, nvml_module)
    return AdvisoryBackend()


def choose(cfg: Config, nvml_module=None) -> tuple[Backend, Capability, list[Capability]]:
    """(backend, its capability, every capability looked at). An explicitly configured backend
    that is not available falls back to advisory (and says so): a cap that is not there is not
    claimed."""
    mode = cfg.agent.enforcement
    candidates = AUTO_ORDER if mode is Enforcement.AUTO else (
        (mode,) if mode in AUTO_ORDER else ())
    seen = []
    for m in candidates:
        b = backend_for(m, cfg, nvml_module)
        cap = b.detect()
        seen.append(cap)
        if cap.available:
            return b, cap, seen
    fallback = AdvisoryBackend()
    cap = fallback.detect()
    if mode is Enforcement.NONE:
        cap = Capability("none", True, False, False, "agent.enforcement = none: no fencing, not even advisory")
    return fallback, cap, seen + [cap]
