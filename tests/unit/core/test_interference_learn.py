"""core.interference_learn: validation, the bounded weights, the robust fit on hand-computed cases,
the prior against the evidence, one user's inflated runtimes, and convergence on a small replay."""
import math
import random
import time

import pytest

from policy_service.config import SwapCostConfig
from policy_service.core.interference import KneeParams, knee_slowdown
from policy_service.core.interference_learn import (
    COMPARE_GRID,
    Evidence,
    InterferenceObs,
    LearnConfig,
    Prior,
    Refusal,
    SharedRun,
    Source,
    check,
    fit_lad,
    from_run,
    learn,
    model_error,
    observe,
    prior_from_config,
    user_influence,
    weighted_median,
    weights,
)

CFG = LearnConfig()
GAVEL = Prior("gavel", KneeParams(0.58, 2.9))
LUCID = KneeParams(0.025, 0.515)


def obs(user="ann", cls="c1", u=0.5, v=0.5, s=1.2, gpu="a100"):
    return InterferenceObs(gpu, user, cls, u, v, s)


# --- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("o, refusal", [
    (obs(u=float("nan")), Refusal.NOT_FINITE),
    (obs(s=float("inf")), Refusal.NOT_FINITE),
    (obs(u=1.5), Refusal.UTIL_RANGE),
    (obs(u=-0.1), Refusal.UTIL_RANGE),
    (obs(v=0.0), Refusal.NOT_SHARED),
    (obs(v=9.0), Refusal.UTIL_RANGE),
    (obs(user=""), Refusal.UNNAMED),
    (obs(gpu=""), Refusal.UNNAMED),
])
def test_invalid_observations_are_refused_with_a_reason(o, refusal):
    c = check(o, CFG)
    assert c.obs is None and c.refusal is refusal and c.reason


def test_slowdown_is_clamped_and_the_clamp_is_in_the_reason():
    c = check(obs(s=50.0), CFG)
    assert c.obs.slowdown == 20.0 and c.refusal is Refusal.NONE and "clamped to 20" in c.reason
    assert check(obs(s=0.1), CFG).obs.slowdown == 0.5
    ok = check(obs(), CFG)
    assert ok.obs == obs() and ok.reason == ""


def test_observe_keeps_only_valid_observations_of_its_gpu_type_within_the_window():
    cfg = LearnConfig(window=3)
    ev = Evidence("a100")
    ev, c = observe(ev, obs(gpu="h100"), cfg)
    assert ev.obs == () and "h100" in c.reason
    ev, _ = observe(ev, obs(u=2.0), cfg)
    assert ev.obs == ()
    for i in range(5):
        ev, _ = observe(ev, obs(s=1.0 + i), cfg)
    assert [o.slowdown for o in ev.obs] == [3.0, 4.0, 5.0]  # the most recent three


# --- arithmetic ---------------------------------------------------------------------------------

def test_weighted_median_is_the_lower_one():
    assert weighted_median([1, 2, 3, 10], [1, 1, 1, 1]) == 2
    assert weighted_median([1, 2, 3, 10], [1, 1, 1, 5]) == 10
    assert weighted_median([3, 1, 2], [0, 1, 1]) == 1
    with pytest.raises(ValueError):
        weighted_median([1.0], [0.0])


def test_weights_cap_a_user_at_r_times_the_rest_plus_the_prior():
    # share 0.5: r = 1. ann 6 runs, bob 2, cy 2, every run its own class, prior weight 0:
    # ann's cap = 1 x (10 - 6 + 0) = 4 -> each of her runs weighs 4/6; bob's cap 8 > 2: 1 each.
    cfg = LearnConfig(max_user_share=0.5, max_class_share=0.5, prior_weight=0.0)
    runs = [obs("ann", f"a{i}") for i in range(6)] + [obs("bob", f"b{i}") for i in range(2)] + \
        [obs("cy", f"c{i}") for i in range(2)]
    assert weights(runs, cfg) == pytest.approx([4 / 6] * 6 + [1.0] * 4)
    # the prior's weight counts on the rest's side: prior 2 -> ann's cap 6 = her runs
    assert weights(runs, LearnConfig(max_user_share=0.5, max_class_share=0.5, prior_weight=2.0)) == [1.0] * 10
    # share 0.1 (r = 1/9), prior 0: ann 4/9 in all (2/27 a run), bob (8/9) / 2 = 4/9 a run
    w = weights(runs, LearnConfig(prior_weight=0.0))
    assert w[:6] == pytest.approx([2 / 27] * 6) and w[6:] == pytest.approx([4 / 9] * 4)


