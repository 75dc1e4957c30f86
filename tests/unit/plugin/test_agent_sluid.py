"""Mapping a process to its Slurm job by cgroup path on every release: v1, v2 ``job_<id>`` and
Slurm 26.05's cgroup v2 directories named by SLUID (the announced job's ``SLURM_JOB_SLUID``).

The SLUIDs below are arbitrary opaque strings: the agent only compares whole path components."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from policy_service.config import AgentConfig
from slurm_plugin.agent.sampler import Agent
from slurm_plugin.agent.state import sluid_map
from slurm_plugin.agent.procs import (
    EvidenceKind,
    KernelEvent,
    ProcFactsCache,
    cgroup_job_id,
    job_id_from_cgroup,
    job_id_from_memcg,
    read_proc_facts,
    usable_sluid,
)

SLUID = "s0a7kq3m9x2vd"
OTHER = "s0a7kq3m9x2ve"
ANNOUNCED = {SLUID: 4242, OTHER: 4243}


@pytest.mark.parametrize("text, sluids, job_id", [
    # cgroup v1 (22.05 era): one line per controller, job_<id> in each
    ("12:memory:/slurm/uid_1000/job_77/step_batch/task_0\n11:devices:/slurm/uid_1000/job_77/step_batch\n"
     "1:name=systemd:/system.slice/slurmd.service\n", {}, 77),
    # cgroup v2, job_<id> (24.11; 26.05 with CgroupJobIdPaths=yes)
    ("0::/system.slice/slurmstepd.scope/job_1234/step_0/user/task_0\n", {}, 1234),
    ("0::/system.slice/slurmstepd.scope/job_1234/step_batch/user/task_0\n", ANNOUNCED, 1234),
    # cgroup v2 on 26.05: the job directory is the SLUID
    (f"0::/system.slice/slurmstepd.scope/{SLUID}/step_batch/user/task_0\n", ANNOUNCED, 4242),
    (f"0::/system.slice/slurmstepd.scope/{SLUID}/step_0/user/task_3\n", ANNOUNCED, 4242),
    (f"0::/system.slice/slurmstepd.scope/{OTHER}/step_extern/user/task_special\n", ANNOUNCED, 4243),
    (f"0::/system.slice/slurmstepd.scope/{SLUID}/step_0/slurm\n", ANNOUNCED, 4242),  # the stepd itself
    # a SLUID nobody announced (or no map at all) says nothing
    (f"0::/system.slice/slurmstepd.scope/{SLUID}/step_0/user/task_0\n", {}, None),
    (f"0::/system.slice/slurmstepd.scope/{SLUID}/step_0/user/task_0\n", {OTHER: 4243}, None),
    # only a whole component counts: no prefixes, suffixes or substrings
    (f"0::/system.slice/slurmstepd.scope/{SLUID}x/step_0/user/task_0\n", ANNOUNCED, None),
    (f"0::/system.slice/slurmstepd.scope/x{SLUID}/step_0\n", ANNOUNCED, None),
    (f"0::/system.slice/slurmstepd.scope/step_{SLUID}/user\n", ANNOUNCED, None),
    # not in a job
    ("0::/user.slice/user-1000.slice/session-3.scope\n", ANNOUNCED, None),
    ("0::/system.slice/slurmstepd.scope/system\n", ANNOUNCED, None),
    ("0::/system.slice/my_job_12/x\n", ANNOUNCED, None),
    ("", ANNOUNCED, None),
])
def test_job_id_from_cgroup_text(text: str, sluids: dict[str, int], job_id: int | None) -> None:
    assert job_id_from_cgroup(text, sluids) == job_id


def test_job_id_from_cgroup_without_a_map_is_as_before() -> None:
    assert job_id_from_cgroup("0::/system.slice/slurmstepd.scope/job_9/step_0\n") == 9
    assert job_id_from_cgroup(f"0::/system.slice/slurmstepd.scope/{SLUID}/step_0\n") is None


@pytest.mark.parametrize("value, usable", [
    (SLUID, SLUID),
    (f"  {SLUID}\n", SLUID),
    ("", None), ("   ", None), (".", None), ("..", None),
    ("a/b", None), ("a\0b", None), ("a\nb", None),
    ("x" * 255, "x" * 255), ("x" * 256, None),
])
def test_usable_sluid_is_any_single_path_component(value: str, usable: str | None) -> None:
    assert usable_sluid(value) == usable


@pytest.mark.parametrize("text, job_id", [
    (f"oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
     f"oom_memcg=/system.slice/slurmstepd.scope/{SLUID},task_memcg=/system.slice/slurmstepd.scope/{SLUID}/"
     f"step_0/user/task_0,task=python,pid=321,uid=1000", 4242),
    (f"oom-kill:constraint=CONSTRAINT_MEMCG,oom_memcg=/system.slice/slurmstepd.scope/{SLUID}x,task=python,"
     "pid=1", None),
    ("Memory cgroup out of memory: Killed process 321 (python) total-vm:100kB", None),
])
def test_job_id_from_memcg(text: str, job_id: int | None) -> None:
    assert job_id_from_memcg(text, ANNOUNCED) == job_id


def _proc(root: Path, pid: int, cgroup: str | None, environ: bytes | None, start_ticks: int = 100) -> None:
    (root / str(pid)).mkdir(exist_ok=True)
    rest = " ".join(["S"] + ["0"] * 18 + [str(start_ticks)] + ["0"] * 10)
    (root / str(pid) / "stat").write_text(f"{pid} (python) {rest}\n")
    if cgroup is not None:
        (root / str(pid) / "cgroup").write_text(cgroup)
    if environ is not None:
        (root / str(pid) / "environ").write_bytes(environ)


def test_proc_facts_cgroup_by_sluid_and_environ_apart(tmp_path: Path) -> None:
    _proc(tmp_path, 1, f"0::/system.slice/slurmstepd.scope/{SLUID}/step_0/user/task_0\n", b"SLURM_JOB_ID=99\0")
    _proc(tmp_path, 2, f"0::/system.slice/slurmstepd.scope/{SLUID}/step_0/user/task_0\n", None)
    _proc(tmp_path, 3, "0::/system.slice/slurmstepd.scope/s-unknown/step_0/user/task_0\n", b"SLURM_JOB_ID=30\0")
    assert [cgroup_job_id(p, tmp_path, ANNOUNCED) for p in (1, 2, 3)] == [4242, 4242, None]
    assert [cgroup_job_id(p, tmp_path) for p in (1, 2, 3)] == [None, None, None]
    assert [(f.cgroup_job, f.env_job) for f in (read_proc_facts(p, tmp_path, ANNOUNCED) for p in (1, 2, 3))] == [
        (4242, 99), (4242, None), (None, 30)]


def test_pid_cache_reads_again_when_the_announced_sluids_change(tmp_path: Path) -> None:
    _proc(tmp_path, 7, f"0::/system.slice/slurmstepd.scope/{SLUID}/step_0/user/task_0\n", None)
    cache = ProcFactsCache(tmp_path)

    def job(sluids):
        return cache.resolve([7], sluids)[7].cgroup_job

    assert job({}) is None  # seen on a GPU before its prolog announced it
    assert job({SLUID: 4242}) == 4242  # announced: read again
    (tmp_path / "7" / "cgroup").write_text("0::/user.slice\n")
    assert job({SLUID: 4242}) == 4242  # same process, same map: cached
    assert job({}) is None  # job stopped: read again


def test_sluid_map_of_tracked_jobs() -> None:
    agent = Agent(AgentConfig(), None, kernel_log=None)
    agent.start(1, [0], None, SLUID)
    agent.start(2, [1], None)
    assert sluid_map(agent._jobs.values()) == {SLUID: 1}
    agent.start(1, [0], None, OTHER)  # restarted (requeued) with a new SLUID: the old one is gone
    assert sluid_map(agent._jobs.values()) == {OTHER: 1}
    agent.stop(1)
    assert sluid_map(agent._jobs.values()) == {}


def test_start_request_sluid_is_optional_and_typed() -> None:
    agent = Agent(AgentConfig(), None, kernel_log=None)
    ok = b'{"ok":true}\n'
    assert agent.handle_line(b'{"op":"start","job_id":1,"gpus":[0]}\n') == ok
    assert agent.handle_line(b'{"op":"start","job_id":2,"gpus":[0],"sluid":null}\n') == ok
    assert agent.handle_line(f'{{"op":"start","job_id":3,"gpus":[0],"sluid":"{SLUID}"}}\n'.encode()) == ok
    assert b"'sluid' must be a string" in agent.handle_line(b'{"op":"start","job_id":4,"sluid":5}\n')
    assert {j["job_id"]: j["sluid"] for j in agent.status()["jobs"]} == {1: None, 2: None, 3: SLUID}


def test_unusable_sluid_is_ignored_with_a_reason_and_the_job_tracked(caplog: pytest.LogCaptureFixture) -> None:
    agent = Agent(AgentConfig(), None, kernel_log=None)
    with caplog.at_level(logging.WARNING, logger="swapaware.agent"):
        assert agent.start(5, [0], None, "a/b") == {"ok": True}
    assert [(j["job_id"], j["sluid"]) for j in agent.status()["jobs"]] == [(5, None)]
    assert "cannot be a cgroup path component" in caplog.text and "SLURM_JOB_ID" in caplog.text


def test_host_oom_in_a_sluid_memcg_is_attributed_to_the_job(tmp_path: Path) -> None:
    agent = Agent(AgentConfig(), None, proc_root=tmp_path, kernel_log=None)
    agent.start(4242, [0], None, SLUID)
    text = (f"oom-kill:constraint=CONSTRAINT_MEMCG,oom_memcg=/system.slice/slurmstepd.scope/{SLUID},"
            f"task_memcg=/system.slice/slurmstepd.scope/{SLUID}/step_0/user/task_0,task=python,pid=321,uid=0")
    event = KernelEvent(EvidenceKind.HOST_OOM, 321, None, None, text)  # pid 321 is gone: no /proc entry
    assert agent._with_live_job(event, {}, sluid_map(agent._jobs.values())).job_id == 4242
