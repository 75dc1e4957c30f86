"""Every GPU option a user types keeps its meaning: each job below runs once with swapaware's
job_submit plugin on and once with it off, on the same cluster, and the two runs must agree on what
the job got (its state, CPUs, memory, whether each step sees a GPU) and on its stdout, byte for
byte. With the plugin on the job's class would share (a memory hint makes it shareable on a first
run): options expressed per GPU, --exclusive and --gpu-bind keep the request whole and say why,
and a plain request that is rewritten to shards prints nothing more than it would without
swapaware. Inside each job the steps a user types (plain, --gpu-bind of every kind, a step asking
for more GPUs than the job holds) get what they get without swapaware, typed jobs included, and
what sbatch prints to a script that captures both of its streams is the same."""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

import pytest

from tests.slurm_stack import Stack
from tests.waiting import wait_for

from .conftest import decision_of, job_field
from .side_by_side import Run, collect, submit, switch_plugin

pytestmark = pytest.mark.integration

HINT = "--comment=swapaware:mem=2G"
# What the batch step and every task of one step see (set/unset, not the index: the GPU a job
# lands on may differ between the two runs), sorted: tasks of one step print in any order. Then a
# step asking for a GPU per task for two tasks, more than the job holds (refused, with and without
# swapaware).
SCRIPT = """#!/bin/bash
echo "batch gpu=${CUDA_VISIBLE_DEVICES:+set}"
srun bash -c 'echo "task $SLURM_PROCID gpu=${CUDA_VISIBLE_DEVICES:+set} step_gpus=${SLURM_STEP_GPUS:+set}'\\
' ordinal=${GPU_DEVICE_ORDINAL:+set} cpus=$SLURM_CPUS_ON_NODE"' | sort
srun --gres=gpu:1 bash -c 'echo "gpu step gpu=${CUDA_VISIBLE_DEVICES:+set}"' | sort
srun -n2 --gpus-per-task=1 bash -c 'echo "two per task gpu=${CUDA_VISIBLE_DEVICES:+set}"' | sort
echo "two per task rc=${PIPESTATUS[0]}"
echo done
"""
# Steps that bind GPUs (srun --gpu-bind of each kind): a step holding shards gets no
# CUDA_VISIBLE_DEVICES under any binding, so a job whose script binds GPUs keeps its request.
BIND_SCRIPT = SCRIPT.replace("echo done\n", """for bind in none closest map_gpu:0 single:1; do
  srun --gpu-bind=$bind bash -c 'echo "bind '$bind' task $SLURM_PROCID gpu=${CUDA_VISIBLE_DEVICES:+set}"' | sort
done
srun --gres=gpu:1 --gpu-bind=closest bash -c 'echo "gpu+bind gpu=${CUDA_VISIBLE_DEVICES:+set}"' | sort
echo done
""")


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]
    reason: str  # the reason the job keeps its request with the plugin on; "" when it shares
    gpu_type: str = ""  # the type of the shards a shared job holds
    script: str = SCRIPT


CASES = (
    Case("cpus_per_gpu", ("--gres=gpu:1", "--cpus-per-gpu=2"), "per_gpu_option"),
    Case("gpus_cpus_per_gpu", ("--gpus=1", "--cpus-per-gpu=2"), "per_gpu_option"),
    Case("mem_per_gpu", ("--gres=gpu:1", "--mem-per-gpu=300M"), "per_gpu_option"),
    Case("ntasks_per_gpu", ("--gpus=1", "--ntasks-per-gpu=2"), "per_gpu_option"),
    Case("gpu_freq", ("--gres=gpu:1", "--gpu-freq=high"), "per_gpu_option"),
    Case("gpu_bind_closest", ("--gres=gpu:1", "--gpu-bind=closest"), "per_gpu_option"),
    Case("gpu_bind_map", ("--gres=gpu:1", "--gpu-bind=map_gpu:0"), "per_gpu_option"),
    Case("gpu_bind_single", ("--gres=gpu:1", "--gpu-bind=single:1"), "per_gpu_option"),
    Case("exclusive", ("--exclusive", "--gres=gpu:1"), "exclusive"),
    # a partition with DefCpuPerGPU=2 DefMemPerGPU=600 (the dev cluster's gpudef): 2 CPUs, 600M
    Case("partition_defaults", ("--partition=gpudef", "--gres=gpu:1"), "per_gpu_default"),
    Case("plain", ("--gres=gpu:1",), ""),
    Case("gpus_per_task", ("--gpus-per-task=1", "--ntasks=1"), ""),
    Case("two_tasks", ("--gres=gpu:1", "--ntasks=2"), ""),
    # typed requests share GPUs of their type, as typed shards (a plain step is refused in a job
    # holding typed shards, and cli_filter mends it)
    Case("typed", ("--gres=gpu:h100:1",), "", "h100"),
    Case("typed_gpus", ("--gpus=a100:1",), "", "a100"),
    Case("step_gpu_bind", ("--gres=gpu:1",), "per_gpu_option", script=BIND_SCRIPT),
    Case("typed_step_gpu_bind", ("--gres=gpu:h100:1",), "per_gpu_option", script=BIND_SCRIPT),
)


