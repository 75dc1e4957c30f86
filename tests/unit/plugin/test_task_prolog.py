"""TaskProlog export lines, table-driven over job environment and enforcement mode."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from policy_service.config import DEFAULT_CONFIG_PATH, GIB, AgentConfig, Config, Enforcement, GpuConfig, NvmlBackend
from slurm_plugin.gpu.nvml_fake import create_fake_gpus
from slurm_plugin import task_prolog
from slurm_plugin.task_prolog import inherited_gpu_lines, task_prolog_lines


def _cfg(mode: Enforcement, shards_per_gpu: int = 8, memory_bytes: int = 80 * GIB) -> Config:
    return Config(gpu=GpuConfig(memory_bytes=memory_bytes, shards_per_gpu=shards_per_gpu),
                  agent=AgentConfig(enforcement=mode, mps_pipe_dir=Path("/run/mps")))


FW, MPS, NONE = Enforcement.FRAMEWORK_ENV, Enforcement.MPS, Enforcement.NONE


def _framework(cap_bytes: int, fraction: float, jax: float | None = None) -> list[str]:
    return [
        f"export SWAPAWARE_GPU_MEM_LIMIT_BYTES={cap_bytes}",
        f"export SWAPAWARE_GPU_MEM_FRACTION={fraction}",
        "export TF_FORCE_GPU_ALLOW_GROWTH=true",
        f"export XLA_PYTHON_CLIENT_MEM_FRACTION={fraction if jax is None else jax}",
    ]


MPS_20G = ["export CUDA_MPS_PIPE_DIRECTORY=/run/mps", "export CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M"]

CASES = [
    # (id, env, mode, mps pipe dir exists, expected lines)
    ("whole-gpu job", {"CUDA_VISIBLE_DEVICES": "0"}, FW, True, []),
    ("zero shards", {"SLURM_SHARDS_ON_NODE": "0"}, FW, True, []),
    ("garbage shards", {"SLURM_SHARDS_ON_NODE": "two"}, FW, True, []),
    ("enforcement none", {"SLURM_SHARDS_ON_NODE": "2"}, NONE, True, []),
    ("2 of 8 shards", {"SLURM_SHARDS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": "0"}, FW, True,
     _framework(20 * GIB, 0.25)),
    ("3 of 8 shards", {"SLURM_SHARDS_ON_NODE": "3"}, FW, False, _framework(30 * GIB, 0.375)),
    ("more shards than a gpu", {"SLURM_SHARDS_ON_NODE": "12"}, FW, False, _framework(80 * GIB, 1.0)),
    ("user jax fraction stricter kept", {"SLURM_SHARDS_ON_NODE": "2", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.1"},
     FW, False, _framework(20 * GIB, 0.25, jax=0.1)),
    ("user jax fraction looser replaced", {"SLURM_SHARDS_ON_NODE": "2", "XLA_PYTHON_CLIENT_MEM_FRACTION": ".9"},
     FW, False, _framework(20 * GIB, 0.25)),
    ("user jax fraction unreadable replaced", {"SLURM_SHARDS_ON_NODE": "2", "XLA_PYTHON_CLIENT_MEM_FRACTION": "x"},
     FW, False, _framework(20 * GIB, 0.25)),
    ("mps with daemon", {"SLURM_SHARDS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": "0"}, MPS, True,
     _framework(20 * GIB, 0.25) + MPS_20G),
    ("mps, gpu remapped by cgroup still ordinal 0", {"SLURM_SHARDS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": "3"},
     MPS, True, _framework(20 * GIB, 0.25) + MPS_20G),
    ("mps without daemon", {"SLURM_SHARDS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": "0"}, MPS, False,
     _framework(20 * GIB, 0.25)),
    ("mps, two gpus visible: no per-device split", {"SLURM_SHARDS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": "0,1"},
     MPS, True, _framework(20 * GIB, 0.25)),
    ("mps, no gpu variables", {"SLURM_SHARDS_ON_NODE": "2"}, MPS, True, _framework(20 * GIB, 0.25)),
]


@pytest.mark.parametrize("env, mode, pipe_dir_exists, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_task_prolog_lines(env, mode, pipe_dir_exists, expected) -> None:
    assert task_prolog_lines(env, _cfg(mode), pipe_dir_exists) == expected


@pytest.mark.parametrize("shards, shards_per_gpu, memory_bytes, cap_bytes, fraction, mps_mib", [
    (1, 3, 3 * 1000**3, 1000**3, 0.333, 953),  # fractions round down, MiB round down
    (1, 7, 141 * 1000**3, 141 * 1000**3 // 7, 0.142, 19209),
    (29, 100, 100 * 1000**3, 29 * 1000**3, 0.29, 27656),
])
def test_caps_round_down(shards, shards_per_gpu, memory_bytes, cap_bytes, fraction, mps_mib) -> None:
    cfg = _cfg(MPS, shards_per_gpu, memory_bytes)
    lines = task_prolog_lines({"SLURM_SHARDS_ON_NODE": str(shards), "CUDA_VISIBLE_DEVICES": "0"}, cfg, True)
    assert lines[0] == f"export SWAPAWARE_GPU_MEM_LIMIT_BYTES={cap_bytes}"
    assert lines[1] == f"export SWAPAWARE_GPU_MEM_FRACTION={fraction}"
    assert lines[-1] == f"export CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={mps_mib}M"


def test_on_a_mixed_fleet_the_cap_is_the_charge_and_fractions_are_of_the_jobs_own_gpu(tmp_path: Path) -> None:
    """10 GiB shards on 40, 48 and 80 GiB GPUs: 2 shards are 20 GiB everywhere, half of a 40 GiB GPU."""
    create_fake_gpus(tmp_path / "gpus", 4, [40 * GIB, 48 * GIB, 80 * GIB, 80 * GIB])
    cfg = replace(_cfg(FW), agent=AgentConfig(enforcement=FW, nvml_backend=NvmlBackend.FAKE,
                                              fake_nvml_dir=tmp_path / "gpus"))
    on = {"SLURM_SHARDS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": "0"}
    assert task_prolog.job_gpu_bytes(on, cfg) == 40 * GIB
    assert task_prolog.job_gpu_bytes({**on, "SLURM_JOB_GPUS": "2"}, cfg) == 80 * GIB  # the node's index first
    assert task_prolog.job_gpu_bytes({"CUDA_VISIBLE_DEVICES": "0"}, cfg) is None  # not a shard job
    assert task_prolog.job_gpu_bytes({**on, "CUDA_VISIBLE_DEVICES": "9"}, cfg) is None  # no such device
    assert task_prolog_lines(on, cfg, False, device_bytes=40 * GIB) == _framework(20 * GIB, 0.5)
    assert task_prolog_lines({**on, "CUDA_VISIBLE_DEVICES": "1"}, cfg, False, device_bytes=48 * GIB) == \
        _framework(20 * GIB, 0.416)
    assert task_prolog_lines(on, cfg, False, device_bytes=80 * GIB) == _framework(20 * GIB, 0.25)
    assert task_prolog_lines({**on, "SLURM_SHARDS_ON_NODE": "5"}, cfg, False, device_bytes=40 * GIB) == \
        _framework(40 * GIB, 1.0)  # never more than the GPU


@pytest.mark.skipif(DEFAULT_CONFIG_PATH.exists(), reason="a site config exists on this machine")
def test_main_prints_lines_and_ignores_user_overrides() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWAPAWARE_", "SLURM_"))}
    env.update(SLURM_SHARDS_ON_NODE="4", SWAPAWARE_AGENT__ENFORCEMENT="none", SWAPAWARE_CONFIG="/nonexistent")
    done = subprocess.run([sys.executable, "-m", "slurm_plugin.task_prolog"], env=env, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    # stdout holds only what Slurm applies to the task's environment: nothing reaches the task's output
    assert done.stdout.splitlines() == _framework(40 * GIB, 0.5)
    assert done.stderr == ""  # slurmstepd would discard it: the cap goes to the node's syslog


@pytest.mark.skipif(DEFAULT_CONFIG_PATH.exists(), reason="a site config exists on this machine")
@pytest.mark.parametrize("step, localid, says", [
    (None, None, True), ("batch", "0", True), ("4294967291", "0", True),  # the batch step
    ("0", "0", False), ("3", "1", False), ("batch", "1", False),  # srun steps, other tasks
])
def test_only_the_batch_step_logs_what_cap_the_job_has(step, localid, says, monkeypatch, capsys) -> None:
    for k in [k for k in os.environ if k.startswith(("SWAPAWARE_", "SLURM_"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_SHARDS_ON_NODE", "4")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    for k, v in (("SLURM_STEP_ID", step), ("SLURM_LOCALID", localid)):
        if v is not None:
            monkeypatch.setenv(k, v)
    logged: list[str] = []
    assert task_prolog.main(log=logged.append) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == _framework(40 * GIB, 0.5) and out.err == ""  # every task gets its environment
    assert logged == (["job 77: swapaware: GPU memory share 40960 MiB is ADVISORY (not enforced on this node): "
                       "stay within it"] if says else [])


@pytest.mark.parametrize("env, unset", [
    ({"SLURM_SHARDS_ON_NODE": "1", "SLURM_TRES_BIND": "gres/gpu:per_task:1"}, True),  # 26.05 --gpus-per-task
    ({"SLURM_SHARDS_ON_NODE": "1", "SLURM_TRES_BIND": "gres/gpu:closest"}, False),  # typed by a user
    ({"SLURM_SHARDS_ON_NODE": "1"}, False),
    ({"SLURM_TRES_BIND": "gres/gpu:per_task:1"}, False),  # a job that holds its GPUs keeps its binding
])
def test_a_shard_job_does_not_hand_slurms_own_gpu_binding_to_its_steps(env, unset) -> None:
    assert inherited_gpu_lines(env) == (["unset SLURM_TRES_BIND"] if unset else [])


def test_the_wrappers_config_names_the_nodes_gpus(tmp_path: Path, monkeypatch, capsys) -> None:
    """``--config`` from the admin's wrapper (the dev stack's): fractions of the job's own 40 GiB GPU."""
    create_fake_gpus(tmp_path / "gpus", 2, [40 * GIB, 80 * GIB])
    conf = tmp_path / "swapaware.toml"
    conf.write_text(f'[agent]\nenforcement = "framework_env"\nnvml_backend = "fake"\n'
                    f'fake_nvml_dir = "{tmp_path / "gpus"}"\n')
    for k in [k for k in os.environ if k.startswith(("SWAPAWARE_", "SLURM_", "CUDA_"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_SHARDS_ON_NODE", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert task_prolog.main(log=lambda _: None, argv=["--config", str(conf)]) == 0
    assert capsys.readouterr().out.splitlines() == _framework(20 * GIB, 0.5)


# ---------------------------------------------------------------- the requeue notice
SHOWN = ("JobId=77 JobName=grows UserId=alice(1000) Restarts=1 AdminComment=swapaware: id=0123abcd model=m "
         "action=whole_gpu shards=8 why=oom_requeued,whole_gpu_as_shards sf=10 StdErr={err} StdIn=/dev/null "
         "StdOut={err}")
BATCH_ENV = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1", "SLURM_STEP_ID": "batch", "SLURM_LOCALID": "0"}


def test_the_rerun_of_a_requeued_job_gets_one_line_in_its_stderr(tmp_path):
    err = tmp_path / "slurm-77.out"
    err.write_text("job output so far\n")
    asked = []
    notice = task_prolog.requeue_notice(BATCH_ENV, lambda j: asked.append(j) or SHOWN.format(err=err))
    assert asked == ["77"] and notice[0] == str(err)
    task_prolog.write_notice(notice, log=lambda m: pytest.fail(m))
    lines = err.read_text().splitlines()
    assert lines[0] == "job output so far" and len(lines) == 2
    assert lines[1].startswith("swapaware: job 77 ran out of GPU memory on a shared GPU and was requeued") \
        and "decision 0123abcd" in lines[1]


@pytest.mark.parametrize("env, shown", [
    ({**BATCH_ENV, "SLURM_RESTART_COUNT": "0"}, SHOWN),           # never requeued: Slurm is not asked
    ({k: v for k, v in BATCH_ENV.items() if k != "SLURM_RESTART_COUNT"}, SHOWN),
    ({**BATCH_ENV, "SLURM_STEP_ID": "0"}, SHOWN),                 # an srun step: not again
    ({**BATCH_ENV, "SLURM_LOCALID": "1"}, SHOWN),                 # another task of the batch step
    (BATCH_ENV, SHOWN.replace("oom_requeued,", "")),              # requeued for another reason (node failure)
    (BATCH_ENV, ""),                                              # scontrol failed
])
def test_no_notice_for_any_other_task(env, shown, tmp_path):
    asked = []
    assert task_prolog.requeue_notice(env, lambda j: asked.append(j) or shown.format(err=tmp_path / "e")) is None
    if env.get("SLURM_RESTART_COUNT", "0") == "0":
        assert asked == []


def test_a_notice_that_cannot_be_written_is_logged_not_raised(tmp_path):
    (tmp_path / "real").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    logged = []
    task_prolog.write_notice((str(tmp_path / "link"), "x\n"), logged.append)  # O_NOFOLLOW
    task_prolog.write_notice((str(tmp_path / "missing" / "e"), "x\n"), logged.append)
    assert len(logged) == 2 and (tmp_path / "real").read_text() == ""


@pytest.mark.parametrize("step", ["batch", "4294967291", "-5"])  # 22.05 / 24.11 / 26.05 spellings
def test_the_batch_step_of_every_release_and_stderr_in_the_output_file(step, tmp_path):
    out = tmp_path / "slurm-77.out"
    shown = SHOWN.replace("StdErr={err}", "StdErr=").format(err=out)  # 26.05: no StdErr of its own
    notice = task_prolog.requeue_notice({**BATCH_ENV, "SLURM_STEP_ID": step}, lambda j: shown)
    assert notice is not None and notice[0] == str(out)
