"""The agent's pure core: accumulators, attribution, evidence, parsers (table-driven)."""
from __future__ import annotations

from pathlib import Path

import pytest

from policy_service.config import AgentConfig
from slurm_plugin.agent.sampler import Agent
from slurm_plugin.agent import state as agent_state
from slurm_plugin.agent.state import (
    GpuObservation,
    Series,
    apply_kernel_event,
    expired_jobs,
    new_job,
    summarize,
)
from slurm_plugin.gpu.nvml import ProcessUsage
from slurm_plugin.agent.procs import (
    EvidenceKind,
    KernelEvent,
    ProcFacts,
    ProcFactsCache,
    job_id_from_cgroup,
    job_id_from_environ,
    parse_kernel_line,
    read_proc_facts,
    start_ticks_from_stat,
)

GB = 1_000_000_000


def _obs(index: int, procs: list[tuple[int, int | None]], total: int = 10 * GB, used: int | None = None,
         util: float | None = None) -> GpuObservation:
    usage = tuple(ProcessUsage(pid, b) for pid, b in procs)
    used_bytes = sum(b or 0 for _, b in procs) if used is None else used
    return GpuObservation(index, total, used_bytes, util, usage, f"gpu{index}", f"GPU-{index}")


def apply_tick(job, t_s, observations, pid_jobs):
    """``agent_state.apply_tick`` with each pid charged to ``pid_jobs[pid]`` on every GPU it is on."""
    owners = {(o.index, p.pid): pid_jobs[p.pid] for o in observations for p in o.procs
              if pid_jobs.get(p.pid) is not None}
    return agent_state.apply_tick(job, t_s, observations, owners)


# --------------------------------------------------------------------------- Series


@pytest.mark.parametrize("points, peak, mean", [
    ([], 0.0, None),
    ([(5.0, 7.0)], 7.0, 7.0),
    ([(0.0, 10.0), (1.0, 10.0), (2.0, 10.0)], 10.0, 10.0),
    # 0 for 1 s, then 100 for 3 s: the last value holds for zero time
    ([(0.0, 0.0), (1.0, 100.0), (2.0, 100.0), (4.0, 0.0)], 100.0, 75.0),
    # uneven spacing weighs by time, not by count
    ([(0.0, 4.0), (3.0, 0.0), (4.0, 0.0)], 4.0, 3.0),
])
def test_series_peak_and_time_weighted_mean(points, peak, mean) -> None:
    series = Series()
    for t_s, value in points:
        series = series.add(t_s, value)
    assert series.samples == len(points)
    assert series.peak == peak
    assert series.mean() == (pytest.approx(mean) if mean is not None else None)


# --------------------------------------------------------------------------- apply_tick


def test_tick_attributes_only_the_jobs_processes() -> None:
    job = new_job(42, [0], uid=1000, wall_s=1000.0, mono_s=0.0)
    obs = [_obs(0, [(100, 3 * GB), (101, 1 * GB), (200, 2 * GB), (300, 5)]), _obs(1, [(400, GB)])]
    pid_jobs = {100: 42, 101: 42, 200: 77, 300: None, 400: 9}
    job = apply_tick(job, 1.0, obs, pid_jobs)
    job = apply_tick(job, 2.0, obs, pid_jobs)
    assert [g.index for g in job.gpu_tracks] == [0]
    assert job.total.peak == 4 * GB and job.total.mean() == 4 * GB
    assert job.pids == {100, 101}
    assert job.evidence == ()


def test_tick_follows_the_job_onto_an_unannounced_gpu_and_sums_gpus() -> None:
    job = new_job(5, [0], None, 0.0, 0.0)
    job = apply_tick(job, 1.0, [_obs(0, [(1, GB)]), _obs(1, [(2, 2 * GB)])], {1: 5, 2: 5})
    job = apply_tick(job, 3.0, [_obs(0, [(1, GB)]), _obs(1, [])], {1: 5})
    summary = summarize(job, "fake-nvml", 1.0, 10.0)
    by_gpu = {g["index"]: g for g in summary["gpus"]}
    assert by_gpu[1]["peak_bytes"] == 2 * GB and by_gpu[1]["mean_bytes"] == 2 * GB
    assert summary["peak_bytes"] == 3 * GB and summary["mean_bytes"] == 3 * GB
    assert summary["samples"] == 2


