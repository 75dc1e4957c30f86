from dataclasses import replace

import pytest

from policy_service.config import EstimatorConfig, GpuConfig
from policy_service.core import estimator
from policy_service.core.request import job_request
from policy_service.core.types import ClassStats, EstimateSource, JobObservation, KeyLevel, ReasonCode

GIB = 1024**3
CFG = EstimatorConfig(min_samples=1)  # the mechanism from one run on (the default waits for 3: test_default_min_samples)
GPU = GpuConfig(memory_bytes=80 * GIB, shards_per_gpu=8)


def req(comment="", env=""):
    r, _ = job_request(user="u", account="a", partition="p", job_name="n", script_fingerprint="f",
                       gres_fields={"tres_per_node": "gres:gpu:1"}, comment=comment, env_mem_hint=env)
    return r


def obs(peak, *, oom=False, shared=True, exit_code=0, runtime=100.0, co=0):
    return JobObservation(runtime_s=runtime, exit_code=exit_code, peak_bytes=peak, oom=oom, shared=shared,
                          co_runners=co)


def fold(peaks, s=None):
    s = s or ClassStats()
    for p in peaks:
        s = estimator.observe(s, obs(p), CFG)
    return s


def test_unknown_without_history():
    e = estimator.estimate(req(), {}, CFG, GPU)
    assert e.source is EstimateSource.UNKNOWN and e.peak_bytes == 0
    assert ReasonCode.NO_HISTORY in {r.code for r in e.reasons}


def test_too_few_runs_say_how_many_and_which_setting_asks_for_more():
    """A class with 2 observed runs under the default min_samples (3) is still unknown, and the
    reason names the runs seen and the settings (what `swapaware explain` prints)."""
    cfg = EstimatorConfig()
    s = ClassStats()
    for p in (GIB, GIB):
        s = estimator.observe(s, obs(p), cfg)
    e = estimator.estimate(req(), {KeyLevel.CLASS: s}, cfg, GPU)
    assert e.source is EstimateSource.UNKNOWN and e.class_samples == 2
    said = next(r.message for r in e.reasons if r.code is ReasonCode.NO_HISTORY)
    assert said.startswith("2 observed run(s) of this class, estimator.min_samples = 3 needed"), said
    assert "estimator.wide_key_min_samples = 5" in said, said


def test_one_run_predicts_it_with_the_cold_margin():
    s = fold([10 * GIB])
    e = estimator.estimate(req(), {KeyLevel.CLASS: s}, CFG, GPU)
    assert e.source is EstimateSource.CLASS and e.peak_bytes == 10 * GIB
    assert e.margin_bytes == pytest.approx(CFG.cold_margin_frac * 10 * GIB, rel=1e-6)


def test_margin_shrinks_to_the_floor_once_a_steady_class_is_known():
    s = fold([10 * GIB] * CFG.cold_samples)
    e = estimator.estimate(req(), {KeyLevel.CLASS: s}, CFG, GPU)
    assert e.margin_bytes == pytest.approx(CFG.min_margin_frac * 10 * GIB, rel=1e-6)


@pytest.mark.parametrize("level,min_samples_ok", [
    (KeyLevel.USER_NAME, 1), (KeyLevel.ACCOUNT, 5), (KeyLevel.PARTITION, 5),
])
def test_fallback_order_and_wide_key_threshold(level, min_samples_ok):
    few = fold([4 * GIB] * (min_samples_ok - 1)) if min_samples_ok > 1 else None
    if few is not None:
        e = estimator.estimate(req(), {level: few}, CFG, GPU)
        assert e.source is EstimateSource.UNKNOWN
    enough = fold([4 * GIB, 6 * GIB] + [4 * GIB] * (min_samples_ok - 1))
    e = estimator.estimate(req(), {level: enough}, CFG, GPU)
    assert e.source is level.source
    if level in (KeyLevel.ACCOUNT, KeyLevel.PARTITION):
        assert e.peak_bytes == 6 * GIB  # wide keys use the largest peak


