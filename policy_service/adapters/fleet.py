"""The cluster's GPUs as slurm.conf and gres.conf declare them: each GPU's node, type and shard
count. Pure: parsed files in, GPUs out.

A shard is a fixed amount of GPU memory on every GPU (``gpu.shard_bytes``), so a GPU's shard
count is its memory in those units (``swapaware gres-conf`` writes ``Count=`` per GPU from NVML):
on a fleet of 40, 48 and 80 GiB GPUs with 10 GiB shards, 4, 4 and 8. The policy reads from here
which shard counts the GPUs a job can land on have (its partitions, its GPU type).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Iterable, Sequence

from policy_service.adapters.slurm_files import GresConf, PartitionLine, SlurmConf


@dataclass(frozen=True)
class GpuShards:
    node: str
    type: str | None  # None: slurm.conf alone names no type for it
    shards: Fraction  # shards of this GPU (a fraction only where slurm.conf's totals do not divide)


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
    out = [GpuShards(name, g.type or gpu_types.get(f), Fraction(g.count or 0, len(g.files)))
           for g in shard_lines for f in g.files]
    if not shard_lines and node.gres.get("shard", 0) > 0:
        out.append(GpuShards(name, None, Fraction(node.gres["shard"], node.gres["gpu"])))
    return out


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
