"""Oversubscription only where the nodes enforce victim semantics (policy.allow_oversubscription)."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from policy_service.config import Config, ConfigError, Oversubscription, load_config
from policy_service.core import policy
from policy_service.core.enforcement import EnforcementView, NodeEnforcementRegistry, NodeReport, view_of
from policy_service.core.request import history_keys
from policy_service.core.types import Action, KeyLevel, ReasonCode

from tests.unit.core.test_policy import CFG, history, make

ENFORCED = EnforcementView(True, "every node that reported enforces victim semantics: nvml-cgroup x2")
ADVISORY = EnforcementView(False, "node(s) n1, n2, n3 do not enforce victim semantics; backends reported: advisory x3")


def decide(setting, view):
    cfg = replace(CFG, policy=replace(CFG.policy, allow_oversubscription=setting))
    r, fields, access = make(comment="swapaware:access=compute_bound")
    return policy.decide(r, history(10.5), cfg, decision_id="d1", now=1.0, gres_fields=fields, access=access,
                         job_class=history_keys(r)[KeyLevel.CLASS], enforcement=view)


@pytest.mark.parametrize("setting, view, action, shards, not_enforced", [
    (Oversubscription.AUTO, ENFORCED, Action.SHARE_OVERSUBSCRIBED, 1, False),
    (Oversubscription.AUTO, ADVISORY, Action.SHARE, 2, True),  # sized to the need, with the reason
    (Oversubscription.AUTO, None, Action.SHARE_OVERSUBSCRIBED, 1, False),  # no view of nodes (simulator): not gated
    (Oversubscription.ON, ADVISORY, Action.SHARE_OVERSUBSCRIBED, 1, False),  # the admin knows better
    (Oversubscription.OFF, ENFORCED, Action.SHARE, 2, False),
    (True, ADVISORY, Action.SHARE_OVERSUBSCRIBED, 1, False),  # booleans still accepted
    (False, ENFORCED, Action.SHARE, 2, False),
])
def test_gate(setting, view, action, shards, not_enforced):
    d = decide(setting, view)
    assert (d.action, d.shards) == (action, shards)
    codes = [r.code for r in d.reasons]
    assert (ReasonCode.OVERSUBSCRIPTION_NOT_ENFORCED in codes) is not_enforced
    if not_enforced:
        assert "advisory x3" in next(r.message for r in d.reasons if r.code is ReasonCode.OVERSUBSCRIPTION_NOT_ENFORCED)
        assert "oversubscription_not_enforced" in d.rewrite.admin_comment


def test_no_reason_when_it_would_not_have_oversubscribed():
    r, fields, access = make()
    d = policy.decide(r, history(5), CFG, decision_id="d1", now=1.0, gres_fields=fields, access=access,
                      job_class=history_keys(r)[KeyLevel.CLASS], enforcement=ADVISORY)
    assert d.action is Action.SHARE
    assert ReasonCode.OVERSUBSCRIPTION_NOT_ENFORCED not in {r.code for r in d.reasons}


def R(node, backend, victim, at=100.0):
    return NodeReport(node, backend, backend != "advisory", victim, at)


@pytest.mark.parametrize("reports, now, ok, text", [
    ([], 100.0, False, "no node has reported"),
    ([R("a", "nvml-cgroup", True), R("b", "nvml-cgroup", True)], 100.0, True, "nvml-cgroup x2"),
    ([R("a", "nvml-cgroup", True), R("b", "advisory", False, at=0.0)], 100.0, False, "node(s) b"),  # any age blocks
    ([R("a", "nvml-cgroup", True), R("b", "mps", False)], 100.0, False, "mps x1"),  # hard cap, no victim
    ([R("a", "nvml-cgroup", True, at=0.0)], 3601.0, False, "older than 3600s"),
    ([R("a", "nvml-cgroup", True, at=1.0)], 3601.0, True, "nvml-cgroup x1"),
])
def test_view(reports, now, ok, text):
    v = view_of(reports, now, 3600.0)
    assert v.victim_enforced is ok and text in v.summary


def test_registry_keeps_last_report_per_node():
    reg = NodeEnforcementRegistry()
    reg.record(R("a", "advisory", False))
    assert not reg.view(100.0, 3600).victim_enforced
    reg.record(R("a", "nvml-cgroup", True))
    assert reg.view(100.0, 3600).victim_enforced
    reg.record(NodeReport("", "advisory", False, False, 1.0))  # no node name: ignored
    assert len(reg.reports()) == 1


@pytest.mark.parametrize("raw, value", [("auto", Oversubscription.AUTO), ("true", Oversubscription.ON),
                                        ("no", Oversubscription.OFF), ("1", Oversubscription.ON)])
def test_config_spellings(raw, value):
    cfg = load_config(_empty(), env={"SWAPAWARE_POLICY__ALLOW_OVERSUBSCRIPTION": raw})
    assert cfg.policy.allow_oversubscription is value


def test_default_is_auto_and_bad_value_refused():
    assert Config().policy.allow_oversubscription is Oversubscription.AUTO
    with pytest.raises(ConfigError):
        load_config(_empty(), env={"SWAPAWARE_POLICY__ALLOW_OVERSUBSCRIPTION": "maybe"})


def _empty() -> Path:
    import tempfile
    f = Path(tempfile.mkdtemp()) / "empty.toml"
    f.write_text("")
    return f