def test_announced_gpu_without_processes_counts_zero_and_util_is_device_wide() -> None:
    job = new_job(5, [0], None, 0.0, 0.0)
    job = apply_tick(job, 0.0, [_obs(0, [], util=50.0)], {})
    job = apply_tick(job, 1.0, [_obs(0, [(1, GB)], util=100.0)], {1: 5})
    job = apply_tick(job, 2.0, [_obs(0, [(1, GB)], util=None)], {1: 5})
    job = apply_tick(job, 3.0, [_obs(0, [(1, GB)], util=0.0)], {1: 5})
    summary = summarize(job, "nvml", 1.0, 3.0)
    assert summary["peak_bytes"] == GB and summary["mean_bytes"] == round(2 * GB / 3)
    # util: 50 for 1 s, 100 for 2 s (the None sample is skipped, not read as 0)
    assert summary["util_mean_pct"] == 83.3 and summary["gpus"][0]["util_mean_pct"] == 83.3


def test_unreported_per_process_memory_is_flagged() -> None:
    job = apply_tick(new_job(5, [0], None, 0.0, 0.0), 0.0, [_obs(0, [(1, None)], used=GB)], {1: 5})
    summary = summarize(job, "nvml", 1.0, 1.0)
    assert summary["per_process_memory_reported"] is False and summary["pids_seen"] == 1


@pytest.mark.parametrize("procs, pid_jobs, used, kind, suspected", [
    ([(1, 9_900_000_000)], {1: 5}, None, EvidenceKind.JOB_NEAR_CAPACITY, True),
    ([(1, 9_700_000_000)], {1: 5}, None, None, False),
    # Full, mostly with a neighbour's memory: listed, never the job's OOM (a neighbour cannot flag it)
    ([(1, 4 * GB), (2, 5_900_000_000)], {1: 5, 2: 6}, None, EvidenceKind.DEVICE_FULL, False),
    ([(1, 4 * GB)], {1: 5}, 9_800_000_000, EvidenceKind.DEVICE_FULL, False),  # non-process memory counts
    ([(2, 10 * GB)], {2: 6}, None, None, False),  # full, but the job held nothing there
])
def test_capacity_evidence(procs, pid_jobs, used, kind, suspected) -> None:
    job = apply_tick(new_job(5, [0], None, 0.0, 0.0), 1.0, [_obs(0, procs, used=used)], pid_jobs)
    job = apply_tick(job, 2.0, [_obs(0, procs, used=used)], pid_jobs)
    summary = summarize(job, "nvml", 1.0, 3.0)
    assert [e.kind for e in job.evidence] == ([kind] if kind else [])  # once per kind and GPU
    assert summary["oom_suspected"] is suspected


def test_capacity_evidence_only_on_the_jobs_own_gpus() -> None:
    # The job (GPU 0) is charged by its cgroup for a process filling GPU 1: its memory counts, but
    # a GPU the job was not given says nothing about the job running out of memory.
    job = apply_tick(new_job(5, [0], None, 0.0, 0.0), 1.0, [_obs(0, [(1, GB)]), _obs(1, [(2, 9_900_000_000)])],
                     {1: 5, 2: 5})
    summary = summarize(job, "nvml", 1.0, 2.0)
    assert summary["peak_bytes"] == GB + 9_900_000_000
    assert job.evidence == () and summary["oom_suspected"] is False


