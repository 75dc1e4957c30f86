"""The parts of slurm.conf and gres.conf the checks need: ``Key=Value`` tokens, ``#`` comments,
``NodeName=DEFAULT`` and ``PartitionName=DEFAULT``, ``NodeSet=``, hostlists (``gpu[01-04,07]``)
and bracketed device files (``/dev/nvidia[0-3]``). Not a full Slurm parser (no ``Include``)."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Mapping, Sequence


@dataclass(frozen=True)
class NodeLine:
    names: tuple[str, ...]
    expr: str
    gres: Mapping[str, int]
    features: tuple[str, ...] = ()
    gres_spec: str = ""  # Gres= as written (NodeName=DEFAULT's where the line has none)


@dataclass(frozen=True)
class PartitionLine:
    name: str
    params: Mapping[str, str]  # lower-case key -> value, PartitionName=DEFAULT values filled in
    nodes: tuple[str, ...]  # node names, Nodes=ALL and NodeSet names resolved
    inherited: frozenset[str] = frozenset()  # keys whose value comes from PartitionName=DEFAULT

    def get(self, key: str, default: str = "") -> str:
        return self.params.get(key.lower(), default)


@dataclass(frozen=True)
class SlurmConf:
    params: Mapping[str, str]  # lower-case key -> value (last wins)
    nodes: tuple[NodeLine, ...]
    partitions: tuple[PartitionLine, ...] = ()

    def get(self, key: str, default: str = "") -> str:
        return self.params.get(key.lower(), default)

    def node(self, name: str) -> NodeLine | None:
        return next((n for n in self.nodes if name in n.names), None)


@dataclass(frozen=True)
class GresLine:
    name: str
    nodes: tuple[str, ...] | None  # None: applies to every node reading the file
    count: int | None
    files: tuple[str, ...]
    type: str | None = None  # Type=, as written


@dataclass(frozen=True)
class GresConf:
    params: Mapping[str, str]
    lines: tuple[GresLine, ...]

    def for_node(self, node: str | None) -> list[GresLine]:
        return [g for g in self.lines if g.nodes is None or (node is not None and node in g.nodes)]


def _tokens(line: str) -> list[tuple[str, str]]:
    line = line.split("#", 1)[0].strip()
    if not line:
        return []
    try:
        parts = shlex.split(line)
    except ValueError:
        parts = line.split()
    return [(k.lower(), v) for k, _, v in (p.partition("=") for p in parts)]


def _expand_brackets(expr: str) -> list[str]:
    """``a[01-03,7]b`` -> ``a01b a02b a03b a7b`` (zero padding kept); nested groups recurse."""
    match = re.search(r"\[([^\]]*)\]", expr)
    if not match:
        return [expr]
    head, tail = expr[: match.start()], expr[match.end():]
    out = []
    for part in match.group(1).split(","):
        lo, _, hi = part.partition("-")
        if hi and lo.isdigit() and hi.isdigit():
            values = [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
        else:
            values = [part]
        out += [x for v in values for x in _expand_brackets(head + v + tail)]
    return out


def expand_list(expr: str) -> list[str]:
    """A Slurm hostlist or file list: top-level commas separate, brackets expand."""
    items, depth, current = [], 0, ""
    for ch in expr:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    items.append(current)
    return [name for item in items if item for name in _expand_brackets(item)]


_COUNT = re.compile(r"^\d+[KMG]?$", re.IGNORECASE)


def _count(raw: str) -> int:
    raw = raw.strip().upper()
    scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(raw[-1:], 1)
    digits = raw[:-1] if scale > 1 else raw
    return int(digits) * scale if digits.isdigit() else 0


def parse_gres_spec(spec: str) -> dict[str, int]:
    """``gpu:a100:4(S:0-1),shard:32`` -> ``{"gpu": 4, "shard": 32}`` (types summed)."""
    return {name: sum(by_type.values()) for name, by_type in parse_gres_types(spec).items()}


def parse_gres_types(spec: str) -> dict[str, dict[str, int]]:
    """``gpu:a100:2,gpu:h100:2,shard:24`` -> ``{"gpu": {"a100": 2, "h100": 2}, "shard": {"": 24}}``
    (lower-case names and types; "" untyped)."""
    out: dict[str, dict[str, int]] = {}
    for item in re.split(r",(?![^(]*\))", spec):
        item = re.sub(r"\(.*\)$", "", item.strip())
        if not item or item.lower() == "(null)":
            continue
        parts = item.lower().split(":")
        counted = len(parts) > 1 and _COUNT.match(parts[-1])
        count = _count(parts[-1]) if counted else 1
        gres_type = parts[1] if len(parts) > (2 if counted else 1) else ""
        by_type = out.setdefault(parts[0], {})
        by_type[gres_type] = by_type.get(gres_type, 0) + count
    return out


def _features(attrs: Mapping[str, str]) -> tuple[str, ...]:
    raw = attrs.get("features", attrs.get("feature", ""))
    return tuple(f.strip().lower() for f in raw.split(",") if f.strip())


def _partition_nodes(expr: str, nodes: Sequence[NodeLine], nodesets: Mapping[str, list[str]]) -> tuple[str, ...]:
    """A partition's ``Nodes=``: ``ALL``, NodeSet names and hostlists (top-level commas)."""
    if expr.strip().upper() == "ALL":
        return tuple(n for node in nodes for n in node.names)
    out: list[str] = []
    for item in expand_list(expr):
        for name in nodesets.get(item, [item]):
            if name not in out:
                out.append(name)
    return tuple(out)


