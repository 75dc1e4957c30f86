"""Overcommit under a long queue: while GPU work waits past policy.overcommit_compute_min_queue, a
job whose compute floor binds is sized by memory alone, unless the site's interference model predicts
it slowed past policy.max_interference_slowdown beside the co-runners the site observed (the helpers
and the estimator's side: test_compute_aware.py)."""
import math
from dataclasses import replace

import pytest

from policy_service.core import policy
from policy_service.core.interference import KneeParams
from policy_service.core.interference_learn import LearnedModel, Prior, Source
from policy_service.core.interference_rule import ANY_TYPE, InterferenceView
from policy_service.core.request import history_keys
from policy_service.core.types import Action, KeyLevel, QueueState, ReasonCode

from tests.unit.core.test_compute_aware import (COMPUTE_BOUND_ACCESS, COMPUTE_CODES, LONG, SHORT_OF_LONG, cfg_with, codes,
                                                reason, with_util)
from tests.unit.core.test_policy import CFG, make
from tests.unit.core.test_queue_rule import gated


# ----------------------------------------------------------------------------- overcommit under a long queue
# LIFT: no interference budget, the long-queue lift as such (with the budget, the default: a class as
# busy as 0.75 is not lifted under the default prior; test_long_queue_keeps_the_floor_past_the_budget).
LIFT = cfg_with(max_interference_slowdown=0.0)

@pytest.mark.parametrize("cfg,queue,util,action,shards,expected_codes", [
    (LIFT, LONG, 0.62, Action.SHARE, 1, {ReasonCode.COMPUTE_OVERCOMMITTED}),
    (LIFT, QueueState(8.0, 4), 0.62, Action.SHARE, 1, {ReasonCode.COMPUTE_OVERCOMMITTED}),
    (LIFT, LONG, 0.97, Action.SHARE, 1, {ReasonCode.COMPUTE_OVERCOMMITTED}),  # not kept whole either
    (LIFT, QueueState(1.25, 0), 0.62, Action.SHARE, 1, {ReasonCode.COMPUTE_OVERCOMMITTED}),  # no node: infinite
    (LIFT, QueueState(8.0, 4, age_s=45.0), 0.62, Action.SHARE, 1, {ReasonCode.COMPUTE_OVERCOMMITTED}),  # fresh
    (LIFT, SHORT_OF_LONG, 0.62, Action.SHARE, 5, {ReasonCode.COMPUTE_SHARDS}),
    (LIFT, SHORT_OF_LONG, 0.97, Action.WHOLE_GPU, 8, {ReasonCode.COMPUTE_BOUND}),
    (LIFT, QueueState(8.0, 4, age_s=45.001), 0.62, Action.SHARE, 5, {ReasonCode.COMPUTE_SHARDS}),  # stale
    (LIFT, QueueState(8.0, 4, age_s=1e6), 0.97, Action.WHOLE_GPU, 8, {ReasonCode.COMPUTE_BOUND}),
    (LIFT, None, 0.62, Action.SHARE, 5, {ReasonCode.COMPUTE_SHARDS}),  # unknown queue
    (cfg_with(LIFT, overcommit_compute_min_queue=0.0), QueueState(100.0, 4), 0.62, Action.SHARE, 5,
     {ReasonCode.COMPUTE_SHARDS}),  # 0: never
    (cfg_with(LIFT, overcommit_compute_min_queue=0.0), QueueState(1.25, 0), 0.97, Action.WHOLE_GPU, 8,
     {ReasonCode.COMPUTE_BOUND}),
    (cfg_with(LIFT, overcommit_compute_min_queue=0.5), QueueState(2.0, 4), 0.62, Action.SHARE, 1,
     {ReasonCode.COMPUTE_OVERCOMMITTED}),
    (cfg_with(LIFT, overcommit_compute_min_queue=0.5), QueueState(1.96, 4), 0.62, Action.SHARE, 5,
     {ReasonCode.COMPUTE_SHARDS}),
    (cfg_with(LIFT, overcommit_compute_min_queue=2.0), QueueState(6.0, 4), 0.62, Action.SHARE, 5,
     {ReasonCode.COMPUTE_SHARDS}),
    (LIFT, LONG, None, Action.SHARE, 1, set()),  # nothing learned: nothing to overcommit
    (cfg_with(LIFT, compute_aware=False), LONG, 0.62, Action.SHARE, 1, set()),
], ids=["at-threshold", "far-above", "compute-bound", "no-node", "age-at-limit", "just-below",
        "just-below-compute-bound", "stale", "stale-compute-bound", "unknown", "threshold-0",
        "threshold-0-infinite", "threshold-half", "below-half", "threshold-2", "no-util", "compute-aware-off"])