def test_weights_cap_a_class_too_and_take_the_smaller_factor():
    # one class of bob's holds 4 of 10 runs: class cap = 1 x (10 - 4) = 6 >= 4, users uncapped
    cfg = LearnConfig(max_user_share=0.5, max_class_share=0.2, prior_weight=0.0)  # class r = 0.25
    runs = [obs("bob", "sweep") for _ in range(4)] + [obs(f"u{i}", f"c{i}") for i in range(6)]
    w = weights(runs, cfg)
    assert w[:4] == pytest.approx([0.25 * 6 / 4] * 4) and w[4:] == [1.0] * 6


def test_fit_lad_recovers_an_exact_model():
    pts = [(v, max(0.0, u + v - 1), knee_slowdown(u, v, 0.5, 2.0) - 1, 1.0)
           for u in (0.2, 0.5, 0.8, 1.0) for v in (0.3, 0.6, 0.9)]
    p = fit_lad(pts, 3.0, 8.0)
    assert p.base == pytest.approx(0.5, abs=1e-3) and p.slope == pytest.approx(2.0, abs=1e-2)


def test_fit_lad_is_the_weighted_median_of_ratios_and_ignores_an_outlier():
    # below the knee only (x = 0): minimise sum |y - a v|: the median of y / v weighted by v.
    # ratios 0.5 (w 0.2), 0.5 (w 0.4), 1.8 (w 0.5): half of 1.1 is reached at 0.5 -> a = 0.5.
    pts = [(0.2, 0.0, 0.1, 1.0), (0.4, 0.0, 0.2, 1.0), (0.5, 0.0, 0.9, 1.0)]
    p = fit_lad(pts, 3.0, 8.0)
    assert p.base == pytest.approx(0.5, abs=1e-3) and p.slope == 0.0
    # the outlier 10x further off: the same fit
    assert fit_lad(pts[:2] + [(0.5, 0.0, 9.0, 1.0)], 3.0, 8.0).base == pytest.approx(0.5, abs=1e-3)


def test_fit_lad_respects_the_bounds():
    pts = [(0.5, 0.5, 20.0, 1.0), (0.5, 0.0, 10.0, 1.0)]
    p = fit_lad(pts, 1.0, 4.0)
    assert p.base <= 1.0 and p.slope <= 4.0


# --- prior against evidence ---------------------------------------------------------------------

def replay(truth, n, seed=1, users=40, noise=0.0, adversary=None, inflate=10.0, frac=0.1):
    """n shared runs: classes' solo utilisation ~ U[0.1, 1], one co-runner; the truth's slowdown
    times lognormal noise; with ``adversary`` a fraction of the runs are that user's, inflated."""
    rng = random.Random(seed)
    classes = [(f"u{rng.randrange(users)}", f"c{i}", rng.uniform(0.1, 1.0)) for i in range(200)]
    ev = Evidence("a100")
    for _ in range(n):
        other = rng.choice(classes)
        if adversary and rng.random() < frac:
            me, k = (adversary, f"{adversary}-{rng.randrange(10)}", rng.uniform(0.1, 1.0)), inflate
        else:
            me, k = rng.choice(classes), 1.0
        s = k * knee_slowdown(me[2], other[2], truth.base, truth.slope) * math.exp(rng.gauss(0.0, noise))
        ev, _ = observe(ev, InterferenceObs("a100", me[0], me[1], me[2], other[2], s), CFG)
    return ev


def test_prior_until_min_runs_and_min_users_with_the_reason():
    m = learn(replay(LUCID, 10), GAVEL, CFG)
    assert m.source is Source.PRIOR and m.params == GAVEL.params and m.fit_mae is None
    assert m.reason == "prior (gavel): 10 shared runs on a100 < min 25"
    few = replay(LUCID, 100, users=1)
    m = learn(few, GAVEL, CFG)
    assert m.source is Source.PRIOR and m.reason == "prior (gavel): 1 users on a100 < min 3"


def test_the_prior_dominates_little_evidence_and_much_evidence_outgrows_it():
    cfg = LearnConfig(prior_weight=200.0)
    little = learn(replay(LUCID, 60), GAVEL, cfg)
    assert little.source is Source.LEARNED
    assert model_error(little.params, GAVEL.params) < model_error(little.params, LUCID)
    much = learn(replay(LUCID, 2000), GAVEL, cfg)
    assert model_error(much.params, LUCID) < 0.02
    assert much.reason.startswith("learned from 2000 shared runs of 40 users on a100: a ")


