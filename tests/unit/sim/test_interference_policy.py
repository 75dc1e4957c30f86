"""swapaware in the simulator deciding with an interference model: fixed, learned online, or the
truth (sim/interference_policy.py), and the engine's report of co-runners' utilisation."""
from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from policy_service.config import AccessClass, Config
from policy_service.core.interference import KneeParams, knee_slowdown
from policy_service.core.interference_learn import Prior, Source, model_error
from policy_service.core.types import GresKind, QueueState
from policy_service.sim.config import InterferenceModel, SimConfig
from policy_service.sim.engine import Engine
from policy_service.sim.interference_policy import (LearningSwapAware, Metered, fixed_view, held_share, oracle_view,
                                                    shared_run_obs)
from policy_service.sim.policies import Admission, NaiveSharing, RunOutcome, SwapAware
from policy_service.sim.workload import SimJob, Workload

GIB = 1024**3
CFG = Config()
GAVEL = KneeParams(0.58, 2.9)
LUCID = KneeParams(0.025, 0.515)
TALLY = KneeParams(1.565, 2.456)  # bench/interference_learning.tally_params(), rounded
QUEUE = QueueState(pending_gpus=4.0, total_gpus=16)  # 25 % pending: shares, below the overcommit threshold


def job(idx: int, util: float, *, duration: float = 100.0, submit: float = 0.0, cls: int | None = None,
        user: str = "u", peak_gib: float = 4.0) -> SimJob:
    c = idx if cls is None else cls
    return SimJob(idx=idx, job_id=f"j{idx}", submit_s=submit, duration_s=duration, num_gpu=1,
                  gpu_milli=int(util * 1000), declared_bytes=int(util * CFG.gpu.memory_bytes),
                  true_peak_bytes=int(peak_gib * GIB), class_id=c, user=user, account="a", job_name=f"c{c}",
                  script_fp="fp", qos_tier=1, access=AccessClass.STREAMING, managed=False, time_limit_s=duration,
                  compute_share=util, solo_util=util)


def solo(util: float) -> RunOutcome:
    return RunOutcome(runtime_s=100.0, peak_bytes=4 * GIB, oom=False, shared=False, co_runners=0, util_frac=util)


def shared(runtime: float, co_util: float, oom: bool = False) -> RunOutcome:
    return RunOutcome(runtime_s=runtime, peak_bytes=4 * GIB, oom=oom, shared=True, co_runners=1, co_util=co_util)


def shards_for(pol: SwapAware, util: float) -> tuple[GresKind, int]:
    j = job(0, util)
    for _ in range(3):
        pol.finished(j, 1, solo(util))
    adm = pol.admit(j, 2, 0.0, QUEUE)
    return adm.kind, adm.count


# ---------------------------------------------------------------- observations

def test_a_completed_shared_run_is_one_observation():
    obs = shared_run_obs(job(3, 0.4, user="ann"), "cls", shared(150.0, 0.6))
    assert obs is not None
    assert (obs.gpu_type, obs.user, obs.job_class, obs.u_self, obs.u_others) == ("*", "ann", "cls", 0.4, 0.6)
    assert obs.slowdown == pytest.approx(1.5)


@pytest.mark.parametrize("outcome", [solo(0.4), shared(150.0, 0.0), shared(150.0, 0.6, oom=True)])
def test_a_solo_lonely_or_failed_run_teaches_nothing(outcome):
    assert shared_run_obs(job(3, 0.4), "cls", outcome) is None


# ---------------------------------------------------------------- views

def test_the_fixed_prior_view_is_the_prior_and_the_oracle_the_truth():
    v = fixed_view(Prior("lucid", LUCID), CFG.interference)
    assert (v.pooled.source, v.pooled.params) == (Source.PRIOR, LUCID)
    o = oracle_view(TALLY, "tally")
    assert (o.pooled.source, o.pooled.params) == (Source.LEARNED, TALLY)


@pytest.mark.parametrize("util", [0.1, 0.2, 0.3, 0.5, 0.7])
def test_the_configured_prior_decides_as_no_view(util):
    assert shards_for(SwapAware(CFG), util) == shards_for(SwapAware(CFG, fixed_view(Prior("gavel", GAVEL),
                                                                                   CFG.interference)), util)


def test_a_steep_truth_charges_more_shards_than_a_flat_one():
    utils = (0.1, 0.2, 0.3, 0.5, 0.7)
    steep = [shards_for(SwapAware(CFG, oracle_view(TALLY)), u) for u in utils]
    flat = [shards_for(SwapAware(CFG, oracle_view(LUCID)), u) for u in utils]
    assert all(kind is GresKind.SHARD for kind, _ in flat)
    # u 0.1: 1 shard by compute, co-runners up to 7/8 of the GPU: tally predicts 1 + 1.565 x 0.875
    # = 2.37 > 2: charged 3 (v 5/8: 1.98); u 0.2: 2 -> 3; Lucid's 1.02 keeps the compute floor.
    assert flat[:2] == [(GresKind.SHARD, 1), (GresKind.SHARD, 2)]
    assert steep[:2] == [(GresKind.SHARD, 3), (GresKind.SHARD, 3)]
    assert all(s[1] >= f[1] or s[0] is GresKind.GPU for s, f in zip(steep, flat))


# ---------------------------------------------------------------- learning