def test_overcommit_under_a_long_queue(cfg, queue, util, action, shards, expected_codes):
    d = gated(queue, stats=with_util(util), cfg=cfg)
    assert (d.action, d.shards) == (action, shards)
    assert codes(d) & COMPUTE_CODES == expected_codes
    if action is Action.SHARE:
        assert d.rewrite.tres_per_node == f"gres:shard:{shards}" and ReasonCode.FITS_IN_SHARDS in codes(d)
    fresh = queue is not None and queue.age_s <= 3 * cfg.policy.queue_poll_s
    assert (ReasonCode.QUEUE_UNKNOWN in codes(d)) is (action is Action.SHARE and not fresh)


def test_overcommitted_reason_carries_the_figures():
    d = gated(QueueState(6.0, 4), stats=with_util(0.62), cfg=LIFT)
    assert reason(d, ReasonCode.COMPUTE_OVERCOMMITTED) == (
        "pending GPU jobs ask for 150% of the cluster's GPUs (>= policy.overcommit_compute_min_queue 100%): "
        "sized by memory alone, co-runners may slow each other down")
    assert "compute_overcommitted" in policy.parse_admin_comment(d.rewrite.admin_comment)["why"].split(",")


def test_long_queue_does_not_mark_a_job_that_stays_whole_for_its_memory():
    d = gated(QueueState(8.0, 4), stats=with_util(0.62, 75), cfg=LIFT)
    assert (d.action, d.shards) == (Action.WHOLE_GPU, 8)
    assert ReasonCode.TOO_LARGE_TO_SHARE in codes(d) and not codes(d) & COMPUTE_CODES


def test_long_queue_does_not_mark_a_job_whose_compute_floor_does_not_bind():
    # util 0.05 -> floor 1 shard, memory needs 1 shard: the long queue changes nothing
    d = gated(QueueState(8.0, 4), stats=with_util(0.05, 3), cfg=LIFT)
    assert (d.action, d.shards) == (Action.SHARE, 1)
    assert not codes(d) & COMPUTE_CODES


def test_overcommit_keeps_the_memory_oversubscription_search_open():
    # 50 GiB of a compute-bound access class, util 0.62: floor 5 without a queue, memory's 1 with one
    quiet = gated(None, stats=with_util(0.62, 40), cfg=LIFT, comment=COMPUTE_BOUND_ACCESS)
    busy = gated(QueueState(8.0, 4), stats=with_util(0.62, 40), cfg=LIFT, comment=COMPUTE_BOUND_ACCESS)
    assert (quiet.action, quiet.shards) == (Action.SHARE, 5)
    assert (busy.action, busy.shards) == (Action.SHARE_OVERSUBSCRIBED, 1)
    assert {ReasonCode.OVERSUBSCRIBED, ReasonCode.COMPUTE_OVERCOMMITTED} <= codes(busy)


# Only "high" work (1 GPU) waits ahead of a high-QoS job; the whole queue (8 GPUs of 4) ahead of a normal one.
PER_QOS = QueueState(8.0, 4, ahead_by_qos=(("high", 1.0), ("normal", 8.0)))


