"""The interference learner in the real service, over real gRPC and a real SQLite history: shared
runs reported by hook events teach the site's model, Explain says which model and from how many
runs, a later decision follows it, and a restarted service reads the same evidence back."""
from __future__ import annotations

import itertools

import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.config import load_config
from policy_service.core.interference_learn import Source
from policy_service.core.interference_rule import ANY_TYPE
from policy_service.serving.client import PolicyClient
from policy_service.serving.server import start_service
from tests.adapter.serving.test_compute_aware_service import run_solo
from tests.adapter.serving.test_service import GIB, facts
from tests.waiting import wait_for

USERS = ("ann", "bob", "cyd", "dee")
LEARN = {  # a small site: 4 users, a light prior, a fit at every new run
    "SWAPAWARE_INTERFERENCE__MIN_RUNS": "8", "SWAPAWARE_INTERFERENCE__MIN_USERS": "3",
    "SWAPAWARE_INTERFERENCE__MAX_USER_SHARE": "0.3", "SWAPAWARE_INTERFERENCE__PRIOR_WEIGHT": "2",
    "SWAPAWARE_INTERFERENCE__REFIT_S": "0.001",
}


@pytest.fixture
def learning(service_env, slurm_jobs):
    env = {**service_env, **LEARN}
    svc = start_service(load_config(env=env), slurm=slurm_jobs)
    client = PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0)
    wait_for(lambda: "interference-load" not in _threads(), 10, "the learner's load at start")
    yield svc, client, env
    client.close()
    svc.stop(0)


def _threads() -> set[str]:
    import threading
    return {t.name for t in threading.enumerate()}


def start(client, job_id: int, at: float, gpu: int = 0) -> None:
    client.call("JobStarted", pb.JobStartedRequest(job_id=job_id, node="n1", gpu_indices=[gpu], started_at=at,
                                                   event_id=f"s{job_id}"))


def finish(client, job_id: int, at: float, util_pct: float, gpu: int = 0) -> pb.JobFinishedResponse:
    return client.call("JobFinished", pb.JobFinishedRequest(
        job_id=job_id, node="n1", gpu_indices=[gpu], finished_at=at, exit_code=0, event_id=f"f{job_id}",
        peak_gpu_bytes=2 * GIB, telemetry_source="fake-nvml",
        gpus=[pb.GpuUsage(gpu_index=gpu, peak_bytes=2 * GIB, util_mean_pct=util_pct, total_bytes=80 * GIB)]))


def model_reason(client, job: pb.JobFacts) -> str:
    d = client.call("Explain", pb.ExplainRequest(job=job)).decision
    (m,) = [r.message for r in d.reasons if r.code == "interference_model"]
    return m


def test_shared_runs_teach_the_model_that_explain_names_and_decisions_follow(learning, slurm_jobs):
    svc, client, _ = learning
    ids = itertools.count(100)
    t = 1000.0
    classes = {u: facts(name=f"sim-{u}", user=u) for u in USERS}
    for u, job in classes.items():  # each class alone first: 100 s, its GPU 30 % busy
        run_solo(client, slurm_jobs, next(ids), job, util_pct=30.0, start=t, end=t + 100)
        t += 200
    light = facts(name="light", user="eve")
    for _ in range(2):  # a class that keeps its GPU 13 % busy: compute asks ceil(0.13 x 8) = 2 shards
        run_solo(client, slurm_jobs, next(ids), light, util_pct=13.0, start=t, end=t + 100)
        t += 200
    before = client.admit(light).decision
    assert (before.action, before.shards) == (pb.ACTION_SHARE, 2)
    assert "now: interference model: prior (gavel)" in model_reason(client, light)

    # pairs on one GPU, each run three times its solo time: a steep site
    pairs = [(a, b) for a, b in itertools.combinations(USERS, 2)]
    for a, b in pairs:
        ja, jb = next(ids), next(ids)
        for job_id, u in ((ja, a), (jb, b)):
            slurm_jobs.comments[job_id] = client.admit(classes[u]).decision.rewrite.admin_comment
        start(client, ja, t)
        start(client, jb, t)
        assert finish(client, ja, t + 300, 60.0).applied
        assert finish(client, jb, t + 300, 60.0).applied
        t += 1000
    learner = svc.handler.interference
    assert learner.runs() == 2 * len(pairs) == 12
    view = learner.settle()  # the fit runs on a timer once refit_s has passed
    assert view.pooled.source is Source.LEARNED and view.pooled.runs == 12 and view.pooled.users == 4
    assert view.pooled.params.base > 1.0  # s(0.3, 0.3) = 3 pulls a far above the prior's 0.58
    said = model_reason(client, light)
    assert "now: interference model: learned from 12 shared runs of 4 users on all GPU types" in said

    after = client.admit(light).decision
    assert after.action in (pb.ACTION_SHARE, pb.ACTION_WHOLE_GPU) and (after.action, after.shards) != (
        before.action, before.shards)
    codes = {r.code for r in after.reasons}
    assert codes & {"interference_shards", "interference_budget"}
    (why,) = [r.message for r in after.reasons if r.code in ("interference_shards", "interference_budget")]
    assert "learned from 12 shared runs of 4 users" in why

    # a class whose own shared runs took 3x its solo runs keeps a whole GPU once it has 3 of each
    ann = classes["ann"]
    for _ in range(2):
        run_solo(client, slurm_jobs, next(ids), ann, util_pct=30.0, start=t, end=t + 100)
        t += 200
    d = client.admit(ann).decision
    assert d.action == pb.ACTION_WHOLE_GPU and "interference_observed" in {r.code for r in d.reasons}


