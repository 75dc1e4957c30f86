"""bench/gpu/oom_requeue.py rehearsed without a GPU: the fake NVML's allocator refuses beyond the
share the TaskProlog hands down, the real service infers the OOM and asks Slurm for the requeue."""
import json
import subprocess
import sys
from pathlib import Path

from slurm_plugin.gpu.nvml_fake import create_fake_gpus

ROOT = Path(__file__).resolve().parents[3]


def test_the_gpu_check_of_the_requeue_passes_on_fake_nvml(tmp_path):
    create_fake_gpus(tmp_path / "gpus", 1, 80 * 1024 ** 3)
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "oom_requeue.py"), "--fake-nvml",
                        str(tmp_path / "gpus"), "--out", str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    (path,) = (tmp_path / "out").glob("oom-requeue-*.json")
    result = json.loads(path.read_text())
    assert result["ok"] and set(result["checks"]) == {"shared_one_shard", "cuda_oom", "oom_inferred",
                                                      "requeued_whole", "rerun_completes"}
    assert [c[0] for c in result["requeue_calls"]] == ["requeuehold", "update", "release"]
    assert result["observation"]["peak_bytes"] >= 0.95 * result["observation"]["charge_bytes"]


def test_a_share_the_job_stays_within_is_not_requeued(tmp_path):
    """The same run on a GPU too small for the 1 GiB more: the whole rerun fails, and the check says so."""
    create_fake_gpus(tmp_path / "gpus", 1, 10 * 1024 ** 3 + 512 * 1024 ** 2)
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "oom_requeue.py"), "--fake-nvml",
                        str(tmp_path / "gpus"), "--out", str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1
    result = json.loads(next((tmp_path / "out").glob("oom-requeue-*.json")).read_text())
    assert result["checks"]["rerun_completes"] is False