def test_class_key_wins_over_wider():
    e = estimator.estimate(req(), {KeyLevel.CLASS: fold([2 * GIB]), KeyLevel.USER_NAME: fold([9 * GIB])}, CFG, GPU)
    assert e.source is EstimateSource.CLASS and e.peak_bytes == 2 * GIB
    assert e.observed_max_bytes == 9 * GIB


def test_varying_class_gets_wider_margin():
    steady = fold([10 * GIB] * 5)
    # Its runs vary by more than the margin floor (x1.55): peak / estimate reaches 14 / 6.
    noisy = fold([6 * GIB, 14 * GIB, 6 * GIB, 14 * GIB, 10 * GIB])
    m_steady = estimator.estimate(req(), {KeyLevel.CLASS: steady}, CFG, GPU).margin_bytes
    m_noisy = estimator.estimate(req(), {KeyLevel.CLASS: noisy}, CFG, GPU).margin_bytes
    assert m_noisy > m_steady


def test_oom_of_shared_job_raises_margin_and_forces_whole_gpu():
    s = fold([10 * GIB])
    before = estimator.estimate(req(), {KeyLevel.CLASS: s}, CFG, GPU)
    s = estimator.observe(s, obs(11 * GIB, oom=True, shared=True, exit_code=1), CFG)
    assert s.whole_gpu_runs_left == CFG.oom_whole_gpu_runs and s.margin_multiplier == CFG.oom_margin_multiplier
    after = estimator.estimate(req(), {KeyLevel.CLASS: s}, CFG, GPU)
    assert after.sized_bytes > before.sized_bytes
    # whole-GPU successful runs count the penalty down
    s2 = estimator.observe(s, obs(10 * GIB, shared=False), CFG)
    assert s2.whole_gpu_runs_left == CFG.oom_whole_gpu_runs - 1


def test_oom_of_whole_gpu_job_does_not_force_penalty():
    s = estimator.observe(fold([10 * GIB]), obs(79 * GIB, oom=True, shared=False, exit_code=1), CFG)
    assert s.whole_gpu_runs_left == 0 and s.oom_count == 1


def test_margin_multiplier_is_capped():
    s = fold([1 * GIB])
    for _ in range(20):
        s = estimator.observe(s, obs(1 * GIB, oom=True), CFG)
    assert s.margin_multiplier == CFG.max_margin_multiplier


def test_runtimes_split_solo_and_shared():
    s = ClassStats()
    s = estimator.observe(s, obs(GIB, runtime=100, co=0), CFG)
    s = estimator.observe(s, obs(GIB, runtime=150, co=2), CFG)
    s = estimator.observe(s, obs(GIB, runtime=999, exit_code=3, co=1), CFG)  # failures teach no runtime
    assert (s.solo_runs, s.shared_runs) == (1, 1)
    assert (s.ewma_solo_runtime_s, s.ewma_shared_runtime_s, s.ewma_corunners) == (100, 150, 2)


def test_observation_without_memory_counts_run_only():
    s = estimator.observe(ClassStats(), obs(None), CFG)
    assert (s.runs, s.samples) == (1, 0)


@pytest.mark.parametrize("comment,history,expect_source,expect_peak,code", [
    ("swapaware:mem=20G", None, EstimateSource.HINT, 20 * GIB, ReasonCode.HINT_USED),
    ("swapaware:mem=200G", None, EstimateSource.HINT, 80 * GIB, ReasonCode.HINT_CAPPED_AT_DEVICE),
    ("swapaware:mem=2G", [10 * GIB], EstimateSource.CLASS, 10 * GIB, ReasonCode.HINT_BELOW_HISTORY),
    ("swapaware:mem=30G", [10 * GIB], EstimateSource.HINT, 30 * GIB, ReasonCode.HINT_USED),
    ("swapaware:mem=junk", None, EstimateSource.UNKNOWN, 0, ReasonCode.HINT_INVALID),
])
def test_hints(comment, history, expect_source, expect_peak, code):
    stats = {KeyLevel.CLASS: fold(history)} if history else {}
    e = estimator.estimate(req(comment), stats, CFG, GPU)
    assert (e.source, e.peak_bytes) == (expect_source, expect_peak)
    assert code in {r.code for r in e.reasons}


