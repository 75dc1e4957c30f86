"""cli_filter's step mending (slurm_plugin/swapaware_cli.lua) run by the real Lua 5.1, with an
options object that behaves as Slurm's (string-only assignment). Option values are the ones
srun's cli_filter saw on 22.05, 24.11 and 26.05 (docs/slurm-releases.md)."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DRIVER = Path(__file__).parents[1] / "cli_driver.lua"

if shutil.which("lua5.1") is None:
    if os.environ.get("CI"):
        raise RuntimeError("lua5.1 is missing: contrib/dev-cluster/cluster.sh install provides it")
    pytest.skip("lua5.1 not installed (run contrib/dev-cluster/cluster.sh install)", allow_module_level=True)

IN_SHARD_JOB = {"SLURM_JOB_ID": "12", "SLURM_SHARDS_ON_NODE": "2", "SLURM_JOB_GPUS": "0"}
IN_GPU_JOB = {"SLURM_JOB_ID": "13", "SLURM_JOB_GPUS": "0", "SLURM_GPUS_ON_NODE": "1"}


def run_cases(cases: list[dict]) -> dict:
    r = subprocess.run(["lua5.1", str(DRIVER), str(ROOT / "slurm_plugin")], input=json.dumps(cases),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


CASES = [
    # (options srun's cli_filter sees, environment, mended?, gres after, gpu options after)
    ({"type": "srun", "gres": "gres/gpu:1"}, IN_SHARD_JOB, True, "shard:2", {}),
    ({"type": "srun", "gres": "gres:gpu:1"}, IN_SHARD_JOB, True, "shard:2", {}),  # 22.05 spelling
    ({"type": "srun", "gpus": "1"}, IN_SHARD_JOB, True, "shard:2", {"gpus": ""}),
    ({"type": "srun", "gpus-per-task": "1"}, IN_SHARD_JOB, True, "shard:2", {"gpus-per-task": ""}),
    ({"type": "srun", "gpus-per-node": "1"}, IN_SHARD_JOB, True, "shard:2", {"gpus-per-node": ""}),
    ({"type": "srun", "gres": "gres/gpu:1,gres/nvme:1"}, IN_SHARD_JOB, True, "gres/nvme:1,shard:2", {}),
    ({"type": "srun", "gres": "gres/gpu:1,gres/shard:1"}, IN_SHARD_JOB, True, "shard:2", {}),
    # a plain step: Slurm refuses it in a job holding typed shards (22.05, 26.05), so it asks for the
    # job's shards, which gives the same GPU in an untyped one
    ({"type": "srun"}, IN_SHARD_JOB, True, "shard:2", {}),
    ({"type": "srun", "ntasks": "2"}, IN_SHARD_JOB, True, "shard:2", {}),
    # a --gpu-bind cannot be taken away (srun refuses an empty one): it stays; a job whose script
    # binds GPUs keeps its GPU request (swapaware_facts.script_binds_gpus)
    ({"type": "srun", "gpu-bind": "closest"}, IN_SHARD_JOB, True, "shard:2", {"gpu-bind": "closest"}),
    ({"type": "srun", "gpus": "h100:1", "gpu-bind": "single:1"}, IN_SHARD_JOB, True, "shard:2",
     {"gpus": "", "gpu-bind": "single:1"}),
    ({"type": "srun", "gpu-bind": "closest"}, IN_GPU_JOB, False, None, {"gpu-bind": "closest"}),
    # more GPUs than the job holds: left for Slurm to refuse, as without swapaware
    ({"type": "srun", "ntasks": "2", "gpus-per-task": "1"}, IN_SHARD_JOB, False, None, {"gpus-per-task": "1"}),
    ({"type": "srun", "gpus-per-task": "1"}, {**IN_SHARD_JOB, "SLURM_NTASKS": "2"}, False, None,
     {"gpus-per-task": "1"}),
    ({"type": "srun", "gpus": "2"}, IN_SHARD_JOB, False, None, {"gpus": "2"}),
    ({"type": "srun", "gres": "gres/gpu:h100:2"}, IN_SHARD_JOB, False, "gres/gpu:h100:2", {}),
    ({"type": "srun", "ntasks": "2", "tres-per-task": "gres/gpu=1"}, IN_SHARD_JOB, False, None,
     {"tres-per-task": "gres/gpu=1"}),
    ({"type": "srun", "gpus-per-task": "1"}, {**IN_SHARD_JOB, "SLURM_GPUS_ON_NODE": "1", "SLURM_NTASKS": "1"}, True,
     "shard:2", {"gpus-per-task": ""}),
    # --gres=gpu:1 in a --gpus-per-task=1 job (22.05 hands the step the job's option too): one GPU
    ({"type": "srun", "gres": "gres:gpu:1", "gpus-per-task": "1", "ntasks": "1"}, IN_SHARD_JOB, True, "shard:2",
     {"gpus-per-task": ""}),
    # the step names its own GRES: as typed
    ({"type": "srun", "gres": "gres/nvme:1"}, IN_SHARD_JOB, False, "gres/nvme:1", {}),
    ({"type": "srun", "gres": "gres/shard:1"}, IN_SHARD_JOB, False, "gres/shard:1", {}),
    ({"type": "srun", "gres": "none"}, IN_SHARD_JOB, False, "none", {}),
    ({"type": "srun", "gpus": "0"}, IN_SHARD_JOB, False, None, {"gpus": "0"}),
    # Slurm's "unset" is no value
    ({"type": "srun", "gres": "unset", "gpus": "unset", "gpu-bind": "unset"}, IN_SHARD_JOB, True, "shard:2", {}),
    ({"type": "srun", "gres": "gres/gpu:0"}, IN_SHARD_JOB, False, "gres/gpu:0", {}),
    ({"type": "srun", "gres": "gres/gpu:1"}, IN_GPU_JOB, False, "gres/gpu:1", {}),  # the job holds a gpu
    ({"type": "srun", "gres": "gres/gpu:1"}, {}, False, "gres/gpu:1", {}),  # not inside a job
    ({"type": "sbatch", "gres": "gres/gpu:1"}, IN_SHARD_JOB, False, "gres/gpu:1", {}),  # a new job
    ({"type": "salloc", "gpus": "1"}, IN_SHARD_JOB, False, None, {"gpus": "1"}),
    # 23.11+: a plain srun inherits the job's --gpus-per-task as --tres-per-task
    ({"type": "srun", "tres-per-task": "gres/gpu=1"}, IN_SHARD_JOB, True, "shard:2", {"tres-per-task": ""}),
    ({"type": "srun", "tres-per-task": "cpu=2,gres/gpu=1"}, IN_SHARD_JOB, True, "shard:2", {"tres-per-task": "cpu=2"}),
    ({"type": "srun", "tres-per-task": "cpu=2"}, IN_SHARD_JOB, True, "shard:2", {"tres-per-task": "cpu=2"}),
    ({"type": "srun", "tres-per-task": "gres/gpu=1"}, IN_GPU_JOB, False, None, {"tres-per-task": "gres/gpu=1"}),
    # 26.05: it also inherits the binding Slurm gave --gpus-per-task, to GPUs the job does not hold
    ({"type": "srun", "tres-per-task": "gres/gpu=1", "tres-bind": "gres/gpu:per_task:1"}, IN_SHARD_JOB, True,
     "shard:2", {"tres-per-task": "", "tres-bind": ""}),
    ({"type": "srun", "gres": "gres/gpu:1", "tres-bind": "gres/gpu:closest"}, IN_SHARD_JOB, True, "shard:2",
     {"tres-bind": "gres/gpu:closest"}),  # not Slurm's own: left as the user typed it
]


@pytest.mark.parametrize("options,env,mended,gres,after", CASES)
def test_steps_that_ask_for_gpus_inside_a_shard_job_ask_for_its_shards(options, env, mended, gres, after):
    out = run_cases([{"options": options, "env": env}])
    res = out["results"][0]
    assert res["mended"] is mended
    assert res["options"].get("gres") == gres
    for key, value in after.items():
        assert res["options"].get(key) == value
    if mended:
        assert any("swapaware" in line and gres in line for line in out["verbose"])


@pytest.mark.parametrize("options,marked,comment", [
    ({"type": "sbatch", "test-only": "set"}, True, "swapaware:test-only"),
    ({"type": "srun", "test-only": "set", "comment": "swapaware:mem=2G"}, True, "swapaware:mem=2G swapaware:test-only"),
    ({"type": "sbatch", "test-only": "set", "comment": "x swapaware:test-only"}, True, "x swapaware:test-only"),
    ({"type": "sbatch"}, False, None),
    ({"type": "sbatch", "test-only": "unset", "comment": "swapaware:mem=2G"}, False, "swapaware:mem=2G"),  # Slurm's unset
    ({"type": "srun", "test-only": "unset"}, False, None),
    ({"type": "sbatch", "comment": "mine"}, False, "mine"),
    ({"type": "salloc", "test-only": "set"}, False, None),
])
def test_a_test_only_submission_is_marked_for_job_submit(options, marked, comment):
    """sbatch/srun --test-only: job_submit cannot tell it from a real submission (measured on 22.05:
    the same job_desc fields), so cli_filter marks its comment and swapaware.lua leaves it as typed."""
    out = run_cases([{"options": options, "env": {}}])
    res = out["results"][0]
    assert res["marked"] is marked and res["options"].get("comment") == comment


CLI_FILTER_ALONE = """
slurm = {SUCCESS = 0, log_debug = function(fmt, ...) io.stderr:write("debug: ", string.format(fmt, ...), "\\n") end}
dofile(arg[1])
local options = {type = "srun", gres = "gres/gpu:1"}
local rc = slurm_cli_pre_submit(options, 0)
io.write(rc, " ", options.gres)
"""


def _pre_submit(where: Path) -> subprocess.CompletedProcess:
    """srun's pre-submit hook of the cli_filter.lua in ``where``, for a GPU step in a shard job."""
    (where / "driver.lua").write_text(CLI_FILTER_ALONE)
    return subprocess.run(["lua5.1", "driver.lua", str(where / "cli_filter.lua")], capture_output=True, text=True,
                          timeout=30, cwd=where, env={"LUA_PATH": ";;", "PATH": os.environ["PATH"], **IN_SHARD_JOB})


@pytest.mark.parametrize("module", [None, "error('broken module')",
                                    "return {mend_step = function() error('mend failed') end}"])
def test_cli_filter_never_stops_a_submission(tmp_path, module):
    """cli_filter.lua alone (a configless host gets it without swapaware_cli.lua), or with a module that
    fails to load or to run: the submission goes on as typed, and nothing reaches the user's streams
    (Slurm shows the debug line only with srun -vv)."""
    shutil.copy(ROOT / "slurm_plugin" / "cli_filter.lua", tmp_path / "cli_filter.lua")
    if module is not None:
        (tmp_path / "swapaware_cli.lua").write_text(module)
    r = _pre_submit(tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "0 gres/gpu:1", r.stdout
    assert r.stderr.startswith("debug: swapaware cli_filter: "), r.stderr


def test_cli_filter_mends_with_its_module_beside_it(tmp_path):
    for name in ("cli_filter.lua", "swapaware_cli.lua"):
        shutil.copy(ROOT / "slurm_plugin" / name, tmp_path / name)
    r = _pre_submit(tmp_path)
    assert (r.returncode, r.stdout, r.stderr) == (0, "0 shard:2", ""), r
