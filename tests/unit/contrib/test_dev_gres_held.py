"""The dev cluster's check after a slurmctld restart (contrib/dev-cluster/nodes.sh): a node whose
GresUsed counts GPUs while no job runs there fails the restart, naming it (docs/slurm-releases.md:
what a restarted 22.05 slurmctld once left). Run with squeue and scontrol stand-ins (shell
functions) giving the texts the releases print."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

NODES = Path(__file__).resolve().parents[3] / "contrib" / "dev-cluster" / "nodes.sh"


def held(gres_used: str, jobs: str = "") -> str | None:
    """What gpus_held_by_no_job prints for a node with this GresUsed and these jobs (None: fails)."""
    script = (f"source {NODES}\n"
              f"squeue() {{ printf '%s' {jobs!r}; }}\n"
              f"scontrol() {{ echo '   Gres=gpu:a100:2(S:0) GresDrain=N/A GresUsed={gres_used}'; }}\n"
              "gpus_held_by_no_job n1")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert not out.stderr, out.stderr
    return out.stdout.strip() if out.returncode == 0 else None


@pytest.mark.parametrize("gres_used", ["gpu:a100:2(IDX:0-1),gpu:h100:0(IDX:N/A)", "gpu:1(IDX:0)",
                                       "gpu:h100:0(IDX:N/A),gpu:a100:1(IDX:1),shard:a100:0(0/8,0/8)",
                                       "shard:0,gpu:12(IDX:0-11)"])
def test_gpus_held_by_no_job_are_named(gres_used):
    assert held(gres_used) == gres_used


@pytest.mark.parametrize("gres_used", ["gpu:a100:0(IDX:N/A),gpu:h100:0(IDX:N/A)", "gpu:0",
                                       "gpu:0(IDX:N/A),shard:a100:3(3/8,0/8)", "(null)", "shard:2"])
def test_no_gpu_counted_is_no_finding(gres_used):
    assert held(gres_used) is None


def test_gpus_held_by_a_running_job_are_no_finding():
    assert held("gpu:a100:2(IDX:0-1)", jobs="42\n") is None
