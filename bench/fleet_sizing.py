"""Shards on a mixed fleet, measured on the dev cluster: one real Slurm with fake GPUs of 40, 48
and 80 GiB (each refusing allocations beyond its own size, as CUDA would), three ways to cut them
into shards, side by side in one run:

  * ``unit``: a shard is 10 GiB on every GPU (gres.conf Count 4/4/8/8; what swapaware ships);
  * ``slots-largest``: 8 shards on every GPU, sized for the 80 GiB GPUs (a shard "is" 10 GiB);
  * ``slots-smallest``: 8 shards on every GPU, sized for the 40 GiB GPUs (a shard "is" 5 GiB).

Per scheme, ``--jobs`` copies of a job whose class is known to need ``--gib`` (a hint) are
submitted held, released together, and each allocates on its GPU exactly the cap the TaskProlog
gave it, holding it ``--hold-s`` seconds. Printed per scheme: the shards each job got, the most
charges each GPU held at once (a job whose allocation failed holds none), and how many jobs
completed and how many failed because their GPU had no room for their charge (a job that got less
than its charge).

    .venv/bin/python bench/fleet_sizing.py            # as root, the host's Slurm
    bash contrib/matrix/run.sh 24.11 bash -c '"$SWAPAWARE_VENV/bin/python" bench/fleet_sizing.py'
"""
from __future__ import annotations

import argparse
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slurm_plugin.gpu.nvml_fake import FakeNvmlTelemetry  # noqa: E402
from tests.slurm_stack import decision_of, job_field, start_stack  # noqa: E402

GIB = 1 << 30
SIZES = "40,48,80,80"
SCHEMES = {  # name -> (GiB per shard as the config and the dev stack take it, per-GPU counts or "" for memory/unit)
    "unit": ("10", ""),
    "slots-largest": ("10", "8,8,8,8"),
    "slots-smallest": ("5", "8,8,8,8"),
}
PORTS = {"SWAPAWARE_CTLD_PORT": "26817", "SWAPAWARE_SLURMD_PORT": "26818", "SWAPAWARE_DBD_PORT": "26819",
         "SWAPAWARE_DB_PORT": "26816", "SWAPAWARE_GRPC_PORT": "56651"}


@dataclass(frozen=True)
class Result:
    scheme: str
    shards: int
    per_gpu_max: tuple[int, ...]
    completed: int
    failed: int


def _script(state: Path, hold_s: float) -> str:
    return f"""#!/bin/bash
exec {Path(sys.executable)} -m slurm_plugin.gpu.nvml fake-alloc --root {state}/node/fake-nvml \\
    --gpu "${{CUDA_VISIBLE_DEVICES%%,*}}" --bytes "$SWAPAWARE_GPU_MEM_LIMIT_BYTES" --hold-seconds {hold_s}
"""


def run_scheme(name: str, state: Path, jobs: int, gib: float, hold_s: float) -> Result:
    shard_gib, counts = SCHEMES[name]
    stack = start_stack(state, PORTS, SWAPAWARE_DEV_GPU_GIB=SIZES, SWAPAWARE_DEV_SHARD_GIB=shard_gib,
                        SWAPAWARE_DEV_GPU_SHARDS=counts)
    try:
        ids = [stack.sbatch(_script(state, hold_s), "--hold", "--gres=gpu:1", f"--comment=swapaware:mem={gib}G",
                            f"--job-name=fleet-{uuid.uuid4().hex[:6]}") for _ in range(jobs)]
        shards = int(decision_of(job_field(stack.show_job(ids[0]), "AdminComment")).get("shards", 0))
        stack.run("scontrol", "release", ",".join(map(str, ids)))
        gpus = FakeNvmlTelemetry(state / "node" / "fake-nvml")
        charge = shards * int(float(shard_gib) * GIB)
        most = [0] * 4
        deadline = time.monotonic() + 120 + 2 * hold_s * jobs
        while time.monotonic() < deadline:
            for i in range(4):
                most[i] = max(most[i], gpus.memory(i).used_bytes // charge if charge else 0)
            done = stack.run("squeue", "-h", "-j", ",".join(map(str, ids)), "-o", "%i", check=False).stdout.split()
            if not done:
                break
            time.sleep(0.25)
        states = [stack.wait_done(j, timeout_s=60) for j in ids]
        return Result(name, shards, tuple(most), states.count("COMPLETED"), len(states) - states.count("COMPLETED"))
    finally:
        stack.stack("down", "--purge")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--gib", type=float, default=25.0, help="the jobs' memory hint, GiB")
    parser.add_argument("--hold-s", type=float, default=8.0)
    parser.add_argument("--state", type=Path, default=Path("/var/tmp/swapaware-bench-fleet"))
    args = parser.parse_args(argv)
    print(f"fleet {SIZES} GiB, {args.jobs} jobs of {args.gib:g} GiB (hint), each allocating its cap")
    print(f"{'scheme':<16}{'shards/job':>11}  {'charges held at once per GPU (40/48/80/80)':<40}{'completed':>10}"
          f"{'failed':>8}")
    for name in SCHEMES:
        r = run_scheme(name, args.state, args.jobs, args.gib, args.hold_s)
        print(f"{r.scheme:<16}{r.shards:>11}  {'/'.join(map(str, r.per_gpu_max)):<40}{r.completed:>10}{r.failed:>8}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
