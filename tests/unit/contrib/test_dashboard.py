"""The Grafana dashboard in contrib/ queries only series the service exports."""
from __future__ import annotations

import json
import re
from pathlib import Path

from policy_service.serving.metrics import ServiceMetrics
from slurm_plugin.agent.metrics import registry_for

DASHBOARD = Path(__file__).resolve().parents[3] / "contrib" / "grafana" / "swapaware.json"
SUFFIXES = ("_bucket", "_count", "_sum", "_total")


AGENT_STATUS = {"jobs": [], "spool_depth": 0}  # an agent that delivers its spool: every series


def families() -> set[str]:
    return ({f.name for f in ServiceMetrics().registry.collect()}
            | {f.name for f in registry_for(lambda: AGENT_STATUS).collect()})


def exported() -> set[str]:
    return {n + s for n in families() for s in ("", *SUFFIXES)}


def test_every_panel_queries_an_exported_series():
    doc = json.loads(DASHBOARD.read_text())
    known = exported()
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    assert exprs and len({p["id"] for p in doc["panels"]}) == len(doc["panels"])
    for expr in exprs:
        used = set(re.findall(r"\bswapaware_[a-z_]+", expr))
        assert used and used <= known, (expr, used - known)
    every = {n for e in exprs for n in re.findall(r"\bswapaware_[a-z_]+", e)}
    assert all(any(n.startswith(f) for n in every) for f in families()), "a series no panel shows"
