"""Compute-aware sizing: the estimator learns a class's solo GPU utilisation, the policy charges
at least ceil(util x shards_per_gpu) shards for it, and drops that floor while a long queue waits."""
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy_service.config import AccessClass, EstimatorConfig, GpuConfig
from policy_service.core import estimator, policy
from policy_service.core.types import Action, ClassStats, JobObservation, KeyLevel, QueueState, ReasonCode

from tests.unit.core.test_policy import CFG, GIB, NO_OVERSUB, history
from tests.unit.core.test_queue_rule import gated

ALPHA = CFG.estimator.ewma_alpha  # 0.3
COMPUTE_CODES = {ReasonCode.COMPUTE_SHARDS, ReasonCode.COMPUTE_BOUND, ReasonCode.COMPUTE_OVERCOMMITTED}


def run(util=None, *, runtime=100.0, exit_code=0, peak=4 * GIB, oom=False, shared=False, co=0):
    return JobObservation(runtime_s=runtime, exit_code=exit_code, peak_bytes=peak, oom=oom, shared=shared,
                          co_runners=co, util_frac=util)


def fold(*observations, s=None, cfg=CFG.estimator):
    s = s or ClassStats()
    for o in observations:
        s = estimator.observe(s, o, cfg)
    return s


def codes(d):
    return {r.code for r in d.reasons}


def reason(d, code):
    (r,) = [r for r in d.reasons if r.code is code]
    return r.message


def with_util(util, *peaks_gib, level=KeyLevel.CLASS):
    """History of a class that needs ``peaks_gib`` (default 3 GiB: one 10 GiB shard) and, at
    ``level``, a learned solo utilisation ``util`` (None: never measured)."""
    stats = history(*(peaks_gib or (3,)))
    if util is not None:
        stats[level] = replace(stats.get(level, ClassStats()), util_runs=1, ewma_solo_util=util)
    return stats


def cfg_with(base=CFG, **policy_kw):
    return replace(base, policy=replace(base.policy, **policy_kw))


LONG = QueueState(pending_gpus=4.0, total_gpus=4)  # pressure exactly 1.0
SHORT_OF_LONG = QueueState(pending_gpus=3.96, total_gpus=4)  # pressure 0.99


# ----------------------------------------------------------------------------- estimator.observe
@pytest.mark.parametrize("obs,util_runs,ewma_util,solo_runs", [
    (run(0.62), 1, 0.62, 1),
    (run(0.62, shared=True), 1, 0.62, 1),  # on shards but alone on its GPU: its own figure
    (run(0.0), 1, 0.0, 1),  # an idle GPU is a figure, not a missing one
    (run(1.0), 1, 1.0, 1),
    (run(1.3), 1, 1.0, 1),  # clamped to 1
    (run(-0.2), 1, 0.0, 1),  # clamped to 0
    (run(0.62, peak=None), 1, 0.62, 1),  # no memory figure: utilisation still learned
    (run(None), 0, 0.0, 1),  # not measured
    (run(0.62, co=1), 0, 0.0, 0),  # device-wide figure with a co-runner: not the job's own
    (run(0.62, co=3, shared=True), 0, 0.0, 0),
    (run(0.62, exit_code=1), 0, 0.0, 0),  # failed
    (run(0.62, exit_code=-9), 0, 0.0, 0),
    (run(0.62, runtime=0.0), 0, 0.0, 0),  # no runtime
    (run(0.62, oom=True, shared=True, exit_code=1), 0, 0.0, 0),  # OOM of a shared run
    (run(0.62, oom=True, shared=False, exit_code=1), 0, 0.0, 0),  # OOM of a whole-GPU run
    (run(0.62, oom=True, shared=False, exit_code=0), 0, 0.0, 0),  # OOM reported on a run that exited 0
], ids=["solo", "solo-on-shards", "zero", "one", "above-one", "negative", "no-peak", "none", "co-runner",
        "co-runners-shared", "failed", "signalled", "zero-runtime", "oom-shared", "oom-whole", "oom-exit-0"])