def _name(case: Case, tag: str) -> str:
    return f"opt-{case.name}-{tag}"


@pytest.fixture(scope="module")
def side_by_side(stack):
    """Every case submitted with the plugin on, then with it off (the cluster as it would be without
    swapaware), each run to its end; the plugin is on again afterwards."""
    tag = uuid.uuid4().hex[:6]
    runs: dict[str, dict[str, Run]] = {"on": {}, "off": {}}
    try:
        for mode in ("on", "off"):
            switch_plugin(stack, mode)
            jobs = {c.name: submit(stack, c.script, (*c.args, HINT), f"opt-{c.name}",
                                    _name(c, f"{tag}-{mode}")) for c in CASES}
            runs[mode] = {c.name: collect(stack, jobs[c.name], _name(c, f"{tag}-{mode}")) for c in CASES}
    finally:
        switch_plugin(stack, "on")
    return runs


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_job_gets_and_prints_what_it_would_without_swapaware(side_by_side, case):
    on, off = side_by_side["on"][case.name], side_by_side["off"][case.name]
    assert off.state == "COMPLETED", off
    assert on.state == off.state, (on, off)
    if case.name == "partition_defaults":  # the partition's DefCpuPerGPU=2 DefMemPerGPU=600 applied
        assert (off.alloc["cpu"], off.alloc["mem"]) == ("2", "600M"), off.alloc
    if case.reason:  # the request as typed: everything allocated, and billed, is the same
        assert on.alloc == off.alloc, (on, off)
    else:  # shards of the GPU instead of the GPU; the CPUs and memory the job got are the same
        assert (on.alloc["cpu"], on.alloc["mem"]) == (off.alloc["cpu"], off.alloc["mem"]), (on, off)
    if case.name == "typed_gpus" and "gpu step" not in off.stdout:
        # The one difference left, measured on 22.05: without swapaware Slurm refuses
        # `srun --gres=gpu:1` in a --gpus=a100:1 job (the step also carries the job's --gpus=a100:1
        # from its environment); cli_filter asks for the job's shards instead and the step runs.
        assert on.stdout.replace("gpu step gpu=set\n", "") == off.stdout, (on.stdout, off.stdout)
    else:
        assert on.stdout == off.stdout, (on.stdout, off.stdout)
    # the batch step and a plain step's tasks see a GPU (a --gpu-bind=none step of a
    # --ntasks-per-gpu job sees none on 22.05, with and without swapaware: compared above)
    plain = [ln for ln in on.stdout.splitlines() if ln.startswith(("batch ", "task "))]
    assert plain and all("gpu=set" in ln for ln in plain), on.stdout


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_billing_is_what_the_job_holds(side_by_side, stack, case):
    """The dev cluster bills CPU=1, GRES/gpu=8, GRES/shard=1 (a 10 GiB shard, 1/8 of the largest GPU):
    a job kept whole bills exactly what it bills without swapaware, a shared job its CPUs and its
    shards' memory as a fraction of the largest GPU. (Slurm 24.11 records no typed gres/shard:<type>
    in AllocTRES, measured: typed shard weights bill nothing.)"""
    on, off = side_by_side["on"][case.name], side_by_side["off"][case.name]
    assert "gres/gpu" in off.alloc and "cpu" in off.alloc, (case.name, off, on)
    cpus, gpus = int(off.alloc["cpu"]), int(off.alloc["gres/gpu"])  # --exclusive: all of the node's
    assert off.alloc["billing"] == str(cpus + 8 * gpus), off.alloc
    if case.reason:
        assert on.alloc["billing"] == off.alloc["billing"], (on.alloc, off.alloc)
    else:
        shards = int(on.alloc["gres/shard"])
        assert "gres/gpu" not in on.alloc and on.alloc["billing"] == str(cpus + shards), on.alloc


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_decision_says_why_the_request_stayed_or_shares(side_by_side, stack, case):
    on, off = side_by_side["on"][case.name], side_by_side["off"][case.name]
    d = decision_of(on.admin_comment)
    if case.reason:
        assert d["action"] == "whole_gpu" and case.reason in d["why"].split(","), d
        assert on.tres_per_node == off.tres_per_node, (on, off)  # the request exactly as typed
    else:
        assert d["action"] == "share", d
        assert on.tres_per_node == stack.gres("shard", 1, case.gpu_type), on


