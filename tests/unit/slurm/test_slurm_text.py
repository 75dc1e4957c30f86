"""The Slurm CLI parsers on each release's output shapes (22.05, 24.11, 26.05; SLURM_VERSIONS.md),
and the CLI backend speaking the running release's dialect."""
import copy
import json

import pytest

from policy_service.slurm import slurm as S
from policy_service.slurm.slurm import (
    CliSlurm,
    SlurmError,
    cluster_release,
    gres_detail_indices,
    job_gpu_indices,
    parse_sacct_json,
    scontrol_field,
)
from policy_service.config import SlurmBackend
from policy_service.core.dialect import DIALECTS

from tests.unit.report.test_report import REAL_SACCT

T0 = 1_796_238_000
NUM = {"set": True, "infinite": False}


def num(n):
    return {**NUM, "number": n}


# `sacct --json=v0.0.42` (24.11) shape: state.current a list, {set, infinite, number} numbers,
# tres lists with energy=-2 and mem without a unit, names "" rather than null.
SACCT_V42_JOB = {
    "account": "proj", "user": "alice", "name": "train", "partition": "gpu", "job_id": 7,
    "comment": {"administrator": "swapaware:v1 id=d7 action=share shards=2", "job": "", "system": ""},
    "exit_code": {"status": ["SUCCESS"], "return_code": num(0), "signal": {"id": {**NUM, "set": False, "number": 0},
                                                                         "name": ""}},
    "derived_exit_code": {"status": ["SUCCESS"], "return_code": num(0)},
    "state": {"current": ["COMPLETED"], "reason": "None"},
    "time": {"elapsed": 60, "eligible": T0, "end": T0 + 61, "start": T0 + 1, "submission": T0, "suspended": 0,
             "limit": num(60), "planned": num(1), "system": {"seconds": 0, "microseconds": 0}},
    "tres": {"allocated": [{"type": "cpu", "name": "", "id": 1, "count": 1},
                           {"type": "mem", "name": "", "id": 2, "count": 256},
                           {"type": "energy", "name": "", "id": 3, "count": -2},
                           {"type": "node", "name": "", "id": 4, "count": 1},
                           {"type": "billing", "name": "", "id": 5, "count": 1},
                           {"type": "gres", "name": "shard", "id": 1002, "count": 2}],
             "requested": [{"type": "cpu", "name": "", "id": 1, "count": 1},
                           {"type": "gres", "name": "gpu", "id": 1001, "count": 1}]},
}


def sacct_v4x(version: str, **job_changes) -> str:
    job = copy.deepcopy(SACCT_V42_JOB)
    for key, value in job_changes.items():
        job[key] = value
    return json.dumps({"meta": {"plugin": {"data_parser": f"data_parser/{version}"}}, "errors": [], "warnings": [],
                       "jobs": [job]})


def test_sacct_22_05_record():
    (job,) = parse_sacct_json(json.dumps(REAL_SACCT))
    assert (job.job_id, job.state, job.exit_code, job.start_time, job.end_time) == (
        3, "COMPLETED", 0, 1796238101, 1796238103)
    assert "gres/shard=1" in job.tres_alloc and job.admin_comment.startswith("swapaware:v1 id=83ca41d906784792")


@pytest.mark.parametrize("version", ["v0.0.42", "v0.0.44"])
def test_sacct_24_11_and_26_05_record(version):
    (job,) = parse_sacct_json(sacct_v4x(version))
    assert (job.job_id, job.user, job.account, job.partition, job.job_name) == (7, "alice", "proj", "gpu", "train")
    assert (job.state, job.exit_code, job.submit_time, job.start_time, job.end_time) == (
        "COMPLETED", 0, T0, T0 + 1, T0 + 61)
    assert job.tres_alloc == "cpu=1,mem=256,energy=-2,node=1,billing=1,gres/shard=2"
    assert job.tres_req == "cpu=1,gres/gpu=1" and job.admin_comment == "swapaware:v1 id=d7 action=share shards=2"


@pytest.mark.parametrize("changes,field,expected", [
    ({"exit_code": {"status": ["ERROR"], "return_code": num(3)}}, "exit_code", 3),
    ({"exit_code": {"status": ["PENDING"], "return_code": {**NUM, "set": False, "number": 0}}}, "exit_code", 0),
    ({"time": {"start": num(T0 + 5), "end": num(T0 + 9), "submission": num(T0)}}, "start_time", T0 + 5),
    ({"time": {"start": {**NUM, "set": False, "number": 0}, "end": 0, "submission": T0}}, "start_time", 0),
    ({"state": {"current": ["CANCELLED", "REQUEUED"], "reason": "None"}}, "state", "CANCELLED,REQUEUED"),
    ({"state": {"current": "FAILED", "reason": "None"}}, "state", "FAILED"),
    ({"comment": {"administrator": None, "job": None, "system": None}}, "admin_comment", ""),
])
def test_sacct_field_shapes(changes, field, expected):
    (job,) = parse_sacct_json(sacct_v4x("v0.0.44", **changes))
    assert getattr(job, field) == expected


def test_sacct_bad_json():
    with pytest.raises(SlurmError, match="invalid JSON"):
        parse_sacct_json("sacct: error: ...")


# `scontrol show job -o`: 24.11 leaves a trailing space before StdErr=
ONELINER_24_11 = ("JobId=12 JobName=train UserId=root(0) Priority=1 AdminComment=swapaware:v1 id=d12 action=share "
                  "shards=1  StdErr=/tmp/slurm-12.out StdIn=/dev/null TresPerNode=gres/shard:1")


