"""CUDA MPS per-client pinned device memory limit (needs nvidia-cuda-mps-control on the node).

Enforced: each MPS client process gets ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M``; the
driver fails that client's allocations beyond it. Not enforced: the cap is per process (a job's
several CUDA processes each get it), a client that unsets the variable before CUDA starts is
capped only by the daemon's ``set_default_device_pinned_mem_limit``, and nothing moves memory to
the host: no victim semantics. Detected by the daemon's control pipe in the pipe directory.
"""
from __future__ import annotations

from pathlib import Path

from slurm_plugin.enforce import Applied, Capability, JobCap, MIB, fmt_mib
from slurm_plugin.enforce.advisory import framework_env


class MpsBackend:
    name = "mps"

    def __init__(self, pipe_dir: Path):
        self.pipe_dir = Path(pipe_dir)

    def detect(self) -> Capability:
        control = self.pipe_dir / "control"
        if not control.exists():
            return Capability(self.name, False, False, False,
                              f"no MPS control pipe {control} (nvidia-cuda-mps-control -d not running)")
        return Capability(self.name, True, True, False,
                          f"per-client pinned device memory limit via {self.pipe_dir}; per process, "
                          "allocations beyond it fail; no host-memory placement")

    def apply(self, job: JobCap) -> Applied:
        env = framework_env(job)
        if job.visible_gpus != 1 or not (self.pipe_dir / "control").exists():
            return Applied(env, {}, f"swapaware: GPU memory share {fmt_mib(job.cap_bytes)} is ADVISORY "
                                    "(MPS limit needs exactly one visible GPU and a running MPS daemon)", False)
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe_dir)
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={job.cap_bytes // MIB}M"
        return Applied(env, {}, f"swapaware: GPU memory capped at {fmt_mib(job.cap_bytes)} per CUDA process "
                                "(MPS pinned memory limit); allocations beyond it fail", True)

    def release(self, job_id: int) -> list[Path]:
        return []
