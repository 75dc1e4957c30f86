"""No borrowed transport (issue 20): the service's gRPC port is its alone, and the hooks' token is
read only from a private file and sent in plaintext only to this host. Real sockets on 127.0.0.1."""
from __future__ import annotations

import errno
import logging
import socket

import grpc
import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.cli import _readable_token
from policy_service.serving.client import PolicyClient
from policy_service.config import ConfigError, UnsafeTokenFile, load_config, read_token
from policy_service.serving.server import start_service
from slurm_plugin.hooks import run as hooks, spool

REMOTE = "10.77.0.1"  # the multi-node dev cluster's controller: not this host


# A port another process holds while the service starts: tests/adapter/serving/test_port_squatter.py.


def test_no_other_socket_can_share_the_port_while_the_service_listens(service):
    """gRPC's default SO_REUSEPORT let a second SO_REUSEPORT socket of the same user bind the port
    and take part of the connections."""
    with socket.socket() as second:
        second.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        with pytest.raises(OSError) as err:
            second.bind(("127.0.0.1", service.grpc_port))
        assert err.value.errno == errno.EADDRINUSE


def token_file(tmp_path, mode: int, name: str = "token"):
    path = tmp_path / name
    path.write_text("s3cret\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602], ids=oct)
def test_a_token_file_group_or_others_may_read_is_refused_naming_the_fix(tmp_path, mode):
    path = token_file(tmp_path, mode)
    with pytest.raises(UnsafeTokenFile) as err:
        read_token(str(path))
    assert str(path) in str(err.value) and f"chmod 600 {path}" in str(err.value)
    assert f"{mode:04o}" in str(err.value)


@pytest.mark.parametrize("mode", [0o600, 0o400], ids=oct)
def test_a_private_token_file_is_read(tmp_path, mode):
    assert read_token(str(token_file(tmp_path, mode))) == "s3cret"


def test_the_service_does_not_start_on_a_shared_token_file(service_env, slurm_jobs, tmp_path):
    path = token_file(tmp_path, 0o644)
    cfg = load_config(env={**service_env, "SWAPAWARE_SERVICE__TOKEN_FILE": str(path)})
    with pytest.raises(UnsafeTokenFile, match=f"chmod 600 {path}"):
        start_service(cfg, slurm=slurm_jobs)


def test_the_cli_says_it_goes_without_a_shared_token_file(tmp_path, capsys):
    path = token_file(tmp_path, 0o644)
    assert _readable_token(str(path)) is None
    assert f"chmod 600 {path}" in capsys.readouterr().err
    assert _readable_token(str(token_file(tmp_path, 0o600, "private"))) == "s3cret"


@pytest.mark.parametrize("address", [f"{REMOTE}:50551", "node1:50551", "[2001:db8::1]:50551", "[::]:50551",
                                     "0.0.0.0:50551", "dns:///ctl.example:50551", "localhost.evil.example:1"])
def test_a_client_refuses_to_send_the_token_in_plaintext_to_another_host(address):
    with pytest.raises(ConfigError) as err:
        PolicyClient(address, 1.0, token="s3cret")
    assert f"plaintext to {address}" in str(err.value) and "tls.ca" in str(err.value)


@pytest.mark.parametrize("address", ["127.0.0.1:1", "127.8.9.10:1", "[::1]:1", "[::ffff:127.0.0.1]:1", "localhost:1",
                                     "dns:///127.0.0.1:1", "unix:/run/x.sock", "unix-abstract:swapaware"])
def test_a_client_sends_the_token_in_plaintext_only_to_this_host(address):
    PolicyClient(address, 1.0, token="s3cret").close()


def test_a_client_sends_the_token_to_another_host_over_tls_or_goes_without_it():
    PolicyClient(f"{REMOTE}:50551", 1.0, token="s3cret", tls=grpc.ssl_channel_credentials()).close()
    PolicyClient(f"{REMOTE}:50551", 1.0).close()


def test_the_token_reaches_the_service_in_plaintext_on_loopback(service_env, slurm_jobs, tmp_path):
    """The rule leaves the single-host setup working: token over plaintext to 127.0.0.1."""
    path = token_file(tmp_path, 0o600)
    svc = start_service(load_config(env={**service_env, "SWAPAWARE_SERVICE__TOKEN_FILE": str(path)}),
                        slurm=slurm_jobs)
    try:
        cfg = load_config(env={**service_env, "SWAPAWARE_HOOKS__TOKEN_FILE": str(path),
                               "SWAPAWARE_HOOKS__SERVICE_ADDRESS": f"127.0.0.1:{svc.grpc_port}"})
        assert hooks.deliver(cfg.hooks, "JobFinished", pb.JobFinishedRequest(job_id=3, event_id="f3", finished_at=1.0))
    finally:
        svc.stop(0)


def test_hooks_never_put_the_token_on_a_plaintext_channel_to_another_host(service_env, tmp_path, caplog):
    """The event goes without the token (the service then refuses it unless MUNGE identifies the
    node) and is spooled; the log says why and how to fix it."""
    cfg = load_config(env={**service_env, "SWAPAWARE_HOOKS__TOKEN_FILE": str(token_file(tmp_path, 0o600)),
                           "SWAPAWARE_HOOKS__SERVICE_ADDRESS": f"{REMOTE}:9", "SWAPAWARE_HOOKS__DEADLINE_S": "0.2"})
    with caplog.at_level(logging.ERROR, logger="swapaware.hooks"):
        client = hooks.hook_client(cfg.hooks, cfg.auth, cfg.tls)
    with client:
        assert client.metadata() is None  # no authorization header
        req = pb.JobFinishedRequest(job_id=4, event_id="f4", finished_at=1.0)
        assert hooks.deliver(cfg.hooks, "JobFinished", req, client=client) is False
    assert len(spool.pending(cfg.hooks.spool_dir)) == 1
    assert any(f"plaintext to {REMOTE}:9" in r.getMessage() for r in caplog.records)


def test_hooks_go_without_a_shared_token_file(service_env, tmp_path, caplog):
    path = token_file(tmp_path, 0o640)
    cfg = load_config(env={**service_env, "SWAPAWARE_HOOKS__TOKEN_FILE": str(path)})
    with caplog.at_level(logging.ERROR, logger="swapaware.hooks"):
        with hooks.hook_client(cfg.hooks, cfg.auth, cfg.tls) as client:
            assert client.metadata() is None
    assert any(f"chmod 600 {path}" in r.getMessage() for r in caplog.records)
