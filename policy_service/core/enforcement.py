"""The nodes' GPU memory enforcement as the service knows it: what each node last reported (with
each job start) and whether oversubscription may count on victim semantics.

Decisions happen at submit time, before a node is chosen, so the gate is cluster-wide: a job may
be charged fewer shards than its need only when at least one node reported, every node's last
report says its backend enforces victim semantics, and the enforcing reports are fresh. A node
that reported anything else, at any time, blocks it until it reports again; a node that never
reported is unknown to the service (the admin guide says to keep allow_oversubscription = auto
only where every GPU node runs the prolog).
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeReport:
    node: str
    backend: str
    hard_cap: bool
    victim: bool
    at: float


@dataclass(frozen=True)
class EnforcementView:
    """The gate's input: whether victim semantics are enforced, and a one-line why."""

    victim_enforced: bool
    summary: str


def view_of(reports: list[NodeReport], now: float, max_age_s: float) -> EnforcementView:
    if not reports:
        return EnforcementView(False, "no node has reported its GPU memory enforcement yet")
    counts = collections.Counter(r.backend + ("" if r.victim else "") for r in reports)
    tally = ", ".join(f"{b} x{n}" for b, n in sorted(counts.items()))
    weak = sorted(r.node for r in reports if not r.victim)
    stale = sorted(r.node for r in reports if r.victim and now - r.at > max_age_s)
    if weak:
        return EnforcementView(False, f"node(s) {', '.join(weak[:5])}{' ...' if len(weak) > 5 else ''} do not "
                                      f"enforce victim semantics; backends reported: {tally}")
    if stale:
        return EnforcementView(False, f"victim-enforcing reports older than {max_age_s:.0f}s from "
                                      f"{', '.join(stale[:5])}; backends reported: {tally}")
    return EnforcementView(True, f"every node that reported enforces victim semantics: {tally}")


class NodeEnforcementRegistry:
    """Last report per node (in memory; refilled by the next job starts after a restart)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nodes: dict[str, NodeReport] = {}

    def record(self, report: NodeReport) -> None:
        if not report.node:
            return
        with self._lock:
            self._nodes[report.node] = report

    def reports(self) -> list[NodeReport]:
        with self._lock:
            return list(self._nodes.values())

    def view(self, now: float, max_age_s: float) -> EnforcementView:
        return view_of(self.reports(), now, max_age_s)
