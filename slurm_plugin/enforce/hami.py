"""HAMi-core / SoftMig-compatible limit: a preloaded library (libvgpu.so) that the site installs.

Enforced: the library intercepts CUDA allocations and fails those beyond
``CUDA_DEVICE_MEMORY_LIMIT_<i>`` (HAMi-core's documented variables, "<MiB>m"); usage of the
processes on a device is kept in ``CUDA_DEVICE_MEMORY_SHARED_CACHE``. SoftMig (a HAMi-core fork
for Slurm) has its root prolog write a root-owned per-job limit file: its location and format were
not confirmed from its documentation here, so ``agent.hami_config_dir`` (empty: no file) and the
file's lines (the same NAME=value variables) are configurable; env alone is what HAMi-core reads.
Not enforced: a job that unsets LD_PRELOAD (unless the site preloads through /etc/ld.so.preload,
as SoftMig does) or calls the driver around the library; no victim semantics (nothing placed in
host memory by us). Detected by the library file.
"""
from __future__ import annotations

from pathlib import Path

from slurm_plugin.enforce import Applied, Capability, JobCap, MIB, fmt_mib
from slurm_plugin.enforce.advisory import framework_env


class HamiBackend:
    name = "hami"

    def __init__(self, library: Path, cache_dir: Path, config_dir: Path | None = None, preload: bool = True):
        self.library, self.cache_dir = Path(library), Path(cache_dir)
        self.config_dir = Path(config_dir) if config_dir else None
        self.preload = preload

    def detect(self) -> Capability:
        if not self.library.is_file():
            return Capability(self.name, False, False, False, f"no HAMi-core library at {self.library}")
        return Capability(self.name, True, True, False,
                          f"{self.library} enforces CUDA_DEVICE_MEMORY_LIMIT per device; no host-memory placement")

    def limit_vars(self, job: JobCap) -> dict[str, str]:
        return {"CUDA_DEVICE_MEMORY_LIMIT_0": f"{job.cap_bytes // MIB}m",
                "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(self.cache_dir / f"job_{job.job_id}.cache")}

    def config_path(self, job_id: int) -> Path | None:
        return self.config_dir / f"job_{job_id}.conf" if self.config_dir else None

    def apply(self, job: JobCap) -> Applied:
        env = framework_env(job)
        if job.visible_gpus != 1 or not self.library.is_file():
            return Applied(env, {}, f"swapaware: GPU memory share {fmt_mib(job.cap_bytes)} is ADVISORY "
                                    "(HAMi limit needs the library and exactly one visible GPU)", False)
        limits = self.limit_vars(job)
        env.update(limits)
        if self.preload:
            env["LD_PRELOAD"] = ":".join(p for p in (str(self.library), job.user_env.get("LD_PRELOAD", "")) if p)
        files = {}
        path = self.config_path(job.job_id)
        if path is not None:
            files[path] = "".join(f"{k}={v}\n" for k, v in sorted(limits.items()))
        return Applied(env, files, f"swapaware: GPU memory capped at {fmt_mib(job.cap_bytes)} "
                                   "(HAMi-core library limit); allocations beyond it fail", True)

    def release(self, job_id: int) -> list[Path]:
        gone = []
        for p in (self.config_path(job_id), self.cache_dir / f"job_{job_id}.cache"):
            if p is not None and p.exists():
                p.unlink()
                gone.append(p)
        return gone
