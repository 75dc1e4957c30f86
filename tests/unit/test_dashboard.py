"""The Grafana dashboard in contrib/ queries only series the service exports."""
from __future__ import annotations

import json
import re
from pathlib import Path

from policy_service.metrics import ServiceMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "contrib" / "grafana" / "swapaware.json"
SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def exported() -> set[str]:
    names = set()
    for fam in ServiceMetrics().registry.collect():
        names.add(fam.name)
        names.update(fam.name + s for s in SUFFIXES)
    return names


def test_every_panel_queries_an_exported_series():
    doc = json.loads(DASHBOARD.read_text())
    known = exported()
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    assert exprs and len({p["id"] for p in doc["panels"]}) == len(doc["panels"])
    for expr in exprs:
        used = set(re.findall(r"\bswapaware_[a-z_]+", expr))
        assert used and used <= known, (expr, used - known)
    every = {n for e in exprs for n in re.findall(r"\bswapaware_[a-z_]+", e)}
    families = {f.name for f in ServiceMetrics().registry.collect()}
    assert all(any(n.startswith(f) for n in every) for f in families), "a series no panel shows"
