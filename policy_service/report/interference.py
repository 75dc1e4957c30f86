"""The report's "Interference: predicted vs observed" (issue 35): each of the history's newest
shared runs with its observed slowdown beside what the site's model and the prior predict.

``compare`` is pure: the shared runs (``SharedRun``, as the service's learner builds them) made
observations by ``interference_learn.from_run`` and validated by ``check`` as the learner does,
each predicted by ``interference_rule.predicted`` with the model decisions use for its GPU type
(``InterferenceView.model_for``) and with the prior; per GPU type the mean absolute errors.

``load_interference`` reads them from the history, read-only, with the service's own learner:
``InterferenceLearner.load`` over the newest ``interference.window`` shared runs, fitted with the
config's [interference] and swap_cost (the model the service has, give or take the refits since
its last one). A class's solo runtime and utilisation are read as they are now, not as they were
when the run ran (as the service's load does).
"""
from __future__ import annotations

import collections
import dataclasses
import threading
from pathlib import Path
from typing import Callable, Iterable, Sequence

from policy_service.config import Config
from policy_service.core.interference import mae
from policy_service.core.interference_learn import LearnConfig, LearnedModel, SharedRun, check, from_run
from policy_service.core.interference_rule import ANY_TYPE, InterferenceView, predicted, prior_view
from policy_service.history.class_stats import ClassStatsReads
from policy_service.history.config import HistoryConfig
from policy_service.history.decisions import DecisionRecords
from policy_service.history.read import HistoryUnreadable, ReadOnlyHistory
from policy_service.history.runs import RunsAndEvents
from policy_service.interference.learner import InterferenceLearner
from policy_service.report.model import InterferenceRun, InterferenceSection, InterferenceSummary

ALL = "(all)"  # the summary row of every GPU type's runs


# ============================================================================ pure
def predict_run(decision_id: str, run: SharedRun, view: InterferenceView, prior: LearnedModel,
                cfg: LearnConfig) -> tuple[InterferenceRun | None, str]:
    """One shared run as a report row, or None and why it teaches the model nothing (the
    learner's reasons: ``from_run``, then ``check``)."""
    obs, why = from_run(run)
    if obs is None:
        return None, why
    gpu_type = obs.gpu_type.lower()
    checked = check(dataclasses.replace(obs, gpu_type=gpu_type or ANY_TYPE), cfg)  # untyped: pooled, as the learner
    if checked.obs is None:
        return None, f"refused ({checked.refusal.value})"
    model = view.model_for(gpu_type)
    return InterferenceRun(
        decision_id=decision_id, gpu_type=gpu_type, user=obs.user, job_class=obs.job_class, u_self=obs.u_self,
        u_others=obs.u_others, observed=obs.slowdown, predicted_learned=predicted(model, obs.u_self, obs.u_others),
        predicted_prior=predicted(prior, obs.u_self, obs.u_others), model_type=model.gpu_type), ""


def summarize_runs(key: str, runs: Sequence[InterferenceRun], model: LearnedModel) -> InterferenceSummary:
    """The runs of one GPU type (or all, ``ALL``) and the model named beside them."""
    observed = [r.observed for r in runs]
    return InterferenceSummary(
        gpu_type=key, runs=len(runs), users=len({r.user for r in runs}),
        mae_learned=mae([r.predicted_learned for r in runs], observed) if runs else None,
        mae_prior=mae([r.predicted_prior for r in runs], observed) if runs else None,
        model_type=model.gpu_type, model_source=model.source.value, model_runs=model.runs, model_users=model.users,
        model_base=model.params.base, model_slope=model.params.slope, model_reason=model.reason)


def compare(runs: Iterable[tuple[str, SharedRun]], view: InterferenceView, prior: LearnedModel,
            cfg: LearnConfig, *, learn: bool = True) -> InterferenceSection:
    """Every (decision id, shared run) predicted by ``view`` (the model of its GPU type, else the
    pooled one) and by ``prior``; per GPU type and over all (``ALL``: the errors of each run's own
    model, the pooled model named) the runs, users and mean absolute errors."""
    rows: list[InterferenceRun] = []
    refused: collections.Counter[str] = collections.Counter()
    for decision_id, run in runs:
        row, why = predict_run(decision_id, run, view, prior, cfg)
        if row is None:
            refused[why] += 1
        else:
            rows.append(row)
    by_type: dict[str, list[InterferenceRun]] = {}
    for r in rows:
        by_type.setdefault(r.gpu_type, []).append(r)
    summary = [summarize_runs(t, rs, view.model_for(t)) for t, rs in sorted(by_type.items())]
    summary.append(summarize_runs(ALL, rows, view.pooled))
    p = prior.prior
    return InterferenceSection(
        runs=tuple(rows), summary=tuple(summary), refused=tuple(sorted(refused.items())),
        prior=f"{p.name}: a {p.params.base:.3f}, b {p.params.slope:.3f}", learn=learn)


