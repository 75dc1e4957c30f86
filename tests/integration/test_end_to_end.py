"""End to end on the real cluster: sbatch -> job_submit.lua -> policy service -> prolog/epilog -> sacct."""
import uuid

import pytest

from tests.waiting import wait_for

from .conftest import GIB, decision_of, fake_alloc_script, job_field

pytestmark = pytest.mark.integration


def test_class_moves_from_whole_gpu_to_shards_after_an_observed_run(stack):
    name = f"train-{uuid.uuid4().hex[:6]}"
    script = fake_alloc_script(stack, gib=3)
    first = stack.sbatch(script, "--gres=gpu:1", f"--job-name={name}")
    info = stack.show_job(first)
    d1 = decision_of(job_field(info, "AdminComment"))
    assert d1["action"] == "whole_gpu" and "no_history" in d1["why"]
    if stack.whole_gpu_as_shards:  # 22.05 on a fleet of one shard count: held as all of a GPU's shards
        assert job_field(info, "TresPerNode") == stack.gres("shard", 8)
        assert "whole_gpu_as_shards" in d1["why"]
    else:  # 23.11+ keeps gpu and shard jobs apart itself: the request stays as typed
        assert job_field(info, "TresPerNode") == stack.gres("gpu", 1)
        assert "whole_gpu_as_shards" not in d1["why"]
        if stack.dialect.gpu_beside_shard_bug:  # 22.05, the dev fleet's 4 and 8 shard GPUs: no one count is whole
            assert "whole_gpu_sizes_differ" in d1["why"], d1
    assert stack.wait_done(first) == "COMPLETED"
    assert decision_of(stack.sacct_admin_comment(first))["id"] == d1["id"]  # sacct shows the record
    d_id, runtime_s, exit_code, peak, gpus, source = stack.wait_observation(first)
    assert d_id == d1["id"] and exit_code == 0 and runtime_s > 0
    assert source == "fake-nvml" and peak == 3 * GIB

    second = stack.sbatch(script, "--gres=gpu:1", f"--job-name={name}")
    info2 = stack.show_job(second)
    assert job_field(info2, "TresPerNode") == stack.gres("shard", 1), info2
    d2 = decision_of(job_field(info2, "AdminComment"))
    assert d2["action"] == "share" and d2["src"] == "class"
    assert stack.wait_done(second) == "COMPLETED"
    out = (stack.state / "jobs" / f"slurm-{second}.out").read_text()
    assert "CUDA_VISIBLE_DEVICES=" in out and "SLURM_SHARDS_ON_NODE=1" in out
    assert "SWAPAWARE_GPU_MEM_LIMIT_BYTES=10737418240" in out  # the TaskProlog's cap: 1 shard, 10 GiB on any GPU
    assert decision_of(stack.sacct_admin_comment(second))["action"] == "share"
    explained = stack.swapaware("explain", str(second)).stdout
    assert f"action: share -> {stack.gres('shard', 1)}" in explained


def test_a_class_that_keeps_a_gpu_busy_is_charged_shards_for_its_compute(stack):
    """The agent samples the (fake) device's utilisation; the epilog reports it; the next
    submission is sized by compute (62 % of 8 shards -> 5), not by its 3 GiB of memory (1)."""
    name = f"busy-{uuid.uuid4().hex[:6]}"
    script = fake_alloc_script(stack, gib=3, busy_pct=62)
    first = stack.sbatch(script, "--gres=gpu:1", f"--job-name={name}")
    assert stack.wait_done(first) == "COMPLETED"
    stack.wait_observation(first)
    info = stack.held(script, "--gres=gpu:1", f"--job-name={name}")
    assert job_field(info, "TresPerNode") == stack.gres("shard", 5), info
    d = decision_of(job_field(info, "AdminComment"))
    assert d["action"] == "share" and "compute_shards" in d["why"], d


def test_job_without_gpu_is_left_alone(stack):
    job = stack.sbatch("#!/bin/sh\ntrue\n")
    info = stack.show_job(job)
    assert job_field(info, "AdminComment") in ("", "(null)")
    assert stack.wait_done(job) == "COMPLETED"


def test_fail_open_and_spooled_observation_arrives_after_service_returns(stack):
    stack.stack("service-stop")
    try:
        name = f"outage-{uuid.uuid4().hex[:6]}"
        job = stack.sbatch(fake_alloc_script(stack, gib=1, hold_s=0.5), "--gres=gpu:1", f"--job-name={name}")
        info = stack.show_job(job)
        assert job_field(info, "TresPerNode") == stack.gres("gpu", 1)  # unchanged
        assert job_field(info, "AdminComment") in ("", "(null)")
        assert stack.wait_done(job) == "COMPLETED"
        spool = stack.state / "node" / "spool"
        wait_for(lambda: any(spool.glob(f"*-finish-{job}-*.json")), 30,
                 lambda: f"the epilog to spool job {job}: {list(spool.iterdir())}", 0.3)
    finally:
        stack.stack("service-start")
    stack.swapaware("replay-spool")
    # the plugin's circuit breaker closes again by itself: GPU jobs get decisions once more
    stack.wait_for_decisions(timeout_s=60)
    _, runtime_s, exit_code, peak, _, _ = stack.wait_observation(job)
    assert exit_code == 0 and runtime_s is not None and peak == 1 * GIB


