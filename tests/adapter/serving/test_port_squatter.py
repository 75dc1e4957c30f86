"""A process that holds the service's gRPC port while the service (re)starts (issue 32) does not
keep it down: the service serves slurmctld on its local socket, says it waits (log, health,
metrics), binds the port once it is free, and stops at once while it waits. Real gRPC and real
sockets on 127.0.0.1."""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Iterator

import pytest
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.admin import probe_service
from policy_service.admin.grpc_port import grpc_port_check, look_at_port
from policy_service.history.store import HistoryStore
from policy_service.core.ha import Role
from policy_service.serving.grpc_server import bind_failure
from policy_service.serving.client import PolicyClient
from policy_service.config import load_config
from policy_service.serving.server import start_service
from tests.waiting import wait_for

from tests.adapter.as_user import NOBODY, run_as
from tests.adapter.conftest import SlurmJobs, socket_call
from tests.adapter.history.test_durability import ROOT
from tests.adapter.ha.test_ha import ha_env

HELD = "is in use by another process"


@pytest.fixture
def squatter():
    """Another process's plain socket, bound and listening on a free loopback port."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s
    s.close()


def metric(svc, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_server.server_port}/metrics", timeout=5).read()
    return {s.name: s.value for fam in text_string_to_metric_families(text.decode()) for s in fam.samples}[name]


def health_status(svc, name: str = "") -> str:
    """The service's own health entry (the health service is served on the gRPC port alone)."""
    reply = svc._health.Check(health_pb2.HealthCheckRequest(service=name), None)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def admit_over_socket(svc, name: str) -> dict:
    return socket_call(svc.socket_path, {"method": "Admit", "request": {
        "brief": True, "job": {"user": "root", "uid": 0, "jobName": name, "tresPerNode": "gres:gpu:1"}}})


def held_service(service_env, slurm_jobs, port: int):
    cfg = load_config(env={**service_env, "SWAPAWARE_SERVICE__GRPC_ADDRESS": f"127.0.0.1:{port}",
                           "SWAPAWARE_SERVICE__METRICS_ADDRESS": "127.0.0.1:0"})
    return start_service(cfg, slurm=slurm_jobs)


def test_a_held_port_does_not_keep_the_service_down(service_env, slurm_jobs, squatter, caplog):
    port = squatter.getsockname()[1]
    with caplog.at_level(logging.INFO, logger="swapaware.service"):
        svc = held_service(service_env, slurm_jobs, port)
        try:
            # up: slurmctld's Admits are answered on the local socket while the port is held
            assert not svc.listener.bound.is_set() and svc.grpc_port == 0
            assert admit_over_socket(svc, "while-held")["response"]["decision"]["decisionId"]
            # and it says it waits: metrics, its health entries, one log line for several tries
            assert metric(svc, "swapaware_grpc_bound") == 0
            wait_for(lambda: metric(svc, "swapaware_grpc_bind_failures_total") >= 2, 15, "a second try at the held port")
            assert (health_status(svc), health_status(svc, "swapaware.v1.PolicyService")) == ("NOT_SERVING",) * 2
            said = [r for r in caplog.records if HELD in r.getMessage()]
            assert len(said) == 1 and said[0].levelno == logging.ERROR, [r.getMessage() for r in said]
            assert f"127.0.0.1:{port}" in said[0].getMessage() and "local socket" in said[0].getMessage()

            squatter.close()  # the other process lets the port go
            assert wait_for(lambda: svc.grpc_port, 15, "the service to bind its port once free") == port
            assert probe_service(f"127.0.0.1:{port}", 5.0)  # the gRPC health check: SERVING
            with PolicyClient(f"127.0.0.1:{port}", 5.0) as client:
                reply = client.admit(pb.JobFacts(user="alice", job_name="after", tres_per_node="gres:gpu:1"))
            assert reply.decision.decision_id
            assert metric(svc, "swapaware_grpc_bound") == 1
            assert any("bound after" in r.getMessage() for r in caplog.records)
        finally:
            svc.stop(0)


