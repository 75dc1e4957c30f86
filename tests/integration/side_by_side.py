"""Jobs run once with swapaware's job_submit plugin on and once with it off, on the same cluster:
switching the plugin (a slurmctld restart once nothing runs), submitting a job with its own output
files, and what the job got, printed and was billed once it ended (shared by the side-by-side
suites: test_user_options, test_billing_weights)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tests.slurm_stack import CLUSTER, Stack, job_field
from tests.waiting import wait_for


@dataclass(frozen=True)
class Run:
    job: int
    state: str
    stdout: str
    stderr: str
    alloc: dict[str, str]  # sacct AllocTRES: cpu, mem, node, billing, gres/gpu or gres/shard
    tres_per_node: str
    admin_comment: str


def running(stack: Stack) -> str | None:
    """Jobs running or completing (None: none)."""
    out = stack.run("squeue", "-h", "-t", "RUNNING,COMPLETING,CONFIGURING", "-o", "%i %j %T").stdout.strip()
    return out or None


def switch_plugin(stack: Stack, mode: str, ready: Callable[[], None] | None = None) -> str:
    """Switch job_submit on or off: a slurmctld restart, once no job runs or completes; what
    cluster.sh said. With the plugin on, ``ready`` (default: a shareable job shares again) waits
    until the service has read the restarted controller. (22.05 saves no GRES configuration flags
    with a node's state: restarted while four gpu:1 jobs ran, it showed
    GresUsed=gpu:a100:1,gpu:h100:1,shard:0 until the node registered again; measured.)"""
    wait_for(lambda: running(stack) is None, 180, lambda: f"no job running before slurmctld restarts: "
             f"{running(stack)}\n{stack.queue_and_gres()}", 0.5)
    said = stack.run("bash", str(CLUSTER), "plugin", mode, timeout=300).stderr
    # the slurmctld that answers runs the new configuration (a restart that left the old one
    # running, unseen, once made every "plugin off" run a plugin-on run)
    plugins = [ln.split("=", 1)[1].strip() for ln in stack.run("scontrol", "show", "config").stdout.splitlines()
               if ln.startswith("JobSubmitPlugins")]
    assert plugins == (["lua"] if mode == "on" else ["(null)"]), (mode, plugins, said)
    stack.wait_nodes_up()
    if mode == "on":  # the first jobs after a restart keep their request until the service read it
        (ready or stack.wait_sharing)()
    return said


def output_prefix(stack: Stack, name: str) -> Path:
    return stack.state / "jobs" / name


def submit(stack: Stack, script: str, args: tuple[str, ...], job_name: str, name: str) -> int:
    """``script`` with ``args`` as ``job_name``, writing to output_prefix(name).out/.err."""
    out = output_prefix(stack, name)
    return stack.sbatch(script, *args, f"--job-name={job_name}", f"--output={out}.out", f"--error={out}.err")


def alloc_of(stack: Stack, job: int) -> dict[str, str]:
    tres = stack.run("sacct", "-X", "-n", "-P", "-j", str(job), "-o", "alloctres").stdout.strip()
    return dict(kv.split("=", 1) for kv in tres.split(",") if "=" in kv)


def collect(stack: Stack, job: int, name: str) -> Run:
    """Job ``job`` (submitted as ``name``) once it ended and accounting shows its GPU TRES."""
    info = stack.show_job(job)
    state = stack.wait_done(job, timeout_s=180)
    out = output_prefix(stack, name)
    # every job here holds a GPU or shards: wait until accounting shows them (in a fresh-clone run
    # with four clusters on two cores, a finished job's AllocTRES once lacked its gres/gpu)
    last: list[dict[str, str]] = [{}]

    def with_gres() -> dict[str, str] | None:
        last[0] = alloc_of(stack, job)
        return last[0] if any(k.startswith("gres/") for k in last[0]) else None

    alloc = wait_for(with_gres, 30, lambda: f"job {job}'s GPU TRES in sacct's AllocTRES: {last[0]}", 0.5)
    return Run(job, state, out.with_suffix(".out").read_text(), out.with_suffix(".err").read_text(), alloc,
               job_field(info, "TresPerNode"), job_field(info, "AdminComment"))
