"""Fits of the memory and interference models (synthetic data with known parameters), the
fitted memory model's draws, and out-of-memory semantics with and without hard caps."""
from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from policy_service.config import Config
from policy_service.core.types import GresKind
from policy_service.sim import memfit
from policy_service.sim.config import SimConfig
from policy_service.sim.engine import Engine
from policy_service.sim.interference_fit import fit_knee, knee_slowdown
from policy_service.sim.memtrace import Run, Series, cut_runs
from policy_service.sim.policies import Admission, SimPolicy, SwapAware
from policy_service.sim.workload import MemoryModel, SimJob, Workload, draw_util

from tests.unit.sim.test_sim_engine import job, small_sim

GIB = 1024**3
CFG = Config()


def _runs_with_growth(n: int, p: float, mu: float, sigma: float, seed: int = 1) -> list[Run]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        first = 10 * GIB
        g = rng.gauss(mu, sigma)
        grows = rng.random() < p and g > 0.02
        peak = int(first * math.exp(g)) if grows else first
        t_peak = rng.uniform(0.05, 0.95) * 1800
        out.append(Run(f"c{i % 7}", i, 0.0, (0.0, t_peak, 1800.0), (first, peak, first if grows else peak)))
    return out


def test_fit_growth_recovers_known_parameters():
    fit = memfit.fit_growth(_runs_with_growth(4000, 0.4, 0.3, 0.1))
    assert fit.grow_prob == pytest.approx(0.4, abs=0.03)
    assert fit.log_growth_median == pytest.approx(0.3, abs=0.02)
    assert fit.log_growth_sigma == pytest.approx(0.1, abs=0.02)
    assert fit.peak_time_frac_quartiles[1] == pytest.approx(0.5, abs=0.05)


def test_fit_growth_of_flat_runs_is_no_growth():
    runs = [Run("c", i, 0.0, (0.0, 10.0), (5 * GIB, 5 * GIB)) for i in range(50)]
    fit = memfit.fit_growth(runs)
    assert fit.grow_prob == 0.0 and fit.log_growth_median == 0.0


@pytest.mark.parametrize("q, s_small, s_jump", [(0.25, 0.01, 0.2), (0.1, 0.005, 0.4), (0.5, 0.02, 0.15)])
def test_fit_variation_recovers_the_per_run_mixture(q, s_small, s_jump):
    rng = random.Random(3)
    e = [rng.gauss(0, s_jump if rng.random() < q else s_small) for _ in range(40000)]
    diffs = [b - a for a, b in zip(e[::2], e[1::2])]
    fit = memfit.fit_variation_from_diffs(diffs, jump=0.05)
    assert fit.run_jump_prob == pytest.approx(q, abs=0.04)
    assert fit.run_sigma_jump == pytest.approx(s_jump, rel=0.12)
    p, _ = memfit.diff_mixture(fit.run_jump_prob, fit.run_sigma_small, fit.run_sigma_jump, 0.05)
    assert p == pytest.approx(fit.diff_jump_prob, abs=1e-3)


def test_consecutive_ratios_skip_gaps_and_other_containers():
    s = Series("c", (0.0, 10.0, 1800.0, 1810.0, 5400.0, 5410.0), (1.0, 2.0, 4.0, 4.0, 8.0, 8.0))
    runs = cut_runs(s, 1800.0)  # windows 0, 1, 3 (2 is empty)
    assert [r.index for r in runs] == [0, 1, 3]
    assert memfit.consecutive_log_ratios(runs) == [pytest.approx(math.log(2.0))]


def test_duty_scale_and_quantiles():
    pct = [Series(f"c{i}", (0.0, 1.0), (float(i), float(i))) for i in range(101)]
    assert memfit.duty_scale(pct) == 100.0
    d = memfit.fit_duty(pct)
    assert d["p50"] == pytest.approx(0.5, abs=0.011)
    frac = [Series("a", (0.0,), (0.4,)), Series("b", (0.0,), (0.9,))]
    assert memfit.duty_scale(frac) == 1.0


