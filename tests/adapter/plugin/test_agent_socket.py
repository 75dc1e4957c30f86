"""The node agent over a real Unix socket, with real threads and real job processes.

Job processes are real subprocesses whose /proc/<pid>/environ carries SLURM_JOB_ID; they
allocate on the file-backed fake NVML (the only fake). They are in no job's cgroup, so the agent
charges them to a job only because they run as the uid the job is announced with (``ME``, this
test's own) on the job's GPUs. All waits poll with a deadline.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from policy_service.config import AgentConfig, NvmlBackend
from slurm_plugin.agent.client import AgentUnavailable, request
from slurm_plugin.agent.sampler import Agent
from slurm_plugin.agent.server import AgentServer
from slurm_plugin.gpu.nvml_fake import FakeNvmlTelemetry, create_fake_gpus

from tests.waiting import wait_for

TOTAL_BYTES = 1_000_000
PERIOD_S = 0.05
ME = os.getuid()  # the owner of every process these tests start




class Rig:
    """A real agent socket and sampler over file-backed fake GPUs. ``proc_root``: the /proc the
    agent reads (a mirror, where a test must write a process's cgroup line)."""

    def __init__(self, base: Path, kernel_log: Path | None = None, proc_root: Path = Path("/proc"),
                 gpus: int = 2) -> None:
        self.root = base / "gpus"
        create_fake_gpus(self.root, count=gpus, total_bytes=TOTAL_BYTES)
        self.fake = FakeNvmlTelemetry(self.root)  # real /proc: the fake driver sees real processes
        self.socket_path = base / "run" / "swapaware" / "agent.sock"
        self.cfg = AgentConfig(socket_path=self.socket_path, sample_period_s=PERIOD_S,
                               nvml_backend=NvmlBackend.FAKE, fake_nvml_dir=self.root)
        self.server = AgentServer(Agent(self.cfg, self.fake, proc_root=proc_root, kernel_log=kernel_log),
                                  self.socket_path)
        self.children: list[subprocess.Popen] = []

    def ask(self, payload: dict[str, Any]) -> dict[str, Any]:
        return request(self.socket_path, payload, timeout_s=5.0)

    def raw(self, data: bytes) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5.0)
            sock.connect(str(self.socket_path))
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        return json.loads(reply)

    def job_process(self, job_id: int | None, gpu: int, nbytes: int) -> subprocess.Popen:
        """A real process of job ``job_id`` holding ``nbytes`` on fake ``gpu`` until killed."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_JOB", "SWAPAWARE_"))}
        if job_id is not None:
            env["SLURM_JOB_ID"] = str(job_id)
        child = subprocess.Popen(
            [sys.executable, "-m", "slurm_plugin.gpu.nvml", "fake-alloc", "--root", str(self.root), "--gpu", str(gpu),
             "--bytes", str(nbytes), "--hold-seconds", "120"], env=env, stdout=subprocess.DEVNULL)
        self.children.append(child)
        wait_for(lambda: any(p.pid == child.pid for p in self.fake.processes(gpu)), what=f"pid {child.pid} alloc")
        return child

    def samples(self, job_id: int) -> int:
        jobs = {j["job_id"]: j for j in self.ask({"op": "status"})["jobs"]}
        return jobs[job_id]["samples"]

    def wait_samples(self, job_id: int, at_least: int) -> None:
        wait_for(lambda: self.samples(job_id) >= at_least, what=f"{at_least} samples of job {job_id}")

    def close(self) -> None:
        for child in self.children:
            child.kill()
            child.wait(timeout=10)
        self.server.stop()


class MirroredRig(Rig):
    """A Rig whose agent reads /proc from a mirror the test writes (a process cannot be put into a
    Slurm cgroup here, nor run as another user without root): a process's ``stat`` and ``environ``
    link to the real ones, its ``cgroup`` (and ``status``: its ``Uid:`` line) hold what the kernel
    would say of a process in that cgroup (and of that user)."""

    def __init__(self, base: Path, gpus: int) -> None:
        self.proc = base / "proc"
        self.proc.mkdir()
        super().__init__(base, proc_root=self.proc, gpus=gpus)

    def mirrored_process(self, cgroup: str, gpu: int, nbytes: int, env_job: int | None = None,
                         uid: int | None = None) -> int:
        """A real process holding ``nbytes`` on ``gpu`` (with SLURM_JOB_ID=``env_job`` unless None),
        seen by the agent in ``cgroup`` (v2) and, with ``uid``, as owned by that user."""
        pid = self.job_process(env_job, gpu, nbytes).pid
        mirror = self.proc / str(pid)
        mirror.mkdir()
        (mirror / "cgroup").write_text(f"0::{cgroup}\n")
        if uid is not None:
            (mirror / "status").write_text(f"Name:\tpython\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
        for name in ("environ", "stat"):  # stat last: the agent caches a process by it
            (mirror / name).symlink_to(Path("/proc") / str(pid) / name)
        return pid

    def wait_more_samples(self, job_id: int, more: int) -> None:
        target = self.samples(job_id) + more
        wait_for(lambda: self.samples(job_id) >= target, what=f"{more} more samples of job {job_id}")


@pytest.fixture
def rig(short_dir: Path) -> Iterator[Rig]:
    r = Rig(short_dir)
    r.server.start()
    yield r
    r.close()


def test_socket_is_private_and_its_directory_is_created(rig: Rig) -> None:
    mode = os.stat(rig.socket_path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert rig.ask({"op": "status"}) == {"ok": True, "source": "fake-nvml", "sample_period_s": PERIOD_S, "jobs": []}


def test_steady_job_reports_exact_peak_and_mean(rig: Rig) -> None:
    mine = rig.job_process(42, gpu=0, nbytes=300_000)
    rig.job_process(77, gpu=0, nbytes=100_000)  # another job on the same GPU
    rig.job_process(None, gpu=0, nbytes=50_000)  # not a Slurm process
    assert rig.ask({"op": "start", "job_id": 42, "gpus": [0], "uid": ME}) == {"ok": True}
    rig.wait_samples(42, 5)
    reply = rig.ask({"op": "stop", "job_id": 42})
    t = reply["telemetry"]
    assert reply["ok"] is True
    assert (t["source"], t["job_id"], t["peak_bytes"], t["mean_bytes"]) == ("fake-nvml", 42, 300_000, 300_000)
    assert t["samples"] >= 5 and t["sample_period_s"] == PERIOD_S and t["pids_seen"] == 1
    assert t["oom_suspected"] is False and t["evidence"] == []
    assert [(g["index"], g["peak_bytes"], g["total_bytes"], g["uuid"]) for g in t["gpus"]] == [
        (0, 300_000, TOTAL_BYTES, "GPU-fake-0000")]
    assert t["started_at"] <= t["stopped_at"] and mine.poll() is None
    assert rig.ask({"op": "status"})["jobs"] == []


def test_growing_job_peak_is_the_sum_and_mean_lies_between(rig: Rig) -> None:
    first = rig.job_process(43, gpu=1, nbytes=200_000)
    rig.ask({"op": "start", "job_id": 43, "gpus": [1], "uid": ME})
    rig.wait_samples(43, 3)
    second = rig.job_process(43, gpu=1, nbytes=500_000)
    seen = rig.samples(43)
    rig.wait_samples(43, seen + 3)
    for child in (first, second):
        child.kill()
        child.wait(timeout=10)
    wait_for(lambda: rig.fake.memory(1).used_bytes == 0, what="release")
    seen = rig.samples(43)
    rig.wait_samples(43, seen + 2)
    t = rig.ask({"op": "stop", "job_id": 43})["telemetry"]
    assert t["peak_bytes"] == 700_000 and t["pids_seen"] == 2
    assert 0 < t["mean_bytes"] < 700_000
    assert t["gpus"][0]["peak_bytes"] == 700_000 and t["gpus"][0]["mean_bytes"] == t["mean_bytes"]


def test_job_near_capacity_is_suspected_oom(rig: Rig) -> None:
    rig.job_process(44, gpu=0, nbytes=990_000)
    rig.ask({"op": "start", "job_id": 44, "gpus": [0], "uid": ME})
    rig.wait_samples(44, 2)
    t = rig.ask({"op": "stop", "job_id": 44})["telemetry"]
    assert t["oom_suspected"] is True
    assert [e["kind"] for e in t["evidence"]] == ["job_near_capacity"] and t["evidence"][0]["gpu"] == 0
    assert t["oom_evidence"].startswith("job_near_capacity: job held 990000 of 1000000 bytes on GPU 0")


def test_device_filled_by_a_co_runner_is_listed_but_not_suspected_oom(rig: Rig) -> None:
    rig.job_process(45, gpu=1, nbytes=390_000)
    rig.job_process(46, gpu=1, nbytes=600_000)
    rig.ask({"op": "start", "job_id": 45, "gpus": [1], "uid": ME})
    rig.ask({"op": "start", "job_id": 46, "gpus": [1], "uid": ME})
    rig.wait_samples(45, 2)
    rig.wait_samples(46, 2)
    t45 = rig.ask({"op": "stop", "job_id": 45})["telemetry"]
    t46 = rig.ask({"op": "stop", "job_id": 46})["telemetry"]
    assert [e["kind"] for e in t45["evidence"]] == ["device_full"] and t45["peak_bytes"] == 390_000
    assert [e["kind"] for e in t46["evidence"]] == ["device_full"] and t46["peak_bytes"] == 600_000
    # most of the device is the other job's: neither is flagged by memory that is not its own
    assert (t45["oom_suspected"], t46["oom_suspected"]) == (False, False)


def test_xid_31_naming_a_job_pid_is_evidence(short_dir: Path) -> None:
    kernel_log = short_dir / "kmsg"
    kernel_log.write_text("old line before the agent started\n")
    r = Rig(short_dir, kernel_log=kernel_log)
    r.server.start()
    try:
        child = r.job_process(47, gpu=0, nbytes=1000)
        r.ask({"op": "start", "job_id": 47, "gpus": [0], "uid": ME})
        r.wait_samples(47, 2)
        with kernel_log.open("a") as fh:
            fh.write(f"4,99,1,-;NVRM: Xid (PCI:0000:3b:00): 31, pid={child.pid}, name=python, Ch 00000010\n")
            fh.write("4,100,1,-;NVRM: Xid (PCI:0000:3b:00): 31, pid=1, name=init\n")
        seen = r.samples(47)
        r.wait_samples(47, seen + 2)
        t = r.ask({"op": "stop", "job_id": 47})["telemetry"]
        assert t["oom_suspected"] is True
        assert [e["kind"] for e in t["evidence"]] == ["xid"] and f"pid={child.pid}" in t["evidence"][0]["detail"]
    finally:
        r.close()


def test_unknown_job_stop_is_ok_with_source_none(rig: Rig) -> None:
    reply = rig.ask({"op": "stop", "job_id": 999})
    assert reply["ok"] is True
    assert reply["telemetry"]["source"] == "none" and reply["telemetry"]["reason"]
    assert reply["telemetry"]["samples"] == 0


@pytest.mark.parametrize("data, error", [
    (b"not json\n", "Expecting value"),
    (b"[1, 2]\n", "JSON object"),
    (b"\xff\xfe\n", "utf-8"),
    (b"\n", "Expecting value"),
    (b'{"op":"start"}\n', "job_id"),
    (b'{"op":"start","job_id":-1}\n', "job_id"),
    (b'{"op":"start","job_id":true}\n', "job_id"),
    (b'{"op":"start","job_id":"5"}\n', "job_id"),
    (b'{"op":"start","job_id":5,"gpus":"0"}\n', "gpus"),
    (b'{"op":"start","job_id":5,"gpus":[0,-1]}\n', "gpus"),
    (b'{"op":"start","job_id":5,"uid":"root"}\n', "uid"),
    (b'{"op":"stop"}\n', "job_id"),
    (b'{"op":"launch"}\n', "unknown op"),
    (b'{"job_id":1}\n', "unknown op"),
    (b"{" + b" " * 70_000 + b"}\n", "too long"),
])
def test_malformed_requests_get_an_error_and_the_agent_survives(rig: Rig, data: bytes, error: str) -> None:
    reply = rig.raw(data)
    assert reply["ok"] is False and error in reply["error"]
    assert rig.ask({"op": "status"})["ok"] is True


def test_client_that_sends_nothing_does_not_block_others(rig: Rig) -> None:
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    idle.connect(str(rig.socket_path))
    try:
        started = time.monotonic()
        assert rig.ask({"op": "start", "job_id": 5, "gpus": [0]}) == {"ok": True}
        assert time.monotonic() - started < 2.0
    finally:
        idle.close()


def test_restart_of_a_tracked_job_resets_it(rig: Rig) -> None:
    rig.ask({"op": "start", "job_id": 6, "gpus": [0]})
    rig.wait_samples(6, 3)
    rig.ask({"op": "start", "job_id": 6, "gpus": [1]})
    jobs = rig.ask({"op": "status"})["jobs"]
    assert [(j["job_id"], j["gpus"]) for j in jobs] == [(6, [1])] and jobs[0]["samples"] < 3


def test_second_agent_on_the_same_socket_is_refused(rig: Rig) -> None:
    other = AgentServer(Agent(rig.cfg, rig.fake, kernel_log=None), rig.socket_path)
    with pytest.raises(RuntimeError, match="another agent"):
        other.start()
    assert rig.ask({"op": "status"})["ok"] is True


def test_stale_socket_file_is_replaced(short_dir: Path) -> None:
    r = Rig(short_dir)
    r.socket_path.parent.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(r.socket_path))
    stale.close()  # file left behind, nobody listening
    r.server.start()
    try:
        assert r.ask({"op": "status"})["ok"] is True
    finally:
        r.close()
    assert not r.socket_path.exists()


def _agent_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SWAPAWARE_")}


def answers(sock: Path) -> bool:
    try:
        return "source" in request(sock, {"op": "status"}, 2.0)
    except AgentUnavailable:
        return False


def test_daemon_main_serves_and_exits_cleanly_on_sigterm(short_dir: Path) -> None:
    root = short_dir / "gpus"
    create_fake_gpus(root, 1, TOTAL_BYTES)
    sock = short_dir / "a" / "agent.sock"
    config = short_dir / "swapaware.toml"
    config.write_text(f'[agent]\nsocket_path = "{short_dir / "unused.sock"}"\nsample_period_s = {PERIOD_S}\n'
                      f'nvml_backend = "fake"\nfake_nvml_dir = "{root}"\n')
    daemon = subprocess.Popen([sys.executable, "-m", "slurm_plugin.agent.daemon", "--config", str(config), "--socket",
                               str(sock), "--foreground"], env=_agent_env(), stderr=subprocess.PIPE, text=True)
    try:
        # the socket file exists from bind(), a moment before listen(): wait until it answers (a
        # fresh-clone run with the unit tests beside six clusters connected in between: refused)
        wait_for(lambda: answers(sock), 30, "the agent's socket to answer")
        assert request(sock, {"op": "start", "job_id": 1, "gpus": [0]}, 5.0) == {"ok": True}
        assert request(sock, {"op": "status"}, 5.0)["source"] == "fake-nvml"
        daemon.send_signal(signal.SIGTERM)
        _, err = daemon.communicate(timeout=15)
    finally:
        daemon.kill()
    assert daemon.returncode == 0, err
    assert not sock.exists()
    assert "config source:" in err and "stopping" in err


def test_daemon_main_rejects_a_bad_config(short_dir: Path) -> None:
    config = short_dir / "bad.toml"
    config.write_text('[agent]\nsample_period_s = -1\n')
    done = subprocess.run([sys.executable, "-m", "slurm_plugin.agent.daemon", "--config", str(config), "--foreground"],
                          env=_agent_env(), capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "sample_period_s" in done.stderr