def no_runs_line(section: InterferenceSection | None) -> str:
    """The one line said where there is nothing to compare ("" where there is)."""
    if section is None:
        return ""
    if section.error:
        return f"interference: not read ({section.error})"
    if not section.runs:
        refused = sum(n for _, n in section.refused)
        return ("interference: no shared run in the history to compare predicted with observed slowdowns" +
                (f" ({refused} that could not teach the model: " +
                 ", ".join(f"{why} {n}" for why, n in section.refused) + ")" if refused else ""))
    return ""


# ============================================================================ reading the history
class HistoryReads(ReadOnlyHistory, ClassStatsReads, DecisionRecords, RunsAndEvents):
    """The history opened read-only as the report opens it (``ReadOnlyHistory``), with the reads of
    the service's store that the learner makes (decisions, class statistics, runs, observations).
    Its connection is read-only: the store's writes fail."""

    def __init__(self, source: Path | str | HistoryConfig):
        super().__init__(source)
        self.where = source.where() if isinstance(source, HistoryConfig) else str(source)
        self._stats_memo: collections.OrderedDict = collections.OrderedDict()  # ClassStatsReads' memo
        self._stats_memo_chars = 0
        self._stats_memo_lock = threading.Lock()

    def _read(self, sql: str, args=()) -> list[tuple]:
        try:
            return list(self._conn.execute(sql, args).fetchall())
        except self._errors as exc:
            raise HistoryUnreadable(f"cannot read the history: {exc}") from None


class _RecordingLearner(InterferenceLearner):
    """The service's learner, keeping each shared run its ``load`` builds (with its decision id)."""

    def __init__(self, cfg: Config, gpu_type_of: Callable[[str, int], str] | None):
        super().__init__(cfg, gpu_type_of)
        self.seen: list[tuple[str, SharedRun]] = []

    def shared_run(self, store, row, gpus, node, runtime_s, exit_code, co_runners) -> SharedRun | None:
        run = super().shared_run(store, row, gpus, node, runtime_s, exit_code, co_runners)
        if run is not None:
            self.seen.append((row.decision_id, run))
        return run


def gpu_types(node_gpus) -> Callable[[str, int], str]:
    """(node, device index) -> the GPU type gres.conf gives it, lowercased ("": none), from
    ``PartitionDefaults.node_gpus``."""
    types = {(node, g.index): (g.type or "").lower() for node, gs in node_gpus.items() for g in gs}
    return lambda node, index: types.get((node, index), "")


def load_interference(source: Path | str | HistoryConfig, cfg: Config,
                      gpu_type_of: Callable[[str, int], str] | None = None) -> InterferenceSection:
    """The history's newest shared runs against the model the service would fit to them now
    (``cfg``'s [interference] and swap_cost) and the prior. With interference.learn off the prior
    alone decides, and is the model the runs are compared with."""
    learning = dataclasses.replace(cfg, interference=dataclasses.replace(cfg.interference, learn=True))
    learner = _RecordingLearner(learning, gpu_type_of)
    try:
        with HistoryReads(source) as store:
            if store.version < 3:
                return InterferenceSection(error=f"history schema {store.version} records no runs' co-runners "
                                                 "by instance (the service migrates it when it opens it)")
            learner.load(store)
    except HistoryUnreadable as exc:
        return InterferenceSection(error=str(exc))
    view = learner.view if cfg.interference.learn else prior_view(cfg)
    return compare(learner.seen, view, prior_view(cfg).pooled, cfg.interference, learn=cfg.interference.learn)


__all__ = ["ALL", "HistoryReads", "compare", "gpu_types", "load_interference",
           "no_runs_line", "predict_run", "summarize_runs"]
