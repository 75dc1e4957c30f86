"""The service's interference learner (issue 35; docs/model.md, "Learning the site's interference").

Each finished run that shared a GPU (co-runners on its GPUs during its run: serving/events.py)
becomes a ``SharedRun``: its class's solo runtime and utilisation and each co-runner's class's
solo utilisation, read from the history's class statistics; its GPU type from gres.conf (the
node and device it ran on: PartitionDefaults.node_gpus). ``interference_learn.from_run`` makes
it an observation, or says why it teaches nothing (counted in ``refused``). Observations go into
the evidence of their GPU type and of every type together (``ANY_TYPE``); each is refitted at
most every ``interference.refit_s`` when new ones came, and the decision path reads ``view``
(an ``InterferenceView``, replaced whole: a reader never sees half a refit).

At start ``load`` reads the newest shared runs back from the history (the figures of their
classes as they are now, not as they were when each ran): the model a restarted service decides
with is the one it had, give or take what the classes learned since. With ``interference.learn``
off the view stays the prior.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Iterable

from policy_service.config import Config
from policy_service.core.interference_learn import (Evidence, InterferenceObs, SharedRun, Source, from_run, learn,
                                                    observe, prior_from_config)
from policy_service.core.interference_rule import ANY_TYPE, InterferenceView, model_line, prior_view
from policy_service.core.types import KeyLevel

log = logging.getLogger("swapaware.service")


class InterferenceLearner:
    """Evidence per GPU type, refitted when due; ``view`` is what decisions use."""

    def __init__(self, cfg: Config, gpu_type_of: Callable[[str, int], str] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg, self.clock = cfg, clock
        self.gpu_type_of = gpu_type_of or (lambda node, index: "")  # "": not known (pooled only)
        self.prior = prior_from_config(cfg.swap_cost, cfg.interference.prior_name)
        self.view: InterferenceView = prior_view(cfg)
        self.refused: collections.Counter = collections.Counter()  # why a shared run taught nothing
        self._evidence: dict[str, Evidence] = {}
        self._lock = threading.Lock()
        # one fit at a time: two fits at once (a timer's and load's, or a second timer started while
        # the first fits) could publish their views in the wrong order, the older evidence last
        self._fit_lock = threading.Lock()
        self._new = 0  # observations since the last fit
        self._timer: threading.Timer | None = None  # the fit to come (maybe_refit)
        self.on_refit: Callable[[InterferenceView, collections.Counter], None] | None = None  # metrics
        self._fitted_at = float("-inf")

    # ------------------------------------------------------------------ evidence
    def add(self, run: SharedRun) -> InterferenceObs | None:
        """One finished shared run (refitted when due); the observation it made, or None."""
        if not self.cfg.interference.learn:
            return None
        obs = self._teachable(run)
        if obs is None:
            return None
        with self._lock:
            kept = self._observe(obs)
        if kept:
            self.maybe_refit()
        return obs if kept else None

    def _teachable(self, run: SharedRun, say: bool = True) -> InterferenceObs | None:
        """``from_run``'s observation; None counted (and logged, with ``say``) with why."""
        obs, why = from_run(run)
        if obs is None:
            self.refused[why] += 1
            if say:
                log.info("interference: a shared run of class %s (user %s) teaches nothing: %s", run.job_class,
                         run.user, why)
        return obs

    def _observe(self, obs: InterferenceObs, into: dict[str, Evidence] | None = None) -> bool:
        """Into its GPU type's evidence and the pooled one (``into``: those, else the learner's)."""
        evidence = self._evidence if into is None else into
        kept = False
        for gpu_type in dict.fromkeys((ANY_TYPE, obs.gpu_type.lower()) if obs.gpu_type else (ANY_TYPE,)):
            ev = evidence.get(gpu_type) or Evidence(gpu_type)
            as_type = InterferenceObs(gpu_type, obs.user, obs.job_class, obs.u_self, obs.u_others, obs.slowdown)
            ev, checked = observe(ev, as_type, self.cfg.interference)
            if checked.obs is None:
                self.refused[checked.reason] += 1
                return kept
            evidence[gpu_type] = ev
            kept = True
        self._new += 1
        return kept

    def runs(self, gpu_type: str = ANY_TYPE) -> int:
        ev = self._evidence.get(gpu_type)
        return len(ev.obs) if ev is not None else 0

    # ------------------------------------------------------------------ fitting
    def maybe_refit(self) -> None:
        """New observations came: a fit once refit_s has passed since the last one, on a timer
        thread (never on the event that brought them: a fit of 2,000 runs takes ~40 ms)."""
        with self._lock:
            if self._new == 0 or self._timer is not None:
                return
            wait = max(0.0, self.cfg.interference.refit_s - (self.clock() - self._fitted_at))
            self._timer = threading.Timer(wait, self._timed)
            self._timer.daemon = True
            self._timer.name = "interference-refit"
            self._timer.start()

    def _timed(self) -> None:
        with self._fit_lock:  # held before the timer is cleared: settle() never sees neither
            with self._lock:
                self._timer = None
            try:
                self._refit()
            except Exception:  # noqa: BLE001 - the last view stays; the next observation tries again
                log.exception("interference learner: refit failed")

    def settle(self, timeout_s: float = 10.0) -> InterferenceView:
        """Wait for a pending fit and one in progress (tests, benches); the view."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                timer = self._timer
            if timer is None:
                break
            timer.join(max(0.0, deadline - time.monotonic()))
        if self._fit_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            self._fit_lock.release()
        return self.view

    def refit(self) -> InterferenceView:
        """Fit every GPU type's model now and publish the view."""
        with self._fit_lock:
            return self._refit()

    def _refit(self) -> InterferenceView:
        with self._lock:
            evidence = dict(self._evidence)
            self._new, self._fitted_at = 0, self.clock()
        pooled_ev = evidence.pop(ANY_TYPE, Evidence(ANY_TYPE))
        pooled = learn(pooled_ev, self.prior, self.cfg.interference)
        by_type = tuple((t, learn(ev, self.prior, self.cfg.interference)) for t, ev in sorted(evidence.items()))
        view = InterferenceView(pooled, by_type)
        old = self.view
        self.view = view
        if self.on_refit is not None:
            self.on_refit(view, self.refused)
        if (pooled.source, pooled.params) != (old.pooled.source, old.pooled.params) or \
                [(t, m.source) for t, m in by_type] != [(t, m.source) for t, m in old.by_type]:
            log.info("%s%s", model_line(pooled), "".join(f"; {t}: {m.reason}" for t, m in by_type
                                                          if m.source is Source.LEARNED))
        return view

    # ------------------------------------------------------------------ from the history
    def shared_run(self, store, row, gpus: Iterable[int], node: str, runtime_s: float, exit_code: int,
                   co_runners) -> SharedRun | None:
        """The SharedRun of a finished run of decision ``row`` (None without class keys)."""
        keys = dict(row.keys) if row is not None else {}
        cls = keys.get(KeyLevel.CLASS)
        if not cls:
            return None
        own = self._class_stats(store, row)
        gpus = tuple(gpus)
        types = {self.gpu_type_of(node, g) for g in gpus} - {""}
        return SharedRun(
            gpu_type=types.pop() if len(types) == 1 else "", user=row.user, job_class=cls, runtime_s=runtime_s,
            exit_code=exit_code, solo_runtime_s=own.ewma_solo_runtime_s if own else 0.0,
            solo_runs=own.solo_runs if own else 0, u_self=own.ewma_solo_util if own and own.util_runs else None,
            u_others=tuple(self._solo_util(store, r.decision_id) for r in co_runners))

    @staticmethod
    def _class_stats(store, row):
        """The statistics of decision ``row``'s class key (None: no row, key or statistics)."""
        cls = dict(row.keys).get(KeyLevel.CLASS) if row is not None else None
        return store.stats({KeyLevel.CLASS: cls}).get(KeyLevel.CLASS) if cls else None

    def _solo_util(self, store, decision_id: str) -> float | None:
        s = self._class_stats(store, store.decision(decision_id) if decision_id else None)
        return s.ewma_solo_util if s is not None and s.util_runs else None

    def load(self, store) -> int:
        """The evidence read anew from the newest shared runs in the history, in place of what this
        process had (the runs beside each: HistoryStore.co_runners, as the service's events read
        them), and the model refitted; how many taught it. A run that finishes while this reads
        teaches the next load (it is in the history), not this one."""
        if not self.cfg.interference.learn:
            return 0
        t0, taught, fresh = time.monotonic(), 0, {}
        for o in store.recent_shared_observations(self.cfg.interference.window):
            row = store.decision(o.decision_id)
            if row is None or o.started_at is None:
                continue
            co = store.co_runners(o.node, o.gpu_indices, o.started_at, o.finished_at, o.instance,
                                  self.cfg.service.open_run_max_s)
            run = self.shared_run(store, row, o.gpu_indices, o.node, o.runtime_s or 0.0, o.exit_code, co)
            obs = self._teachable(run, say=False) if run is not None else None  # counted, not logged one by one
            if obs is not None:
                taught += self._observe(obs, fresh)
        with self._lock:
            self._evidence = fresh
        view = self.refit()
        log.info("interference learner: %d shared run(s) read back from the history in %.2f s; %s", taught,
                 time.monotonic() - t0, model_line(view.pooled))
        return taught
