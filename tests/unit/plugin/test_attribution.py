"""Which job a GPU process is charged to (slurm_plugin/agent/attribution.py): only the kernel's word.

The attack these rules close (issue 32): an ordinary user ran ``env SLURM_JOB_ID=<victim's job>
<GPU process>`` and the agent charged the process to the victim's job (87 GB on a GPU the victim
did not hold, flagged OOM). Table-driven over the pure rule: cgroup text, environ bytes, the
process's uid, the GPU it is on, the announced jobs (uid + GPUs)."""
from __future__ import annotations

import pytest

from slurm_plugin.agent.state import GpuObservation, apply_tick, new_job, summarize
from slurm_plugin.agent.attribution import charged_job_of, sample_owners
from slurm_plugin.gpu.nvml import ProcessUsage
from slurm_plugin.agent.procs import ProcFacts

VICTIM, ATTACKER = 1001, 1002  # uids
SLUID = "s0a7kq3m9x2vd"
JOBS = {
    500: new_job(500, [0], VICTIM, 0.0, 0.0),  # the victim's job, GPU 0
    600: new_job(600, [1], ATTACKER, 0.0, 0.0),  # the attacker's own job, GPU 1
    700: new_job(700, [2], None, 0.0, 0.0),  # announced without a uid
    800: new_job(800, [3], VICTIM, 0.0, 0.0, sluid=SLUID),  # 26.05: cgroup directory named by SLUID
}
LOGIN = "0::/user.slice/user-1002.slice/session-3.scope\n"  # no job's cgroup
IN_600 = "0::/system.slice/slurmstepd.scope/job_600/step_0/user/task_0\n"
IN_500 = "0::/system.slice/slurmstepd.scope/job_500/step_0/user/task_0\n"


def env(job_id: int) -> bytes:
    return f"PATH=/bin\0SLURM_JOB_ID={job_id}\0HOME=/home/x\0".encode()


@pytest.mark.parametrize("cgroup, environ, uid, gpu, charged", [
    # another user's process with the victim's SLURM_JOB_ID: never the victim's, on any GPU
    pytest.param(LOGIN, env(500), ATTACKER, 0, None, id="other-uid-on-victims-gpu"),
    pytest.param(LOGIN, env(500), ATTACKER, 1, None, id="other-uid-on-another-gpu"),
    pytest.param("", env(500), ATTACKER, 0, None, id="other-uid-no-cgroup-file"),
    pytest.param(LOGIN, env(500), 0, 0, None, id="root-process-with-a-users-job-id"),
    # the job's own user outside any job cgroup (a login shell, proctrack/linuxproc)
    pytest.param(LOGIN, env(500), VICTIM, 0, 500, id="same-uid-on-the-jobs-gpu"),
    pytest.param(LOGIN, env(500), VICTIM, 1, None, id="same-uid-on-another-jobs-gpu"),
    # a GPU no announced job holds: the prolog's SLURM_JOB_GPUS names one GPU type only for a job
    # holding two (24.11, 26.05)
    pytest.param(LOGIN, env(500), VICTIM, 9, 500, id="same-uid-on-a-gpu-no-job-holds"),
    pytest.param(LOGIN, env(500), ATTACKER, 9, None, id="other-uid-on-a-gpu-no-job-holds"),
    pytest.param(LOGIN, env(500), None, 0, None, id="owner-unknown-or-two-identities"),
    # a job announced without a uid never gets a process by its environment
    pytest.param(LOGIN, env(700), 0, 2, None, id="job-without-uid"),
    pytest.param(LOGIN, env(900), VICTIM, 0, None, id="job-not-announced"),
    pytest.param(LOGIN, b"HOME=/x\0", VICTIM, 0, None, id="no-job-id"),
    # the cgroup wins: a process in job A's cgroup is A's, whatever its environment says
    pytest.param(IN_600, env(500), ATTACKER, 0, 600, id="in-own-cgroup-forged-env-on-victims-gpu"),
    pytest.param(IN_600, env(500), ATTACKER, 1, 600, id="in-own-cgroup-forged-env-hides-nothing"),
    pytest.param(IN_600, b"", ATTACKER, 1, 600, id="in-own-cgroup"),
    pytest.param(IN_500, env(600), VICTIM, 0, 500, id="victims-process-says-attackers-job"),
    pytest.param(f"0::/system.slice/slurmstepd.scope/{SLUID}/step_0/user/task_0\n", env(500), VICTIM, 3, 800,
                 id="sluid-cgroup-wins-over-env"),
])
def test_charged_only_where_the_kernel_says(cgroup: str, environ: bytes, uid: int | None, gpu: int,
                                            charged: int | None) -> None:
    assert charged_job_of(cgroup, environ, uid, gpu, JOBS) == charged


def _obs(index: int, procs: list[tuple[int, int]], total: int = 100) -> GpuObservation:
    return GpuObservation(index, total, sum(b for _, b in procs), None,
                          tuple(ProcessUsage(p, b) for p, b in procs))


def test_a_forged_job_id_neither_charges_nor_flags_the_victim() -> None:
    # pid 1: the victim's own process (its cgroup); pid 2: the attacker's, outside any job with
    # SLURM_JOB_ID=500, filling GPU 1; pid 3: the attacker's, beside the victim's on GPU 0.
    facts = {1: ProcFacts(500, 500, VICTIM), 2: ProcFacts(None, 500, ATTACKER), 3: ProcFacts(None, 500, ATTACKER)}
    sample = [_obs(0, [(1, 10), (3, 89)]), _obs(1, [(2, 99)])]
    owners = sample_owners(sample, facts, JOBS)
    assert owners == {(0, 1): 500}
    victim = apply_tick(JOBS[500], 1.0, sample, owners)
    summary = summarize(victim, "nvml", 1.0, 2.0)
    assert (summary["peak_bytes"], summary["pids_seen"], summary["oom_suspected"]) == (10, 1, False)
    assert [g["index"] for g in summary["gpus"]] == [0]
    # GPU 0 was full (99 of 100): listed, but a neighbour's memory never makes it the victim's OOM
    assert [e["kind"] for e in summary["evidence"]] == ["device_full"]


def test_same_user_outside_the_cgroup_counts_only_on_the_jobs_gpus() -> None:
    facts = {4: ProcFacts(None, 500, VICTIM)}
    sample = [_obs(0, [(4, 99)]), _obs(1, [(4, 99)])]
    owners = sample_owners(sample, facts, JOBS)
    assert owners == {(0, 4): 500}
    summary = summarize(apply_tick(JOBS[500], 1.0, sample, owners), "nvml", 1.0, 2.0)
    assert summary["peak_bytes"] == 99 and summary["oom_suspected"] is True  # its own memory, its own GPU
    assert [e["gpu"] for e in summary["evidence"]] == [0]
