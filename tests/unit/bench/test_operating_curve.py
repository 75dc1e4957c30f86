"""bench/operating_curve.py's arithmetic (GPU-hours saved and lost, requeued fraction, the chosen
point) and bench/real_trace.py's replay at the shards' cap, on hand-computed cases."""
import math

import pytest

from policy_service.config import Config, EstimatorConfig, GpuConfig

from tests.unit.bench_loader import load_bench

rt = load_bench("real_trace")
oc = load_bench("operating_curve")

G = 1 << 30
S10 = 10 * G


def rep(shared=True, shards=2, spg=8, peak=15 * G, charge=13 * G, over_at_s=None, runtime_s=3600.0):
    return rt.Replayed(shared=shared, ape=0.0, charge_bytes=charge, peak_bytes=peak, shards=shards if shared else 0,
                       shards_per_gpu=spg, shard_bytes=S10, limit_bytes=shards * S10 if shared else 0,
                       over_at_s=over_at_s, runtime_s=runtime_s)


def test_saved_is_the_unheld_part_of_the_gpu_for_the_run():
    assert oc.saved_gpu_h(rep(shards=2, spg=8, runtime_s=3600)) == pytest.approx(0.75)
    assert oc.saved_gpu_h(rep(shards=3, spg=4, runtime_s=7200)) == pytest.approx(0.5)
    assert oc.saved_gpu_h(rep(shards=8, spg=8)) == 0.0  # all shards: nothing freed
    assert oc.saved_gpu_h(rep(shared=False)) == 0.0
    assert oc.saved_gpu_h(rep(over_at_s=600)) == 0.0  # requeued: the rerun holds a whole GPU


def test_lost_is_the_share_held_until_the_oom_plus_the_wait():
    r = rep(shards=2, spg=8, over_at_s=1800)
    assert oc.lost_gpu_h(r, 0.5) == pytest.approx(2 / 8 * 0.5 + 0.5)
    assert oc.lost_gpu_h(r, 0.0) == pytest.approx(0.125)
    assert oc.lost_gpu_h(rep(shards=4, spg=16, over_at_s=7200), 2.0) == pytest.approx(0.25 * 2 + 2)
    assert oc.lost_gpu_h(rep(), 0.5) == 0.0  # not requeued
    assert oc.lost_gpu_h(rep(shared=False, over_at_s=60), 0.5) == 0.0  # whole GPU: never requeued


def test_summarise_counts_shared_requeued_and_shard_units():
    runs = [rep(shared=False, peak=20 * G, charge=30 * G),
            rep(shards=2, peak=15 * G, charge=16 * G, runtime_s=1800),  # 20 GiB cap
            rep(shards=1, peak=12 * G, charge=8 * G, over_at_s=900, runtime_s=1800)]  # 10 GiB cap, dies at 15 min
    p = oc.summarise(oc.Setting(0.35, 1, 10), 1800, runs, requeue_wait_h=0.5)
    assert (p.scored, p.shared, p.requeued) == (3, 2, 1)
    assert p.shared_frac == pytest.approx(2 / 3)
    assert p.requeued_frac == pytest.approx(0.5)
    assert p.charge_ratio == pytest.approx((20 / 15 + 10 / 12) / 2)
    assert p.rounding == pytest.approx(((20 - 16) / 15 + (10 - 8) / 12) / 2)
    assert p.saved_h == pytest.approx(6 / 8 * 0.5)
    assert p.lost_h == pytest.approx(1 / 8 * 0.25 + 0.5)
    assert p.net_h == pytest.approx(0.375 - 0.53125)
    assert p.lost_over_saved == pytest.approx(0.53125 / 0.375)


def test_summarise_with_no_shared_run():
    p = oc.summarise(oc.Setting(0.35, 1, 10), 1800, [rep(shared=False)], requeue_wait_h=0.5)
    assert (p.shared, p.saved_h, p.lost_h) == (0, 0.0, 0.0)
    assert math.isnan(p.requeued_frac) and math.isinf(p.lost_over_saved)


def _pt(setting, window, shared, requeued, saved, lost):
    return oc.Point(setting, window, scored=shared, shared=shared, requeued=requeued, charge_ratio=1.5, rounding=0.1,
                    saved_h=saved, lost_h=lost)


