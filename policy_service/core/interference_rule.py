"""The site's interference model in decisions (issue 35). Pure, as all of core/.

``InterferenceView`` is what the service learned (``interference_learn.learn`` per GPU type, and
over every type's runs together: ``pooled``), or the configured prior alone (``prior_view``). A
job is judged by the model of the GPU type it asks for once that type's model is learned, else
by the pooled one.

The budget (``policy.max_interference_slowdown``), applied by ``shard_sizing`` to a job whose solo
utilisation ``u`` is learned: charged ``k`` of a GPU's ``spg`` shards, its co-runners hold the
other ``spg - k`` and, charged for their own compute (the compute rule), keep the GPU at most
``v = (spg - k) / spg`` busy, so the model predicts at most ``s(u, v)`` for it. The job is charged
the fewest shards (at least what memory and compute need) for which that stays within the budget,
or keeps a whole GPU when even one co-runner's shard would cost more. Under Gavel's fit (the
default prior, a = 0.58) that is at most 1.58x, within the default budget of 2: the prior
changes no decision; a site whose runs teach a steeper model (tally-bench's time-slicing: a =
1.6) gets fewer, larger shares.

Under a long queue (``queue_rules.compute_overcommit``) co-runners are sized by memory alone, so
their shards no longer bound their load: a job is lifted to memory's count only where ``s(u, v)``
is within the budget, ``v`` the load the co-runners of the site's shared runs were observed to
keep a GPU busy with (or one co-runner of ``swap_cost.default_solo_util`` while the model is the
prior: ``lift_co_runners``); elsewhere it keeps its floor (``long_queue_lift``).

``observed_slowdown``: a class whose shared runs took longer than the budget times its solo runs
keeps a whole GPU whatever the model says (jobs that must not be slowed, issue 35 item 2).
"""
from __future__ import annotations

from dataclasses import dataclass

from policy_service.config import Config
from policy_service.core.interference import knee_slowdown
from policy_service.core.interference_learn import LearnedModel, Source, prior_from_config
from policy_service.core.types import ClassStats, KeyLevel, Reason, ReasonCode

ANY_TYPE = "*"  # the pooled model's GPU type: every type's runs together


@dataclass(frozen=True)
class InterferenceView:
    """The models a decision may use: ``pooled`` (every GPU type's runs) and each type's own."""

    pooled: LearnedModel
    by_type: tuple[tuple[str, LearnedModel], ...] = ()

    def model_for(self, gpu_type: str) -> LearnedModel:
        """The learned model of ``gpu_type``; the pooled one where that type has none learned
        (or the job names no type)."""
        for t, m in self.by_type:
            if t == gpu_type and m.source is Source.LEARNED:
                return m
        return self.pooled


_PRIOR_VIEWS: dict[int, tuple[Config, InterferenceView]] = {}


def prior_view(cfg: Config) -> InterferenceView:
    """The configured prior alone (remembered per config object, as policy.model_version)."""
    known = _PRIOR_VIEWS.get(id(cfg))
    if known is not None and known[0] is cfg:
        return known[1]
    prior = prior_from_config(cfg.swap_cost, cfg.interference.prior_name)
    view = InterferenceView(LearnedModel(
        ANY_TYPE, Source.PRIOR, prior.params, prior, 0, 0, 0.0, cfg.interference.prior_weight, None,
        f"prior ({prior.name}): a {prior.params.base:.3f}, b {prior.params.slope:.3f}" +
        ("" if cfg.interference.learn else " (interference.learn = false)")))
    if len(_PRIOR_VIEWS) >= 16:
        _PRIOR_VIEWS.clear()
    _PRIOR_VIEWS[id(cfg)] = (cfg, view)
    return view


def predicted(model: LearnedModel, u_self: float, u_others: float) -> float:
    """The model's slowdown of a job of solo utilisation ``u_self`` beside co-runners summing ``u_others``."""
    if u_others <= 0:
        return 1.0
    return knee_slowdown(u_self, u_others, model.params.base, model.params.slope)


