"""Slurm TaskProlog: memory fencing for shared (shard) jobs, chosen by ``agent.enforcement``.

Slurm runs the TaskProlog as the job's user before each task and applies the
``export NAME=value`` lines it prints to the task's environment. Only jobs with shards
(``SLURM_SHARDS_ON_NODE`` set and > 0) get lines; whole-GPU jobs get none. The job's cap is
``shards * gpu.shard_bytes`` (a shard is the same memory on every GPU), at most the memory of the
job's GPU as the node's NVML reports it, the same arithmetic the policy used to size the request;
fractions (``SWAPAWARE_GPU_MEM_FRACTION``, XLA's) are of that GPU. The config file must be readable by
job users.

What each mechanism does, and does not, guarantee:

``none``
    Prints nothing. Shards fence nothing; co-located jobs may exceed the device together.

``framework_env``: cooperative, not enforced (also what ``auto`` falls back to).
    * ``SWAPAWARE_GPU_MEM_LIMIT_BYTES`` / ``SWAPAWARE_GPU_MEM_FRACTION``: the job's share, for
      wrappers and users (e.g. ``torch.cuda.set_per_process_memory_fraction(fraction)``).
      PyTorch has no environment variable that caps memory (``PYTORCH_CUDA_ALLOC_CONF`` tunes
      the caching allocator, it does not cap it), so PyTorch jobs are NOT capped by this.
    * ``TF_FORCE_GPU_ALLOW_GROWTH=true``: TensorFlow allocates as it goes instead of grabbing
      nearly the whole device at start. Stops the grab, does not cap growth.
    * ``XLA_PYTHON_CLIENT_MEM_FRACTION``: JAX/XLA preallocates this fraction of the device
      (default 0.75, which alone would starve co-runners) and its allocator stays within it;
      CUDA context and library workspaces are outside it. A stricter value the user set is kept.
    Raw CUDA, CuPy, and anything that ignores these variables are not limited.

``mps``: enforced per client process by the CUDA driver, when an MPS control daemon runs.
    Everything of ``framework_env``, plus, when the daemon's pipe directory
    (``agent.mps_pipe_dir``) exists, ``CUDA_MPS_PIPE_DIRECTORY`` and
    ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M``: allocations beyond the limit fail with an
    out-of-memory error in that client. Limits: it is per client process (a job whose tasks
    or children each create a CUDA context gets the cap per process); it applies to device
    ordinal 0 as the client sees it, so it is emitted only when the job sees exactly one GPU
    (always the case for shard jobs on Slurm 22.05); MPS runs one server per user at a time,
    so jobs of different users on one GPU are serialised, not co-run; without the daemon the
    variable is ignored by CUDA (hence the directory check, which cannot see a dead daemon).
    A program can unset the variable before it initialises CUDA: this guards against
    accidents, not against a hostile user (for that, the admin sets the daemon's
    ``set_default_device_pinned_mem_limit``).

``hami``, ``nvml-cgroup``, ``auto``: the backends of ``slurm_plugin/enforce`` (HAMi-core library
limit; cgroup v2 dmem max/low; ``auto`` the strongest the node has, else ``framework_env``). Their
lines are ``framework_env``'s plus the mechanism's. An unavailable mechanism is not claimed.

What cap is enforced, or that the share is advisory, is logged once per job (the batch step's
first task) to the node's syslog (``swapaware-taskprolog``, facility user), never put in the job's
output: Slurm writes a ``print`` line into the task's standard output, where ``$(srun ...)`` and
``srun > file`` would capture it, and discards everything else a TaskProlog writes, its standard
error included (slurmstepd runs it with stdout and stderr on one pipe and keeps only ``print``,
``export`` and ``unset`` lines). A job's output is exactly what it would be without swapaware.

One exception, asked for by the job's own history: the rerun of a job that swapaware requeued on
a whole GPU after its shared run ran out of GPU memory (``SLURM_RESTART_COUNT`` > 0 and the
AdminComment's reasons name ``oom_requeued``) gets one line in its standard error file, written
by the batch step's first task's TaskProlog as the job's user (``requeue_notice``), before the
script starts. Jobs never requeued cost nothing: Slurm is asked only where the restart count is set.

The config is read from ``/etc/swapaware/swapaware.toml`` only: the job's environment (which
the user controls) is not consulted for ``SWAPAWARE_*`` overrides or ``SWAPAWARE_CONFIG``.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import syslog
from pathlib import Path
from typing import Callable, Mapping

from policy_service.config import Config, ConfigError, Enforcement, load_config
from slurm_plugin.enforce import Backend, JobCap
from slurm_plugin.enforce.choose import choose
from slurm_plugin.hooks.job_env import parse_gpu_indices
from slurm_plugin.gpu.nvml import TelemetryError, open_telemetry

MIB = 1024 * 1024
_QUIET = logging.getLogger("swapaware.task_prolog")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


def _shards(env: Mapping[str, str]) -> int:
    raw = env.get("SLURM_SHARDS_ON_NODE", "").strip()
    return int(raw) if raw.isdigit() else 0


def _visible_gpu_count(env: Mapping[str, str]) -> int | None:
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return len([d for d in raw.split(",") if d.strip()])


def _floor_fraction(numerator: int, denominator: int) -> float:
    """``numerator / denominator`` rounded down to 3 decimals, in integer arithmetic."""
    return (numerator * 1000 // denominator) / 1000


def job_cap_bytes(shards: int, cfg: Config, device_bytes: int | None = None) -> int:
    """Bytes the job's shards stand for: ``shards * shard_bytes`` (a shard is the same memory on
    every GPU), at most its GPU (``device_bytes``; gpu.memory_bytes where not known)."""
    return min(shards * cfg.gpu.shard_bytes, device_bytes or cfg.gpu.memory_bytes)


def job_gpu_bytes(env: Mapping[str, str], cfg: Config) -> int | None:
    """Memory of the GPU the job's shards are on, from the node's NVML (or its fake); None where
    not known. Its NVML index: SLURM_JOB_GPUS, else CUDA_VISIBLE_DEVICES (an index within the job's
    devices where cgroups constrain them; then the first device NVML shows the job)."""
    indices = parse_gpu_indices(env)
    if _shards(env) <= 0 or not indices:
        return None
    try:
        telemetry = open_telemetry(cfg.agent, _QUIET)
        if telemetry is None:
            return None
        try:
            return telemetry.memory(indices[0]).total_bytes
        finally:
            telemetry.close()
    except (TelemetryError, OSError):
        return None


def _framework_lines(env: Mapping[str, str], cap_bytes: int, fraction: float) -> list[str]:
    jax_fraction = fraction
    try:
        jax_fraction = min(fraction, float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"]))
    except (KeyError, ValueError):
        pass
    return [
        f"export SWAPAWARE_GPU_MEM_LIMIT_BYTES={cap_bytes}",
        f"export SWAPAWARE_GPU_MEM_FRACTION={fraction}",
        "export TF_FORCE_GPU_ALLOW_GROWTH=true",
        f"export XLA_PYTHON_CLIENT_MEM_FRACTION={jax_fraction}",
    ]


def _mps_lines(env: Mapping[str, str], cap_bytes: int, cfg: Config, pipe_dir_exists: bool) -> list[str]:
    if not pipe_dir_exists or _visible_gpu_count(env) != 1:
        return []
    return [
        f"export CUDA_MPS_PIPE_DIRECTORY={cfg.agent.mps_pipe_dir}",
        f"export CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={cap_bytes // MIB}M",
    ]


def job_cap(env: Mapping[str, str], cfg: Config, device_bytes: int | None = None) -> JobCap | None:
    """The task's job share (None: not a shard job); ``device_bytes``: its GPU's memory (job_gpu_bytes)."""
    shards = _shards(env)
    if shards <= 0:
        return None
    raw_id = env.get("SLURM_JOB_ID", "")
    return JobCap(int(raw_id) if raw_id.isdigit() else 0, job_cap_bytes(shards, cfg, device_bytes),
                  device_bytes or cfg.gpu.memory_bytes, _visible_gpu_count(env), user_env=dict(env))


def task_prolog_lines(env: Mapping[str, str], cfg: Config, mps_pipe_dir_exists: bool,
                      backend: Backend | None = None, device_bytes: int | None = None) -> list[str]:
    """The ``export`` lines for one task, from its environment and the config (no I/O but the
    backend's own look at the node, for hami / nvml-cgroup / auto, whose backend the caller chose).
    ``device_bytes``: the memory of the job's GPU (job_gpu_bytes; gpu.memory_bytes where None)."""
    shards = _shards(env)
    mode = cfg.agent.enforcement
    if shards <= 0 or mode is Enforcement.NONE:
        return []
    if mode not in (Enforcement.FRAMEWORK_ENV, Enforcement.MPS):
        job = job_cap(env, cfg, device_bytes)
        applied = (backend or choose(cfg)[0]).apply(job)
        return [f"export {k}={v}" for k, v in applied.env.items()]
    cap_bytes = job_cap_bytes(shards, cfg, device_bytes)
    fraction = _floor_fraction(cap_bytes, device_bytes or cfg.gpu.memory_bytes)
    lines = _framework_lines(env, cap_bytes, fraction)
    if mode is Enforcement.MPS:
        lines += _mps_lines(env, cap_bytes, cfg, mps_pipe_dir_exists)
    return lines


def enforcement_message(env: Mapping[str, str], cfg: Config, lines: list[str], backend: Backend | None,
                        device_bytes: int | None = None) -> str:
    """The line the node's log gets: the cap that is enforced, or that its share is advisory."""
    job = job_cap(env, cfg, device_bytes)
    if job is None or cfg.agent.enforcement is Enforcement.NONE:
        return ""
    if cfg.agent.enforcement in (Enforcement.FRAMEWORK_ENV, Enforcement.MPS):
        if any(line.startswith("export CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=") for line in lines):
            return (f"swapaware: GPU memory capped at {job.cap_bytes // MIB} MiB per CUDA process (MPS pinned "
                    "memory limit); allocations beyond it fail")
        return (f"swapaware: GPU memory share {job.cap_bytes // MIB} MiB is ADVISORY (not enforced on this "
                "node): stay within it")
    return (backend or choose(cfg)[0]).apply(job).message


# SLURM_STEP_ID of the batch step as a task of it sees it (SLURM_BATCH_SCRIPT: "4294967291", and
# "-5" on 26.05, measured), or unset.
BATCH_STEP_IDS = ("", "batch", "4294967291", "-5")


def says_enforcement(env: Mapping[str, str]) -> bool:
    """Whether this task logs what cap the job has: the batch step's first task, once per job
    (steps started with srun each run the TaskProlog again, for every task)."""
    return env.get("SLURM_STEP_ID", "").strip() in BATCH_STEP_IDS and env.get("SLURM_LOCALID", "0") == "0"


# The environment sbatch gives a --gpus-per-task job (24.11 and 26.05): SLURM_TRES_PER_TASK=gres/gpu=1
# and SLURM_TRES_BIND=gres/gpu:per_task:1, the binding Slurm made itself. An srun in a job
# rewritten to shards reads them back as its own options; the binding names GPUs the job does not
# hold, and measured on 26.05.5 the step then runs without CUDA_VISIBLE_DEVICES even when
# cli_filter has cleared the option. Unset in the batch script's environment, its steps take the
# job's own shards. (The same test as policy_service.core.request.implicit_gpu_bind, which the node
# wing does not import.)
_IMPLICIT_BIND = re.compile(r"^gres[:/]gpu:per_task:\d+$")


def inherited_gpu_lines(env: Mapping[str, str]) -> list[str]:
    """``unset`` lines for what a shard job's srun steps must not inherit (none for other jobs,
    and none for a binding the user typed: such a job is never rewritten to shards)."""
    if _shards(env) <= 0 or not _IMPLICIT_BIND.match(env.get("SLURM_TRES_BIND", "")):
        return []
    return ["unset SLURM_TRES_BIND"]


_OOM_REQUEUED = re.compile(r"\bwhy=[\w,]*\boom_requeued\b")
# 26.05 shows "StdErr=" empty where standard error goes to the standard output file.
_STD_PATHS = (re.compile(r"\bStdErr=(\S+)"), re.compile(r"\bStdOut=(\S+)"))
_DECISION_ID = re.compile(r"\bid=(\w+)")


def requeue_notice(env: Mapping[str, str], show_job: Callable[[str], str]) -> tuple[str, str] | None:
    """(standard error path, line) for the batch step of a job requeued whole after a shared
    run's GPU out-of-memory; None for every other task. ``show_job(job_id)``: ``scontrol show job
    -o``, asked only where Slurm says the job was restarted."""
    try:
        restarts = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        return None
    job_id = env.get("SLURM_JOB_ID", "")
    if restarts <= 0 or not job_id.isdigit() or not says_enforcement(env):
        return None
    text = show_job(job_id)
    path = next((m for m in (p.search(text) for p in _STD_PATHS) if m), None)
    if not _OOM_REQUEUED.search(text) or not path:
        return None
    decision = _DECISION_ID.search(text.split("AdminComment=", 1)[-1])
    return path.group(1), (f"swapaware: job {job_id} ran out of GPU memory on a shared GPU and was requeued once on "
                           f"a whole GPU, as submitted (decision {decision.group(1) if decision else '?'}; "
                           "sacct -o AdminComment shows why)\n")


def scontrol_show_job(job_id: str) -> str:
    try:
        res = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return res.stdout if res.returncode == 0 else ""


def write_notice(notice: tuple[str, str] | None, log: Callable[[str], None]) -> None:
    """Append the line to the job's standard error file (as the job's user: the TaskProlog's)."""
    if notice is None:
        return
    path, line = notice
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        log(f"job {os.environ.get('SLURM_JOB_ID', '?')}: requeue notice not written to {path}: {exc}")


def syslog_line(message: str) -> None:
    """One line to the node's syslog (nowhere where the node has no syslog socket)."""
    syslog.openlog("swapaware-taskprolog", 0, syslog.LOG_USER)
    syslog.syslog(syslog.LOG_INFO, message)
    syslog.closelog()


def main(log: Callable[[str], None] = syslog_line, argv: list[str] | None = None) -> int:
    """Print the export/unset lines for this task (stdout: Slurm applies them to the task's
    environment, and shows nothing of them) and, for the batch step only, log the cap; always exit
    0 (a failing TaskProlog must not fail the task). ``--config PATH`` (from the TaskProlog wrapper
    the admin writes, never from the job's environment) replaces /etc/swapaware/swapaware.toml."""
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[1]) if len(args) == 2 and args[0] == "--config" else None
    try:
        cfg = load_config(path, env={})
    except ConfigError as exc:
        log(f"job {os.environ.get('SLURM_JOB_ID', '?')}: {exc}; no memory fencing")
        return 0
    pipe_dir_exists = Path(cfg.agent.mps_pipe_dir).is_dir()
    backend = None if cfg.agent.enforcement in (Enforcement.FRAMEWORK_ENV, Enforcement.MPS,
                                                Enforcement.NONE) else choose(cfg)[0]
    device_bytes = job_gpu_bytes(os.environ, cfg)
    lines = task_prolog_lines(os.environ, cfg, pipe_dir_exists, backend, device_bytes)
    for line in lines + inherited_gpu_lines(os.environ):
        sys.stdout.write(line + "\n")
    write_notice(requeue_notice(os.environ, scontrol_show_job), log)
    if says_enforcement(os.environ):
        message = enforcement_message(os.environ, cfg, lines, backend, device_bytes)
        if message:
            log(f"job {os.environ.get('SLURM_JOB_ID', '?')}: {message}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
