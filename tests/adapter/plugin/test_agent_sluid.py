"""Slurm 26.05 (cgroup v2, no CgroupJobIdPaths): the prolog announces the job with its SLUID and
the agent attributes the job's GPU processes by their cgroup directory, not by job_<id>.

Real agent socket and sampler thread, the real prolog code, real processes allocating on the
file-backed fake NVML. A process cannot be put into a Slurm cgroup here, so the agent reads
/proc from a mirror: each test process's ``stat`` and ``environ`` link to the real ones and its
``cgroup`` holds the line slurmstepd would have made. The processes carry no SLURM_JOB_ID, so
only the cgroup path can attribute them."""
from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from policy_service.config import Config, HookConfig
from slurm_plugin.hooks import run as hooks
from slurm_plugin.agent.client import notify_start

from tests.adapter.plugin.test_agent_socket import MirroredRig

SLUID = "s0a7kq3m9x2vd"  # opaque to the agent: any single path component


class Node(MirroredRig):
    """An agent whose /proc view is a mirror in which the test writes each process's cgroup."""

    def __init__(self, base: Path) -> None:
        super().__init__(base, gpus=1)
        self.gpus = self.root
        self.hooks = HookConfig(agent_socket=self.socket_path, agent_timeout_s=5.0,
                                service_address="127.0.0.1:1", deadline_s=0.5, spool_dir=base / "spool")

    def process(self, cgroup_path: str, nbytes: int) -> int:
        """A real process holding ``nbytes`` on GPU 0, in cgroup ``cgroup_path`` (v2), without SLURM_JOB_ID."""
        return self.mirrored_process(cgroup_path, 0, nbytes)


@pytest.fixture
def node(short_dir: Path) -> Iterator[Node]:
    n = Node(short_dir)
    n.server.start()
    yield n
    n.close()


def test_prolog_announced_sluid_attributes_the_jobs_processes(node: Node) -> None:
    # Another job (CgroupJobIdPaths=yes style) keeps the sampler busy before ours is announced.
    node.ask({"op": "start", "job_id": 4243, "gpus": [0]})
    node.process("/system.slice/slurmstepd.scope/job_4243/step_0/user/task_0", 100_000)
    node.process(f"/system.slice/slurmstepd.scope/{SLUID}/step_batch/user/task_0", 300_000)
    node.process("/system.slice/slurmstepd.scope/s-not-announced/step_0/user/task_0", 50_000)
    node.process("/user.slice/user-1000.slice/session-3.scope", 20_000)
    node.wait_more_samples(4243, 2)  # our process was seen (and not attributed) before the prolog ran

    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_SLUID": SLUID, "SLURM_JOB_GPUS": "0", "SLURM_JOB_UID": "1000",
           "SLURMD_NODENAME": "n1"}
    hooks.run_prolog(env, Config(hooks=node.hooks), 1000.0)  # the service is down: its event is spooled
    assert [(j["job_id"], j["sluid"]) for j in node.ask({"op": "status"})["jobs"]] == [(4243, None), (4242, SLUID)]
    node.wait_more_samples(4242, 3)

    t = node.ask({"op": "stop", "job_id": 4242})["telemetry"]
    assert (t["peak_bytes"], t["mean_bytes"], t["pids_seen"]) == (300_000, 300_000, 1)
    t_other = node.ask({"op": "stop", "job_id": 4243})["telemetry"]
    assert (t_other["peak_bytes"], t_other["pids_seen"]) == (100_000, 1)


def test_a_job_announced_without_sluid_does_not_claim_sluid_directories(node: Node) -> None:
    notify_start(node.hooks, 4242, [0], 1000)  # a 24.11 prolog: no SLURM_JOB_SLUID
    node.process(f"/system.slice/slurmstepd.scope/{SLUID}/step_0/user/task_0", 300_000)
    node.wait_more_samples(4242, 3)
    t = node.ask({"op": "stop", "job_id": 4242})["telemetry"]
    assert (t["peak_bytes"], t["pids_seen"]) == (0, 0)


class OneLineAgent:
    """Records the request line a client sends, answers ok: what goes over the wire."""

    def __init__(self, path: Path) -> None:
        self.lines: list[dict[str, Any]] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                self.lines.append(json.loads(conn.makefile("rb").readline()))
                conn.sendall(b'{"ok":true}\n')

    def close(self) -> None:
        self._sock.close()


@pytest.mark.parametrize("job_env, sent", [
    ({"SLURM_JOB_SLUID": SLUID}, SLUID),
    ({"SLURM_JOB_SLUID": ""}, None),
    ({}, None),  # before 25.11: the request older agents know, unchanged
])
def test_prolog_sends_the_sluid_only_when_slurm_gives_one(short_dir: Path, job_env: dict[str, str],
                                                          sent: str | None) -> None:
    fake = OneLineAgent(short_dir / "agent.sock")
    cfg = Config(hooks=HookConfig(agent_socket=short_dir / "agent.sock", agent_timeout_s=5.0,
                                  service_address="127.0.0.1:1", deadline_s=0.5, spool_dir=short_dir / "spool"))
    try:
        hooks.run_prolog({"SLURM_JOB_ID": "7", "SLURM_JOB_GPUS": "0", **job_env}, cfg, 1000.0)
    finally:
        fake.close()
    (line,) = fake.lines
    assert line.get("sluid") == sent and ("sluid" in line) == (sent is not None)
    assert {k: line[k] for k in ("op", "job_id", "gpus")} == {"op": "start", "job_id": 7, "gpus": [0]}
