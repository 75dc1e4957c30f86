"""The report's "Interference: predicted vs observed" on a real SQLite history written by the real
service: shared runs reported by hook events over gRPC on a node whose gres.conf gives its two GPUs
types, then the report's loading path (``load_report`` and the command) reads them back read-only
and compares each run's observed slowdown with the model the service learned and the prior."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from policy_service.config import load_config
from policy_service.core.interference import knee_slowdown
from policy_service.report import command as report_cli
from policy_service.report.aggregate import load_report
from policy_service.report.interference import ALL, gpu_types
from policy_service.serving.client import PolicyClient
from policy_service.serving.server import start_service
from policy_service.slurm.partitions import SlurmConfWatch
from policy_service.slurm.slurm import ClusterRelease
from tests.adapter.interference.test_learner import LEARN, USERS, finish, start
from tests.adapter.serving.test_compute_aware_service import run_solo
from tests.adapter.serving.test_service import facts

SLURM_CONF = "NodeName=n1 CPUs=8 Gres=gpu:a100:1,gpu:h100:1,shard:16\nPartitionName=gpu Nodes=n1 Default=YES\n"
GRES_CONF = ("Name=gpu Type=a100 File=/dev/nvidia0\nName=gpu Type=h100 File=/dev/nvidia1\n"
             "Name=shard Count=8 File=/dev/nvidia0\nName=shard Count=8 File=/dev/nvidia1\n")
PRIOR = (0.58, 2.9)  # swap_cost.compute_interference_base, _knee_slope (Gavel's)


@pytest.fixture
def shared_history(service_env, slurm_jobs):
    """12 shared runs on the a100 (4 users' classes in pairs, each 3x its solo time) and 2 on the
    h100 (2x); the service's learner as it stands afterwards; the history written and closed."""
    env = {**service_env, **LEARN}
    conf = Path(env["SWAPAWARE_SERVICE__SLURM_CONF"])
    conf.write_text(SLURM_CONF)
    (conf.parent / "gres.conf").write_text(GRES_CONF)
    svc = start_service(load_config(env=env), slurm=slurm_jobs)
    client = PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0)
    try:
        ids, t = itertools.count(100), 1000.0
        classes = {u: facts(name=f"rep-{u}", user=u) for u in USERS}
        for job in classes.values():  # alone: 100 s, the GPU 30 % busy
            run_solo(client, slurm_jobs, next(ids), job, util_pct=30.0, start=t, end=t + 100)
            t += 200
        pairs = [(a, b, 0, 300) for a, b in itertools.combinations(USERS, 2)] + [("ann", "bob", 1, 200)]
        for a, b, gpu, took in pairs:
            ja, jb = next(ids), next(ids)
            for job_id, u in ((ja, a), (jb, b)):
                slurm_jobs.comments[job_id] = client.admit(classes[u]).decision.rewrite.admin_comment
            start(client, ja, t, gpu)
            start(client, jb, t, gpu)
            assert finish(client, ja, t + took, 60.0, gpu).applied and finish(client, jb, t + took, 60.0, gpu).applied
            t += 1000
        learner = svc.handler.interference
        assert learner.runs() == 14 and learner.runs("a100") == 12 and learner.runs("h100") == 2
        view = learner.settle()  # the last run's refit is on a timer thread: the view after it
        svc.handler.flush()
    finally:
        client.close()
        svc.stop(0)
    return env, view


def _type_of(env):
    return gpu_types(SlurmConfWatch(Path(env["SWAPAWARE_SERVICE__SLURM_CONF"])).current().node_gpus)


