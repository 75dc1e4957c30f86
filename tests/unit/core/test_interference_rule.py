"""The site's interference model in decisions (core/interference_rule.py): the budget on what
co-runners may cost a job with a learned utilisation, the class kept whole when its own shared
runs were slowed past the budget, and which model a job's GPU type is judged by."""
from dataclasses import replace

import pytest

from policy_service.core import policy
from policy_service.core.interference import KneeParams
from policy_service.core.interference_learn import LearnedModel, Prior, Source
from policy_service.core.interference_rule import (ANY_TYPE, InterferenceView, budget_shards, co_runner_room,
                                                   observed_slowdown, predicted, prior_view)
from policy_service.core.request import history_keys
from policy_service.core.types import Action, ClassStats, KeyLevel, ReasonCode

from tests.unit.core.test_compute_aware import cfg_with, codes, reason, with_util
from tests.unit.core.test_policy import CFG, make

OFF_QUEUE = cfg_with(share_min_queue=0.0, allow_oversubscription=False)
RULE_CODES = {ReasonCode.INTERFERENCE_SHARDS, ReasonCode.INTERFERENCE_BUDGET, ReasonCode.INTERFERENCE_OBSERVED}


def model(a: float, b: float, gpu_type: str = ANY_TYPE, source: Source = Source.LEARNED) -> LearnedModel:
    return LearnedModel(gpu_type, source, KneeParams(a, b), Prior("gavel", KneeParams(0.58, 2.9)), 300, 12, 250.0,
                        25.0, 0.1, f"learned from 300 shared runs of 12 users on {gpu_type}: a {a:.3f}, b {b:.3f}")


def decide(stats, cfg=OFF_QUEUE, view=None, fields=None):
    r, fields, access = make(fields=fields)
    return policy.decide(r, stats, cfg, decision_id="i1", now=1.0, job_class=history_keys(r)[KeyLevel.CLASS],
                         gres_fields=fields, access=access, interference=view)


STEEP = InterferenceView(model(1.6, 2.5))  # near tally-bench's time-slicing (a 1.565, b 2.456)


# ----------------------------------------------------------------------------- the arithmetic
def test_predicted_and_the_room_co_runners_leave_by_hand():
    m = model(1.6, 2.5)
    assert predicted(m, 0.3, 0.0) == 1.0
    assert co_runner_room(1, 8) == 0.875 and co_runner_room(8, 8) == 0.0
    # s(u, v) = 1 + a v + b max(0, u + v - 1)
    assert predicted(m, 0.3, 0.875) == pytest.approx(1 + 1.6 * 0.875 + 2.5 * 0.175)  # 2.8375
    assert predicted(m, 0.3, 0.75) == pytest.approx(1 + 1.2 + 2.5 * 0.05)  # 2.325
    assert predicted(m, 0.3, 0.625) == pytest.approx(2.0)


def test_budget_shards_is_the_fewest_within_the_budget():
    m = model(1.6, 2.5)
    assert budget_shards(0.3, 1, 8, m, 2.0) == (3, pytest.approx(2.0))  # 2.84, 2.33, then 2.00
    assert budget_shards(0.3, 4, 8, m, 2.0) == (4, pytest.approx(1.8))  # already within: as it is
    none, worst = budget_shards(0.3, 1, 8, model(3.0, 8.0), 1.2)  # even 7 of 8: 1 + 3 x 0.125 = 1.375
    assert none is None and worst == pytest.approx(1.375)


def test_observed_slowdown_needs_the_minimum_runs_of_each():
    s = ClassStats(solo_runs=3, shared_runs=3, ewma_solo_runtime_s=100.0, ewma_shared_runtime_s=250.0)
    assert observed_slowdown(s, 3) == pytest.approx(2.5)
    assert observed_slowdown(replace(s, shared_runs=2), 3) is None
    assert observed_slowdown(replace(s, ewma_solo_runtime_s=0.0), 3) is None
    assert observed_slowdown(None, 1) is None


# ----------------------------------------------------------------------------- decisions
@pytest.mark.parametrize("u", [0.05, 0.13, 0.3, 0.5, 0.62, 0.8, 0.87])
def test_the_default_prior_changes_no_decision(u):
    """Gavel's fit (a 0.58) predicts at most 1.58x where co-runners are charged for their compute:
    within the default budget of 2, so with the prior every decision is what it was without a budget."""
    stats = with_util(u)
    with_budget, without = decide(stats), decide(stats, cfg_with(OFF_QUEUE, max_interference_slowdown=0.0))
    assert (with_budget.action, with_budget.shards) == (without.action, without.shards)
    assert not codes(with_budget) & RULE_CODES


def test_a_steep_site_model_charges_more_shards_and_says_which_model():
    d = decide(with_util(0.3), view=STEEP)  # memory: 1 shard; compute: ceil(0.3 x 8) = 3
    assert (d.action, d.shards) == (Action.SHARE, 3)
    assert not codes(d) & RULE_CODES  # 3 shards (compute) already leave co-runners 62.5 %: 2.00x
    d = decide(with_util(0.13), view=STEEP)  # compute asks 2; 2 shards: 1 + 1.6 x 0.75 = 2.2 > 2
    assert (d.action, d.shards) == (Action.SHARE, 3)
    msg = reason(d, ReasonCode.INTERFERENCE_SHARDS)
    assert "charged 3 of 8 shards (not 2)" in msg and "at most 62% busy" in msg and "2.00x slower" in msg
    assert "learned from 300 shared runs of 12 users" in msg
    assert "interference_shards" in policy.parse_admin_comment(d.rewrite.admin_comment)["why"]


