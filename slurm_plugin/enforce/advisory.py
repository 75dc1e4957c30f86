"""Advisory fallback: framework allocator settings; nothing stops a job that ignores them."""
from __future__ import annotations

from pathlib import Path

from slurm_plugin.enforce import Applied, Capability, JobCap, fmt_mib


def _floor_fraction(numerator: int, denominator: int) -> float:
    return (numerator * 1000 // denominator) / 1000


def framework_env(job: JobCap) -> dict[str, str]:
    fraction = _floor_fraction(job.cap_bytes, job.device_bytes)
    jax = fraction
    try:
        jax = min(fraction, float(job.user_env["XLA_PYTHON_CLIENT_MEM_FRACTION"]))
    except (KeyError, ValueError):
        pass
    return {"SWAPAWARE_GPU_MEM_LIMIT_BYTES": str(job.cap_bytes), "SWAPAWARE_GPU_MEM_FRACTION": str(fraction),
            "TF_FORCE_GPU_ALLOW_GROWTH": "true", "XLA_PYTHON_CLIENT_MEM_FRACTION": str(jax)}


class AdvisoryBackend:
    name = "advisory"

    def detect(self) -> Capability:
        return Capability(self.name, True, False, False,
                          "framework_env: TF growth, JAX fraction and SWAPAWARE_GPU_MEM_* are hints; "
                          "PyTorch, raw CUDA and anything ignoring them are not limited")

    def apply(self, job: JobCap) -> Applied:
        return Applied(framework_env(job), {}, f"swapaware: GPU memory share {fmt_mib(job.cap_bytes)} is ADVISORY "
                                               "(not enforced on this node): stay within it", False)

    def release(self, job_id: int) -> list[Path]:
        return []
