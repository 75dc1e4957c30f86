"""A mixed fleet on the real cluster: the dev node's fake GPUs hold 40, 48 and 80 GiB, each
enforcing its own size (an allocation beyond it fails, as CUDA's would), with 4, 4 and 8 shards
of 10 GiB (cluster.sh gpus). No shared job gets less memory than its charge on any GPU: jobs that
each allocate all of their charge all complete, the 80 GiB GPUs hold two where the others hold
one, and typed requests share within their type."""
import sys
import uuid
from pathlib import Path

import pytest

from slurm_plugin.gpu.nvml_fake import FakeNvmlTelemetry
from tests.slurm_stack import dev_fleet
from tests.waiting import wait_for

from .conftest import GIB, decision_of, job_field

pytestmark = pytest.mark.integration

HOLD_S = 20


def _charge_script(stack) -> str:
    """Allocates exactly the charge the TaskProlog gave the job, on its GPU, and holds it."""
    return f"""#!/bin/bash
echo "gpu=$CUDA_VISIBLE_DEVICES shards=$SLURM_SHARDS_ON_NODE cap=$SWAPAWARE_GPU_MEM_LIMIT_BYTES \\
fraction=$SWAPAWARE_GPU_MEM_FRACTION"
exec {Path(sys.executable)} -m slurm_plugin.gpu.nvml fake-alloc --root {stack.state}/node/fake-nvml \\
    --gpu "${{CUDA_VISIBLE_DEVICES%%,*}}" --bytes "$SWAPAWARE_GPU_MEM_LIMIT_BYTES" --hold-seconds {HOLD_S}
"""


@pytest.fixture
def mixed():
    fleet = dev_fleet()
    if len({gib for _, _, gib in fleet}) == 1:
        pytest.skip(f"the dev fleet is uniform on this release (cluster.sh gpus: {fleet})")
    return fleet


def test_every_shared_job_gets_its_charge_on_gpus_of_every_size(stack, mixed):
    fleet = mixed
    name = f"mixed-{uuid.uuid4().hex[:6]}"
    jobs = [stack.sbatch(_charge_script(stack), "--hold", "--gres=gpu:1", "--comment=swapaware:mem=25G",
                         f"--job-name={name}", f"--output={stack.state}/jobs/{name}-%j.out") for _ in range(8)]
    try:
        decisions = [decision_of(job_field(stack.show_job(j), "AdminComment")) for j in jobs]
        assert {d["action"] for d in decisions} == {"share"}, decisions
        k = int(decisions[0]["shards"])
        assert k in (3, 4), decisions[0]  # 25 GiB and its margin in 10 GiB shards: 1 per 40/48 GiB GPU, 2 per 80
        stack.run("scontrol", "release", ",".join(map(str, jobs)))
        gpus = FakeNvmlTelemetry(stack.state / "node" / "fake-nvml")
        want = [(shards // k) * k * 10 * GIB for _, shards, _ in fleet]  # jobs a GPU holds x their charge

        def packed() -> list[int] | None:
            used = [gpus.memory(i).used_bytes for i in range(len(fleet))]
            return used if used == want else None

        wait_for(packed, 60, lambda: f"every GPU to hold its jobs' charges {want}: "
                 f"{[gpus.memory(i).used_bytes for i in range(len(fleet))]}", 0.5)
        states = [stack.wait_done(j, timeout_s=180) for j in jobs]
        assert states == ["COMPLETED"] * len(jobs), states  # no allocation of a charge failed
        for j in jobs:
            line = (stack.state / "jobs" / f"{name}-{j}.out").read_text().splitlines()[0]
            fields = dict(kv.split("=", 1) for kv in line.split())
            gib = fleet[int(fields["gpu"])][2]
            assert (int(fields["shards"]), int(fields["cap"])) == (k, k * 10 * GIB), line
            assert float(fields["fraction"]) == int(k * 10 * 1000 / gib) / 1000, (line, gib)  # of its own GPU
    finally:
        stack.run("scancel", *map(str, jobs), check=False)


@pytest.mark.parametrize("request_args, expected", [
    (("--gres=gpu:a100:1", "--comment=swapaware:mem=25G"), ("share", "shard", "a100")),
    (("--gres=gpu:a100:1", "--comment=swapaware:mem=45G"), ("whole_gpu", "gpu", "a100")),  # > the a100s' 40 GiB
    (("--gres=gpu:1", "--comment=swapaware:mem=45G"), ("share", "shard", "")),  # only an 80 GiB GPU takes it
    (("--gres=gpu:h100:1", "--comment=swapaware:mem=45G"), ("share", "shard", "h100")),
])
def test_a_job_is_sized_for_the_gpus_it_can_land_on(stack, mixed, request_args, expected):
    info = stack.held("#!/bin/sh\ntrue\n", *request_args, f"--job-name=sized-{uuid.uuid4().hex[:6]}")
    d = decision_of(job_field(info, "AdminComment"))
    action, gres, gpu_type = expected
    assert d["action"] == action, d
    if action == "share":
        assert job_field(info, "TresPerNode") == stack.gres(gres, int(d["shards"]), gpu_type), info
        assert int(d["shards"]) * 10 <= max(gib for t, _, gib in mixed if t == gpu_type or not gpu_type)
    else:
        assert "too_large_to_share" in d["why"], d