@pytest.mark.parametrize("event, attached, suspected", [
    (KernelEvent(EvidenceKind.XID, 100, None, 31, "Xid 31 pid=100"), True, True),
    (KernelEvent(EvidenceKind.XID, 100, None, 43, "Xid 43 pid=100"), True, False),
    (KernelEvent(EvidenceKind.XID, 999, None, 31, "Xid 31 pid=999"), False, False),
    (KernelEvent(EvidenceKind.XID, None, 5, 31, "Xid 31"), True, True),
    (KernelEvent(EvidenceKind.HOST_OOM, None, 5, None, "oom-kill ... job_5"), True, False),
    # pid 100 was charged to job 5, but the line's cgroup names job 6 (the pid was reused): job 6's
    (KernelEvent(EvidenceKind.XID, 100, 6, 31, "Xid 31 pid=100"), False, False),
])
def test_kernel_events_attach_to_the_right_job(event, attached, suspected) -> None:
    job = apply_tick(new_job(5, [0], None, 0.0, 0.0), 0.0, [_obs(0, [(100, GB)])], {100: 5})
    job = apply_kernel_event(job, event)
    assert (len(job.evidence) == 1) is attached
    assert summarize(job, "nvml", 1.0, 1.0)["oom_suspected"] is suspected


def test_expiry_bound() -> None:
    jobs = {1: new_job(1, [], None, 0.0, 0.0), 2: new_job(2, [], None, 0.0, 50.0)}
    assert expired_jobs(jobs, now_mono_s=120.0, max_age_s=100.0) == [1]
    clock = [0.0]
    agent = Agent(AgentConfig(), None, kernel_log=None, max_job_age_s=100.0, mono_clock=lambda: clock[0])
    agent.start(1, [0], None)
    clock[0] = 101.0
    agent.start(2, [0], None)
    assert [j["job_id"] for j in agent.status()["jobs"]] == [2]


def test_agent_without_telemetry_reports_source_none() -> None:
    agent = Agent(AgentConfig(), None, kernel_log=None)
    agent.start(3, [0], 1000)
    agent.sample_once()
    telemetry = agent.stop(3)
    assert telemetry["source"] == "none" and "not sampled" in telemetry["reason"] and telemetry["samples"] == 0
    assert agent.stop(3)["reason"].startswith("job was not started")


# --------------------------------------------------------------------------- parsers


@pytest.mark.parametrize("text, job_id", [
    ("0::/system.slice/slurmstepd.scope/job_1234/step_0/user/task_0\n", 1234),
    ("12:memory:/slurm/uid_1000/job_77/step_batch/task_0\n11:devices:/slurm/uid_1000/job_77/step_batch\n", 77),
    ("4:memory:/slurm_node01/uid_0/job_9/step_0\n", 9),
    ("0::/user.slice/user-1000.slice/session-3.scope\n", None),
    ("0::/system.slice/my_job_12/x\n", None),  # job_ must be a whole path component
    ("0::/slurm/job_12abc/step_0\n", None),
    ("", None),
])
def test_job_id_from_cgroup(text: str, job_id: int | None) -> None:
    assert job_id_from_cgroup(text) == job_id


@pytest.mark.parametrize("data, job_id", [
    (b"PATH=/bin\0SLURM_JOB_ID=55\0HOME=/root\0", 55),
    (b"SLURM_JOBID=56\0", 56),
    (b"SLURM_JOB_ID=57\0SLURM_JOBID=58\0", 57),
    (b"SLURM_ARRAY_JOB_ID=60\0", None),
    (b"SLURM_JOB_ID=\0", None),
    (b"SLURM_JOB_ID=abc\0", None),
    (b"", None),
])
def test_job_id_from_environ(data: bytes, job_id: int | None) -> None:
    assert job_id_from_environ(data) == job_id


