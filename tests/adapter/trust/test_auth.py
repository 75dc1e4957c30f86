"""With a token configured, only callers holding it may feed observations to the model."""
from pathlib import Path

import grpc
import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.serving.grpc_server import authorized
from policy_service.serving.client import PolicyClient
from policy_service.config import ConfigError, load_config, read_token
from policy_service.serving.server import start_service
from slurm_plugin.hooks import run as hooks, spool
from tests.adapter.conftest import socket_call


@pytest.fixture
def secured(service_env, slurm_jobs, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)  # a token file group or others may read is refused
    env = {**service_env, "SWAPAWARE_SERVICE__TOKEN_FILE": str(token)}
    svc = start_service(load_config(env=env), slurm=slurm_jobs)
    yield svc, env, token
    svc.stop(0)


def test_events_need_the_token_and_admit_over_grpc_is_only_a_dry_run(secured):
    """Token mode (no MUNGE here): the token identifies the nodes' hooks, not slurmctld."""
    svc, _, _ = secured
    finish = pb.JobFinishedRequest(job_id=1, event_id="e1", finished_at=10.0)
    facts = pb.JobFacts(user="u", uid=1000, tres_per_node="gres:gpu:1")
    with PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0) as anon:
        with pytest.raises(grpc.RpcError) as err:
            anon.call("JobFinished", finish)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            anon.call("JobStarted", pb.JobStartedRequest(job_id=1, event_id="s1"))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        d = anon.admit(facts).decision
        assert "dry_run_not_slurmctld" in [r.code for r in d.reasons]
        with pytest.raises(grpc.RpcError) as err:  # recorded nowhere; and an anonymous caller sees no job
            anon.explain(pb.ExplainRequest(decision_id=d.decision_id))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert anon.explain(pb.ExplainRequest(job=facts)).decision.action  # a what-if: open to all
    recorded = socket_call(svc.socket_path, {"method": "Admit", "request": {"job": {
        "user": "u", "uid": 1000, "tresPerNode": "gres:gpu:1"}}})["response"]["decision"]
    assert "dry_run_not_slurmctld" not in [r["code"] for r in recorded.get("reasons", [])]
    with PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0, token="wrong") as wrong:
        for call in (lambda: wrong.call("JobFinished", finish), lambda: wrong.admit(facts)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "not the hooks' token" in err.value.details()
    with PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0, token="s3cret") as ok:
        assert ok.call("JobFinished", finish).applied
        explained = ok.explain(pb.ExplainRequest(decision_id=recorded["decisionId"]))
        assert explained.decision.decision_id == recorded["decisionId"]
        assert "dry_run_not_slurmctld" in [r.code for r in ok.admit(facts).decision.reasons]
    assert [o.job_id for o in svc.store.observations()] == [1]
    svc.handler.flush()
    assert svc.store.decision(d.decision_id) is None


def test_hooks_with_a_bad_token_spool_and_deliver_once_it_is_fixed(secured, tmp_path):
    svc, env, token = secured
    spool_dir = Path(env["SWAPAWARE_HOOKS__SPOOL_DIR"])
    bad = tmp_path / "bad-token"
    bad.write_text("nope")
    bad.chmod(0o600)
    base = {**env, "SWAPAWARE_HOOKS__SERVICE_ADDRESS": f"127.0.0.1:{svc.grpc_port}"}
    cfg_bad = load_config(env={**base, "SWAPAWARE_HOOKS__TOKEN_FILE": str(bad)}).hooks
    req = pb.JobFinishedRequest(job_id=2, event_id="f2", finished_at=5.0)
    assert hooks.deliver(cfg_bad, "JobFinished", req) is False
    assert len(spool.pending(spool_dir)) == 1
    assert spool.replay(spool_dir, hooks.hook_client(cfg_bad).call, 10).stopped_by.startswith("UNAUTHENTICATED")
    assert len(spool.pending(spool_dir)) == 1  # kept, not rejected
    cfg_ok = load_config(env={**base, "SWAPAWARE_HOOKS__TOKEN_FILE": str(token)}).hooks
    assert hooks.replay_main(cfg_ok).sent == 1 and not spool.pending(spool_dir)
    assert [o.job_id for o in svc.store.observations()] == [2]


@pytest.mark.parametrize("metadata,token,ok", [
    ((), None, True),
    ((("authorization", "Bearer t"),), "t", True),
    ((("authorization", "Bearer x"),), "t", False),
    ((("authorization", "t"),), "t", False),
    ((), "t", False),
])
def test_authorized(metadata, token, ok):
    assert authorized(metadata, token) is ok


def test_token_file_errors(tmp_path):
    assert read_token("") is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        read_token(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="token file"):
        read_token(str(tmp_path / "missing"))