def test_the_report_compares_the_historys_shared_runs_with_the_services_model(shared_history):
    env, view = shared_history
    cfg = load_config(env=env)
    rep = load_report([], cfg.service.db_path, by="user", shards_per_gpu=8, now=5e4, interference_cfg=cfg,
                      gpu_type_of=_type_of(env))
    sec = rep.interference
    assert sec is not None and not sec.error and sec.refused == ()
    assert len(sec.runs) == 14 and {r.user for r in sec.runs} == set(USERS)
    assert sorted(r.gpu_type for r in sec.runs) == ["a100"] * 12 + ["h100"] * 2
    a100 = view.model_for("a100")
    assert a100.gpu_type == "a100" and a100.runs == 12  # the service learned the a100's own model
    prior = 1 + PRIOR[0] * 0.3  # s(0.3, 0.3) by Gavel's fit: below the knee
    for r in sec.runs:
        assert (r.u_self, r.u_others) == (pytest.approx(0.3), pytest.approx(0.3))
        assert r.observed == pytest.approx(3.0 if r.gpu_type == "a100" else 2.0)
        assert r.predicted_prior == pytest.approx(prior)
        model = view.model_for(r.gpu_type)  # the a100's own; the h100's runs are too few: every type's
        assert r.model_type == ("a100" if r.gpu_type == "a100" else "*")
        assert r.predicted_learned == pytest.approx(knee_slowdown(0.3, 0.3, model.params.base, model.params.slope))
    by = {x.gpu_type: x for x in sec.summary}
    assert list(by) == ["a100", "h100", ALL]
    assert (by["a100"].runs, by["a100"].users, by["a100"].model_source, by["a100"].model_runs) == (12, 4, "learned", 12)
    assert (by["a100"].model_base, by["a100"].model_slope) == pytest.approx((a100.params.base, a100.params.slope))
    assert by["a100"].mae_prior == pytest.approx(3.0 - prior)
    assert by["a100"].mae_learned < by["a100"].mae_prior  # the site's model is nearer its runs than the prior
    assert (by["h100"].runs, by["h100"].users, by["h100"].model_type, by["h100"].model_runs) == (2, 2, "*", 14)
    assert by["h100"].mae_prior == pytest.approx(2.0 - prior)
    assert (by[ALL].runs, by[ALL].users) == (14, 4)
    assert by[ALL].mae_prior == pytest.approx((12 * (3.0 - prior) + 2 * (2.0 - prior)) / 14)


def test_without_gres_types_every_run_is_judged_by_the_pooled_model(shared_history):
    env, view = shared_history
    cfg = load_config(env=env)
    rep = load_report([], cfg.service.db_path, by="user", shards_per_gpu=8, now=5e4, interference_cfg=cfg)
    (untyped, total) = rep.interference.summary
    assert (untyped.gpu_type, untyped.runs, untyped.model_type, untyped.model_source) == ("", 14, "*", "learned")
    assert (total.model_base, total.model_slope) == pytest.approx((view.pooled.params.base, view.pooled.params.slope))


def test_the_command_prints_it_and_draws_the_plot(shared_history, slurm_jobs, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    env, _ = shared_history
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SWAPAWARE_CONFIG", raising=False)
    config = tmp_path / "swapaware.toml"
    config.write_text('[service]\nslurm_backend = "cli"\nslurm_release = "22.05"\n')
    monkeypatch.setattr(report_cli, "cluster_release", lambda configured, timeout_s: ClusterRelease(None, "test"))
    monkeypatch.setattr(report_cli, "open_slurm", lambda backend, timeout_s, release: slurm_jobs)
    res = CliRunner().invoke(report_cli.report_command, ["--format", "json", "--interference", "--plot",
                                                         str(tmp_path / "plots"), "--config", str(config)],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output + res.stderr
    part = json.loads(res.stdout)["interference"]
    assert part["available"] and [x["gpu_type"] for x in part["summary"]] == ["a100", "h100", ALL]
    assert len(part["runs"]) == 14 and part["summary"][0]["model_source"] == "learned"
    png = (tmp_path / "plots" / "interference.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    table = CliRunner().invoke(report_cli.report_command, ["--config", str(config)], catch_exceptions=False).stdout
    assert "Interference: predicted vs observed slowdowns (14 shared runs)" in table


def test_an_empty_history_says_there_is_nothing_to_compare(service_env, slurm_jobs, tmp_path):
    svc = start_service(load_config(env=service_env), slurm=slurm_jobs)
    svc.stop(0)
    cfg = load_config(env=service_env)
    rep = load_report([], cfg.service.db_path, by="user", shards_per_gpu=8, now=5e4, interference_cfg=cfg)
    assert rep.interference.runs == () and not rep.interference.error
    from policy_service.report.formats import format_table
    from policy_service.report.plots import write_plots

    assert "interference: no shared run in the history to compare" in format_table(rep)
    pytest.importorskip("matplotlib")
    assert "interference.png" not in [p.name for p in write_plots(tmp_path / "plots", rep)]