def parse_slurm_conf(text: str) -> SlurmConf:
    params: dict[str, str] = {}
    nodes: list[NodeLine] = []
    default_gres = ""
    default_features: tuple[str, ...] = ()
    partition_defaults: dict[str, str] = {}
    partitions: list[tuple[str, dict[str, str], frozenset[str]]] = []
    nodeset_lines: list[tuple[str, dict[str, str]]] = []
    for line in text.splitlines():
        tokens = _tokens(line)
        if not tokens:
            continue
        first_key, first_value = tokens[0]
        if first_key == "nodename":
            attrs = dict(tokens[1:])
            if first_value.upper() == "DEFAULT":
                default_gres = attrs.get("gres", default_gres)
                default_features = _features(attrs) or default_features
                continue
            spec = attrs.get("gres", default_gres)
            nodes.append(NodeLine(tuple(expand_list(first_value)), first_value, parse_gres_spec(spec),
                                  _features(attrs) or default_features, spec))
        elif first_key == "partitionname":
            attrs = dict(tokens[1:])
            if first_value.upper() == "DEFAULT":
                partition_defaults.update(attrs)
            else:
                partitions.append((first_value, {**partition_defaults, **attrs},
                                   frozenset(partition_defaults) - frozenset(attrs)))
        elif first_key == "nodeset":
            nodeset_lines.append((first_value, dict(tokens[1:])))
        elif first_key in ("downnodes", "frontendname", "switchname"):
            continue
        else:
            params.update(tokens)
    nodesets: dict[str, list[str]] = {}
    for name, attrs in nodeset_lines:
        members = expand_list(attrs["nodes"]) if "nodes" in attrs else []
        if "feature" in attrs:
            wanted = attrs["feature"].strip().lower()
            members += [n for node in nodes if wanted in node.features for n in node.names]
        nodesets[name] = members
    parts = tuple(PartitionLine(name, attrs, _partition_nodes(attrs.get("nodes", ""), nodes, nodesets), inherited)
                  for name, attrs, inherited in partitions)
    return SlurmConf(params, tuple(nodes), parts)


def parse_gres_conf(text: str) -> GresConf:
    params: dict[str, str] = {}
    lines: list[GresLine] = []
    for line in text.splitlines():
        attrs = dict(_tokens(line))
        if "name" not in attrs:
            params.update(attrs)
            continue
        nodes = tuple(expand_list(attrs["nodename"])) if "nodename" in attrs else None
        count = _count(attrs["count"]) if "count" in attrs else None
        files = tuple(expand_list(attrs["file"])) if "file" in attrs else ()
        lines.append(GresLine(attrs["name"].lower(), nodes, count, files, attrs.get("type") or None))
    return GresConf(params, tuple(lines))


def gres_totals(lines: Sequence[GresLine]) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in lines:
        n = g.count if g.count is not None else max(1, len(g.files))
        out[g.name] = out.get(g.name, 0) + n
    return out


# =========================================================================== checks