def test_swapaware_writes_nothing_to_a_jobs_output(side_by_side):
    """stdout is the job's own (compared above); stderr holds nothing of swapaware's (the TaskProlog
    logs the cap to the node's syslog), and no error of Slurm's that the job without swapaware did not get (Slurm's own lines carry a time
    stamp and may name the GPU the job landed on: compared without them)."""
    def slurm_errors(text: str) -> set[str]:
        # a step Slurm refuses is refused with and without swapaware, not always for the same stated
        # reason: srun -n2 --gpus-per-task=1 in a 1-GPU job says "More processors requested than
        # permitted" without it and "Invalid generic resource (gres) specification" in a job holding
        # shards (both measured)
        refused = ("Unable to create step", "Step requested GRES")  # a step refused, for some reason
        return {"a step refused" if any(r in ln for r in refused) else
                re.sub(r"\d+", "N", ln.split("] ", 1)[-1].split(" does not specify")[0])
                for ln in text.splitlines() if "error" in ln}

    for case in CASES:
        on, off = side_by_side["on"][case.name], side_by_side["off"][case.name]
        ours = [ln for ln in on.stderr.splitlines() if "swapaware" in ln]
        assert ours == [], (case.name, on.stderr)
        assert slurm_errors(on.stderr) <= slurm_errors(off.stderr), (case.name, on.stderr, off.stderr)
        assert "swapaware" not in on.stdout, (case.name, on.stdout)


def _normalised(text: str) -> str:
    """sbatch's output with what differs between any two submissions (job ids, times) taken out."""
    text = re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", "T", text)
    return re.sub(r"\d+", "N", text)


def _client_output(stack: Stack, tag: str) -> dict[str, str]:
    """What a script capturing both of sbatch's streams gets: `$(sbatch --parsable ... 2>&1)` for a
    GPU job whose class shares (held, then cancelled), and a --test-only query."""
    name = f"opt-out-{tag}"
    held = stack.run("bash", "-c", f"sbatch --parsable --hold --gres=gpu:1 {HINT} --job-name={name} "
                     "--wrap true 2>&1").stdout
    if held.strip().isdigit():
        stack.run("scancel", held.strip(), check=False)
    test_only = stack.run("bash", "-c", f"sbatch --test-only --gres=gpu:1 {HINT} --job-name={name}-t "
                          "--wrap true 2>&1").stdout
    return {"held": held, "test_only": test_only}


@pytest.fixture(scope="module")
def client_outputs(stack, side_by_side):
    """_client_output with the plugin off, then on (after the jobs above: the plugin is on)."""
    tag = uuid.uuid4().hex[:6]
    out = {}
    try:
        switch_plugin(stack, "off")
        out["off"] = _client_output(stack, f"{tag}-off")
    finally:
        switch_plugin(stack, "on")
    out["on"] = _client_output(stack, f"{tag}-on")
    return out


def test_sbatch_prints_what_it_prints_without_swapaware(client_outputs):
    """Nothing on stdout or stderr by default (policy.tell_users off): `$(sbatch --parsable job.sh 2>&1)`
    is the job id alone, and --test-only prints Slurm's one line."""
    on, off = client_outputs["on"], client_outputs["off"]
    assert re.fullmatch(r"\d+\n", off["held"]), off
    assert re.fullmatch(r"\d+\n", on["held"]), on
    assert "to start at" in off["test_only"], off
    assert _normalised(on["test_only"]) == _normalised(off["test_only"]), (on, off)


def test_a_test_only_query_leaves_no_decision(stack):
    """sbatch --test-only runs job_submit as a submission does; with swapaware it records nothing
    (cli_filter marks it): the history holds one decision more after a test-only query and a real
    held job, the real job's."""
    name = f"opt-testonly-{uuid.uuid4().hex[:6]}"

    def fenced(tag: str) -> int:
        """The decisions in the history once a held job's decision is there (the service writes
        them after it answers: a count read without a fence may miss the last ones)."""
        fence = stack.held("#!/bin/sh\ntrue\n", "--gres=gpu:1", HINT, f"--job-name={name}-{tag}")
        fence_id = decision_of(job_field(fence, "AdminComment"))["id"]

        def count() -> int | None:
            with stack.history() as db:
                if db.execute("SELECT 1 FROM decisions WHERE decision_id=?", (fence_id,)).fetchone() is None:
                    return None
                return db.execute("SELECT COUNT(*) FROM decisions").fetchone()[0]

        return wait_for(count, 30, f"decision {fence_id} of the fence job in the history", 0.3)

    before = fenced("before")
    r = stack.run("sbatch", "--test-only", "--gres=gpu:1", HINT, f"--job-name={name}", "--wrap", "true")
    assert "to start at" in r.stdout + r.stderr, r
    assert fenced("after") == before + 1  # the second fence's decision alone