def test_observe_folds_utilisation_only_of_successful_solo_runs(obs, util_runs, ewma_util, solo_runs):
    s = estimator.observe(ClassStats(), obs, CFG.estimator)
    assert (s.util_runs, s.ewma_solo_util, s.solo_runs, s.runs) == (util_runs, ewma_util, solo_runs, 1)


@pytest.mark.parametrize("obs", [run(0.9, co=1), run(0.9, exit_code=2), run(0.9, runtime=0.0),
                                 run(0.9, oom=True, shared=True, exit_code=1), run(None)],
                         ids=["co-runner", "failed", "zero-runtime", "oom", "none"])
def test_runs_that_teach_no_utilisation_leave_the_learned_figure_alone(obs):
    before = ClassStats(runs=3, solo_runs=3, util_runs=3, ewma_solo_util=0.4)
    after = estimator.observe(before, obs, CFG.estimator)
    assert (after.util_runs, after.ewma_solo_util, after.runs) == (3, 0.4, 4)


def test_ewma_of_utilisation_with_the_default_alpha():
    s = fold(run(0.5))
    assert (s.util_runs, s.ewma_solo_util) == (1, 0.5)  # the first figure is taken as it is
    s = fold(run(0.9), s=s)
    assert s.util_runs == 2
    assert s.ewma_solo_util == pytest.approx((1 - ALPHA) * 0.5 + ALPHA * 0.9, abs=1e-15)
    assert s.ewma_solo_util == pytest.approx(0.62, abs=1e-12)


def test_ewma_of_utilisation_exact_arithmetic():
    cfg = EstimatorConfig(ewma_alpha=0.25)  # binary fractions: every step is exact
    s = fold(run(0.5), cfg=cfg)
    assert s.ewma_solo_util == 0.5
    s = fold(run(1.0), s=s, cfg=cfg)
    assert s.ewma_solo_util == 0.625  # 0.75 * 0.5 + 0.25 * 1.0
    s = fold(run(0.25), s=s, cfg=cfg)
    assert s.ewma_solo_util == 0.53125  # 0.75 * 0.625 + 0.25 * 0.25
    s = fold(run(1.5), s=s, cfg=cfg)  # clamped to 1.0 before the fold
    assert s.ewma_solo_util == 0.6484375  # 0.75 * 0.53125 + 0.25 * 1.0
    assert s.util_runs == 4


def test_first_utilisation_figure_is_taken_as_is_even_after_solo_runs_without_one():
    s = fold(run(None), run(None), run(0.62, co=1))  # solo runs without a figure, then a shared one
    assert (s.solo_runs, s.shared_runs, s.util_runs) == (2, 1, 0)
    s = fold(run(0.8), s=s)
    assert (s.util_runs, s.ewma_solo_util) == (1, 0.8)  # not blended with the 0.0 default


def test_runs_without_a_figure_in_between_do_not_disturb_the_average():
    cfg = EstimatorConfig(ewma_alpha=0.25)
    s = fold(run(0.5), run(None), run(0.9, co=2), run(0.9, exit_code=1), run(1.0), cfg=cfg)
    assert (s.util_runs, s.ewma_solo_util) == (2, 0.625)


def test_observation_without_util_defaults_to_none():
    assert JobObservation(1.0, 0, None, False, False, 0).util_frac is None


# ----------------------------------------------------------------------------- solo_utilisation
U = ClassStats(util_runs=1, ewma_solo_util=0.4)
V = ClassStats(util_runs=5, ewma_solo_util=0.7)
NONE_YET = ClassStats(runs=4, util_runs=0, ewma_solo_util=0.9)  # a figure with no run behind it