def test_a_model_under_which_no_share_stays_within_budget_keeps_the_gpu_whole():
    d = decide(with_util(0.3), cfg_with(OFF_QUEUE, max_interference_slowdown=1.2),
               view=InterferenceView(model(3.0, 8.0)))
    assert d.action is Action.WHOLE_GPU and ReasonCode.INTERFERENCE_BUDGET in codes(d)
    assert "1.38x slower, more than policy.max_interference_slowdown 1.20x" in reason(d, ReasonCode.INTERFERENCE_BUDGET)


def test_no_budget_and_no_utilisation_leave_the_model_out():
    assert (decide(with_util(0.13), cfg_with(OFF_QUEUE, max_interference_slowdown=0.0), view=STEEP).shards) == 2
    d = decide(with_util(None), view=STEEP)  # no learned utilisation: memory alone, as before
    assert (d.action, d.shards) == (Action.SHARE, 1) and not codes(d) & RULE_CODES
    # compute_aware off: co-runners are not charged for their compute, their load is not bounded
    d = decide(with_util(0.13), cfg_with(OFF_QUEUE, compute_aware=False), view=STEEP)
    assert d.shards == 1 and not codes(d) & RULE_CODES


def test_a_class_slowed_past_the_budget_when_shared_keeps_a_whole_gpu():
    stats = with_util(0.3)
    slowed = replace(stats[KeyLevel.CLASS], solo_runs=3, shared_runs=3, ewma_solo_runtime_s=100.0,
                     ewma_shared_runtime_s=240.0)
    d = decide({KeyLevel.CLASS: slowed})
    assert d.action is Action.WHOLE_GPU and ReasonCode.INTERFERENCE_OBSERVED in codes(d)
    assert "took 2.40x its solo runs (3 shared, 3 solo)" in reason(d, ReasonCode.INTERFERENCE_OBSERVED)
    d = decide({KeyLevel.CLASS: replace(slowed, shared_runs=2)})  # not enough shared runs yet
    assert d.action is Action.SHARE
    d = decide({KeyLevel.CLASS: replace(slowed, ewma_shared_runtime_s=190.0)})  # 1.9x: within the budget
    assert d.action is Action.SHARE


def test_a_typed_job_is_judged_by_its_type_once_learned_else_by_the_pooled_model():
    typed = {"tres_per_node": "gres:gpu:h100:1"}
    steep_h100 = InterferenceView(model(0.58, 2.9), (("h100", model(1.6, 2.5, "h100")),))
    assert decide(with_util(0.13), view=steep_h100, fields=typed).shards == 3  # h100's own model
    assert decide(with_util(0.13), view=steep_h100).shards == 2  # untyped: the pooled (Gavel-like) one
    not_yet = InterferenceView(model(0.58, 2.9), (("h100", model(1.6, 2.5, "h100", Source.PRIOR)),))
    assert decide(with_util(0.13), view=not_yet, fields=typed).shards == 2  # h100 not learned yet: pooled


def test_the_prior_view_names_the_prior():
    v = prior_view(CFG)
    assert v.pooled.source is Source.PRIOR and v.pooled.params == KneeParams(0.58, 2.9)
    assert v.pooled.reason == "prior (gavel): a 0.580, b 2.900" and prior_view(CFG) is v


# ----------------------------------------------------------------------------- priority
def site_factor_and_reason(d):
    (r,) = [r for r in d.reasons if r.code in (ReasonCode.PRIORITY_CONTENTION, ReasonCode.PRIORITY_DEFAULT)]
    return d.site_factor, r


def test_the_model_predicts_the_contention_of_a_class_never_measured_shared():
    # Gavel's prior: s(0.3, 0.5) = 1 + 0.58 x 0.5 = 1.29 beside a co-runner of the default 50 %
    sf, r = site_factor_and_reason(decide(with_util(0.3)))
    assert sf == 290 and r.code is ReasonCode.PRIORITY_CONTENTION
    assert r.message.startswith("predicted contention degree 0.290 (alone 30% busy, beside a co-runner 50% busy; "
                                "interference model: prior (gavel)")
    # s(0.8, 0.5) = 1 + 0.29 + 2.9 x 0.3 = 2.16: past the knee
    assert decide(with_util(0.8)).site_factor == 1000  # 1160, capped at site_factor_max
    # the site's model: a steeper one predicts more
    assert decide(with_util(0.3), view=STEEP).site_factor == 800  # 1 + 1.6 x 0.5 = 1.8


def test_a_measured_contention_degree_wins_and_no_utilisation_keeps_the_default():
    stats = with_util(0.3)
    measured = replace(stats[KeyLevel.CLASS], solo_runs=2, shared_runs=2, ewma_solo_runtime_s=100.0,
                       ewma_shared_runtime_s=150.0, ewma_corunners=1.0)
    sf, r = site_factor_and_reason(decide({KeyLevel.CLASS: measured}))
    assert sf == 500 and r.message.startswith("contention degree 0.500 (shared 150s vs solo 100s)")
    sf, r = site_factor_and_reason(decide(with_util(None)))
    assert (sf, r.code) == (0, ReasonCode.PRIORITY_DEFAULT)