def test_choose_maximises_mean_net_within_the_requeue_bound_in_every_window():
    a, b, c, d = (oc.Setting(f, 1, 10) for f in (0.2, 0.35, 0.5, 0.65))
    pts = [_pt(a, 1800, 1000, 20, 900, 10), _pt(a, 7200, 200, 1, 800, 5),  # 2 % at 30 min: out
           _pt(b, 1800, 1000, 10, 600, 20), _pt(b, 7200, 200, 2, 500, 10),  # exactly 1 %: in, net 535
           _pt(c, 1800, 1000, 5, 700, 10), _pt(c, 7200, 200, 0, 300, 0),  # net (690 + 300) / 2 = 495
           _pt(d, 1800, 0, 0, 0, 0), _pt(d, 7200, 0, 0, 0, 0)]  # shares nothing: out
    assert oc.choose(pts) == b
    assert oc.choose(pts, max_requeued=0.005) == c  # b's 1 % is over a 0.5 % bound
    assert oc.choose(pts, max_requeued=0.0) is None  # c requeued 5 of 1000 at 30 min


def test_targets_at_their_bounds():
    s = oc.Setting(0.35, 1, 10)
    ok = oc.Point(s, 1800, 1000, 1000, 10, charge_ratio=1.5, rounding=0.1, saved_h=100.0, lost_h=5.0)
    assert all(oc.targets(ok).values())
    bad = oc.Point(s, 1800, 1000, 1000, 11, charge_ratio=1.51, rounding=0.1, saved_h=100.0, lost_h=5.1)
    assert not any(oc.targets(bad).values())


def test_configs_set_the_swept_fields():
    est, gpu = oc.configs(oc.Setting(0.5, 3, 5), Config())
    assert (est.quantile_floor_frac, est.min_samples) == (0.5, 3)
    assert (gpu.shards_per_gpu, gpu.shard_bytes) == (16, 5 * G)


def _run(idx, gib, step=60.0):
    return rt.Run("c", idx, idx * 1800.0, tuple(i * step for i in range(len(gib))), tuple(int(v * G) for v in gib))


def test_first_above_is_strict_and_timed_from_the_window_start():
    r = _run(0, [4, 10, 10.5, 12])
    assert rt.first_above(r, 10 * G) == 120.0
    assert rt.first_above(r, 12 * G) is None


# Cold class (1 prior run of 4 GiB): peak 4 + cold margin 25 % = 5 GiB charge, 1 shard of 10 GiB.
EST = EstimatorConfig(min_samples=1, cold_samples=3, cold_margin_frac=0.25, min_margin_frac=0.10, deviation_k=3.0,
                      oom_whole_gpu_runs=2)
GPU = GpuConfig(memory_bytes=80 * G, shards_per_gpu=8)


def test_replay_dies_at_the_charge_or_at_the_shards_cap():
    runs = [_run(0, [4, 4]), _run(1, [4, 6, 11]), _run(2, [4, 4])]
    at_charge = rt.replay_outcomes(runs, EST, GPU, at_cap=False)
    at_cap = rt.replay_outcomes(runs, EST, GPU, at_cap=True)
    r = at_charge[0]
    assert (r.shared, r.charge_bytes, r.shards, r.cap_bytes, r.limit_bytes) == (True, 5 * G, 1, S10, 5 * G)
    assert (r.over, r.over_at_s) == (True, 60.0)  # 6 GiB > 5 GiB charge at the second sample
    r = at_cap[0]
    assert (r.limit_bytes, r.over, r.over_at_s, r.runtime_s) == (S10, True, 120.0, 120.0)  # 11 GiB > 10 GiB cap
    # Fed back as an OOM of a shared run: the next run serves the whole-GPU penalty.
    assert [x.shared for x in at_cap] == [True, False]
    runs_fit = [_run(0, [4, 4]), _run(1, [4, 6, 9]), _run(2, [4, 4])]
    assert [(x.shared, x.over) for x in rt.replay_outcomes(runs_fit, EST, GPU, at_cap=True)] == [(True, False),
                                                                                                 (True, False)]


def test_requeue_observes_the_whole_gpu_rerun_too():
    """The OOM at the cap starts 2 whole-GPU penalty runs; with the requeue the rerun (whole, exit 0)
    is observed as well and serves one of them, and its true peak is learned."""
    runs = [_run(0, [4, 4]), _run(1, [4, 6, 11]), _run(2, [4, 4]), _run(3, [4, 4])]
    once = rt.replay_outcomes(runs, EST, GPU, at_cap=True)
    rerun = rt.replay_outcomes(runs, EST, GPU, at_cap=True, requeue=True)
    assert [x.shared for x in once] == [True, False, False]
    assert [x.shared for x in rerun] == [True, False, True]
    # run 3 is charged from a history that holds the rerun's 11 GiB peak, not only the 10 GiB cap
    assert rerun[2].charge_bytes >= 11 * G