@pytest.mark.parametrize("cfg,qos,shards,code", [
    (LIFT, "high", 5, ReasonCode.COMPUTE_SHARDS),  # 25 % ahead of it: keeps the floor
    (LIFT, "normal", 1, ReasonCode.COMPUTE_OVERCOMMITTED),  # 200 % ahead of it
    (LIFT, "", 1, ReasonCode.COMPUTE_OVERCOMMITTED),  # no --qos: the whole queue
    (LIFT, "unlisted", 1, ReasonCode.COMPUTE_OVERCOMMITTED),
    (cfg_with(LIFT, queue_per_qos=False), "high", 1, ReasonCode.COMPUTE_OVERCOMMITTED),  # every job sees it all
], ids=["high", "normal", "no-qos", "unlisted-qos", "per-qos-off"])
def test_overcommit_reads_the_queue_ahead_of_the_jobs_qos(cfg, qos, shards, code):
    d = gated(PER_QOS, stats=with_util(0.62), cfg=cfg, qos=qos)
    assert (d.action, d.shards) == (Action.SHARE, shards)
    assert codes(d) & COMPUTE_CODES == {code}


def test_overcommit_reason_names_the_qos_view():
    d = gated(PER_QOS, stats=with_util(0.62), cfg=LIFT, qos="normal")
    assert reason(d, ReasonCode.COMPUTE_OVERCOMMITTED).startswith(
        "pending GPU jobs at or above QoS 'normal' ask for 200% of the cluster's GPUs")


def test_decide_with_util_and_queue_is_pure():
    assert gated(PER_QOS, stats=with_util(0.62), cfg=LIFT, qos="high") == \
        gated(PER_QOS, stats=with_util(0.62), cfg=LIFT, qos="high")


# The default prior (Gavel's fit: a 0.58, b 2.9) and budget 2. The prior has no shared runs, so the
# co-runners of a job sized by memory alone are one of swap_cost.default_solo_util (0.5): a job of solo
# utilisation u is predicted 1 + 0.58 x 0.5 + 2.9 x max(0, u - 0.5), within 2 up to u 0.7448. (The
# rule before predicted beside a whole busy GPU, 1 + 0.58 + 2.9 u: within 2 only up to u 0.1448.)
@pytest.mark.parametrize("util,shards,lifted,slow", [
    (0.62, 1, True, "1.64"),   # 1.638x <= 2: floor 5 lifted to memory's 1
    (0.74, 1, True, "1.99"),   # 1.986x: floor ceil(5.92) = 6 lifted
    (0.75, 6, False, "2.02"),  # 2.015x > 2: floor 6 kept
    (0.80, 7, False, "2.16"),  # 2.16x: floor ceil(6.4) = 7 kept
], ids=["u62-within", "u74-within", "u75-past", "u80-past"])
def test_long_queue_keeps_the_floor_past_the_budget(util, shards, lifted, slow):
    d = gated(QueueState(8.0, 4), stats=with_util(util), cfg=CFG)
    assert (d.action, d.shards) == (Action.SHARE, shards)
    assert (ReasonCode.COMPUTE_OVERCOMMITTED in codes(d)) is lifted
    assert (ReasonCode.LONG_QUEUE_OVER_BUDGET in codes(d)) is (not lifted)
    beside = (f"alone on a GPU it kept it {util:.0%} busy (class history), and beside co-runners keeping the GPU 50% "
              f"busy (one co-runner of swap_cost.default_solo_util: no shared runs learned) the site's model "
              f"predicts it {slow}x slower")
    model = "(interference model: prior (gavel): a 0.580, b 2.900)"
    if lifted:
        assert reason(d, ReasonCode.COMPUTE_OVERCOMMITTED) == (
            "pending GPU jobs ask for 200% of the cluster's GPUs (>= policy.overcommit_compute_min_queue 100%): "
            f"sized by memory alone, co-runners may slow each other down; {beside}, within "
            f"policy.max_interference_slowdown 2.00x {model}")
    else:
        assert ReasonCode.COMPUTE_SHARDS in codes(d)
        assert reason(d, ReasonCode.LONG_QUEUE_OVER_BUDGET) == (
            f"not sized by memory alone for the long queue (policy.overcommit_compute_min_queue 100%): {beside}, "
            f"more than policy.max_interference_slowdown 2.00x {model}")
        assert "long_queue_over_budget" in policy.parse_admin_comment(d.rewrite.admin_comment)["why"].split(",")
    quiet = gated(None, stats=with_util(util), cfg=CFG)  # no queue: the floor, and no word of the budget
    assert quiet.shards == math.ceil(util * 8)
    assert ReasonCode.LONG_QUEUE_OVER_BUDGET not in codes(quiet)