def test_stop_while_waiting_for_the_port_is_prompt_and_leaves_the_port_alone(service_env, slurm_jobs, squatter):
    port = squatter.getsockname()[1]
    svc = held_service(service_env, slurm_jobs, port)
    wait_for(lambda: svc.listener.tries >= 2, 15, "a retry")  # now in a wait of 2 s or more
    t0 = time.monotonic()
    svc.listener.stop(0)  # what svc.stop() does first with the gRPC side: the retries end at once
    assert time.monotonic() - t0 < 0.5 and not svc.listener._thread.is_alive()
    svc.stop(0)  # the rest of the service (the local socket's and metrics' servers take up to 0.5 s each)
    assert time.monotonic() - t0 < 5
    squatter.close()
    with socket.socket() as s:  # the stopped service took nothing: the port binds
        s.bind(("127.0.0.1", port))
    assert svc.grpc_port == 0


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (SigCgt in /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(line.split()[1] for line in f if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (sig - 1) & 1)


@contextlib.contextmanager
def serve_process(env: dict, log_path) -> Iterator[subprocess.Popen]:
    """`swapaware serve` as a process of its own (stdout and stderr to ``log_path``), killed
    afterwards where it still runs."""
    with open(log_path, "w") as log:
        p = subprocess.Popen([sys.executable, "-c", "from policy_service.cli import main; main()", "serve"],
                             env={**os.environ, **env}, cwd=ROOT, stderr=log, stdout=log)
    try:
        yield p
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_swapaware_serve_on_a_held_port_waits_and_stops_on_sigterm(service_env, squatter, tmp_path):
    port = squatter.getsockname()[1]
    log_path = tmp_path / "serve.log"
    with serve_process({**service_env, "SWAPAWARE_SERVICE__GRPC_ADDRESS": f"127.0.0.1:{port}"}, log_path) as p:
        wait_for(lambda: HELD in log_path.read_text() or p.poll() is not None, 60, "the service to say it waits")
        assert p.poll() is None, log_path.read_text()  # it did not exit
        wait_for(lambda: os.path.exists(service_env["SWAPAWARE_SERVICE__SOCKET_PATH"]), 15, "the local socket")
        wait_for(lambda: catches(p.pid, signal.SIGTERM), 15, "serve's SIGTERM handler")  # set once started
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == 0
    out = log_path.read_text()
    assert out.count(HELD) == 1 and "stopped" in out and "Traceback" not in out


def test_a_privileged_port_without_the_capability_names_the_fix():
    if os.geteuid() != 0:
        pytest.skip("needs root, to try the bind as another user")
    with open("/proc/sys/net/ipv4/ip_unprivileged_port_start") as f:
        if int(f.read()) <= 455:
            pytest.skip("ports below 1024 are not privileged on this host")
    err = run_as(NOBODY, NOBODY, lambda: list(bind_failure("127.0.0.1:455", "").args))
    assert err[0] == errno.EACCES and "CAP_NET_BIND_SERVICE" in err[1] and "contrib/systemd" in err[1]


def as_seen_by_doctor(svc, cfg):
    """The service's config, with the metrics port it took (doctor reads swapaware_grpc_bound there)."""
    return dataclasses.replace(cfg, service=dataclasses.replace(
        cfg.service, metrics_address=f"127.0.0.1:{svc.metrics_server.server_port}"))


def test_doctor_fails_grpc_port_while_the_service_waits_and_passes_once_it_is_bound(service_env, slurm_jobs,
                                                                                     squatter):
    port = squatter.getsockname()[1]
    svc = held_service(service_env, slurm_jobs, port)
    try:
        cfg = as_seen_by_doctor(svc, load_config(env={**service_env, "SWAPAWARE_SERVICE__GRPC_ADDRESS":
                                                      f"127.0.0.1:{port}"}))
        seen = look_at_port(cfg, ask_service=True)
        assert seen.service_bound is False and seen.listener_uids == (os.geteuid(),)  # the squatter's
        check = grpc_port_check(cfg.service.grpc_address, seen)
        assert not check.ok and "the service on this host waits for its port" in check.detail, check
        squatter.close()
        wait_for(lambda: svc.grpc_port, 15, "the service to bind its port once free")
        seen = look_at_port(cfg, ask_service=True)
        assert seen.service_bound is True and seen.listener_uids == (os.geteuid(),) == (seen.service_uid,)
        assert grpc_port_check(cfg.service.grpc_address, seen).ok
    finally:
        svc.stop(0)


def test_doctor_fails_grpc_port_held_by_another_user_than_the_services(service_env, slurm_jobs, squatter):
    if os.geteuid() != 0:
        pytest.skip("needs root, to give the service's socket to another user")
    port = squatter.getsockname()[1]
    svc = held_service(service_env, slurm_jobs, port)
    try:
        os.chown(svc.socket_path, NOBODY, -1)  # as if the service ran as nobody: the squatter (root) is not it
        cfg = load_config(env={**service_env, "SWAPAWARE_SERVICE__GRPC_ADDRESS": f"127.0.0.1:{port}"})
        check = grpc_port_check(cfg.service.grpc_address, look_at_port(cfg, ask_service=False))
        assert not check.ok and f"listened on by uid 0, not by the service's user (uid {NOBODY}" in check.detail
    finally:
        svc.stop(0)


def test_ha_a_service_waiting_for_its_port_still_takes_the_writer_role_and_records_admits(short_dir, squatter):
    """[ha]: the role does not hang on the gRPC port. The service of the controller in control takes
    the lease and records slurmctld's Admits (local socket) while the port is held."""
    port = squatter.getsockname()[1]
    db = short_dir / "shared" / "history.sqlite3"
    db.parent.mkdir()
    HistoryStore(db).close()
    cfg = load_config(env=ha_env(short_dir, "a", db, Role.PRIMARY, {
        "SWAPAWARE_SERVICE__GRPC_ADDRESS": f"127.0.0.1:{port}"}))
    svc = start_service(cfg, slurm=SlurmJobs())
    try:
        assert svc.grpc_port == 0
        wait_for(svc.role.is_writer, 10, "the writer role")
        assert health_status(svc, "swapaware.writer") == "SERVING"
        decision = admit_over_socket(svc, "ha-held")["response"]["decision"]["decisionId"]
        svc.handler.flush()
        assert svc.store.decision(decision) is not None
        squatter.close()
        wait_for(lambda: svc.grpc_port, 15, "the service to bind its port once free")
        assert probe_service(f"127.0.0.1:{port}", 5.0) and svc.role.is_writer()
    finally:
        svc.stop(0)
