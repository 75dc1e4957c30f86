"""A freshly started service answers with the queue already read: the first snapshot is taken
before gRPC, the local socket and health serve; a first poll that fails or hangs does not keep
the service from starting (its decisions then say queue_unknown).

The stateful Slurm stand-in answers squeue slowly here, so a service that answered before its
first poll would decide on an unknown queue."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import grpc
from google.protobuf import json_format
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.slurm.slurm import PendingJob
from policy_service.serving.client import PolicyClient
from policy_service.config import load_config
from policy_service.serving.server import start_service

from tests.adapter.conftest import SlurmJobs, socket_call
from tests.adapter.serving.test_service import GIB, facts, run_job

LOGGER = "swapaware.queue"
JOB = facts(name="fresh")


@dataclass
class SlowSlurm(SlurmJobs):
    """squeue takes ``delay_s``, or blocks until ``release`` is set."""

    delay_s: float = 0.0
    release: threading.Event | None = None
    reads_done: int = 0

    def pending_jobs(self) -> list[PendingJob]:
        time.sleep(self.delay_s)
        if self.release is not None:
            self.release.wait(30)
        try:
            return super().pending_jobs()
        finally:
            self.reads_done += 1


@pytest.fixture
def queue_env(service_env):
    # A long poll period: only the first poll can have been taken when the first Admit comes.
    return dict(service_env, SWAPAWARE_POLICY__SHARE_MIN_QUEUE="0.05", SWAPAWARE_POLICY__QUEUE_POLL_S="300")


@pytest.fixture
def learned(queue_env):
    """The history of a service that ran once: JOB's class peaked at 3 GiB (fits one shard)."""
    slurm = SlowSlurm()
    svc = start_service(load_config(env=queue_env), slurm=slurm)
    try:
        with PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0) as client:
            run_job(client, slurm, 81, JOB, peak=3 * GIB)
    finally:
        svc.stop(0)
    return slurm.comments


def reasons(decision) -> dict[str, str]:
    return {r.code: r.message for r in decision.reasons}


def serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
    return resp.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("pending, action, shards, reason", [
    ([PendingJob(90, "gres:gpu:1", "", "", 1, 1, "Priority")], pb.ACTION_SHARE, 1, "fits_in_shards"),
    ([], pb.ACTION_WHOLE_GPU, 8, "queue_short"),
])
def test_first_admit_after_a_start_sees_the_queue(queue_env, learned, pending, action, shards, reason):
    slurm = SlowSlurm(comments=dict(learned), pending=pending, delay_s=0.3)
    svc = start_service(load_config(env=queue_env), slurm=slurm)
    try:
        with PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0) as client:
            d = client.admit(JOB).decision
        why = reasons(d)
        assert "queue_unknown" not in why, why
        assert (d.action, d.shards) == (action, shards) and reason in why
        # the local socket (the Lua plugin's path) answers from the same snapshot
        local = socket_call(svc.socket_path, {"method": "Admit", "request": {
            "job": json_format.MessageToDict(JOB)}})["response"]["decision"]
        assert local["shards"] == shards and "queue_unknown" not in str(local["reasons"]), local
        assert serving(svc.grpc_port) and slurm.queue_reads == slurm.reads_done == 1  # only the first poll
    finally:
        svc.stop(0)


def test_failing_first_snapshot_does_not_prevent_start(queue_env, learned, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    slurm = SlowSlurm(comments=dict(learned), pending=None)  # squeue fails
    svc = start_service(load_config(env=queue_env), slurm=slurm)
    try:
        assert serving(svc.grpc_port) and svc.queue_monitor.snapshot() is None
        with PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0) as client:
            d = client.admit(JOB).decision
        assert d.action == pb.ACTION_SHARE and "queue_unknown" in reasons(d)  # as before this change
    finally:
        svc.stop(0)
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert any("the first poll failed" in w and "Unable to contact slurm controller" in w for w in warnings), warnings


def test_hanging_first_snapshot_delays_start_only_by_the_slurm_timeout(queue_env, learned, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    env = dict(queue_env, SWAPAWARE_SERVICE__SLURM_TIMEOUT_S="0.1")  # bound: 3 calls x 0.1 s
    slurm = SlowSlurm(comments=dict(learned), pending=[], release=threading.Event())
    t0 = time.monotonic()
    svc = start_service(load_config(env=env), slurm=slurm)
    took_s = time.monotonic() - t0
    try:
        # the squeue stand-in answers only once released (after the start): the start ended without it
        assert 0.3 <= took_s < 10.0, took_s
        assert serving(svc.grpc_port) and slurm.reads_done == 0
        with PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0) as client:
            assert "queue_unknown" in reasons(client.admit(JOB).decision)
    finally:
        slurm.release.set()
        svc.stop(0)
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert any("did not answer the first poll within 0.3 s" in w for w in warnings), warnings
