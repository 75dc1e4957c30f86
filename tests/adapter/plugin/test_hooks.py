"""The prolog/epilog console scripts against a real service, and their spool when it is down."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.config import load_config
from policy_service.serving.server import start_service
from slurm_plugin.hooks import run as hooks, spool

BIN = Path(sys.executable).parent


def run_hook(name: str, env: dict[str, str], **job_env: str) -> subprocess.CompletedProcess:
    full = {"PATH": os.environ["PATH"], **env, **job_env}
    return subprocess.run([str(BIN / f"swapaware-{name}")], env=full, capture_output=True, text=True, timeout=60)


def hook_env(service_env, port):
    return {**service_env, "SWAPAWARE_HOOKS__SERVICE_ADDRESS": f"127.0.0.1:{port}"}


@pytest.mark.parametrize("env,expected", [
    ({"SLURM_JOB_GPUS": "0,2"}, [0, 2]),
    ({"SLURM_JOB_GPUS": "1-3"}, [1, 2, 3]),
    ({"CUDA_VISIBLE_DEVICES": "3"}, [3]),
    ({"SLURM_JOB_GPUS": "", "CUDA_VISIBLE_DEVICES": "1,0"}, [0, 1]),
    ({"CUDA_VISIBLE_DEVICES": "GPU-abc"}, []),
    ({}, []),
])
def test_parse_gpu_indices(env, expected):
    assert hooks.parse_gpu_indices(env) == expected


@pytest.mark.parametrize("env,expected", [
    ({"SLURM_JOB_EXIT_CODE2": "3:0", "SLURM_JOB_DERIVED_EC": "0:0"}, (3, 0, 0)),
    ({"SLURM_JOB_EXIT_CODE2": "0:9"}, (0, 9, 0)),
    ({"SLURM_JOB_EXIT_CODE": "256"}, (1, 0, 0)),
    ({"SLURM_JOB_EXIT_CODE": "9"}, (0, 9, 0)),
    ({"SLURM_JOB_EXIT_CODE2": "garbage"}, (0, 0, 0)),
])
def test_parse_exit(env, expected):
    assert hooks.parse_exit(env) == expected


def test_prolog_and_epilog_deliver_to_the_service(service, service_env, slurm_jobs, client):
    d = client.admit(pb.JobFacts(user="alice", job_name="t", tres_per_node="gres:gpu:1")).decision
    slurm_jobs.comments[7] = d.rewrite.admin_comment
    env = hook_env(service_env, service.grpc_port)
    r = run_hook("prolog", env, SLURM_JOB_ID="7", SLURM_JOB_GPUS="2", SLURMD_NODENAME="n1")
    assert r.returncode == 0, r.stderr
    assert service.store.run(7).decision_id == d.decision_id and service.store.run(7).gpu_indices == (2,)
    r = run_hook("epilog", env, SLURM_JOB_ID="7", SLURM_JOB_GPUS="2", SLURMD_NODENAME="n1",
                 SLURM_JOB_EXIT_CODE2="0:0")
    assert r.returncode == 0, r.stderr
    (obs,) = service.store.observations(job_id=7)
    assert obs.decision_id == d.decision_id and obs.runtime_s is not None and obs.runtime_s >= 0
    assert obs.peak_bytes is None and obs.telemetry_source == "none"  # no agent here
    assert not spool.pending(Path(service_env["SWAPAWARE_HOOKS__SPOOL_DIR"]))


def test_hooks_spool_when_service_is_down_and_replay_when_back(service_env, slurm_jobs, tmp_path):
    spool_dir = Path(service_env["SWAPAWARE_HOOKS__SPOOL_DIR"])
    # nothing listens here: a port we held and released
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead_port = s.getsockname()[1]
    s.close()
    env = hook_env(service_env, dead_port)
    for name in ("prolog", "epilog"):
        r = run_hook(name, env, SLURM_JOB_ID="8", CUDA_VISIBLE_DEVICES="0", SLURM_JOB_EXIT_CODE2="1:0")
        assert r.returncode == 0  # never drains the node
        assert "spooled" in r.stderr
    assert len(spool.pending(spool_dir)) == 2
    # the service comes back (on a port we learn only now); the next hook run replays in order
    cfg = load_config(env=service_env)
    svc = start_service(cfg, slurm=slurm_jobs)
    try:
        env = hook_env(service_env, svc.grpc_port)
        r = run_hook("prolog", env, SLURM_JOB_ID="9", CUDA_VISIBLE_DEVICES="1")
        assert r.returncode == 0 and "replayed 2" in r.stderr, r.stderr
        assert not spool.pending(spool_dir)
        (obs,) = svc.store.observations(job_id=8)
        assert obs.exit_code == 1 and obs.started_at is not None  # the spooled start arrived first
        assert svc.store.run(9) is not None
    finally:
        svc.stop(0)


def test_hook_with_broken_config_still_exits_zero(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[service\n")
    r = run_hook("epilog", {"SWAPAWARE_CONFIG": str(bad), "SWAPAWARE_HOOKS__SPOOL_DIR": str(tmp_path / "sp"),
                            "SWAPAWARE_HOOKS__SERVICE_ADDRESS": "127.0.0.1:1", "SWAPAWARE_HOOKS__DEADLINE_S": "0.5"},
                 SLURM_JOB_ID="5")
    assert r.returncode == 0 and "config unusable" in r.stderr


def test_hook_without_job_id_exits_zero_and_says_why(service_env):
    r = run_hook("prolog", service_env)
    assert r.returncode == 0 and "SLURM_JOB_ID" in r.stderr


def test_rejected_spool_entries_are_kept_aside(service, service_env, client):
    spool_dir = Path(service_env["SWAPAWARE_HOOKS__SPOOL_DIR"])
    spool.spool_event(spool_dir, "JobFinished", pb.JobFinishedRequest(job_id=3), "bad")  # no event id: invalid
    (spool_dir / "99-garbage.json").write_text("{not json")
    result = spool.replay(spool_dir, client.call, 10)
    assert (result.sent, result.rejected, result.left) == (0, 2, 0)
    assert sorted(p.name for p in (spool_dir / "rejected").iterdir() if p.suffix == ".why").__len__() == 2


@pytest.mark.parametrize("exit2,expect_oom", [("0:0", False), ("1:0", True), ("0:9", True)])
def test_agent_oom_suspicion_needs_a_failed_job(exit2, expect_oom):
    req = hooks.finished_request({"SLURM_JOB_ID": "4", "SLURM_JOB_EXIT_CODE2": exit2}, 10.0,
                                 {"source": "fake-nvml", "peak_bytes": 5, "oom_suspected": True,
                                  "oom_evidence": "device 99% full"})
    assert req.oom_detected is expect_oom


def test_event_refused_live_is_kept_not_dropped(service, service_env):
    spool_dir = Path(service_env["SWAPAWARE_HOOKS__SPOOL_DIR"])
    hooks_cfg = load_config(env={**service_env, "SWAPAWARE_HOOKS__SERVICE_ADDRESS": f"127.0.0.1:{service.grpc_port}"}).hooks
    bad = pb.JobFinishedRequest(job_id=6, event_id="")  # the service refuses: no event id
    assert hooks.deliver(hooks_cfg, "JobFinished", bad) is False
    kept = [p for p in (spool_dir / "rejected").iterdir() if p.suffix == ".json"]
    assert len(kept) == 1 and not spool.pending(spool_dir)
