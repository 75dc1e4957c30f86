"""The simulator's swapaware policy deciding with an interference model (issue 35 item 3).

Three ways to give ``policy.decide`` its ``interference`` view:

* ``fixed_view(prior)``: a fixed prior is the model (what ``interference_learn.learn`` answers
  with no evidence); ``SwapAware(cfg)`` with no view decides with the configured prior.
* ``oracle_view(truth)``: the simulation's interference truth is the model (an upper bound for
  what learning can reach with the same decision logic).
* ``LearningSwapAware``: starts from a prior and folds every completed run that shared a GPU
  into one pooled ``Evidence`` (GPU type ``*``): ``u_self`` the job's solo utilisation,
  ``u_others`` its co-runners' summed solo utilisations averaged over the run's progress (the
  engine's ``RunOutcome.co_util``; the weighting under which the model's part below the knee is
  exact for a run whose co-runners change), slowdown its runtime over its solo runtime. Every
  ``refit_every`` folded runs it refits with ``learn`` and decides with the new model.
  ``obs_sigma``: the slowdown it observes is the run's times lognormal noise of median 1 (what
  runtimes carry on a real site besides sharing: input sizes, node speed); the run itself is not
  changed. ``evidence``: what an earlier replay folded (bench/interference_policy.py's
  ``warm_evidence``), its model used from the start.

``Metered`` wraps any policy and adds up the GPU-hours its runs held (runtime x the GPUs, or
shards / shards per GPU, it was admitted with: ``swapaware report``'s gpu_hours_used).
"""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

from policy_service.config import Config
from policy_service.core.interference import KneeParams
from policy_service.core.interference_learn import (Evidence, InterferenceObs, LearnConfig, LearnedModel, Prior,
                                                    Source, learn, observe)
from policy_service.core.interference_rule import ANY_TYPE, InterferenceView
from policy_service.core.types import GresKind, QueueState
from policy_service.sim.policies import Admission, RunOutcome, SimPolicy, SwapAware
from policy_service.sim.workload import SimJob


@dataclass(frozen=True)
class Refit:
    """The learned model after ``runs`` folded shared runs."""

    runs: int
    params: KneeParams
    source: Source


def fixed_view(prior: Prior, cfg: LearnConfig) -> InterferenceView:
    """The prior alone as the pooled model."""
    return InterferenceView(pooled=learn(Evidence(ANY_TYPE), prior, cfg))


def oracle_view(truth: KneeParams, name: str = "truth") -> InterferenceView:
    """The interference truth as a learned pooled model."""
    return InterferenceView(pooled=LearnedModel(
        ANY_TYPE, Source.LEARNED, truth, Prior(name, truth), 0, 0, 0.0, 0.0, None,
        f"oracle ({name}): a {truth.base:.3f}, b {truth.slope:.3f}"))


def shared_run_obs(job: SimJob, job_class: str, outcome: RunOutcome) -> InterferenceObs | None:
    """The observation a finished run gives: None unless it completed on shards beside co-runners."""
    if not outcome.shared or outcome.oom or outcome.co_util <= 0 or job.duration_s <= 0:
        return None
    return InterferenceObs(ANY_TYPE, job.user, job_class, job.solo_util, outcome.co_util,
                           outcome.runtime_s / job.duration_s)


def runtime_noise(rng: random.Random, sigma: float) -> float:
    """A factor of lognormal noise of median 1 (``sigma``: of its log): what a run's observed
    runtime carries besides sharing (input sizes, node speed)."""
    return math.exp(rng.gauss(0.0, sigma))


class LearningSwapAware(SwapAware):
    """swapaware learning the site's interference from its own shared runs, from ``prior``."""

    name, label = "swapaware-learning", "swapaware (learning interference)"

    def __init__(self, cfg: Config, prior: Prior, refit_every: int = 25, obs_sigma: float = 0.0, seed: int = 0,
                 evidence: Evidence | None = None):
        if refit_every < 1:
            raise ValueError("refit_every must be >= 1")
        if obs_sigma < 0:
            raise ValueError("obs_sigma must be >= 0")
        ev = evidence if evidence is not None else Evidence(ANY_TYPE)
        super().__init__(cfg, interference=InterferenceView(pooled=learn(ev, prior, cfg.interference)))
        self.prior = prior
        self.refit_every = refit_every
        self.obs_sigma = obs_sigma
        self.rng = random.Random(seed)
        self.evidence = ev
        self.folded = len(ev.obs)  # shared runs accepted into the evidence
        self.refits: list[Refit] = []

    @property
    def model(self) -> LearnedModel:
        return self.interference.pooled

    def finished(self, job: SimJob, attempt: int, outcome: RunOutcome) -> None:
        super().finished(job, attempt, outcome)  # caches the job's history keys
        obs = shared_run_obs(job, self._keys[(job.class_id, job.num_gpu)][0][1], outcome)
        if obs is None:
            return
        if self.obs_sigma > 0:
            obs = dataclasses.replace(obs, slowdown=obs.slowdown * runtime_noise(self.rng, self.obs_sigma))
        self.evidence, checked = observe(self.evidence, obs, self.cfg.interference)
        if checked.obs is None:
            return
        self.folded += 1
        if self.folded % self.refit_every == 0:
            model = learn(self.evidence, self.prior, self.cfg.interference)
            self.interference = InterferenceView(pooled=model)
            self.refits.append(Refit(self.folded, model.params, model.source))


def held_share(adm: Admission, shards_per_gpu: int) -> float:
    """GPUs an admission holds: its GPU count, or its shards' fraction of one GPU."""
    return adm.count / shards_per_gpu if adm.kind is GresKind.SHARD else float(adm.count)


class Metered(SimPolicy):
    """``inner`` unchanged, plus the GPU-seconds its runs held (``gpu_s``)."""

    def __init__(self, inner: SimPolicy):
        super().__init__(inner.cfg)
        self.inner = inner
        self.name, self.label, self.overflow = inner.name, inner.label, inner.overflow
        self.spg = inner.cfg.gpu.shards_per_gpu
        self.held: dict[tuple[int, int], Admission] = {}
        self.gpu_s = 0.0

    def admit(self, job: SimJob, attempt: int, now: float, queue: QueueState | None = None) -> Admission:
        adm = self.inner.admit(job, attempt, now, queue)
        self.held[(job.idx, attempt)] = adm
        return adm

    def redecide(self, job: SimJob, attempt: int, now: float, queue: QueueState | None) -> Admission | None:
        adm = self.inner.redecide(job, attempt, now, queue)
        if adm is not None:
            self.held[(job.idx, attempt)] = adm
        return adm

    def knowledge(self, job: SimJob) -> int:
        return self.inner.knowledge(job)

    def finished(self, job: SimJob, attempt: int, outcome: RunOutcome) -> None:
        self.inner.finished(job, attempt, outcome)
        adm = self.held.pop((job.idx, attempt), None)
        if adm is not None:
            self.gpu_s += outcome.runtime_s * held_share(adm, self.spg)
