"""Which job a GPU process's memory is charged to: only a job the kernel ties it to. Pure.

The node agent reads three things about each process on a GPU (``procs.ProcFacts``): the job its
cgroup names, the ``SLURM_JOB_ID`` of its environment, and its owner uid. Only the first and the
last come from the kernel; the environment is whatever the process's user put there. So:

1. Its cgroup names a job (``job_<id>``, or the SLUID an announced job came with): that job, on
   any GPU, whatever its environment says. A user cannot leave their job's cgroup, so a forged
   ``SLURM_JOB_ID=<other job>`` neither hides a process from its own job nor charges it to another.
2. Its cgroup names no job (a login shell, an ssh session, ``proctrack/linuxproc``): its
   ``SLURM_JOB_ID`` counts only when the process's owner (the real and effective uid, which the
   kernel keeps) is the uid the prolog announced the job with (``JobTrack.uid``), and only for its
   memory on the job's own GPUs (``JobTrack.gpus``), or on a GPU no announced job holds (the
   prolog's list can be short: see charged_job). A job announced without a uid gets no such
   process; another user's process is never charged to it, whatever its environment says.
3. Otherwise nobody's: its memory is the device's, not a job's.

Rule 2 lets a user charge their own job for their own processes on their own GPUs, nothing more:
what they could do by running those processes inside the job. The OOM evidence built from the
charged memory (``agent_state``) is therefore the job's own.
"""
from __future__ import annotations

from typing import Iterable, Mapping

from slurm_plugin.agent.state import GpuObservation, JobTrack, sluid_map
from slurm_plugin.agent.procs import ProcFacts, job_id_from_cgroup, job_id_from_environ


def charged_job(facts: ProcFacts, gpu: int, jobs: Mapping[int, JobTrack]) -> int | None:
    """The job charged for the memory of the process ``facts`` describe on GPU ``gpu`` (``jobs``:
    the announced jobs by id), or None. The rules are the module's."""
    if facts.cgroup_job is not None:
        return facts.cgroup_job
    job = jobs.get(facts.env_job) if facts.env_job is not None else None
    if job is None or job.uid is None or facts.uid != job.uid:
        return None
    # The job's own GPUs, as the prolog announced them; or a GPU no announced job holds: Slurm 24.11
    # and 26.05 gave the prolog SLURM_JOB_GPUS of one GPU type only for a job holding two (a gpu:4
    # job on a100,a100,h100,h100 announced [2, 3] and ran on GPU 0; measured). Never another job's.
    if gpu not in job.gpus and any(gpu in other.gpus for other in jobs.values()):
        return None
    return job.job_id


def charged_job_of(cgroup_text: str, environ: bytes, uid: int | None, gpu: int,
                   jobs: Mapping[int, JobTrack]) -> int | None:
    """``charged_job`` from the text of ``/proc/<pid>/cgroup``, the bytes of its ``environ`` and
    its owner uid (a cgroup directory named by SLUID counts for the announced jobs that have one)."""
    facts = ProcFacts(job_id_from_cgroup(cgroup_text, sluid_map(jobs.values())), job_id_from_environ(environ), uid)
    return charged_job(facts, gpu, jobs)


def sample_owners(observations: Iterable[GpuObservation], facts: Mapping[int, ProcFacts],
                  jobs: Mapping[int, JobTrack]) -> dict[tuple[int, int], int]:
    """(GPU index, pid) -> the job charged for that process's memory on that GPU, for every
    process of one sample that is charged to a job (``facts``: by pid; a pid without facts is
    nobody's)."""
    out: dict[tuple[int, int], int] = {}
    for obs in observations:
        for proc in obs.procs:
            pf = facts.get(proc.pid)
            job_id = charged_job(pf, obs.index, jobs) if pf is not None else None
            if job_id is not None:
                out[(obs.index, proc.pid)] = job_id
    return out