def feed(pol: LearningSwapAware, truth: KneeParams, runs: int, seed: int = 7) -> None:
    """``runs`` shared runs of 12 users' classes, slowdowns exactly the truth's."""
    rng = random.Random(seed)
    for i in range(runs):
        u, v = rng.uniform(0.1, 1.0), rng.uniform(0.1, 1.0)
        j = job(i, u, cls=i % 60, user=f"user{i % 12}")
        pol.finished(j, 1, shared(100.0 * knee_slowdown(u, v, truth.base, truth.slope), v))


def test_the_learning_policy_moves_from_the_wrong_prior_to_the_truth():
    pol = LearningSwapAware(CFG, Prior("lucid", LUCID), refit_every=25)
    before = model_error(pol.model.params, GAVEL)
    feed(pol, GAVEL, 24)
    assert pol.refits == [] and pol.model.params == LUCID  # not refitted yet
    feed(pol, GAVEL, 276, seed=8)
    assert pol.folded == 300 and [r.runs for r in pol.refits] == list(range(25, 301, 25))
    errors = [model_error(r.params, GAVEL) for r in pol.refits]
    assert before > 0.7
    assert errors[-1] < 0.05 < before
    assert errors[-1] < errors[0]
    assert pol.model.source is Source.LEARNED and pol.interference.pooled is pol.model


def test_learning_a_steep_truth_shares_less_than_its_prior():
    pol = LearningSwapAware(CFG, Prior("gavel", GAVEL), refit_every=25)
    assert shards_for(pol, 0.2) == (GresKind.SHARD, 2)  # Gavel's prior: 1 + 0.58 x 0.75 = 1.44
    feed(pol, TALLY, 300)
    assert model_error(pol.model.params, TALLY) < 0.05
    assert shards_for(pol, 0.2) == (GresKind.SHARD, 3)


def test_refit_every_and_the_noise_must_be_in_range():
    with pytest.raises(ValueError):
        LearningSwapAware(CFG, Prior("gavel", GAVEL), refit_every=0)
    with pytest.raises(ValueError):
        LearningSwapAware(CFG, Prior("gavel", GAVEL), obs_sigma=-0.1)


def test_observed_slowdowns_carry_the_noise_drawn_from_the_seed():
    pol = LearningSwapAware(CFG, Prior("gavel", GAVEL), obs_sigma=0.2, seed=5)
    exact = LearningSwapAware(CFG, Prior("gavel", GAVEL))
    rng = random.Random(5)
    factors = [math.exp(rng.gauss(0.0, 0.2)) for _ in range(3)]
    for i in range(3):
        j = job(i, 0.4, user=f"user{i}")
        pol.finished(j, 1, shared(150.0, 0.6))
        exact.finished(j, 1, shared(150.0, 0.6))
    assert [o.slowdown for o in exact.evidence.obs] == [pytest.approx(1.5)] * 3
    assert [o.slowdown for o in pol.evidence.obs] == [pytest.approx(1.5 * f) for f in factors]
    assert len(set(factors)) == 3


def test_a_policy_given_earlier_evidence_decides_with_its_model_from_the_start():
    warm = LearningSwapAware(CFG, Prior("gavel", GAVEL), refit_every=25)
    feed(warm, TALLY, 300)
    pol = LearningSwapAware(CFG, Prior("gavel", GAVEL), refit_every=25, evidence=warm.evidence)
    assert pol.folded == 300 and pol.refits == []
    assert pol.model.params == warm.model.params and pol.model.source is Source.LEARNED
    assert shards_for(pol, 0.2) == (GresKind.SHARD, 3)  # tally's, not the prior's 2
    feed(pol, TALLY, 25, seed=9)
    assert [r.runs for r in pol.refits] == [325]


# ---------------------------------------------------------------- the engine's report

class Recorder(NaiveSharing):
    def __init__(self, cfg: Config):
        super().__init__(cfg, shards=4)
        self.outcomes: dict[int, RunOutcome] = {}

    def finished(self, job, attempt, outcome):
        self.outcomes[job.idx] = outcome


def test_the_engine_reports_co_runners_utilisation_averaged_over_progress():
    # a (100 s of work) and b (50 s) start together on one GPU, u 0.5 each; truth s = 1 + v:
    # together both run at 1 / 1.5 until b ends at 75 s; a has done 50 s and ends alone at 125 s.
    sim = SimConfig()
    sim = replace(sim, interference=replace(sim.interference, model=InterferenceModel.UTIL, fit="custom",
                                            knee_base=1.0, knee_slope=0.0))
    jobs = [job(0, 0.5, duration=100.0), job(1, 0.5, duration=50.0)]
    w = Workload(jobs=jobs, load=0.0, noise=0.0, arrival_window_s=1.0, gpus=1, description={})
    rec = Recorder(CFG)
    meter = Metered(rec)
    res = Engine(w, meter, CFG, sim, per_corunner=0.0, check=True).run()
    a, b = rec.outcomes[0], rec.outcomes[1]
    assert (a.runtime_s, b.runtime_s) == (pytest.approx(125.0), pytest.approx(75.0))
    assert b.co_util == pytest.approx(0.5)
    assert a.co_util == pytest.approx(0.25)  # half its work beside b: 1 + 0.25 = 1.25 = 125 / 100
    assert res.records[0].slowdown == pytest.approx(1.0 + 1.0 * a.co_util)
    assert meter.gpu_s == pytest.approx((125.0 + 75.0) * 4 / 8)


def test_held_share():
    assert held_share(Admission(GresKind.SHARD, 3), 8) == 0.375
    assert held_share(Admission(GresKind.GPU, 2), 8) == 2.0
