"""agent_client against a real agent, a missing one, a hung one and a broken one: never raises."""
from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

import pytest

from policy_service.config import AgentConfig, HookConfig, NvmlBackend
from slurm_plugin.agent.client import collect, notify_start, status
from slurm_plugin.agent.sampler import Agent
from slurm_plugin.agent.server import AgentServer
from slurm_plugin.gpu.nvml_fake import FakeNvmlTelemetry, create_fake_gpus

TIMEOUT_S = 0.3


def _hooks(sock: Path) -> HookConfig:
    return HookConfig(agent_socket=sock, agent_timeout_s=TIMEOUT_S)


def test_notify_and_collect_against_a_running_agent(short_dir: Path) -> None:
    create_fake_gpus(short_dir / "gpus", 1, 1000)
    sock = short_dir / "agent.sock"
    cfg = AgentConfig(socket_path=sock, sample_period_s=0.05, nvml_backend=NvmlBackend.FAKE,
                      fake_nvml_dir=short_dir / "gpus")
    with AgentServer(Agent(cfg, FakeNvmlTelemetry(short_dir / "gpus"), kernel_log=None), sock):
        assert notify_start(_hooks(sock), 11, [0], 1000) is True
        assert notify_start(_hooks(sock), 12, [0], "1001") is True  # SLURM_JOB_UID text, as the prolog has it
        assert notify_start(_hooks(sock), 13, [0], "") is True
        assert notify_start(_hooks(sock), 14, None, 0) is False  # never raises
        jobs = {j["job_id"]: j["uid"] for j in status(_hooks(sock))["jobs"]}
        assert jobs == {11: 1000, 12: 1001, 13: None}
        telemetry = collect(_hooks(sock), 11)
        assert telemetry is not None and telemetry["job_id"] == 11 and telemetry["source"] == "fake-nvml"
        assert telemetry["oom_suspected"] is False and telemetry["oom_evidence"] == ""
        assert collect(_hooks(sock), 11)["source"] == "none"  # already stopped
        assert notify_start(_hooks(sock), -3, [0], 1000) is False  # refused by the agent


def test_missing_agent_fails_fast_and_logs(short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    hooks = HookConfig(agent_socket=short_dir / "nobody.sock", agent_timeout_s=5.0)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="swapaware.agent_client"):
        assert notify_start(hooks, 1, [0], 0) is False
        assert collect(hooks, 1) is None
    assert time.monotonic() - started < 2.5  # connect fails at once: waiting for the 5 s timeout would not
    assert len(caplog.records) == 2 and "job 1" in caplog.records[0].getMessage()


def test_hung_agent_costs_one_timeout(short_dir: Path) -> None:
    sock_path = short_dir / "hung.sock"
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hung.bind(str(sock_path))
    hung.listen(8)  # accepts connections (backlog) but never answers
    try:
        started = time.monotonic()
        assert collect(_hooks(sock_path), 5) is None
        elapsed_s = time.monotonic() - started
        assert TIMEOUT_S * 0.9 <= elapsed_s < 10 * TIMEOUT_S  # (the upper bound: it ended)
        hung.setblocking(False)
        tries = 0
        while True:  # one connection in the backlog: it was asked once, not again after the timeout
            try:
                hung.accept()[0].close()
            except BlockingIOError:
                break
            tries += 1
        assert tries == 1
    finally:
        hung.close()


def test_trickling_agent_is_bounded_by_one_overall_deadline(short_dir: Path) -> None:
    sock_path = short_dir / "slow.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(sock_path))
    server.listen(1)
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = server.accept()
        with conn:
            while not stop.is_set():
                conn.sendall(b" ")  # valid JSON whitespace, never a newline
                time.sleep(TIMEOUT_S / 10)

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        assert notify_start(_hooks(sock_path), 5, [0], 0) is False
        # a deadline per read would never end while the agent trickles: the upper bound is that it ended
        assert time.monotonic() - started < 10 * TIMEOUT_S
    finally:
        stop.set()
        server.close()


@pytest.mark.parametrize("reply", [b"garbage\n", b"[1]\n", b'{"ok":true}\n', b'{"ok":true,"telemetry":3}\n', b""])
def test_broken_replies_give_none(short_dir: Path, reply: bytes) -> None:
    sock_path = short_dir / "broken.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(sock_path))
    server.listen(1)

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(reply)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        assert collect(_hooks(sock_path), 5) is None
    finally:
        thread.join(timeout=5)
        server.close()