def test_long_queue_keeps_a_compute_bound_job_whole_past_the_budget():
    """u 0.97: floor 8 (whole GPU); beside one co-runner 50 % busy 1.29 + 2.9 x 0.47 = 2.65x > 2."""
    d = gated(QueueState(8.0, 4), stats=with_util(0.97), cfg=CFG)
    assert d.action is Action.WHOLE_GPU
    assert {ReasonCode.COMPUTE_BOUND, ReasonCode.LONG_QUEUE_OVER_BUDGET} <= codes(d)
    assert "predicts it 2.65x slower" in reason(d, ReasonCode.LONG_QUEUE_OVER_BUDGET)


def test_a_gentler_model_lets_the_long_queue_lift_a_busy_class():
    """u 0.9 beside one co-runner 50 % busy: Lucid's fit (a 0.025, b 0.515) 1 + 0.0125 + 0.515 x 0.4 =
    1.22x, lifted to memory's 1 shard; Gavel's (the default) 1.29 + 2.9 x 0.4 = 2.45x, floor 8 kept."""
    lucid = replace(CFG, swap_cost=replace(CFG.swap_cost, compute_interference_base=0.025,
                                           compute_interference_knee_slope=0.515))
    d = gated(QueueState(8.0, 4), stats=with_util(0.9), cfg=lucid)
    assert (d.action, d.shards) == (Action.SHARE, 1)
    assert ReasonCode.COMPUTE_OVERCOMMITTED in codes(d) and ReasonCode.LONG_QUEUE_OVER_BUDGET not in codes(d)
    assert "predicts it 1.22x slower, within" in reason(d, ReasonCode.COMPUTE_OVERCOMMITTED)
    gavel = gated(QueueState(8.0, 4), stats=with_util(0.9), cfg=CFG)
    assert gavel.action is Action.WHOLE_GPU and ReasonCode.LONG_QUEUE_OVER_BUDGET in codes(gavel)


def learned(co_util):
    """A learned model near tally-bench's time-slicing (a 1.6, b 2.5) whose shared runs' co-runners kept
    a GPU ``co_util`` busy on average (None: not known)."""
    return InterferenceView(LearnedModel(ANY_TYPE, Source.LEARNED, KneeParams(1.6, 2.5), Prior("gavel", KneeParams(
        0.58, 2.9)), 300, 12, 250.0, 25.0, 0.1, "learned from 300 shared runs of 12 users on all GPU types: a 1.600, "
        "b 2.500", co_util))


@pytest.mark.parametrize("co_util,shards,slow,whence", [
    (0.3, 1, "1.48", "as the co-runners of the site's 300 shared runs kept it on average"),  # 1 + 0.48: lifted
    (0.9, 5, "3.74", "as the co-runners of the site's 300 shared runs kept it on average"),  # 1 + 1.44 + 2.5 x 0.52
    (None, 5, "2.10", "one co-runner of swap_cost.default_solo_util: no shared runs learned"),  # 1 + 0.8 + 2.5 x 0.12
], ids=["light-co-runners", "busy-co-runners", "not-known"])
def test_the_long_queue_predicts_beside_the_co_runners_the_site_observed(co_util, shards, slow, whence):
    """u 0.62 (floor 5): the same steep model lifts it where the site's shared GPUs carry light co-runners
    and keeps its floor where they carry busy ones."""
    r, fields, access = make()
    d = policy.decide(r, with_util(0.62), CFG, decision_id="q1", now=1.0, job_class=history_keys(r)[KeyLevel.CLASS],
                      gres_fields=fields, access=access, queue=QueueState(8.0, 4), interference=learned(co_util))
    assert (d.action, d.shards) == (Action.SHARE, shards)
    code = ReasonCode.COMPUTE_OVERCOMMITTED if shards == 1 else ReasonCode.LONG_QUEUE_OVER_BUDGET
    v = 0.5 if co_util is None else co_util
    assert (f"beside co-runners keeping the GPU {v:.0%} busy ({whence}) the site's model predicts it {slow}x slower"
            in reason(d, code))