@pytest.mark.parametrize("stats,expected", [
    ({}, None),
    ({KeyLevel.CLASS: U}, (0.4, KeyLevel.CLASS)),
    ({KeyLevel.USER_NAME: V}, (0.7, KeyLevel.USER_NAME)),
    ({KeyLevel.CLASS: U, KeyLevel.USER_NAME: V}, (0.4, KeyLevel.CLASS)),  # the narrower key first
    ({KeyLevel.CLASS: NONE_YET, KeyLevel.USER_NAME: V}, (0.7, KeyLevel.USER_NAME)),  # class has no util runs
    ({KeyLevel.CLASS: NONE_YET}, None),
    ({KeyLevel.CLASS: NONE_YET, KeyLevel.USER_NAME: NONE_YET}, None),
    ({KeyLevel.ACCOUNT: V, KeyLevel.PARTITION: U}, None),  # wide keys never say how busy one job is
    ({KeyLevel.ACCOUNT: V, KeyLevel.USER_NAME: U}, (0.4, KeyLevel.USER_NAME)),
], ids=["empty", "class", "user-name", "class-first", "class-without-runs", "no-runs", "no-runs-anywhere",
        "wide-only", "user-name-over-account"])
def test_solo_utilisation_key_fallback(stats, expected):
    assert policy.solo_utilisation(stats) == expected


def test_user_name_utilisation_sizes_a_new_class():
    d = gated(None, stats=with_util(0.62, level=KeyLevel.USER_NAME), cfg=CFG)
    assert (d.action, d.shards) == (Action.SHARE, 5)
    assert "62% busy (user_name history)" in reason(d, ReasonCode.COMPUTE_SHARDS)


# ----------------------------------------------------------------------------- sizing through decide
@pytest.mark.parametrize("cfg,stats,action,shards,code", [
    (CFG, with_util(0.62), Action.SHARE, 5, ReasonCode.COMPUTE_SHARDS),  # memory: 1 shard; compute: 5
    (NO_OVERSUB, with_util(0.62), Action.SHARE, 5, ReasonCode.COMPUTE_SHARDS),
    (CFG, with_util(0.97), Action.WHOLE_GPU, 8, ReasonCode.COMPUTE_BOUND),
    (CFG, with_util(1.0), Action.WHOLE_GPU, 8, ReasonCode.COMPUTE_BOUND),
    (CFG, with_util(0.8751), Action.WHOLE_GPU, 8, ReasonCode.COMPUTE_BOUND),  # ceil(7.0008) = 8
    (CFG, with_util(0.875), Action.SHARE, 7, ReasonCode.COMPUTE_SHARDS),  # exactly 7 of 8
    (CFG, with_util(0.13), Action.SHARE, 2, ReasonCode.COMPUTE_SHARDS),  # ceil(1.04) = 2
    (CFG, with_util(0.125), Action.SHARE, 1, ReasonCode.FITS_IN_SHARDS),  # exactly 1 of 8: memory's 1
    (CFG, with_util(0.05), Action.SHARE, 1, ReasonCode.FITS_IN_SHARDS),  # memory decides
    (CFG, with_util(0.0), Action.SHARE, 1, ReasonCode.FITS_IN_SHARDS),
    (CFG, with_util(None), Action.SHARE, 1, ReasonCode.FITS_IN_SHARDS),  # never measured
    (NO_OVERSUB, with_util(0.62, 45), Action.SHARE, 6, ReasonCode.FITS_IN_SHARDS),  # memory's 6 > compute's 5
    (CFG, with_util(0.62, 75), Action.WHOLE_GPU, 8, ReasonCode.TOO_LARGE_TO_SHARE),  # 93.75 GiB > device
    (CFG, with_util(0.97, 75), Action.WHOLE_GPU, 8, ReasonCode.TOO_LARGE_TO_SHARE),
    (cfg_with(compute_aware=False), with_util(0.62), Action.SHARE, 1, ReasonCode.FITS_IN_SHARDS),
    (cfg_with(compute_aware=False), with_util(0.97), Action.SHARE, 1, ReasonCode.FITS_IN_SHARDS),
    (replace(CFG, gpu=GpuConfig(memory_bytes=80 * GIB, shards_per_gpu=4)), with_util(0.62), Action.SHARE, 3,
     ReasonCode.COMPUTE_SHARDS),  # ceil(2.48) = 3 of 4
    (replace(CFG, gpu=GpuConfig(memory_bytes=80 * GIB, shards_per_gpu=25)), with_util(0.28), Action.SHARE, 7,
     ReasonCode.COMPUTE_SHARDS),  # 0.28 * 25 = 7.000000000000001: float noise is not an 8th shard
    (replace(CFG, gpu=GpuConfig(memory_bytes=80 * GIB, shards_per_gpu=1)), with_util(0.05), Action.WHOLE_GPU, 1,
     ReasonCode.COMPUTE_BOUND),  # one shard per GPU: any measured use is the whole GPU
], ids=["u62", "u62-no-oversub", "u97", "u100", "u8751", "u875", "u13", "u125", "u05", "u0", "unmeasured",
        "memory-wins", "too-large", "too-large-compute-bound", "off-u62", "off-u97", "spg4", "spg25-noise", "spg1"])
