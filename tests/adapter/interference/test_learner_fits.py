"""The learner's fits in order: two fits at once never publish the older evidence last, and
settle() returns only once a fit in progress has published."""
from __future__ import annotations

import threading

from policy_service.config import load_config
from policy_service.core.interference_learn import SharedRun
from policy_service.interference import learner as learner_module
from policy_service.interference.learner import InterferenceLearner


def run(i: int) -> SharedRun:
    return SharedRun(gpu_type="", user=f"u{i % 4}", job_class=f"c{i}", runtime_s=150.0, exit_code=0,
                     solo_runtime_s=100.0, solo_runs=1, u_self=0.3, u_others=(0.3,))


def test_a_fit_started_later_publishes_after_the_one_in_progress(monkeypatch):
    cfg = load_config(env={"SWAPAWARE_INTERFERENCE__REFIT_S": "3600", "SWAPAWARE_INTERFERENCE__MIN_RUNS": "1",
                           "SWAPAWARE_INTERFERENCE__MIN_USERS": "1"})
    lrn = InterferenceLearner(cfg)
    first_fitting, release_first = threading.Event(), threading.Event()
    real_learn, calls = learner_module.learn, []

    def slow_learn(ev, prior, c):
        calls.append(len(ev.obs))
        if len(calls) == 1:  # the first fit holds its (older) evidence until released
            first_fitting.set()
            assert release_first.wait(10)
        return real_learn(ev, prior, c)

    monkeypatch.setattr(learner_module, "learn", slow_learn)
    lrn.add(run(0))  # never fitted: the timer's fit starts at once
    assert first_fitting.wait(10)
    lrn.add(run(1))  # newer evidence (its own timer's fit is refit_s away) ...
    b = threading.Thread(target=lrn.refit)  # ... fitted now, while the first fit is in progress
    b.start()
    b.join(0.3)
    assert b.is_alive() and calls == [1]  # the second waits for the first
    release_first.set()
    b.join(10)
    assert calls == [1, 2] and lrn.view.pooled.runs == 2  # the newest evidence published last
    lrn._timer.cancel()


def test_settle_waits_for_the_fit_in_progress(monkeypatch):
    cfg = load_config(env={"SWAPAWARE_INTERFERENCE__REFIT_S": "0.001", "SWAPAWARE_INTERFERENCE__MIN_RUNS": "1",
                           "SWAPAWARE_INTERFERENCE__MIN_USERS": "1"})
    lrn = InterferenceLearner(cfg)
    fitting, real_learn = threading.Event(), learner_module.learn

    def slow_learn(ev, prior, c):
        fitting.set()
        threading.Event().wait(0.3)  # a fit that takes a while (the timer's)
        return real_learn(ev, prior, c)

    monkeypatch.setattr(learner_module, "learn", slow_learn)
    lrn.add(run(0))  # schedules the timer's fit
    assert fitting.wait(10)
    assert lrn.settle().pooled.runs == 1
