"""Spooled events reach the service in batches, each once, and the node agent's replayer delivers
them on its own once the service is back (real service on loopback, real SQLite)."""
from __future__ import annotations

import shutil
import socket
import threading
from pathlib import Path

import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.serving.client import PolicyClient
from policy_service.config import load_config
from policy_service.serving.server import start_service
from slurm_plugin.hooks import spool
from slurm_plugin.hooks.replayer import SpoolReplayer, next_delay
from tests.waiting import wait_for


def spool_jobs(spool_dir: Path, jobs: range) -> int:
    for j in jobs:
        spool.spool_event(spool_dir, "JobStarted", pb.JobStartedRequest(
            job_id=j, node="n1", gpu_indices=[0], started_at=1000.0 + j, event_id=f"s-{j}"), f"s-{j}")
        spool.spool_event(spool_dir, "JobFinished", pb.JobFinishedRequest(
            job_id=j, node="n1", gpu_indices=[0], started_at=1000.0 + j, finished_at=2000.0 + j,
            event_id=f"f-{j}"), f"f-{j}")
    return 2 * len(jobs)


class Counting:
    """``client.call`` that counts calls per method."""

    def __init__(self, client: PolicyClient):
        self.client, self.calls = client, {}

    def __call__(self, method: str, request):
        self.calls[method] = self.calls.get(method, 0) + 1
        return self.client.call(method, request)


def test_spooled_events_are_delivered_once_in_batches(service, client, tmp_path):
    """(An older service without ReportEvents: test_replay_batches.py.)"""
    spool_dir = tmp_path / "spool"
    n = spool_jobs(spool_dir, range(1, 301))
    send = Counting(client)
    expect_calls = {"ReportEvents": 2}
    result = spool.replay(spool_dir, send, max_events=10_000)
    assert (result.sent, result.rejected, result.left, result.stopped_by) == (n, 0, 0, "")
    assert send.calls == expect_calls
    assert len(service.store.observations()) == 300
    # the same events again (a reply lost after the service applied them): nothing counts twice
    spool_jobs(spool_dir, range(1, 301))
    assert spool.replay(spool_dir, send, max_events=10_000).sent == n
    assert len(service.store.observations()) == 300


def test_a_bad_event_in_a_batch_is_set_aside_and_the_rest_delivered(service, client, tmp_path):
    spool_dir = tmp_path / "spool"
    spool_jobs(spool_dir, range(1, 4))
    spool.spool_event(spool_dir, "JobFinished", pb.JobFinishedRequest(job_id=9, node="n1"), "no-event-id")
    result = spool.replay(spool_dir, client.call, max_events=100)
    assert (result.sent, result.rejected, result.left) == (6, 1, 0)
    why = next((spool_dir / "rejected").glob("*.why")).read_text()
    assert "event_id is required" in why


def test_a_service_that_is_down_stops_the_replay_and_keeps_everything(tmp_path):
    spool_dir = tmp_path / "spool"
    n = spool_jobs(spool_dir, range(1, 11))
    with PolicyClient(f"127.0.0.1:{free_port()}", 1.0) as nowhere:
        result = spool.replay(spool_dir, nowhere.call, max_events=100)
    assert (result.sent, result.left) == (0, n) and result.stopped_by.startswith("UNAVAILABLE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_replayer_delivers_on_its_own_once_the_service_is_back(service_env, slurm_jobs, tmp_path):
    """No hook runs: the agent's replayer finds the spool, fails while the service is down (backing
    off), and delivers everything, once, soon after the service comes back."""
    port = free_port()
    spool_dir = tmp_path / "spool"
    n = spool_jobs(spool_dir, range(1, 51))
    replayer = SpoolReplayer(spool_dir, lambda: PolicyClient(f"127.0.0.1:{port}", 1.0), interval_s=0.05,
                             max_backoff_s=0.4)
    stop = threading.Event()
    replayer.start(stop)
    try:
        wait_for(lambda: replayer.state.failures >= 3, 30, "the replayer to fail while the service is down")
        assert replayer.status()["spool_depth"] == n
        cfg = load_config(env={**service_env, "SWAPAWARE_SERVICE__GRPC_ADDRESS": f"127.0.0.1:{port}"})
        svc = start_service(cfg, slurm=slurm_jobs)
        try:
            # the replayer counts a replay's deliveries once the replay returns, after the spool is empty
            wait_for(lambda: not spool.pending(spool_dir) and replayer.status()["replay_delivered"] == n, 30,
                     lambda: f"the spool to be delivered and counted: {replayer.status()}")
            assert len(svc.store.observations()) == 50
            st = replayer.status()
            assert (st["spool_depth"], st["replay_delivered"], st["replay_failures"]) == (0, n, 0)
        finally:
            svc.stop(0)
    finally:
        stop.set()


def test_backoff_doubles_up_to_its_bound_and_resets():
    assert next_delay(0, 5.0, 30.0, 0.9) == 5.0
    assert [next_delay(f, 5.0, 30.0, 0.0) for f in (1, 2, 3, 4, 9)] == [5.0, 10.0, 20.0, 30.0, 30.0]
    assert next_delay(3, 5.0, 30.0, 0.999) == pytest.approx(10.005, rel=1e-3)  # jitter takes off up to half
    assert next_delay(1, 5.0, 30.0, 0.999) == pytest.approx(2.5025)  # at least half the interval


def test_hooks_send_the_jobs_sluid(tmp_path):
    from slurm_plugin.hooks import run as hooks
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_SLUID": "sl0123456789", "SLURMD_NODENAME": "n1"}
    assert hooks.started_request(env, 10.0).sluid == "sl0123456789"
    assert hooks.finished_request(env, 11.0, None).sluid == "sl0123456789"
    assert hooks.finished_request({"SLURM_JOB_ID": "7"}, 11.0, None).sluid == ""


def test_the_agent_status_shows_the_spool(tmp_path):
    from policy_service.config import AgentConfig
    from slurm_plugin.agent.sampler import Agent
    spool_dir = tmp_path / "spool"
    spool_jobs(spool_dir, range(1, 3))
    agent = Agent(AgentConfig(), None, kernel_log=None)
    agent.replayer = SpoolReplayer(spool_dir, lambda: None, 5.0, 30.0)
    assert agent.status()["spool_depth"] == 4
    shutil.rmtree(spool_dir)
    assert agent.status()["spool_depth"] == 0