def test_compute_aware_sizing(cfg, stats, action, shards, code):
    d = gated(None, stats=stats, cfg=cfg)
    assert (d.action, d.shards) == (action, shards)
    assert code in codes(d)
    present = codes(d) & COMPUTE_CODES
    assert present == ({code} if code in COMPUTE_CODES else set())
    if action is Action.SHARE:
        assert d.rewrite.tres_per_node == f"gres:shard:{shards}"
        assert f"fits {shards} of {cfg.gpu.shards_per_gpu} shards" in reason(d, ReasonCode.FITS_IN_SHARDS)


def test_compute_shards_reason_carries_the_figures():
    d = gated(None, stats=with_util(0.62), cfg=replace(CFG, policy=replace(CFG.policy, tell_users=True)))
    assert reason(d, ReasonCode.COMPUTE_SHARDS) == (
        "alone on a GPU it kept it 62% busy (class history): charged 5 of 8 shards so the jobs on a GPU ask for "
        "no more than its compute")
    assert reason(d, ReasonCode.FITS_IN_SHARDS) == "3.8GiB fits 5 of 8 shards (50.0GiB)"
    assert d.reasons[0].code is ReasonCode.COMPUTE_SHARDS
    assert d.rewrite.user_message.startswith("swapaware: gpu request rewritten to 5 shard(s)")
    why = policy.parse_admin_comment(d.rewrite.admin_comment)["why"].split(",")
    assert why[:2] == ["compute_shards", "fits_in_shards"]


def test_compute_bound_reason_and_record():
    d = gated(None, stats=with_util(0.97), cfg=CFG)
    assert reason(d, ReasonCode.COMPUTE_BOUND) == (
        "alone on a GPU it kept it 97% busy (class history): it needs the whole GPU's compute")
    assert d.rewrite.tres_per_node == "gres:shard:8" and d.rewrite.user_message is None
    assert ReasonCode.FITS_IN_SHARDS not in codes(d) and ReasonCode.WHOLE_GPU_AS_SHARDS in codes(d)
    parsed = policy.parse_admin_comment(d.rewrite.admin_comment)
    assert parsed["action"] == "whole_gpu" and parsed["why"].split(",")[0] == "compute_bound"


# A compute-bound access class swaps cheaply: 40 GiB + 25 % cold margin = 50 GiB fits 5 shards,
# yet memory alone oversubscribes it down to 1 shard within the 1.25x budget.
COMPUTE_BOUND_ACCESS = "swapaware:access=compute_bound"


@pytest.mark.parametrize("cfg,util,action,shards,offloaded_gib", [
    (CFG, None, Action.SHARE_OVERSUBSCRIBED, 1, 40),  # memory alone: 1 shard
    (CFG, 0.05, Action.SHARE_OVERSUBSCRIBED, 1, 40),  # floor 1: same as memory alone
    (CFG, 0.3, Action.SHARE_OVERSUBSCRIBED, 3, 20),  # floor ceil(2.4) = 3: the search starts there
    (CFG, 0.5, Action.SHARE_OVERSUBSCRIBED, 4, 10),  # floor 4
    (CFG, 0.62, Action.SHARE, 5, 0),  # floor 5 = memory's 5: nothing left to search
    (cfg_with(compute_aware=False), 0.3, Action.SHARE_OVERSUBSCRIBED, 1, 40),
], ids=["no-util", "u05", "u30", "u50", "u62", "compute-aware-off"])
def test_oversubscription_never_goes_below_the_compute_floor(cfg, util, action, shards, offloaded_gib):
    d = gated(None, stats=with_util(util, 40), cfg=cfg, comment=COMPUTE_BOUND_ACCESS)
    assert d.estimate.sized_bytes == 50 * GIB
    assert (d.action, d.shards, d.offloaded_bytes) == (action, shards, offloaded_gib * GIB)
    assert ReasonCode.COMPUTE_SHARDS not in codes(d)  # the floor never exceeds memory's 5 shards here
    if action is Action.SHARE_OVERSUBSCRIBED:
        assert reason(d, ReasonCode.OVERSUBSCRIBED).startswith(f"charged {shards} shard(s) for 50.0GiB")
        assert 1.0 < d.swap_slowdown <= cfg.policy.max_victim_slowdown
    else:
        assert ReasonCode.FITS_IN_SHARDS in codes(d) and d.swap_slowdown == 1.0


