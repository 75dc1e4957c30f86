"""The cluster's GPUs as slurm.conf and gres.conf declare them: each GPU's node, type and shard
count. Pure: parsed files in, GPUs out.

A shard is a fixed amount of GPU memory on every GPU (``gpu.shard_bytes``), so a GPU's shard
count is its memory in those units (``swapaware gres-conf`` writes ``Count=`` per GPU from NVML):
on a fleet of 40, 48 and 80 GiB GPUs with 10 GiB shards, 4, 4 and 8. The policy reads from here
which shard counts the GPUs a job can land on have (its partitions, its GPU type).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Iterable, Sequence

from policy_service.slurm.slurm_files import GresConf, PartitionLine, SlurmConf


@dataclass(frozen=True)
class GpuShards:
    node: str
    type: str | None  # None: slurm.conf alone names no type for it
    shards: Fraction  # shards of this GPU (a fraction only where slurm.conf's totals do not divide)
    index: int | None = None  # the device's number in gres.conf's File= (/dev/nvidia2: 2); None: not known


def node_gpus(conf: SlurmConf, gres: GresConf, name: str) -> list[GpuShards]:
    """The GPUs of one node with their shard counts and types. gres.conf first (``Name=shard
    Count=`` per ``File=``; a shard takes the type of the gpu line with its File=, or its own
    Type=), else the node's slurm.conf ``Gres=`` (shards / gpus, type unknown). GPUs without
    shards are left out (no shard job lands on them)."""
    node = conf.node(name)
    if node is None or node.gres.get("gpu", 0) <= 0:
        return []
    lines = gres.for_node(name)
    gpu_types = {f: g.type for g in lines if g.name == "gpu" for f in g.files}
    shard_lines = [g for g in lines if g.name == "shard" and g.files and g.count]
    out = [GpuShards(name, g.type or gpu_types.get(f), Fraction(g.count or 0, len(g.files)), file_index(f))
           for g in shard_lines for f in g.files]
    if not shard_lines and node.gres.get("shard", 0) > 0:
        out.append(GpuShards(name, None, Fraction(node.gres["shard"], node.gres["gpu"])))
    return out


def file_index(path: str) -> int | None:
    """The device number a gres.conf File= names (/dev/nvidia2: 2), which is the index NVML and
    Slurm's SLURM_JOB_GPUS give it on a node whose devices are numbered in PCI order."""
    m = re.search(r"(\d+)$", path)
    return int(m.group(1)) if m else None


def shard_memory_mismatch(node: str, index: int, shards: int, shard_bytes: int, total_bytes: int) -> str:
    """Why a GPU's shards promise more memory than the node's NVML reports for it ("" when they fit)."""
    if shards <= 0 or total_bytes <= 0 or shards * shard_bytes <= total_bytes:
        return ""
    return (f"{node} GPU {index}: gres.conf gives it {shards} shards of {shard_bytes / 2**30:.1f} GiB "
            f"({shards * shard_bytes / 2**30:.1f} GiB) but the node agent reports {total_bytes / 2**30:.1f} GiB: "
            f"a shared job there can get less than its charge; write Count={total_bytes // shard_bytes} "
            "(swapaware gres-conf) and reconfigure")


def partition_gpus(conf: SlurmConf, part: PartitionLine, gres: GresConf) -> list[GpuShards]:
    """The GPUs with shards of the partition's nodes."""
    return [g for name in part.nodes for g in node_gpus(conf, gres, name)]


def counts_by_type(gpus: Iterable[GpuShards]) -> dict[str, frozenset[int]]:
    """Whole shards per GPU by lower-case type ("": type not known), GPUs with none left out."""
    out: dict[str, set[int]] = {}
    for g in gpus:
        if int(g.shards) > 0:
            out.setdefault((g.type or "").lower(), set()).add(int(g.shards))
    return {t: frozenset(c) for t, c in out.items()}


def shard_counts(gpus: Sequence[GpuShards]) -> tuple[int, ...]:
    """Whole shards per GPU, sorted, without repeats (a GPU with no whole shard left out)."""
    return tuple(sorted({int(g.shards) for g in gpus if int(g.shards) > 0}))
