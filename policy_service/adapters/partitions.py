"""What a job's partition gives it, read from the controller's slurm.conf and gres.conf: the
per-GPU defaults (``DefCpuPerGPU``, ``DefMemPerGPU``) and the shard counts of its GPUs.

Slurm gives a job that asks for GPUs those CPUs and that memory per GPU unless the job says
otherwise; a job that holds shards holds no GPU and gets none of them (measured on 22.05: with
``DefCpuPerGPU=2`` a ``--gres=gpu:1`` job ran with 2 CPUs, the same job rewritten to a shard with 1).
Such a job keeps its request (``core/policy.py``, reason ``per_gpu_default``).

A shard is a fixed amount of memory on every GPU, so GPUs of different memory have different
shard counts (``adapters/fleet.py``); the policy sizes a job for the GPUs its partitions hold.

``partition_defaults`` is pure; ``SlurmConfWatch`` re-reads the files when they changed (a ``stat``
at most every ``check_every_s``), and keeps the last good reading when slurm.conf cannot be read.
gres.conf is read beside slurm.conf; without it a node's shards per GPU come from its ``Gres=``.
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

from policy_service.adapters.fleet import counts_by_type, partition_gpus
from policy_service.adapters.slurm_files import GresConf, SlurmConf, parse_gres_conf, parse_slurm_conf

log = logging.getLogger("swapaware.service")

PER_GPU_DEFAULTS = ("DefCpuPerGPU", "DefMemPerGPU")


@dataclass(frozen=True)
class PartitionDefaults:
    by_partition: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # name -> ("DefCpuPerGPU=2", ...)
    default_partition: str = ""  # the Default=YES partition: where a job that names none goes
    # every partition -> lower-case GPU type ("": not known) -> the shard counts of its GPUs of that type
    shards: Mapping[str, Mapping[str, frozenset[int]]] = field(default_factory=dict)
    # (node, device number) -> that GPU's shards, from gres.conf (checked against the node agents'
    # NVML totals: events.EventApplier)
    gpu_shards: Mapping[tuple[str, int], int] = field(default_factory=dict)

    def _names(self, partition: str) -> list[str]:
        return [p.strip() for p in (partition or "").split(",") if p.strip()] or [self.default_partition]

    def for_job(self, partition: str) -> tuple[str, ...]:
        """The per-GPU defaults of the partitions a job may run in (``-p a,b``: any of them)."""
        return tuple(dict.fromkeys(v for n in self._names(partition) for v in self.by_partition.get(n, ())))

    def shard_counts(self, partition: str, gpu_type: str = "") -> tuple[int, ...] | None:
        """Shard counts of the GPUs (of ``gpu_type``, "" any) a job in ``partition`` can land on;
        None where a partition is not known (the policy then takes gpu.shards_per_gpu)."""
        names, want = self._names(partition), gpu_type.lower()
        if not all(n in self.shards for n in names):
            return None
        return tuple(sorted({c for n in names for t, counts in self.shards[n].items()
                             if not want or not t or t == want for c in counts}))

    def all_shard_counts(self) -> set[int]:
        """Every shard count a GPU of a known partition has."""
        return {c for by_type in self.shards.values() for counts in by_type.values() for c in counts}


NONE = PartitionDefaults()


def _set(value: str) -> bool:
    return value.strip() not in ("", "0")


def partition_defaults(conf: SlurmConf, gres: GresConf | None = None) -> PartitionDefaults:
    """Each partition's own DefCpuPerGPU / DefMemPerGPU, else the cluster-wide ones, and its GPUs."""
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
    gres = gres or GresConf({}, ())
    shards = {part.name: counts_by_type(partition_gpus(conf, part, gres)) for part in conf.partitions}
    per_gpu = {(g.node, g.index): int(g.shards) for part in conf.partitions for g in partition_gpus(conf, part, gres)
               if g.index is not None}
    return PartitionDefaults(by, default, shards, per_gpu)


class SlurmConfWatch:
    """The partitions of the slurm.conf at ``path`` (and gres.conf beside it), re-read when either's
    mtime or size changed."""

    def __init__(self, path: Path, check_every_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.path, self.check_every_s, self.clock = Path(path), check_every_s, clock
        self.gres_path = self.path.parent / "gres.conf"
        self._lock = threading.Lock()
        self._seen: tuple[tuple[float, int], tuple[float, int] | None] | None = None
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
            seen = (_stamp(self.path), _stamp(self.gres_path) if self.gres_path.exists() else None)
            if seen == self._seen:
                return
            conf = parse_slurm_conf(self.path.read_text(errors="replace"))
            gres = parse_gres_conf(self.gres_path.read_text(errors="replace")) if seen[1] else None
            self._current, self._seen = partition_defaults(conf, gres), seen
            self._failed = ""
            log.info("slurm.conf %s: partitions with per-GPU defaults (their GPU jobs keep their request): %s; "
                     "shards per GPU (%s): %s", self.path,
                     ", ".join(f"{p} ({' '.join(v)})" for p, v in self._current.by_partition.items()) or "none",
                     self.gres_path if seen[1] else "no gres.conf: from slurm.conf's Gres=",
                     "; ".join(f"{p} {_fmt_counts(c)}" for p, c in self._current.shards.items()) or "no partitions")
        except (OSError, ValueError) as exc:
            why = f"{type(exc).__name__}: {exc}"
            if why != self._failed:
                log.warning("cannot read slurm.conf %s (%s): per-GPU partition defaults taken as %s", self.path, why,
                            "the last ones read" if self._seen else "none")
                self._failed = why


def _stamp(path: Path) -> tuple[float, int]:
    st = os.stat(path)
    return st.st_mtime, st.st_size


def _fmt_counts(by_type: Mapping[str, frozenset[int]]) -> str:
    return ",".join(f"{t or 'untyped'}:{'/'.join(map(str, sorted(c)))}" for t, c in sorted(by_type.items())) or "none"


def slurm_conf_path(configured: str) -> Path:
    """service.slurm_conf, else $SLURM_CONF, else /etc/slurm/slurm.conf."""
    return Path(configured or os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf")