def gpu_index(stack, job_id: int) -> tuple[int, ...]:
    from policy_service.slurm.slurm_text import job_gpu_indices

    detail = stack.run("scontrol", "show", "job", "-d", str(job_id)).stdout
    indices = job_gpu_indices(detail)
    assert indices, detail
    return indices


def wait_running(stack, job_id: int, timeout_s: float = 30) -> None:
    wait_for(lambda: job_field(stack.show_job(job_id), "JobState") == "RUNNING", timeout_s,
             lambda: f"job {job_id} to run: {stack.show_job(job_id)}", 0.3)


def test_whole_gpu_decision_never_shares_a_gpu_with_shard_jobs(stack):
    """On 22.05 a gpu:1 job can land on a GPU whose shards are in use; held as all shards it cannot.
    On 24.11 and 26.05 Slurm itself keeps them apart, and the request stays gpu:1."""
    sharer = stack.sbatch("#!/bin/sh\nsleep 20\n", "--gres=shard:1")
    wait_running(stack, sharer)
    whole = stack.sbatch("#!/bin/sh\nsleep 20\n", "--gres=gpu:1", f"--job-name=big-{uuid.uuid4().hex[:6]}",
                         "--comment=swapaware:mem=75G")  # with margin more than the device: whole GPU
    try:
        assert decision_of(job_field(stack.show_job(whole), "AdminComment"))["action"] == "whole_gpu"
        wait_running(stack, whole)
        assert gpu_index(stack, whole) != gpu_index(stack, sharer)
    finally:
        stack.run("scancel", str(sharer), str(whole))


def test_site_factor_reaches_slurm_priority(stack):
    """sprio's SITE column shows exactly the decision's site factor (no offset, no wrap)."""
    # all shards of each GPU: whole GPUs whatever the account's history suggests for gpu:1 jobs
    fillers = [stack.sbatch("#!/bin/sh\nsleep 30\n", stack.fill_gres(i), f"--job-name=fill{i}") for i in range(4)]
    waiting = stack.sbatch("#!/bin/sh\ntrue\n", stack.whole_gpu_request, f"--job-name=wait-{uuid.uuid4().hex[:6]}")
    try:
        sf = int(decision_of(job_field(stack.show_job(waiting), "AdminComment"))["sf"])
        site = wait_for(lambda: stack.run("sprio", "-h", "-j", str(waiting), "-o", "%S", check=False).stdout.split(),
                        20, f"sprio to list job {waiting}", 0.5)
        assert int(site[0]) == sf
    finally:
        stack.run("scancel", *(str(j) for j in (*fillers, waiting)))


def test_shared_job_that_dies_at_its_cap_gets_a_whole_gpu_next_time(stack):
    name = f"grows-{uuid.uuid4().hex[:6]}"
    first = stack.sbatch(fake_alloc_script(stack, gib=3, hold_s=0.5), "--gres=gpu:1", f"--job-name={name}")
    assert stack.wait_done(first) == "COMPLETED"
    stack.wait_observation(first)
    # same class name, a script that grows to 9.8 GiB of its 10 GiB shard and then fails
    grows = fake_alloc_script(stack, gib=9.8, hold_s=1.0).replace("exec ", "") + "exit 3\n"
    # --no-requeue: this test is about what the class learns (test_requeue.py: the requeue itself)
    second = stack.sbatch(grows, "--gres=gpu:1", f"--job-name={name}", "--no-requeue")
    assert job_field(stack.show_job(second), "TresPerNode") == stack.gres("shard", 1)
    assert stack.wait_done(second) == "FAILED"
    stack.wait_observation(second)
    with stack.history() as db:
        (oom,) = db.execute("SELECT oom FROM observations WHERE job_id=?", (second,)).fetchone()
    assert oom == 1
    third = stack.sbatch(grows, "--gres=gpu:1", f"--job-name={name}")  # the class that ran out of memory
    d3 = decision_of(job_field(stack.show_job(third), "AdminComment"))
    assert d3["action"] == "whole_gpu" and "oom_penalty" in d3["why"]
    whole = stack.gres("shard", 8) if stack.whole_gpu_as_shards else stack.gres("gpu", 1)
    assert job_field(stack.show_job(third), "TresPerNode") == whole
    stack.run("scancel", str(third))