def test_co_runner_load_is_the_evidence_weighted_as_the_fit():
    """LearnedModel.co_util (what the long-queue lift predicts beside): the observations' co-runner
    utilisations weighted as the fit. ann's 6 runs beside 0.9 weigh 4/6 each (4 in all, her cap:
    test_weights_cap_a_user_at_r_times_the_rest_plus_the_prior), bob's and cy's 4 beside 0.3 weigh 1:
    (4 x 0.9 + 4 x 0.3) / 8 = 0.6, not the plain mean 0.66. The prior has none."""
    cfg = LearnConfig(max_user_share=0.5, max_class_share=0.5, prior_weight=0.0, min_runs=10, min_users=3)
    runs = [obs("ann", f"a{i}", v=0.9) for i in range(6)] + [obs("bob", f"b{i}", v=0.3) for i in range(2)] + \
        [obs("cy", f"c{i}", v=0.3) for i in range(2)]
    m = learn(Evidence("a100", tuple(runs)), GAVEL, cfg)
    assert m.source is Source.LEARNED and m.co_util == pytest.approx(0.6)
    assert learn(Evidence("a100", tuple(runs[:9])), GAVEL, cfg).co_util is None  # 9 < min_runs: the prior


def test_prior_from_config_takes_the_service_defaults():
    assert prior_from_config(SwapCostConfig()) == GAVEL


# --- bounds -------------------------------------------------------------------------------------

@pytest.mark.parametrize("frac", [0.1, 0.5])
def test_one_user_with_inflated_runtimes_moves_the_fit_at_most_the_bound(frac):
    ev10 = replay(LUCID, 1000, noise=0.1, adversary="mallory", inflate=10.0, frac=frac)
    ev1000 = replay(LUCID, 1000, noise=0.1, adversary="mallory", inflate=1000.0, frac=frac)
    # the clamp aside, how far the inflation goes does not matter: the same fit at 10x and 1000x
    assert learn(ev10, GAVEL, CFG).params == learn(ev1000, GAVEL, CFG).params
    ws = weights(ev10.obs, CFG)
    mine = sum(w for w, o in zip(ws, ev10.obs) if o.user == "mallory")
    rest = sum(1 for o in ev10.obs if o.user != "mallory")
    assert mine <= CFG.max_user_share / (1 - CFG.max_user_share) * (rest + CFG.prior_weight) + 1e-9
    assert user_influence(ev10, "mallory", GAVEL, CFG) <= 0.05
    assert model_error(learn(ev10, GAVEL, CFG).params, LUCID) <= 0.05


def test_unbounded_the_same_user_would_move_it_further():
    ev = replay(LUCID, 1000, noise=0.1, adversary="mallory", inflate=10.0, frac=0.5)
    loose = LearnConfig(max_user_share=0.9, max_class_share=0.9)
    assert user_influence(ev, "mallory", GAVEL, loose) > 2 * user_influence(ev, "mallory", GAVEL, CFG)


# --- convergence --------------------------------------------------------------------------------

def test_convergence_on_a_small_replay_in_seconds():
    t0 = time.perf_counter()
    ev = replay(LUCID, 300, noise=0.1)
    m = learn(ev, GAVEL, CFG)
    assert time.perf_counter() - t0 < 5.0
    assert model_error(GAVEL.params, LUCID) > 0.5  # the prior is far off
    assert m.source is Source.LEARNED and model_error(m.params, LUCID) <= 0.05
    assert len(COMPARE_GRID) == 100


# ----------------------------------------------------------------------------- from a finished run
def shared_run(**kw) -> SharedRun:
    base = dict(gpu_type="a100", user="ann", job_class="c1", runtime_s=300.0, exit_code=0, solo_runtime_s=100.0,
                solo_runs=2, u_self=0.3, u_others=(0.25, 0.15))
    return SharedRun(**{**base, **kw})


def test_a_shared_run_is_an_observation_compared_within_its_class():
    obs, why = from_run(shared_run())
    assert why == "" and obs == InterferenceObs("a100", "ann", "c1", 0.3, pytest.approx(0.4), 3.0)


@pytest.mark.parametrize("kw,why", [
    (dict(u_others=()), "no co-runner"),
    (dict(exit_code=1), "failed, or no runtime"),
    (dict(runtime_s=0.0), "failed, or no runtime"),
    (dict(solo_runs=0), "its class has no solo runtime yet"),
    (dict(solo_runtime_s=0.0), "its class has no solo runtime yet"),
    (dict(u_self=None), "its class's solo utilisation is not learned yet"),
    (dict(u_others=(0.2, None)), "a co-runner's solo utilisation is not learned yet"),
])
def test_a_run_that_cannot_teach_says_why(kw, why):
    assert from_run(shared_run(**kw)) == (None, why)
