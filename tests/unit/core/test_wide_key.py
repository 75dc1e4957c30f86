"""Wide keys (account, partition): no single user's runs move the estimate others get past the
bound (policy_service/core/wide_key.py; issue 32 item 3: one 87 GB run made every new class of a
three-user account too large to share)."""
from __future__ import annotations

import json

import pytest

from policy_service.history.schema import stats_from_json, stats_to_json
from policy_service.config import Config, GpuConfig
from policy_service.core import estimator, policy, wide_key
from policy_service.core.request import history_keys, job_request
from policy_service.core.types import (Action, ClassStats, EstimateSource, JobObservation, KeyLevel, ReasonCode,
                                       UserFigure)

GIB = 1024**3
CFG = Config(gpu=GpuConfig(memory_bytes=80 * GIB, shards_per_gpu=8))  # 10 GiB shards; estimator defaults
EST = CFG.estimator  # wide_key_min_samples 5, wide_key_user_cap 1.5
HONEST = [("alice", 10), ("bob", 9), ("carol", 8), ("alice", 10), ("bob", 9), ("carol", 8)]  # (user, GiB)
HUGE_GIB = 81  # 87 GB, on an 80 GiB GPU
SHARED = (Action.SHARE, Action.SHARE_OVERSUBSCRIBED)


def run(s: ClassStats, user: str, gib: float, *, level: KeyLevel = KeyLevel.ACCOUNT, oom: bool = False,
        shared: bool = False) -> ClassStats:
    obs = JobObservation(100.0, 1 if oom else 0, int(gib * GIB), oom, shared, 0)
    return estimator.observe_key(level, s, obs, EST, user)


def account(runs: list[tuple[str, float]], s: ClassStats | None = None) -> ClassStats:
    s = s or ClassStats()
    for user, gib in runs:
        s = run(s, user, gib)
    return s


def new_class(user: str, account_stats: ClassStats):
    """A job of ``user`` whose class and user+name keys know nothing: the account key sizes it."""
    r, access = job_request(user=user, account="lab", partition="gpu", job_name="never-seen", script_fingerprint="fp",
                            gres_fields={"tres_per_node": "gres:gpu:1"})
    return policy.decide(r, {KeyLevel.ACCOUNT: account_stats}, CFG, decision_id="d", now=1.0,
                         job_class=history_keys(r)[KeyLevel.CLASS], gres_fields={"tres_per_node": "gres:gpu:1"},
                         access=access)


def test_an_honest_account_shares_its_new_classes() -> None:
    d = new_class("alice", account(HONEST))
    assert d.action in SHARED and (d.estimate.source, d.estimate.peak_bytes) == (EstimateSource.ACCOUNT, 10 * GIB)


@pytest.mark.parametrize("huge_runs", [1, 20])
def test_one_users_huge_runs_cannot_switch_sharing_off_for_the_others(huge_runs: int) -> None:
    s = account(HONEST)
    for i in range(huge_runs):  # whole-GPU runs, and shared ones that failed out of memory
        s = run(s, "mallory", HUGE_GIB, oom=i % 2 == 1, shared=i % 2 == 1)
    assert s.max_peak_bytes == HUGE_GIB * GIB and s.margin_multiplier == 1.0  # seen, but no OOM margin for all
    bound = int(EST.wide_key_user_cap * 10 * GIB)  # 1.5 x the largest peak of the rest of the key
    for user in ("alice", "bob", "dave"):  # dave: a user with no run under the account yet
        d = new_class(user, s)
        assert d.estimate.peak_bytes == bound
        assert d.action in SHARED and ReasonCode.TOO_LARGE_TO_SHARE not in {r.code for r in d.reasons}
        assert "held to 1.5 x the others' largest peak" in " ".join(r.message for r in d.reasons)
    # mallory's own runs size mallory's own new classes
    assert new_class("mallory", s).estimate.peak_bytes == HUGE_GIB * GIB


def test_one_users_runs_alone_do_not_make_the_key_usable_for_others() -> None:
    s = account([("mallory", 1)] * 20)  # hidden usage: tiny peaks, many runs
    assert wide_key.evidence(s, "alice", EST) == EST.wide_key_min_samples - 1
    assert new_class("alice", s).estimate.source is EstimateSource.UNKNOWN
    assert new_class("mallory", s).estimate.source is EstimateSource.ACCOUNT


def test_a_users_own_figure_counts_in_full_for_them_and_anchors_the_others() -> None:
    s = account([("mallory", HUGE_GIB)] * 4 + [("alice", 20)])
    assert new_class("alice", s).estimate.peak_bytes == 30 * GIB  # mallory's held to 1.5 x alice's 20
    assert new_class("dave", s).estimate.peak_bytes == 30 * GIB


def test_narrow_keys_fold_as_before_and_keep_no_user_figures() -> None:
    for level in (KeyLevel.CLASS, KeyLevel.USER_NAME):
        s = run(run(ClassStats(), "alice", 10, level=level), "alice", 12, level=level, oom=True, shared=True)
        assert s.users == () and s.margin_multiplier == EST.oom_margin_multiplier and s.max_peak_bytes == 12 * GIB


def test_statistics_stored_before_figures_count_as_one_user_and_are_held_once_others_run() -> None:
    legacy = ClassStats(samples=10, runs=10, ewma_peak_bytes=HUGE_GIB * GIB, max_peak_bytes=HUGE_GIB * GIB)
    assert new_class("alice", legacy).estimate.peak_bytes == HUGE_GIB * GIB  # as before: nothing to hold it to
    s = run(legacy, "bob", 10)
    assert wide_key.figures(s) == (UserFigure(wide_key.LEGACY, 10, HUGE_GIB * GIB), UserFigure("bob", 1, 10 * GIB))
    assert new_class("alice", s).estimate.peak_bytes == 15 * GIB


def test_figures_are_bounded_and_survive_the_history_store() -> None:
    s = account([(f"user{i}", 1) for i in range(100)])
    assert len(s.users) == 64 and s.users[-1].user == "user99"  # the most recently seen
    assert stats_from_json(stats_to_json(s)) == s
    stored = json.loads(stats_to_json(s))
    stored["users"] = [{"user": "a", "samples": 2, "max_peak_bytes": GIB}, {"user": 5}, "x",
                       {"user": "b", "samples": -3, "max_peak_bytes": "big"}, {"user": "a", "samples": 3}]
    assert stats_from_json(json.dumps(stored)).users == (UserFigure("b", 0, 0), UserFigure("a", 3, 0))