def test_memory_model_growth_reproduces_the_fitted_summary():
    mcfg = SimConfig().memory
    model = MemoryModel(mcfg, CFG.gpu)
    rng = random.Random(11)
    draws = [model.growth(rng) for _ in range(20000)]
    growers = [d for d in draws if d[0] < 1.0]
    # grow_prob x P(g > 0) (g ~ N(0.213, 0.183): 0.878)
    assert len(growers) / len(draws) == pytest.approx(mcfg.grow_prob * 0.878, abs=0.02)
    logs = sorted(-math.log(f) for f, _ in growers)
    assert logs[len(logs) // 2] == pytest.approx(0.24, abs=0.03)  # median of the truncated normal
    times = sorted(t for _, t in growers)
    assert times[len(times) // 2] == pytest.approx(0.5, abs=0.03)


def test_fixed_growth_model_when_grow_prob_is_zero():
    mcfg = replace(SimConfig().memory, grow_prob=0.0, init_frac=0.5, growth_at_work_frac=0.1)
    assert MemoryModel(mcfg, CFG.gpu).growth(random.Random(1)) == (0.5, 0.1)
    none = replace(mcfg, growth_at_work_frac=0.0)
    assert MemoryModel(none, CFG.gpu).growth(random.Random(1)) == (1.0, 0.0)


def test_draw_util_inverts_the_quantiles():
    q = ((0.0, 0.0), (0.5, 0.1), (1.0, 0.5))
    assert draw_util(q, 0.0) == 0.0 and draw_util(q, 0.25) == pytest.approx(0.05)
    assert draw_util(q, 0.75) == pytest.approx(0.3) and draw_util(q, 1.0) == 0.5


def test_fit_knee_recovers_known_parameters():
    # Pairs from the model itself with util ~ U[0.2, 1]: the fit finds parameters that reproduce
    # the quantiles (base and slope trade off with util_lo, so the quantiles are what is checked).
    rng = random.Random(5)
    slow = []
    for _ in range(3000):
        u, v = rng.uniform(0.2, 1.0), rng.uniform(0.2, 1.0)
        slow.append(knee_slowdown(u, v, 0.1, 2.0) - 1.0)
    fit = fit_knee(slow)
    assert fit.rms_error < 0.05
    assert fit.slope == pytest.approx(2.0, abs=0.5)
    for k, v in fit.quantiles_measured.items():
        assert fit.quantiles_model[k] == pytest.approx(v, abs=0.1)


# ---------------------------------------------------------------- OOM with and without hard caps

class Fixed(SimPolicy):
    """Both jobs get 3 of 8 shards (30 GiB each of an 80 GiB device); no swapping."""

    name = "fixed"

    def admit(self, j, attempt, now, queue=None):
        return Admission(GresKind.SHARD, 3, site_factor=100 * (2 - j.idx))


class FixedVictim(Fixed):
    name = "fixed-victim"
    overflow = SwapAware.overflow


def _engine(hard_caps: bool, jobs, policy_cls=Fixed):
    sim = small_sim(gpus_per_node=1, max_attempts=1)
    sim = replace(sim, node=replace(sim.node, hard_caps=hard_caps))
    w = Workload(jobs=jobs, load=0.0, noise=0.0, arrival_window_s=0.0, gpus=1, description={})
    return Engine(w, policy_cls(CFG), CFG, sim, per_corunner=0.47, check=True).run()


@pytest.mark.parametrize("hard_caps, grower_peak, other_peak, expect", [
    # (OOM events, which job failed, neighbour OOMs)
    (True, 50, 25, (1, "grower", 0)),  # grows past its 30 GiB cap: it fails alone, device not full
    (False, 50, 25, (0, None, 0)),  # no cap: 50 + 25 fits the 80 GiB device, nobody fails
    (True, 28, 25, (0, None, 0)),  # within its cap: fine either way
    (False, 28, 25, (0, None, 0)),
    # no cap, device full: the grower takes the free pool first (it allocated at 50 % of its run,
    # the neighbour grows at 80 %): the neighbour, within its own charge, fails
    (False, 58, 29, (1, "other", 1)),
    (True, 58, 29, (1, "grower", 0)),  # caps: the grower fails at its growth, the neighbour is safe
])
def test_oom_semantics_with_and_without_hard_caps(hard_caps, grower_peak, other_peak, expect):
    grower = job(0, 0.0, 100.0, milli=1000, peak_gib=grower_peak, init_frac=0.4, grow_at=0.5)
    other = job(1, 0.0, 100.0, milli=1000, peak_gib=other_peak, init_frac=0.5, grow_at=0.8)
    res = _engine(hard_caps, [grower, other])
    failed = [name for name, r in zip(("grower", "other"), res.records) if r.failed]
    assert (res.oom_events, failed[0] if failed else None, res.neighbour_oom_events) == expect


def test_hard_caps_leave_an_oversubscribed_jobs_host_part_alone():
    # Under VICTIM overflow an admission sized above its shards keeps the rest in host memory:
    # the cap is the sized need, not the shards.
    class Sized(FixedVictim):
        def admit(self, j, attempt, now, queue=None):
            return Admission(GresKind.SHARD, 3, site_factor=1.0, sized_bytes=50 * GIB)

    grower = job(0, 0.0, 100.0, milli=1000, peak_gib=45, init_frac=0.5, grow_at=0.5)
    res = _engine(True, [grower], Sized)
    assert res.oom_events == 0
    over = job(0, 0.0, 100.0, milli=1000, peak_gib=55, init_frac=0.5, grow_at=0.5)
    assert _engine(True, [over], Sized).oom_events == 1
