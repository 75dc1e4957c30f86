"""What a job's partition gives each GPU by default (slurm.conf ``DefCpuPerGPU``,
``DefMemPerGPU``), read from the controller's slurm.conf.

Slurm gives a job that asks for GPUs those CPUs and that memory per GPU unless the job says
otherwise; a job that holds shards holds no GPU and gets none of them (measured on 22.05: with
``DefCpuPerGPU=2`` a ``--gres=gpu:1`` job ran with 2 CPUs, the same job rewritten to a shard with 1).
Such a job keeps its request (``core/policy.py``, reason ``per_gpu_default``).

``partition_defaults`` is pure; ``SlurmConfWatch`` re-reads the file when it changed (a ``stat``
at most every ``check_every_s``), and keeps the last good reading when it cannot be read.
``Include`` lines are not followed (as ``swapaware doctor``).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from policy_service.adapters.slurm_files import SlurmConf, parse_slurm_conf

log = logging.getLogger("swapaware.service")

PER_GPU_DEFAULTS = ("DefCpuPerGPU", "DefMemPerGPU")


@dataclass(frozen=True)
class PartitionDefaults:
    by_partition: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # name -> ("DefCpuPerGPU=2", ...)
    default_partition: str = ""  # the Default=YES partition: where a job that names none goes

    def for_job(self, partition: str) -> tuple[str, ...]:
        """The per-GPU defaults of the partitions a job may run in (``-p a,b``: any of them)."""
        names = [p.strip() for p in (partition or "").split(",") if p.strip()] or [self.default_partition]
        return tuple(dict.fromkeys(v for n in names for v in self.by_partition.get(n, ())))


NONE = PartitionDefaults()


def _set(value: str) -> bool:
    return value.strip() not in ("", "0")


def partition_defaults(conf: SlurmConf) -> PartitionDefaults:
    """Each partition's own DefCpuPerGPU / DefMemPerGPU, else the cluster-wide ones."""
    by: dict[str, tuple[str, ...]] = {}
    default = ""
    for part in conf.partitions:
        values = []
        for key in PER_GPU_DEFAULTS:
            value = part.get(key) or conf.get(key)
            if _set(value):
                values.append(f"{key}={value.strip()}")
        if values:
            by[part.name] = tuple(values)
        if part.get("Default").strip().upper() == "YES":
            default = part.name
    return PartitionDefaults(by, default)


class SlurmConfWatch:
    """The partition defaults of the slurm.conf at ``path``, re-read when its mtime or size changed."""

    def __init__(self, path: Path, check_every_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.path, self.check_every_s, self.clock = Path(path), check_every_s, clock
        self._lock = threading.Lock()
        self._seen: tuple[float, int] | None = None
        self._next_check = float("-inf")
        self._current = NONE
        self._failed: str = ""

    def current(self) -> PartitionDefaults:
        now = self.clock()
        if now < self._next_check:
            return self._current
        with self._lock:
            if now < self._next_check:
                return self._current
            self._next_check = now + self.check_every_s
            self._reload()
            return self._current

    def _reload(self) -> None:
        try:
            st = os.stat(self.path)
            if (st.st_mtime, st.st_size) == self._seen:
                return
            conf = parse_slurm_conf(self.path.read_text(errors="replace"))
            self._current, self._seen = partition_defaults(conf), (st.st_mtime, st.st_size)
            self._failed = ""
            log.info("slurm.conf %s: partitions with per-GPU defaults (their GPU jobs keep their request): %s",
                     self.path, ", ".join(f"{p} ({' '.join(v)})" for p, v in self._current.by_partition.items())
                     or "none")
        except (OSError, ValueError) as exc:
            why = f"{type(exc).__name__}: {exc}"
            if why != self._failed:
                log.warning("cannot read slurm.conf %s (%s): per-GPU partition defaults taken as %s", self.path, why,
                            "the last ones read" if self._seen else "none")
                self._failed = why


def slurm_conf_path(configured: str) -> Path:
    """service.slurm_conf, else $SLURM_CONF, else /etc/slurm/slurm.conf."""
    return Path(configured or os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf")