def co_runner_room(k: int, spg: int) -> float:
    """How busy co-runners charged for their compute keep a GPU of ``spg`` shards at most when
    the job holds ``k``: the other shards' share."""
    return max(0, spg - k) / spg


def budget_shards(u: float, k: int, spg: int, model: LearnedModel, budget: float) -> tuple[int | None, float]:
    """(the fewest shards in [k, spg) whose predicted slowdown is within ``budget``, that
    slowdown); (None, the slowdown at spg - 1 shards) when none is."""
    slow = 1.0
    for kk in range(max(1, k), spg):
        slow = predicted(model, u, co_runner_room(kk, spg))
        if slow <= budget:
            return kk, slow
    return None, slow


def observed_slowdown(s: ClassStats | None, min_runs: int) -> float | None:
    """The class's shared runtime over its solo runtime (each an EWMA of at least ``min_runs``
    runs); None before."""
    if s is None or s.shared_runs < min_runs or s.solo_runs < min_runs or s.ewma_solo_runtime_s <= 0:
        return None
    return s.ewma_shared_runtime_s / s.ewma_solo_runtime_s


def lift_co_runners(model: LearnedModel, cfg: Config) -> tuple[float, str]:
    """How busy the co-runners of a job sized by memory alone (the long-queue lift) keep its GPU,
    for the budget, and whence: what the co-runners of the site's shared runs kept a GPU busy
    with (``LearnedModel.co_util``: the observations' summed co-runner utilisations, weighted as
    the fit), or, while the model is the prior, one co-runner of swap_cost.default_solo_util (as
    the priority's predicted contention). Not a whole GPU's: memory-sized co-runners are not
    charged for their compute, but the ones the site's GPUs carry are not all busy."""
    if model.co_util is not None:
        return model.co_util, f"as the co-runners of the site's {model.runs} shared runs kept it on average"
    return cfg.swap_cost.default_solo_util, "one co-runner of swap_cost.default_solo_util: no shared runs learned"


def long_queue_lift(u: float, level: KeyLevel, model: LearnedModel | None, cfg: Config,
                    long_queue: Reason) -> tuple[bool, Reason]:
    """Whether a long queue (``long_queue``: ``queue_rules.compute_overcommit``'s reason) sizes a
    job whose compute floor binds by memory alone, and the reason to say so: only where the model
    predicts it within policy.max_interference_slowdown beside the co-runners such a GPU carries
    (``lift_co_runners``); past it, the job keeps its floor (LONG_QUEUE_OVER_BUDGET). No budget
    or no model: lifted, as the queue rule alone says."""
    budget = cfg.policy.max_interference_slowdown
    if model is None or budget <= 0:
        return True, long_queue
    v, whence = lift_co_runners(model, cfg)
    slow = predicted(model, u, v)
    beside = (f"alone on a GPU it kept it {u:.0%} busy ({level.value} history), and beside co-runners keeping the "
              f"GPU {v:.0%} busy ({whence}) the site's model predicts it {slow:.2f}x slower")
    if slow <= budget:
        return True, Reason(long_queue.code, f"{long_queue.message}; {beside}, within policy.max_interference_slowdown "
                                             f"{budget:.2f}x ({model_line(model)})")
    return False, Reason(ReasonCode.LONG_QUEUE_OVER_BUDGET,
                         f"not sized by memory alone for the long queue (policy.overcommit_compute_min_queue "
                         f"{cfg.policy.overcommit_compute_min_queue:.0%}): {beside}, more than "
                         f"policy.max_interference_slowdown {budget:.2f}x ({model_line(model)})")


def model_line(model: LearnedModel) -> str:
    """One line naming the model: for reasons and ``swapaware explain``."""
    return f"interference model: {model.reason}"
