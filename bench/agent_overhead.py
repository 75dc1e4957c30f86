"""CPU cost of one agent sample, on the fake NVML, with K jobs and P job processes.

Runs ``Agent.sample_once`` N times in this process and reports process CPU time per sample
for: idle (no jobs), K jobs without GPU processes, and K jobs with P real processes (``sleep``
children carrying SLURM_JOB_ID, each holding fake GPU memory), and the share of the last case
spent reading the fake devices. Attribution reads /proc/<pid>/stat of every GPU process every
sample (cgroup/environ only for a pid not seen before), as in production. The fake reads
files where real NVML makes driver calls, so on a GPU node the read share differs.

    .venv/bin/python bench/agent_overhead.py [--samples 200] [--jobs 8] [--procs 32] [--gpus 8]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

from policy_service.config import AgentConfig, NvmlBackend
from slurm_plugin.agent.daemon import Agent
from slurm_plugin.gpu.nvml_fake import FakeNvmlTelemetry, create_fake_gpus, fake_alloc

GIB = 1024**3


def _cpu_per_sample_s(agent: Agent, samples: int) -> float:
    agent.sample_once()  # warm caches (device identity)
    start_s = time.process_time()
    for _ in range(samples):
        agent.sample_once()
    return (time.process_time() - start_s) / samples


def _cpu_per_read_s(agent: Agent, samples: int) -> float:
    """CPU of the telemetry reads alone (what NVML would do), for the same sample."""
    start_s = time.process_time()
    for _ in range(samples):
        agent._observe()  # noqa: SLF001 - the bench splits the sample into its parts
    return (time.process_time() - start_s) / samples


def _spawn_job_processes(root: Path, jobs: int, procs: int, gpus: int) -> list[subprocess.Popen]:
    children = []
    for i in range(procs):
        job_id = 1000 + i % jobs
        env = dict(os.environ, SLURM_JOB_ID=str(job_id))
        child = subprocess.Popen(["sleep", "600"], env=env)
        children.append(child)
        fake_alloc(root, (job_id - 1000) % gpus, child.pid, GIB)
    return children


def run(samples: int, jobs: int, procs: int, gpus: int) -> list[tuple[str, float]]:
    with tempfile.TemporaryDirectory(prefix="sa-bench-") as tmp:
        root = Path(tmp) / "gpus"
        create_fake_gpus(root, gpus, 80 * GIB)
        cfg = AgentConfig(nvml_backend=NvmlBackend.FAKE, fake_nvml_dir=root, sample_period_s=1.0)
        agent = Agent(cfg, FakeNvmlTelemetry(root), kernel_log=None)
        results = [("idle (no jobs)", _cpu_per_sample_s(agent, samples))]
        for k in range(jobs):
            agent.start(1000 + k, [k % gpus], os.getuid())  # the bench processes run as this user
        results.append((f"{jobs} jobs, 0 GPU processes", _cpu_per_sample_s(agent, samples)))
        children = _spawn_job_processes(root, jobs, procs, gpus)
        try:
            results.append((f"{jobs} jobs, {procs} GPU processes", _cpu_per_sample_s(agent, samples)))
            results.append(("  of which fake NVML reads", _cpu_per_read_s(agent, samples)))
            telemetry = agent.stop(1000)
            assert telemetry["peak_bytes"] > 0, "bench processes were not attributed"
        finally:
            for child in children:
                child.kill()
                child.wait()
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--procs", type=int, default=32)
    parser.add_argument("--gpus", type=int, default=8)
    args = parser.parse_args()
    print(f"fake NVML, {args.gpus} GPUs, {args.samples} samples per case")
    print(f"{'case':<32} {'CPU/sample':>12} {'CPU share at 1 s period':>24}")
    for name, cpu_s in run(args.samples, args.jobs, args.procs, args.gpus):
        print(f"{name:<32} {cpu_s * 1e3:>9.3f} ms {cpu_s / 1.0 * 100:>22.3f} %")


if __name__ == "__main__":
    main()