# ----------------------------------------------------------------------------- property
queues = st.one_of(
    st.none(),
    st.builds(QueueState, pending_gpus=st.floats(0.0, 64.0), total_gpus=st.integers(0, 16),
              age_s=st.sampled_from([0.0, 10.0, 45.0, 45.001, 1e6]),
              ahead_by_qos=st.sampled_from([(), (("high", 0.5), ("normal", 12.0))])),
)


@settings(max_examples=400, deadline=None)
@given(util=st.floats(min_value=0.0, max_value=1.0), peaks=st.lists(st.floats(0.01, 120.0), max_size=4),
       spg=st.sampled_from([1, 2, 4, 7, 8, 10, 16]), mem_gib=st.sampled_from([16, 40, 80, 141]),
       oversub=st.booleans(), access=st.sampled_from(list(AccessClass)), queue=queues,
       threshold=st.sampled_from([0.0, 0.5, 1.0, 2.0]), qos=st.sampled_from(["", "high", "normal"]),
       per_qos=st.booleans())
def test_property_a_shared_job_gets_its_compute_unless_overcommitted(util, peaks, spg, mem_gib, oversub, access,
                                                                     queue, threshold, qos, per_qos):
    cfg = replace(CFG, gpu=GpuConfig(memory_bytes=mem_gib * GIB, shards_per_gpu=spg),
                  policy=replace(CFG.policy, allow_oversubscription=oversub, compute_aware=True,
                                 overcommit_compute_min_queue=threshold, queue_per_qos=per_qos))
    stats = history(*peaks) if peaks else {}
    # learned through the estimator, as the service learns it
    stats[KeyLevel.CLASS] = estimator.observe(stats.get(KeyLevel.CLASS, ClassStats()), run(util, peak=None),
                                              cfg.estimator)
    assert stats[KeyLevel.CLASS].ewma_solo_util == util
    d = gated(queue, stats=stats, cfg=cfg, qos=qos, comment=f"swapaware:access={access.value}")
    # The policy's 1e-9 tolerance: 0.28 x 25 = 7.000000000000001 means 7 shards, not 8.
    floor = max(1, math.ceil(util * spg - 1e-9))
    overcommitted = ReasonCode.COMPUTE_OVERCOMMITTED in codes(d)
    if d.action in (Action.SHARE, Action.SHARE_OVERSUBSCRIBED) and not overcommitted:
        assert d.shards >= floor
        assert floor < spg
    if ReasonCode.COMPUTE_SHARDS in codes(d):  # the floor raised memory's count: charged exactly the floor
        assert (d.action, d.shards) == (Action.SHARE, floor) and floor > 1
        assert not overcommitted and ReasonCode.OVERSUBSCRIBED not in codes(d)
    if overcommitted:
        view = qos if per_qos else ""
        assert d.action in (Action.SHARE, Action.SHARE_OVERSUBSCRIBED)
        assert threshold > 0 and queue is not None and queue.age_s <= 3 * cfg.policy.queue_poll_s
        assert queue.pressure_for(view) >= threshold
        assert not codes(d) & {ReasonCode.COMPUTE_SHARDS, ReasonCode.COMPUTE_BOUND}
    if ReasonCode.COMPUTE_BOUND in codes(d):
        assert d.action is Action.WHOLE_GPU and floor >= spg
    assert 0 <= d.shards <= spg
