"""Per-cgroup GPU memory limits: cgroup v2 ``dmem`` (kernel 6.14+, a driver that registers its
device memory as a region, NVIDIA r615+), or NVML ``nvmlDeviceSetMemoryLimits`` where the installed
NVML binding has it.

Enforced: ``dmem.max`` (hard: the job's allocations beyond it fail) and ``dmem.low`` (soft: under
pressure the kernel evicts memory of cgroups above their low first), written for the job's cgroup
by root. A job charged below its need gets low = charge and max = need (or the device): it is the
designated victim, evicted first. Detected by ``dmem`` in cgroup.controllers and a region in
``dmem.capacity``; the NVML call is detected by attribute, never assumed. Not verified on a GPU here.
"""
from __future__ import annotations

from pathlib import Path

from slurm_plugin.enforce import Applied, Capability, JobCap, fmt_mib
from slurm_plugin.enforce.advisory import framework_env


def nvml_has_memory_limits(nvml_module=None) -> bool:
    try:
        mod = nvml_module if nvml_module is not None else __import__("pynvml")
    except ImportError:
        return False
    return callable(getattr(mod, "nvmlDeviceSetMemoryLimits", None))


class NvmlCgroupBackend:
    name = "nvml-cgroup"

    def __init__(self, cgroup_root: Path, job_cgroup: str, nvml_module=None):
        self.root, self.job_cgroup, self.nvml_module = Path(cgroup_root), job_cgroup, nvml_module

    def regions(self) -> list[str]:
        try:
            text = (self.root / "dmem.capacity").read_text()
        except OSError:
            return []
        return [line.split()[0] for line in text.splitlines() if line.strip()]

    def detect(self) -> Capability:
        try:
            controllers = (self.root / "cgroup.controllers").read_text().split()
        except OSError:
            controllers = []
        nvml = nvml_has_memory_limits(self.nvml_module)
        if "dmem" not in controllers:
            return Capability(self.name, False, False, False,
                              f"no dmem controller in {self.root}/cgroup.controllers (kernel < 6.14 or cgroup v1); "
                              f"NVML nvmlDeviceSetMemoryLimits {'present' if nvml else 'absent'} in the binding")
        regions = self.regions()
        if not regions:
            return Capability(self.name, False, False, False, "dmem controller present but no device region "
                                                              "registered (driver without dmem support)")
        return Capability(self.name, True, True, True, f"dmem.max hard cap, dmem.low soft limit (holders above it "
                                                       f"evicted first) on {', '.join(regions)}")

    @staticmethod
    def region_of(job: JobCap, regions: list[str]) -> str | None:
        """The region of the job's GPU: regions in dmem.capacity order taken as GPU index order
        (unverified on a multi-GPU node with a real driver: check ``dmem.capacity`` there)."""
        raw = (job.user_env.get("SLURM_JOB_GPUS") or "").split(",")[0].strip()
        return regions[int(raw)] if raw.isdigit() and int(raw) < len(regions) else None

    def cgroup(self, job_id: int) -> Path:
        return self.root / self.job_cgroup.format(job_id=job_id)

    def apply(self, job: JobCap) -> Applied:
        env = framework_env(job)
        regions = self.regions()
        if not regions or job.visible_gpus != 1:
            return Applied(env, {}, f"swapaware: GPU memory share {fmt_mib(job.cap_bytes)} is ADVISORY "
                                    "(no dmem region, or not exactly one GPU)", False)
        region = regions[0] if len(regions) == 1 else self.region_of(job, regions)
        if region is None:
            return Applied(env, {}, f"swapaware: GPU memory share {fmt_mib(job.cap_bytes)} is ADVISORY "
                                    "(the job's GPU has no known dmem region)", False)
        hard = max(job.cap_bytes, min(job.need_bytes, job.device_bytes)) if job.need_bytes else job.cap_bytes
        cg = self.cgroup(job.job_id)
        files = {cg / "dmem.max": f"{region} {hard}\n", cg / "dmem.low": f"{region} {job.cap_bytes}\n"}
        if hard > job.cap_bytes:
            msg = (f"swapaware: GPU memory {fmt_mib(job.cap_bytes)} protected, up to {fmt_mib(hard)} allowed; "
                   "memory above the protected part is evicted first under pressure (dmem)")
        else:
            msg = f"swapaware: GPU memory capped at {fmt_mib(hard)} (cgroup dmem.max); allocations beyond it fail"
        return Applied(env, files, msg, True)

    def release(self, job_id: int) -> list[Path]:
        return []  # the job's cgroup goes with the job
