"""What a job's partition gives it, read from the controller's slurm.conf and gres.conf: the
per-GPU defaults (``DefCpuPerGPU``, ``DefMemPerGPU``), the shard counts of its GPUs and how its
``TRESBillingWeights`` bill a job that holds shards.

Slurm gives a job that asks for GPUs those CPUs and that memory per GPU unless the job says
otherwise; a job that holds shards holds no GPU and gets none of them (measured on 22.05: with
``DefCpuPerGPU=2`` a ``--gres=gpu:1`` job ran with 2 CPUs, the same job rewritten to a shard with 1).
Such a job keeps its request (``core/route.py``, reason ``per_gpu_default``). So does a job whose
shards would not bill its fraction of the GPU under its partition's weights (``billing_weights.py``,
reason ``shards_unbilled``), and a whole GPU is held as shards only where all of them bill the GPU.

A shard is a fixed amount of memory on every GPU, so GPUs of different memory have different
shard counts (``slurm/fleet.py``); the policy sizes a job for the GPUs its partitions hold.

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

from policy_service.slurm.billing_weights import (
    BillingWeights,
    distinct_gpus,
    read_weights,
    shard_billing,
    unbilled_reason,
    whole_unbilled,
)
from policy_service.slurm.fleet import GpuShards, counts_by_type, partition_gpus, shard_counts
from policy_service.slurm.slurm_files import GresConf, SlurmConf, parse_gres_conf, parse_slurm_conf
from policy_service.core.types import LiveShards

log = logging.getLogger("swapaware.service")

PER_GPU_DEFAULTS = ("DefCpuPerGPU", "DefMemPerGPU")
LIVE_MEMO_MAX = 256  # live_shard_counts' results kept (partition, type and snapshot)


@dataclass(frozen=True)
class PartitionDefaults:
    by_partition: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # name -> ("DefCpuPerGPU=2", ...)
    default_partition: str = ""  # the Default=YES partition: where a job that names none goes
    # every partition -> lower-case GPU type ("": not known) -> the shard counts of its GPUs of that type
    shards: Mapping[str, Mapping[str, frozenset[int]]] = field(default_factory=dict)
    # (node, device number) -> that GPU's shards, from gres.conf (checked against the node agents'
    # NVML totals: events.EventApplier)
    gpu_shards: Mapping[tuple[str, int], int] = field(default_factory=dict)
    # every partition -> its GPUs with shards (node, type, count): where the controller refuses shards
    gpus: Mapping[str, tuple[GpuShards, ...]] = field(default_factory=dict)
    nodes: Mapping[str, frozenset[str]] = field(default_factory=dict)  # every partition -> its nodes with shards
    node_gpus: Mapping[str, tuple[GpuShards, ...]] = field(default_factory=dict)  # node -> its GPUs with shards
    billing: Mapping[str, BillingWeights] = field(default_factory=dict)  # every partition -> its TRESBillingWeights
    # every partition -> one of its GPUs with shards of each (type, shard count): what billing depends on
    gpu_kinds: Mapping[str, tuple[GpuShards, ...]] = field(default_factory=dict)
    # live_shard_counts' results for the snapshot they were worked out from (no part of the value)
    _live_memo: dict = field(default_factory=dict, compare=False, repr=False)
    _billing_memo: dict = field(default_factory=dict, compare=False, repr=False)  # unbilled's, per (partition, type)

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
                             if _of_type(t, want) for c in counts}))

    def unbilled(self, partition: str, gpu_type: str = "") -> tuple[str, str]:
        """(why a job of ``gpu_type`` in ``partition`` that holds shards would not bill its fraction of
        a GPU, why all the shards of one GPU would not bill what the GPU bills) under the weights of
        each partition it may run in (billing_weights.py); "" where they would. A partition not known
        says nothing."""
        key = (partition, gpu_type.lower())
        hit = self._billing_memo.get(key)
        if hit is None:
            if len(self._billing_memo) > LIVE_MEMO_MAX:
                self._billing_memo.clear()
            share, whole = [], []
            for name in self._names(partition):
                weights, gpus = self.billing.get(name), self.gpu_kinds.get(name, ())
                if weights is None:
                    continue
                on = [g for g in gpus if _of_type(g.type, key[1])]
                if on:
                    verdict = shard_billing(weights, gpus, on)
                    share.append(unbilled_reason(name, weights, verdict))
                    whole.append(whole_unbilled(name, weights, on, verdict))
            hit = self._billing_memo[key] = (next((w for w in share if w), ""), next((w for w in whole if w), ""))
        return hit

    def live_shard_counts(self, partition: str, gpu_type: str,
                          live: LiveShards | None) -> tuple[tuple[int, ...] | None, tuple[str, ...]]:
        """(shard_counts of the GPUs the controller in control takes shard jobs on, "node: why" of
        the nodes it refuses them on). ``live`` None, or a partition not known: shard_counts, ().
        Only the nodes the live counts name as possibly refusing are looked at, and a refusal is
        worked out once per snapshot, partition and type (this runs on every Admit)."""
        counts = self.shard_counts(partition, gpu_type)
        if live is None or counts is None:
            return counts, ()
        if live.unread:
            return (), (f"every node: {live.unread}",)
        if not live.zero and not live.untyped:
            return counts, ()
        key = (id(live), partition, gpu_type.lower())
        hit = self._live_memo.get(key)
        if hit is not None and hit[0] is live:
            return hit[1]
        if len(self._live_memo) > LIVE_MEMO_MAX:  # one snapshot's partitions and types at a time, in practice
            self._live_memo.clear()
        out = self._live_counts(partition, gpu_type, live, counts)
        self._live_memo[key] = (live, out)
        return out

    def warm_live(self, live: LiveShards | None) -> int:
        """Work out live_shard_counts from ``live`` for every partition of the fleet (and none: the
        default) and every GPU type there (and none), so that no Admit pays for it (the queue poll
        prepares each snapshot with this; milliseconds at 1,000 nodes that all refuse). The pairs
        worked out: 0 where no node refuses (nothing to work out) or the counts are unread."""
        if live is None or live.unread or (not live.zero and not live.untyped):
            return 0
        pairs = {(name, t) for name, by_type in self.shards.items() for t in ("", *by_type)}
        pairs |= {("", t) for t in ("", *self.shards.get(self.default_partition, {}))}
        if len(pairs) > LIVE_MEMO_MAX // 2:   # more than the memo keeps: Admits work out their own
            return 0
        self._live_memo.clear()               # the snapshots before this one: no Admit reads them again
        for name, t in sorted(pairs):
            self.live_shard_counts(name, t, live)
        return len(pairs)

    def _live_counts(self, partition: str, gpu_type: str, live: LiveShards,
                     counts: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[str, ...]]:
        want, names = gpu_type.lower(), self._names(partition)
        suspects = [g for n in sorted(self._suspects(live)) if any(n in self.nodes.get(p, ()) for p in names)
                    for g in self.node_gpus.get(n, ()) if _of_type(g.type, want)]
        refused = _refused(suspects, live)
        if not refused:
            return counts, ()
        kept = [g for n in names for g in self.gpus.get(n, ())
                if _of_type(g.type, want) and (g.node, g.type) not in refused]
        return shard_counts(kept), _named(refused)

    def shards_refused(self, live: LiveShards | None) -> tuple[str, ...]:
        """"node: why" of every node with shards whose shards the controller in control refuses."""
        if live is None:
            return ()
        if live.unread:
            return (f"every node: {live.unread}",)
        return _named(_refused([g for n in sorted(self._suspects(live)) for g in self.node_gpus.get(n, ())], live))

    def _suspects(self, live: LiveShards) -> set[str]:
        """The nodes whose GPUs live may refuse: a count of 0, or untyped where gres.conf types them."""
        return set(live.zero) | {n for n in live.untyped if any(g.type for g in self.node_gpus.get(n, ()))}

    def all_shard_counts(self) -> set[int]:
        """Every shard count a GPU of a known partition has."""
        return {c for by_type in self.shards.values() for counts in by_type.values() for c in counts}


NONE = PartitionDefaults()


def _of_type(gpu_type: str | None, want: str) -> bool:
    """A GPU of ``gpu_type`` serves a request of type ``want`` (lower case; "" any): an untyped GPU
    serves every type."""
    return not want or not gpu_type or gpu_type.lower() == want


def _refused(gpus: list[GpuShards], live: LiveShards) -> dict[tuple[str, str | None], str]:
    """(node, type) -> why the controller refuses shard jobs on those GPUs."""
    out: dict[tuple[str, str | None], str] = {}
    for g in gpus:
        why = live.refuses(g.node, g.type)
        if why:
            out.setdefault((g.node, g.type), why)
    return out


def _named(refused: Mapping[tuple[str, str | None], str]) -> tuple[str, ...]:
    """One "node: why" per node (its first refused type's why)."""
    by_node: dict[str, str] = {}
    for (node, _), why in sorted(refused.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        by_node.setdefault(node, why)
    return tuple(f"{node}: {why}" for node, why in by_node.items())


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
    gpus = {part.name: tuple(partition_gpus(conf, part, gres)) for part in conf.partitions}
    shards = {name: counts_by_type(of) for name, of in gpus.items()}
    per_gpu = {(g.node, g.index): int(g.shards) for of in gpus.values() for g in of if g.index is not None}
    by_node: dict[str, dict[tuple, GpuShards]] = {}
    for of in gpus.values():
        for g in of:
            by_node.setdefault(g.node, {}).setdefault((g.index, g.type, g.shards), g)
    return PartitionDefaults(by, default, shards, per_gpu, gpus,
                             {name: frozenset(g.node for g in of) for name, of in gpus.items()},
                             {node: tuple(seen.values()) for node, seen in by_node.items()},
                             {part.name: read_weights(part.get("TRESBillingWeights")) for part in conf.partitions},
                             {name: tuple(distinct_gpus(of)) for name, of in gpus.items()})


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
            unbilled = [why for p in self._current.billing for why in [self._current.unbilled(p)[0]] if why]
            if unbilled:
                log.warning("slurm.conf %s: GPU jobs keep their request (shards_unbilled) in %d partition(s): %s",
                            self.path, len(unbilled), " | ".join(unbilled))
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