def test_a_restarted_service_reads_the_same_evidence_back(learning, slurm_jobs):
    svc, client, env = learning
    ids = itertools.count(300)
    t = 1000.0
    classes = {u: facts(name=f"r-{u}", user=u) for u in USERS}
    for job in classes.values():
        run_solo(client, slurm_jobs, next(ids), job, util_pct=40.0, start=t, end=t + 100)
        t += 200
    for a, b in itertools.combinations(USERS, 2):
        ja, jb = next(ids), next(ids)
        for job_id, u in ((ja, a), (jb, b)):
            slurm_jobs.comments[job_id] = client.admit(classes[u]).decision.rewrite.admin_comment
        start(client, ja, t)
        start(client, jb, t)
        finish(client, ja, t + 150, 80.0)
        finish(client, jb, t + 150, 80.0)
        t += 1000
    first = svc.handler.interference
    assert first.runs() == 12 and first.settle().pooled.source is Source.LEARNED
    svc.handler.flush()
    svc.stop(0)
    again = start_service(load_config(env=env), slurm=slurm_jobs)
    try:
        # the view, not runs(): load() puts the runs read back in place, then refits from them (CI
        # run 57 read the view in between: still the prior, with runs() already 12)
        wait_for(lambda: again.handler.interference.view.pooled.runs == 12, 10,
                 lambda: f"the model refitted from the shared runs read back at start: "
                         f"{again.handler.interference.view.pooled}")
        assert again.handler.interference.view.pooled.params == pytest.approx(first.view.pooled.params)
        assert again.handler.interference.runs(ANY_TYPE) == 12
    finally:
        again.stop(0)


def test_runs_that_cannot_teach_are_counted_with_why(learning, slurm_jobs):
    svc, client, _ = learning
    # two classes never seen alone: their shared runs have no solo runtime to compare with
    a, b = facts(name="new-a", user="ann"), facts(name="new-b", user="bob")
    for job_id, job in ((500, a), (501, b)):
        slurm_jobs.comments[job_id] = client.admit(job).decision.rewrite.admin_comment
    start(client, 500, 1000.0)
    start(client, 501, 1000.0)
    assert finish(client, 500, 1300.0, 50.0).applied and finish(client, 501, 1300.0, 50.0).applied
    learner = svc.handler.interference
    assert learner.runs() == 0
    assert learner.refused["its class has no solo runtime yet"] == 2


