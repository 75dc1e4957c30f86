"""Two users on one node: a process that names another user's job in SLURM_JOB_ID is not charged
to that job and cannot flag it OOM (issue 32: ``env SLURM_JOB_ID=<victim's job> <GPU process>``
made a victim's run record memory on a GPU it did not hold, flagged OOM).

Real agent socket and sampler thread, real processes allocating on the file-backed fake NVML. A
test cannot put a process into a Slurm cgroup nor (without root) run it as another user, so the
agent reads /proc from a mirror: each process's ``stat`` and ``environ`` link to the real ones,
its ``cgroup`` and ``status`` (``Uid:``) hold what the kernel would say for a process of that
user in that cgroup."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.adapter.plugin.test_agent_socket import TOTAL_BYTES, MirroredRig

VICTIM_UID, ATTACKER_UID = 2001, 2002
VICTIM_JOB, ATTACKER_JOB = 5001, 5002
LOGIN = "/user.slice/user-{uid}.slice/session-3.scope"  # outside any job's cgroup
JOB_CGROUP = "/system.slice/slurmstepd.scope/job_{job}/step_0/user/task_0"


class Node(MirroredRig):
    """An agent over two fake GPUs whose /proc view is a mirror the test writes."""

    def __init__(self, base: Path) -> None:
        super().__init__(base, gpus=2)

    def process(self, *, uid: int, env_job: int, cgroup: str, gpu: int, nbytes: int) -> int:
        """A real process with SLURM_JOB_ID=``env_job`` holding ``nbytes`` on ``gpu``, seen by the
        agent as owned by ``uid`` and in ``cgroup``."""
        return self.mirrored_process(cgroup, gpu, nbytes, env_job=env_job, uid=uid)


@pytest.fixture
def node(short_dir: Path) -> Iterator[Node]:
    n = Node(short_dir)
    n.server.start()
    yield n
    n.close()


def test_another_users_process_naming_the_victims_job_is_not_charged_and_flags_nothing(node: Node) -> None:
    assert node.ask({"op": "start", "job_id": VICTIM_JOB, "gpus": [0], "uid": VICTIM_UID}) == {"ok": True}
    assert node.ask({"op": "start", "job_id": ATTACKER_JOB, "gpus": [1], "uid": ATTACKER_UID}) == {"ok": True}
    # GPU 0 (the victim's): its batch step, and its own login shell's process (same uid, its GPU)
    node.process(uid=VICTIM_UID, env_job=VICTIM_JOB, cgroup=JOB_CGROUP.format(job=VICTIM_JOB), gpu=0, nbytes=100_000)
    node.process(uid=VICTIM_UID, env_job=VICTIM_JOB, cgroup=LOGIN.format(uid=VICTIM_UID), gpu=0, nbytes=50_000)
    # the attacker, outside any job with SLURM_JOB_ID=<victim's job>: fills GPU 0 to 98 % ...
    node.process(uid=ATTACKER_UID, env_job=VICTIM_JOB, cgroup=LOGIN.format(uid=ATTACKER_UID), gpu=0,
                 nbytes=830_000)
    # ... and holds 98.5 % of GPU 1, which the victim does not hold
    node.process(uid=ATTACKER_UID, env_job=VICTIM_JOB, cgroup=LOGIN.format(uid=ATTACKER_UID), gpu=1,
                 nbytes=985_000)
    # the attacker's own job step says it is the victim's: its cgroup says otherwise, and wins
    node.process(uid=ATTACKER_UID, env_job=VICTIM_JOB, cgroup=JOB_CGROUP.format(job=ATTACKER_JOB), gpu=0,
                 nbytes=10_000)
    assert node.fake.memory(0).used_bytes == 990_000 and node.fake.memory(1).used_bytes == 985_000
    node.wait_more_samples(VICTIM_JOB, 3)
    node.wait_more_samples(ATTACKER_JOB, 1)

    victim = node.ask({"op": "stop", "job_id": VICTIM_JOB})["telemetry"]
    assert (victim["peak_bytes"], victim["pids_seen"]) == (150_000, 2)
    assert [(g["index"], g["peak_bytes"], g["total_bytes"]) for g in victim["gpus"]] == [(0, 150_000, TOTAL_BYTES)]
    assert victim["oom_suspected"] is False and victim["oom_evidence"] == ""
    assert [e["kind"] for e in victim["evidence"]] == ["device_full"]  # listed: GPU 0 was full, not by it

    attacker = node.ask({"op": "stop", "job_id": ATTACKER_JOB})["telemetry"]
    assert (attacker["peak_bytes"], attacker["pids_seen"]) == (10_000, 1)  # its own step: not hidden
    assert attacker["oom_suspected"] is False
