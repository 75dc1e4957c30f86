"""A squatter on the service's port during a restart, with TLS on (issue 20): the hooks'
events are spooled, the squatter completes no call (so it sees neither an event nor the token),
and once the real service is back on the port the agent's replayer delivers each event once.
Real gRPC on 127.0.0.1, certificates from the openssl CLI (tests/adapter/trust/test_tls.py)."""
from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.config import load_config
from policy_service.serving.server import start_service
from slurm_plugin.hooks import run as hooks, spool
from slurm_plugin.hooks.replayer import SpoolReplayer
from tests.waiting import wait_for

from tests.adapter.trust.test_tls import make_ca, make_cert, pki  # noqa: F401 - pki: the CA and the service's certificate

EVENTS = 5
TOKEN = "s3cret-of-the-hooks"
METHOD = "/swapaware.v1.PolicyService/JobFinished"


class Recorder(grpc.GenericRpcHandler):
    """Whatever a squatter would be sent: each call's method and metadata; every call answered
    with an empty reply, which a client would take for the service's."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def service(self, details):
        self.calls.append((details.method, dict(details.invocation_metadata)))
        return grpc.unary_unary_rpc_method_handler(lambda request, context: b"")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def squat(port: int, kind: str, pki: Path) -> tuple[grpc.Server, Recorder, grpc.Channel]:  # noqa: F811
    """A gRPC server of another process's on ``port``: plaintext, or TLS with a certificate for
    127.0.0.1 from a CA of its own (not the one the clients trust); and a channel of a client
    that would trust it (plaintext, or that CA)."""
    recorder = Recorder()
    server = grpc.server(ThreadPoolExecutor(4), handlers=[recorder], options=[("grpc.so_reuseport", 0)])
    address = f"127.0.0.1:{port}"
    if kind == "plaintext":
        server.add_insecure_port(address)
        server.start()
        return server, recorder, grpc.insecure_channel(address)
    d = pki / "squatter"
    if not (d / "squatter.pem").exists():
        d.mkdir(exist_ok=True)
        make_ca(d, "selfca")
        make_cert(d, "squatter", "selfca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    pair = [((d / "squatter.key").read_bytes(), (d / "squatter.pem").read_bytes())]
    server.add_secure_port(address, grpc.ssl_server_credentials(pair))
    server.start()
    return server, recorder, grpc.secure_channel(address, grpc.ssl_channel_credentials((d / "selfca.pem").read_bytes()))


def finished(i: int) -> pb.JobFinishedRequest:
    return pb.JobFinishedRequest(job_id=7000 + i, node="n1", event_id=f"sq-{i}", finished_at=100.0 + i,
                                 peak_gpu_bytes=2 * 1024**3, exit_code=0)


@pytest.mark.parametrize("kind", ["plaintext", "self-signed-tls"])
def test_a_squatter_during_a_restart_gets_nothing_and_the_events_arrive_once(service_env, slurm_jobs, pki,  # noqa: F811
                                                                             tmp_path, kind):
    port = free_port()
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    env = {**service_env, "SWAPAWARE_SERVICE__GRPC_ADDRESS": f"127.0.0.1:{port}",
           "SWAPAWARE_HOOKS__SERVICE_ADDRESS": f"127.0.0.1:{port}", "SWAPAWARE_HOOKS__DEADLINE_S": "1",
           "SWAPAWARE_SERVICE__TOKEN_FILE": str(token), "SWAPAWARE_HOOKS__TOKEN_FILE": str(token),
           "SWAPAWARE_TLS__CERT": str(pki / "server.pem"), "SWAPAWARE_TLS__KEY": str(pki / "server.key"),
           "SWAPAWARE_TLS__CA": str(pki / "ca.pem")}
    cfg = load_config(env=env)
    spool_dir = Path(cfg.hooks.spool_dir)

    # the agent's replayer, its client made as the agent makes it, with the dev stack's interval
    # and backoff bound (contrib/dev-stack.sh: replay_interval_s 1, replay_max_backoff_s 4)
    replayer = SpoolReplayer(spool_dir, lambda: hooks.hook_client(cfg.hooks, cfg.auth, cfg.tls), interval_s=1.0,
                             max_backoff_s=4.0)
    stop = threading.Event()
    server, recorder, trusting = squat(port, kind, pki)
    try:
        # the control: a client that trusted the squatter would be answered, and would hand it
        # the event and the token
        with trusting:
            trusting.unary_unary(METHOD)(finished(99).SerializeToString(), timeout=5,
                                         metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert [(m, md.get("authorization")) for m, md in recorder.calls] == [(METHOD, f"Bearer {TOKEN}")]
        recorder.calls.clear()
        # the hooks, as slurmd runs them at the end of each job, while the squatter holds the port
        for i in range(EVENTS):
            assert hooks.deliver(cfg.hooks, "JobFinished", finished(i), auth=cfg.auth, tls=cfg.tls) is False
        assert len(spool.pending(spool_dir)) == EVENTS
        replayer.start(stop)
        wait_for(lambda: replayer.state.failures >= 1, 30, "the replayer to fail against the squatter")
        assert recorder.calls == []  # no call completed: no event, no token, no credential
    finally:
        server.stop(0).wait()

    # the real service returns on the port
    failed = replayer.state.failures
    svc = start_service(cfg, slurm=slurm_jobs)
    returned = time.monotonic()
    try:
        # the replayer counts a replay's deliveries once the replay returns, after the spool is empty
        wait_for(lambda: len(svc.store.observations()) == EVENTS and not spool.pending(spool_dir)
                 and replayer.status()["replay_delivered"] == EVENTS, 30,
                 lambda: f"every spooled event delivered ({len(svc.store.observations())} applied, "
                         f"{len(spool.pending(spool_dir))} spooled, {replayer.status()['replay_delivered']} counted "
                         "by the replayer)")
        took = time.monotonic() - returned
        print(f"\n[{kind} squatter] service back -> all {EVENTS} spooled events delivered in {took:.2f} s "
              f"(the replayer had failed {failed} times)")
        stop.set()
        # a second replay (swapaware replay-spool) finds nothing; each event was applied once
        assert hooks.replay_main(cfg.hooks, cfg.auth, cfg.tls).sent == 0
        assert sorted(o.job_id for o in svc.store.observations()) == [7000 + i for i in range(EVENTS)]
        assert replayer.status()["replay_delivered"] == EVENTS
    finally:
        stop.set()
        svc.stop(0)