@pytest.mark.parametrize("line, kind, pid, code, job_id", [
    ("4,1021,352331881,-;NVRM: Xid (PCI:0000:3b:00): 31, pid=4242, name=python, Ch 00000010, "
     "intr 00000000. MMU Fault: ENGINE GRAPHICS", EvidenceKind.XID, 4242, 31, None),
    ("[ 1234.5] NVRM: Xid (PCI:0000:af:00): 43, pid=17, name=train, Ch 00000008", EvidenceKind.XID, 17, 43, None),
    ("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.", EvidenceKind.XID, None, 79, None),
    ("6,900,1,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
     "oom_memcg=/slurm/uid_0/job_88,task_memcg=/slurm/uid_0/job_88/step_0/task_0,task=python,pid=321,uid=0",
     EvidenceKind.HOST_OOM, 321, None, 88),
    ("Memory cgroup out of memory: Killed process 321 (python) total-vm:100kB", EvidenceKind.HOST_OOM, 321, None, None),
    ("6,901,2,-;usb 1-1: new high-speed USB device", None, None, None, None),
])
def test_parse_kernel_line(line, kind, pid, code, job_id) -> None:
    event = parse_kernel_line(line)
    if kind is None:
        assert event is None
        return
    assert (event.kind, event.pid, event.code, event.job_id) == (kind, pid, code, job_id)
    assert not event.text.startswith(("4,", "6,"))


def test_read_proc_facts_keeps_cgroup_environ_and_owner_apart(tmp_path: Path) -> None:
    def proc(pid: int, cgroup: str | None, environ: bytes | None, status: str | None) -> None:
        (tmp_path / str(pid)).mkdir()
        for name, data in (("cgroup", cgroup), ("status", status)):
            if data is not None:
                (tmp_path / str(pid) / name).write_text(data)
        if environ is not None:
            (tmp_path / str(pid) / "environ").write_bytes(environ)

    proc(1, "0::/slurmstepd.scope/job_10/step_0\n", b"SLURM_JOB_ID=99\0", "Name:\tx\nUid:\t1000\t1000\t1000\t1000\n")
    proc(2, "0::/user.slice\n", b"SLURM_JOB_ID=20\0", "Uid:\t1000\t0\t0\t0\n")  # set-uid: two identities
    proc(3, None, b"SLURM_JOB_ID=30\0", None)  # no status: the owner of /proc/<pid>
    proc(4, "0::/user.slice\n", None, "Uid:\t7\t7\t7\t7\n")
    me = (tmp_path / "3").stat().st_uid
    assert [read_proc_facts(p, tmp_path) for p in (1, 2, 3, 4, 5)] == [
        ProcFacts(10, 99, 1000), ProcFacts(None, 20, None), ProcFacts(None, 30, me), ProcFacts(None, None, 7),
        ProcFacts(None, None, None)]


def _stat_line(pid: int, start_ticks: int) -> str:
    rest = " ".join(["S"] + ["0"] * 18 + [str(start_ticks)] + ["0"] * 10)
    return f"{pid} (my (odd) name) {rest}\n"


def test_start_ticks_parser() -> None:
    assert start_ticks_from_stat(_stat_line(7, 123456)) == 123456
    assert start_ticks_from_stat("7 (x) S 1 2") is None


def test_pid_cache_remembers_a_process_and_notices_pid_reuse(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "stat").write_text(_stat_line(7, 100))
    (tmp_path / "7" / "status").write_text("Uid:\t5\t5\t5\t5\n")
    (tmp_path / "7" / "environ").write_bytes(b"SLURM_JOB_ID=5\0")
    cache = ProcFactsCache(tmp_path)
    assert cache.resolve([7]) == {7: ProcFacts(None, 5, 5)}
    (tmp_path / "7" / "environ").write_bytes(b"SLURM_JOB_ID=6\0")
    assert cache.resolve([7]) == {7: ProcFacts(None, 5, 5)}  # same process: not re-read
    (tmp_path / "7" / "stat").write_text(_stat_line(7, 200))
    assert cache.resolve([7]) == {7: ProcFacts(None, 6, 5)}  # new process with the same pid
    assert cache.resolve([8]) == {8: ProcFacts(None, None, None)}
