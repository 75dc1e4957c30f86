"""The prolog's side of enforcement: the node's capability for the service (with each job start)
and the root-owned files a backend needs (HAMi/SoftMig per-job limit file, cgroup dmem limits)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.config import Config
from slurm_plugin.enforce import Applied
from slurm_plugin.enforce.choose import choose

log = logging.getLogger("swapaware.enforce")


def capability_proto(cfg: Config) -> pb.NodeEnforcement:
    _, cap, _ = choose(cfg)
    return pb.NodeEnforcement(backend=cap.backend, hard_cap=cap.hard_cap, victim=cap.victim, detail=cap.detail)


def write_files(applied: Applied) -> list[Path]:
    written = []
    for path, text in applied.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.chmod(0o644)
        tmp.replace(path) if not path.name.startswith("dmem.") else path.write_text(text)
        written.append(path)
    return written


def apply_root(env: Mapping[str, str], cfg: Config) -> list[Path]:
    """Write the chosen backend's root-owned files for a shard job (prolog, as root). Only where
    the prolog's environment names the job's shards (SLURM_SHARDS_ON_NODE); otherwise nothing."""
    from slurm_plugin.task_prolog import job_cap, job_gpu_bytes  # the TaskProlog's arithmetic, one place
    job = job_cap(env, cfg, job_gpu_bytes(env, cfg))
    if job is None:
        return []
    backend, _, _ = choose(cfg)
    return write_files(backend.apply(job))