def test_ewma_follows_growth():
    s = fold([10 * GIB] * 3 + [20 * GIB] * 6)
    e = estimator.estimate(req(), {KeyLevel.CLASS: s}, CFG, GPU)
    assert 18 * GIB < e.peak_bytes <= 20 * GIB
    assert replace(s).max_peak_bytes == 20 * GIB


def test_wide_key_history_does_not_overrule_a_hint():
    wide = fold([79 * GIB] * CFG.wide_key_min_samples)
    e = estimator.estimate(req("swapaware:mem=16G"), {KeyLevel.ACCOUNT: wide}, CFG, GPU)
    assert (e.source, e.peak_bytes) == (EstimateSource.HINT, 16 * GIB)


@pytest.mark.parametrize("reported,failed,peak,charged,expect", [
    (True, False, None, 0, True),  # the node saw it
    (False, True, int(9.6 * GIB), 10 * GIB, True),  # died at its cap
    (False, True, 5 * GIB, 10 * GIB, False),  # died for another reason
    (False, False, int(9.9 * GIB), 10 * GIB, False),  # full but fine
    (False, True, int(9.9 * GIB), 0, False),  # not shared: no cap to hit
    (False, True, None, 10 * GIB, False),  # no memory figure
])
def test_infer_oom(reported, failed, peak, charged, expect):
    oom, why = estimator.infer_oom(reported=reported, failed=failed, peak_bytes=peak, charged_bytes=charged,
                                   charge_frac=CFG.oom_charge_frac)
    assert oom is expect and bool(why) is expect


# ---------------------------------------------------------------- quantile (conformal) margin
LEGACY = replace(CFG, recent_runs=0, margin_multiplier_decay=1.0)


@pytest.mark.parametrize("ratios,q,expect", [
    ((1.0, 1.1, 1.2, 1.3), 0.5, 1.2),  # ceil(5 x 0.5) = 3rd smallest
    ((1.3, 1.0, 1.2, 1.1), 0.5, 1.2),  # order does not matter
    ((1.0, 1.1, 1.2, 1.3), 0.95, 1.3),  # too few for q: the largest
    (tuple(1 + i / 100 for i in range(1, 41)), 0.9, 1.37),  # ceil(41 x 0.9) = 37th smallest
])
def test_conformal_ratio(ratios, q, expect):
    assert estimator._conformal_ratio(ratios, q) == pytest.approx(expect)


@pytest.mark.parametrize("peaks,expect_charge_gib", [
    # 5 runs of 10 GiB: ratios all 1.0 -> the floor (1 + quantile_floor_frac) x 10 GiB
    ([10 * GIB] * 5, 10 * (1 + CFG.quantile_floor_frac)),
    # one run 40 % above the estimate among 4 ratios: the largest ratio (1.4) scales the estimate
    ([10 * GIB, 10 * GIB, 10 * GIB, 14 * GIB, 10 * GIB], None),
])
def test_quantile_margin_sizes_the_charge(peaks, expect_charge_gib):
    s = fold(peaks)
    assert len(s.recent_ratios) == len(peaks) - 1
    e = estimator.estimate(req(), {KeyLevel.CLASS: s}, CFG, GPU)
    ratio = max(1 + CFG.quantile_floor_frac, max(s.recent_ratios))
    assert e.sized_bytes == pytest.approx(s.ewma_peak_bytes * ratio, rel=1e-6)
    if expect_charge_gib is not None:
        assert e.sized_bytes == pytest.approx(expect_charge_gib * GIB, rel=1e-6)
    else:
        assert max(s.recent_ratios) == pytest.approx(1.4)
    why = " ".join(r.message for r in e.reasons)
    assert f"quantile of {len(s.recent_ratios)} recent runs" in why