@pytest.mark.parametrize("key,expected", [
    ("AdminComment", "swapaware:v1 id=d12 action=share shards=1"),
    ("TresPerNode", "gres/shard:1"), ("JobId", "12"), ("Nope", None),
])
def test_scontrol_field_is_stripped(key, expected):
    assert scontrol_field(ONELINER_24_11, key) == expected


@pytest.mark.parametrize("value,expected", [
    ("gpu:1(IDX:0)", (0,)),
    ("gpu:a100:2(IDX:0-1)", (0, 1)),
    ("gpu:3(IDX:0,2-3)", (0, 2, 3)),
    ("shard:2(IDX:1)", (1,)),  # 22.05 shard jobs
    ("shard:8(0/8,8/8,0/8,0/8)", (1,)),  # 24.11+: this job's shards / the GPU's, per GPU
    ("shard:12(8/8,4/8,0/8,0/8)", (0, 1)),  # MULTIPLE_SHARING_GRES_PJ: spans two GPUs
    ("shard:1(0/8,0/8,0/8,1/8)", (3,)),
    ("gpu:1(IDX:2),nvme:1(IDX:0)", (2,)),  # not a GPU GRES: ignored
    ("(null)", ()), ("", ()),
])
def test_gres_detail_indices(value, expected):
    assert gres_detail_indices(value) == expected


def test_gres_detail_rejects_garbage():
    with pytest.raises(SlurmError):
        gres_detail_indices("gpu:1(IDX:a-b)")


SHOW_JOB_D_24_11 = """JobId=12 JobName=train
   UserId=root(0) GroupId=root(0) MCS_label=N/A
   JobState=RUNNING Reason=None Dependency=(null)
   NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   ReqTRES=cpu=1,mem=256M,node=1,billing=1,gres/shard=8
   AllocTRES=cpu=1,mem=256M,node=1,billing=1,gres/shard=8
   JOB_GRES=shard:8
     Nodes=vm CPU_IDs=0 Mem=256 GRES=shard:8(0/8,8/8,0/8,0/8)
   TresPerNode=gres/shard:8
"""
SHOW_JOB_D_22_05 = SHOW_JOB_D_24_11.replace("GRES=shard:8(0/8,8/8,0/8,0/8)", "GRES=gpu:1(IDX:2)").replace(
    "JOB_GRES=shard:8", "JOB_GRES=gpu:1")


@pytest.mark.parametrize("text,expected", [(SHOW_JOB_D_24_11, (1,)), (SHOW_JOB_D_22_05, (2,)), ("JobId=1\n", ())])
def test_job_gpu_indices(text, expected):
    assert job_gpu_indices(text) == expected


class RecordingCli(CliSlurm):
    def __init__(self, dialect=None):
        super().__init__(1.0, dialect=dialect)
        self.argv = []

    def _run(self, argv):
        self.argv.append(argv)
        return json.dumps({"jobs": []})


@pytest.mark.parametrize("dialect,flag", [
    (None, "--json"), (DIALECTS[(22, 5)], "--json"), (DIALECTS[(24, 11)], "--json=v0.0.42"),
    (DIALECTS[(26, 5)], "--json=v0.0.44"),
])
def test_accounting_pins_the_release_data_parser(dialect, flag):
    cli = RecordingCli(dialect)
    cli.accounting_jobs(job_ids=[5])
    assert cli.argv == [["sacct", flag, "-X", "--allusers", "-j", "5"]]


def test_cluster_release_prefers_the_configuration(monkeypatch):
    monkeypatch.setattr(S, "slurm_version_from", lambda timeout_s: pytest.fail("Slurm asked"))
    r = cluster_release("24.11", 1.0)
    assert (r.version, r.source, r.dialect.gres_prefix) == ((24, 11), "service.slurm_release", "gres/")


def _commands(tmp_path, monkeypatch, **scripts: str) -> None:
    """Only these commands on PATH (shell scripts standing in for the Slurm binaries)."""
    for name, body in scripts.items():
        f = tmp_path / name
        f.write_text("#!/bin/sh\n" + body + "\n")
        f.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))


NO_CONFIG = 'echo "scontrol: fatal: Could not establish a configuration source" >&2; exit 1'


@pytest.mark.parametrize("scripts,version,source", [
    ({"scontrol": 'echo "slurm 24.11.5"'}, (24, 11), "scontrol --version"),
    # 22.05 before slurm.conf exists: the client fails, the daemon's -V answers
    ({"scontrol": NO_CONFIG, "slurmctld": 'echo "slurm-wlm 22.05.8"'}, (22, 5), "slurmctld -V"),
    ({"scontrol": NO_CONFIG, "slurmd": 'echo "slurm-wlm 26.05.5"'}, (26, 5), "slurmd -V"),
    ({"scontrol": NO_CONFIG}, None, "no Slurm command told its version (scontrol --version: exit 1 "),
    ({}, None, "no Slurm command told its version (scontrol --version: FileNotFoundError"),
])
def test_cluster_release_asks_the_installed_slurm(tmp_path, monkeypatch, scripts, version, source):
    _commands(tmp_path, monkeypatch, **scripts)
    r = cluster_release("", 5.0)
    assert r.version == version and r.source.startswith(source), r.source
    if version is None:
        assert r.dialect == DIALECTS[max(DIALECTS)]  # unknown: the newest known, logged as a warning


def test_open_slurm_gives_the_cli_the_release_dialect():
    cli = S.open_slurm(SlurmBackend.CLI, 1.0, S.ClusterRelease((24, 11), "test"))
    assert isinstance(cli, CliSlurm) and cli.sacct_json_arg == "--json=v0.0.42"
    unknown = S.open_slurm(SlurmBackend.CLI, 1.0, S.ClusterRelease(None, "test"))
    assert unknown.sacct_json_arg == "--json"  # unknown release: the flag every release takes