def test_a_user_whose_shared_runs_run_long_cannot_steer_the_site_model(service_env, slurm_jobs):
    """Mallory's three classes run 100 s alone and 2,000 s beside each other (her jobs sleep when
    shared): two thirds of the site's shared runs, 20x slowdowns. Honest classes are slowed 1.2x.
    Her weight is capped at max_user_share (0.1) of the evidence: the site's model stays where the
    honest runs put it; the same evidence fitted without the caps follows her."""
    from dataclasses import replace

    from policy_service.core.interference_learn import learn, user_influence
    from policy_service.core.interference_rule import predicted

    env = {**service_env, **LEARN, "SWAPAWARE_INTERFERENCE__MAX_USER_SHARE": "0.1"}
    svc = start_service(load_config(env=env), slurm=slurm_jobs)
    client = PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0)
    try:
        ids, t = itertools.count(700), 1000.0
        classes = {u: facts(name=f"m-{u}", user=u) for u in USERS}
        evil = {f"mallory-{i}": facts(name=f"m-mallory-{i}", user="mallory") for i in range(3)}
        for job in (*classes.values(), *evil.values()):
            run_solo(client, slurm_jobs, next(ids), job, util_pct=30.0, start=t, end=t + 100)
            t += 200

        def pair(a: pb.JobFacts, b: pb.JobFacts, runs_s: float) -> None:
            nonlocal t
            ja, jb = next(ids), next(ids)
            for job_id, job in ((ja, a), (jb, b)):
                slurm_jobs.comments[job_id] = client.admit(job).decision.rewrite.admin_comment
            start(client, ja, t)
            start(client, jb, t)
            assert finish(client, ja, t + runs_s, 60.0).applied and finish(client, jb, t + runs_s, 60.0).applied
            t += 5000

        for a, b in itertools.combinations(USERS, 2):
            pair(classes[a], classes[b], 120.0)
        for a, b in itertools.combinations(evil, 2):
            for _ in range(4):
                pair(evil[a], evil[b], 2000.0)
        learner = svc.handler.interference
        view = learner.settle()
        ev = learner._evidence[ANY_TYPE]
        assert len(ev.obs) == 36 and sum(o.user == "mallory" for o in ev.obs) == 24
        assert view.pooled.source is Source.LEARNED
        assert predicted(view.pooled, 0.3, 0.3) == pytest.approx(1.2, abs=0.05)  # what the honest runs say
        cfg = svc.handler.cfg.interference
        assert user_influence(ev, "mallory", learner.prior, cfg) < 0.05
        unbounded = learn(ev, learner.prior, replace(cfg, max_user_share=0.9, max_class_share=0.9))
        assert predicted(unbounded, 0.3, 0.3) == pytest.approx(1.9)  # she steers it: a at its bound (3.0)
    finally:
        client.close()
        svc.stop(0)


def test_the_metrics_show_the_model_and_the_untaught_runs(learning, slurm_jobs):
    svc, client, _ = learning
    test_shared_runs_teach_the_model_that_explain_names_and_decisions_follow(learning, slurm_jobs)
    registry = svc.handler.metrics.registry
    value = lambda what: registry.get_sample_value("swapaware_interference_model",  # noqa: E731
                                                   {"gpu_type": "*", "what": what})
    assert (value("learned"), value("runs")) == (1.0, 12.0)
    assert value("a") == pytest.approx(svc.handler.interference.view.pooled.params.base)
    a, b = facts(name="new-a2", user="ann"), facts(name="new-b2", user="bob")  # never alone: untaught
    for job_id, job in ((900, a), (901, b)):
        slurm_jobs.comments[job_id] = client.admit(job).decision.rewrite.admin_comment
    start(client, 900, 90000.0)
    start(client, 901, 90000.0)
    finish(client, 900, 90300.0, 50.0)
    finish(client, 901, 90300.0, 50.0)
    svc.handler.interference.refit()
    assert registry.get_sample_value("swapaware_interference_untaught_runs",
                                     {"why": "its class has no solo runtime yet"}) == 2.0


@pytest.mark.parametrize("closed", [True, False])
def test_a_load_cut_short_by_the_stop_is_no_error(closed, tmp_path, caplog):
    """The learner reads the history in a thread of its own; a service stopped meanwhile closes the
    store under it. That is said at info, without a traceback; a read that fails on an open store
    is still an error with one."""
    import logging
    import sqlite3
    import threading
    import types

    from policy_service.history.store import HistoryStore
    from policy_service.serving.server import start_interference

    store = HistoryStore(tmp_path / "h.sqlite3", accept_empty=True)
    done = threading.Event()

    def load(s):
        try:
            if closed:
                s.close()
            s._read("SELECT * FROM no_such_table")
        finally:
            done.set()

    handler = types.SimpleNamespace(store=store, interference=types.SimpleNamespace(load=load))
    with caplog.at_level(logging.INFO, logger="swapaware.service"):
        start_interference(handler, None)
        assert done.wait(10)
        wait_for(lambda: "interference-load" not in _threads(), 10, "the load thread to end")
    said = [r for r in caplog.records if "interference learner" in r.getMessage()]
    assert len(said) == 1
    if closed:
        assert said[0].levelno == logging.INFO and said[0].exc_info is None
        assert "stopped before" in said[0].getMessage()
    else:
        assert said[0].levelno == logging.ERROR and said[0].exc_info[0] is sqlite3.OperationalError
        store.close()
