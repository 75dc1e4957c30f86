import pytest

from policy_service.config import AccessClass, SwapCostConfig
from policy_service.core import swapcost
from policy_service.core.swapcost import SwapMode
from policy_service.core.types import CoJob

GB = 10**9
CFG = SwapCostConfig()
PCIE4 = CFG.pcie_gen4_bytes_per_s


def job(name, mem_gb, prio, access=AccessClass.STREAMING, solo=100.0):
    return CoJob(name=name, footprint_bytes=int(mem_gb * GB), working_set_bytes=int(0.8 * mem_gb * GB),
                 access=access, priority=prio, solo_time_s=solo, sweeps_per_s=CFG.default_sweeps_per_s)


SEED = [job("t1", 6, 4), job("t2", 6, 3), job("t3", 6, 2), job("t4", 6, 1)]  # 24 GB on 18 GB = 1.33x


def test_no_oversubscription_only_compute_interference():
    jobs = [job("a", 4, 2), job("b", 4, 1)]
    cost = swapcost.predict(jobs, 18 * GB, PCIE4, CFG)
    assert cost.deficit_bytes == 0 and cost.risk == 0
    for s in cost.jobs:
        # no utilisation known: default_solo_util each (0.5 + 0.5, at the knee): 1 + base x 0.5
        assert s.slowdown == pytest.approx(1 + CFG.compute_interference_base * CFG.default_solo_util)
        assert not s.victim


def test_seed_scenario_victim_rule_spares_the_top_job():
    cost = swapcost.predict(SEED, 18 * GB, PCIE4, CFG, SwapMode.VICTIM)
    assert cost.deficit_bytes == 6 * GB
    base = swapcost.compute_slowdown(4, CFG)
    assert cost.of("t1").slowdown == pytest.approx(base)  # no added latency for the top task
    assert cost.of("t1").offloaded_bytes == 0
    assert cost.of("t4").victim and cost.of("t4").offloaded_bytes == 6 * GB
    assert cost.of("t4").slowdown > base


def test_seed_scenario_total_time_beats_naive_sharing_by_16_percent():
    victim = swapcost.total_response_s(swapcost.predict(SEED, 18 * GB, PCIE4, CFG, SwapMode.VICTIM), SEED)
    naive = swapcost.total_response_s(swapcost.predict(SEED, 18 * GB, PCIE4, CFG, SwapMode.NAIVE), SEED)
    assert victim <= 0.84 * naive


def test_victims_are_taken_lowest_priority_first_with_capped_fractions():
    jobs = [job("hi", 10, 3), job("mid", 4, 2), job("lo", 2, 1)]
    shares = swapcost.victim_shares(jobs, 5 * GB)
    assert shares == {"lo": 2 * GB, "mid": 3 * GB}


def test_naive_streaming_hits_a_cliff_just_past_1x():
    a = [job("a", 9.1, 1), job("b", 9.1, 2)]  # 1.01x
    cost = swapcost.predict(a, 18 * GB, PCIE4, CFG, SwapMode.NAIVE)
    tiny_deficit = cost.deficit_bytes
    assert tiny_deficit < 0.02 * 18.2 * GB
    for s in cost.jobs:  # every co-runner pays, and pays for its whole working set
        assert s.slowdown > 2.0


def test_random_access_degrades_in_proportion():
    r = [job("a", 10, 1, AccessClass.RANDOM), job("b", 10, 2, AccessClass.RANDOM)]
    small = swapcost.predict(r, 19 * GB, PCIE4, CFG, SwapMode.NAIVE).of("a").slowdown
    large = swapcost.predict(r, 15 * GB, PCIE4, CFG, SwapMode.NAIVE).of("a").slowdown
    assert 1 < small < large


@pytest.mark.parametrize("access,bigger_than", [
    (AccessClass.STREAMING, AccessClass.COMPUTE_BOUND),
    (AccessClass.RANDOM, AccessClass.COMPUTE_BOUND),
])
def test_compute_bound_jobs_tolerate_offload_best(access, bigger_than):
    a = swapcost.victim_slowdown(10 * GB, 2 * GB, access, PCIE4, CFG)
    b = swapcost.victim_slowdown(10 * GB, 2 * GB, bigger_than, PCIE4, CFG)
    assert a > b > 1


def test_faster_link_costs_less():
    slow = swapcost.victim_slowdown(10 * GB, 2 * GB, AccessClass.STREAMING, CFG.pcie_gen4_bytes_per_s, CFG)
    fast = swapcost.victim_slowdown(10 * GB, 2 * GB, AccessClass.STREAMING, CFG.nvlink_c2c_bytes_per_s, CFG)
    assert slow > fast > 1


def test_duplicate_names_rejected():
    with pytest.raises(ValueError):
        swapcost.predict([job("a", 1, 1), job("a", 1, 2)], GB, PCIE4, CFG)


# ---------------------------------------------------------------- interference knee


@pytest.mark.parametrize("own, others, expect", [
    (0.0, 0.0, 1.0),  # alone
    (0.9, 0.0, 1.0),
    (0.2, 0.3, 1 + 0.58 * 0.3),  # summed 0.5: below the knee, linear in the co-runner's utilisation
    (0.5, 0.5, 1 + 0.58 * 0.5),  # at the knee
    (0.6, 0.6, 1 + 0.58 * 0.6 + 2.9 * 0.2),  # above: steep
    (1.0, 1.0, 1 + 0.58 + 2.9),  # two saturating jobs
])
def test_interference_slowdown_table(own, others, expect):
    assert swapcost.interference_slowdown(own, others, CFG) == pytest.approx(expect)


def test_interference_is_monotone_and_steeper_above_the_knee():
    below = [swapcost.interference_slowdown(0.3, v / 100, CFG) for v in range(0, 71)]
    above = [swapcost.interference_slowdown(0.3, v / 100, CFG) for v in range(70, 171)]
    assert all(b >= a for a, b in zip(below, below[1:])) and all(b >= a for a, b in zip(above, above[1:]))
    slope_below = (below[-1] - below[1]) / 0.69
    slope_above = (above[-1] - above[0]) / 1.0
    assert slope_above > 4 * slope_below
    # depends on both jobs' utilisation: the same co-runner hurts a busier job more above the knee
    assert swapcost.interference_slowdown(0.9, 0.5, CFG) > swapcost.interference_slowdown(0.4, 0.5, CFG)


def test_compute_slowdown_uses_learned_utilisations_to_rank_corunners():
    light = swapcost.compute_slowdown(2, CFG, own_util=0.4, others_util=0.1)
    heavy = swapcost.compute_slowdown(2, CFG, own_util=0.4, others_util=0.9)
    assert light < heavy
    assert swapcost.compute_slowdown(1, CFG, own_util=1.0, others_util=1.0) == 1.0
    # unknown utilisations fall back to default_solo_util per job
    assert swapcost.compute_slowdown(3, CFG) == pytest.approx(
        swapcost.interference_slowdown(CFG.default_solo_util, 2 * CFG.default_solo_util, CFG))
