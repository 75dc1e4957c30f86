"""policy.mode applied to decisions: shadow keeps the decision and changes nothing but the AdminComment."""
from __future__ import annotations

import pytest

from policy_service.config import Config, PolicyMode
from policy_service.core import policy
from policy_service.core.mode import SHADOW_TOKEN, apply_mode, shadow_comment
from policy_service.core.types import Action, Rewrite

from tests.unit.core.test_policy import decide, history, make, telling

CFG = Config()
MAX = CFG.policy.admin_comment_max_chars


@pytest.mark.parametrize("kw,stats", [
    ({}, history(10, 10, 10)),  # shares
    ({}, None),  # kept whole: no history
    ({"fields": {"tres_per_node": "gres:shard:2"}}, None),  # asked for shards: site factor only
])
def test_shadow_changes_nothing_but_the_admin_comment(kw, stats):
    enforced = decide(stats, **kw)
    shadow = apply_mode(enforced, PolicyMode.SHADOW, MAX)
    assert shadow.rewrite == Rewrite(admin_comment=shadow.rewrite.admin_comment)
    assert shadow.rewrite.admin_comment and SHADOW_TOKEN in shadow.rewrite.admin_comment
    fields = policy.parse_admin_comment(shadow.rewrite.admin_comment)
    # what would have been done is kept: action, shards, prediction, the decision id
    assert fields["mode"] == "shadow" and fields["action"] == enforced.action.value
    assert fields["shards"] == str(enforced.shards) and fields["id"] == enforced.decision_id
    assert (shadow.action, shadow.shards, shadow.estimate) == (enforced.action, enforced.shards, enforced.estimate)
    assert shadow.mode is PolicyMode.SHADOW and shadow.reasons[-1].code.value == "shadow_mode"


def test_a_sharing_decision_in_shadow_sets_no_gres_no_site_factor_no_message():
    enforced = decide(history(10, 10, 10), cfg=telling(CFG))
    assert enforced.action in (Action.SHARE, Action.SHARE_OVERSUBSCRIBED)
    assert enforced.rewrite.tres_per_node and enforced.rewrite.user_message
    shadow = apply_mode(enforced, PolicyMode.SHADOW, MAX)
    r = shadow.rewrite
    assert (r.tres_per_node, r.tres_per_job, r.tres_per_task, r.tres_per_socket, r.site_factor,
            r.user_message) == (None,) * 6


def test_enforce_is_the_decision_itself_and_non_gpu_jobs_stay_without_a_record():
    d = decide(history(10, 10, 10))
    assert apply_mode(d, PolicyMode.ENFORCE, MAX) is d
    none = decide(fields={"tres_per_node": ""})
    assert apply_mode(none, PolicyMode.SHADOW, MAX).rewrite == Rewrite()


@pytest.mark.parametrize("comment,limit,expect", [
    ("swapaware:v1 id=ab action=share shards=2", 200, "swapaware:v1 id=ab mode=shadow action=share shards=2"),
    ("swapaware:v1 id=ab action=share shards=2", 30, "swapaware:v1 id=ab mode=shadow"),
    ("swapaware:v1 id=ab", 200, "swapaware:v1 id=ab mode=shadow"),
])
def test_shadow_comment(comment, limit, expect):
    assert shadow_comment(comment, limit) == expect