def test_few_runs_keep_the_deviation_margin():
    s = fold([10 * GIB, 12 * GIB, 10 * GIB])  # 2 ratios < quantile_min_runs
    e_new = estimator.estimate(req(), {KeyLevel.CLASS: s}, CFG, GPU)
    e_old = estimator.estimate(req(), {KeyLevel.CLASS: s}, LEGACY, GPU)
    assert e_new.margin_bytes == e_old.margin_bytes
    assert "mean deviation" in e_new.reasons[0].message


def test_recent_runs_are_bounded():
    s = fold([GIB * (1 + i % 3) for i in range(CFG.recent_runs * 3)])
    assert len(s.recent_ratios) == CFG.recent_runs and len(s.recent_peaks) == CFG.recent_runs
    assert fold([GIB] * 10, ClassStats()).recent_ratios == (1.0,) * 9
    assert estimator.observe(ClassStats(), obs(GIB), LEGACY).recent_peaks == ()


def test_observed_max_is_the_recent_max_once_the_quantile_is_in_use():
    s = fold([30 * GIB] + [10 * GIB] * CFG.recent_runs)  # the 30 GiB spike left the ring
    new = estimator.estimate(req(), {KeyLevel.CLASS: s}, CFG, GPU)
    old = estimator.estimate(req(), {KeyLevel.CLASS: s}, LEGACY, GPU)
    assert new.observed_max_bytes == 10 * GIB and old.observed_max_bytes == 30 * GIB


def test_oom_penalty_fades_after_good_runs_only_with_decay():
    s = estimator.observe(fold([10 * GIB] * 5), obs(11 * GIB, oom=True, exit_code=1), CFG)
    assert s.margin_multiplier == CFG.oom_margin_multiplier
    good = estimator.observe(s, obs(10 * GIB, shared=False), CFG)
    assert good.margin_multiplier == pytest.approx(CFG.oom_margin_multiplier / CFG.margin_multiplier_decay)
    for _ in range(10):
        good = estimator.observe(good, obs(10 * GIB, shared=False), CFG)
    assert good.margin_multiplier == 1.0
    kept = estimator.observe(s, obs(10 * GIB, shared=False), LEGACY)
    assert kept.margin_multiplier == CFG.oom_margin_multiplier


def test_reset_class_restarts_the_ring():
    s = replace(fold([10 * GIB] * 6), samples=0)
    s = estimator.observe(s, obs(2 * GIB), CFG)
    assert s.recent_ratios == () and s.recent_peaks == (2 * GIB,)


def test_stats_json_round_trip_and_old_json_without_new_fields():
    import dataclasses
    import json

    from policy_service.history.schema import stats_from_json
    s = fold([10 * GIB, 12 * GIB, 11 * GIB, 13 * GIB, 12 * GIB])
    assert stats_from_json(json.dumps(dataclasses.asdict(s))) == s
    old = {k: v for k, v in dataclasses.asdict(s).items() if k not in ("recent_ratios", "recent_peaks")}
    loaded = stats_from_json(json.dumps(old))
    assert loaded.recent_ratios == () and loaded.samples == s.samples
    e = estimator.estimate(req(), {KeyLevel.CLASS: loaded}, CFG, GPU)  # falls back to the deviation margin
    assert e.margin_bytes == estimator.estimate(req(), {KeyLevel.CLASS: loaded}, LEGACY, GPU).margin_bytes


def test_default_min_samples_keeps_a_class_whole_for_its_first_runs():
    """The default (estimator.min_samples 3, chosen on the measured operating curve) gives a class
    an estimate only from its third run on; before that the policy keeps the whole GPU."""
    default = EstimatorConfig()
    assert default.min_samples == 3
    assert not estimator.estimate(req(), {KeyLevel.CLASS: fold([4 * GIB] * 2)}, default, GPU).known
    e = estimator.estimate(req(), {KeyLevel.CLASS: fold([4 * GIB] * 3)}, default, GPU)
    assert e.known and e.source is EstimateSource.CLASS
