"""The parsers on what each supported Slurm release really printed (tests/golden/<release>/,
captured from real daemons by contrib/matrix/golden.sh: one held job per kind of GPU request,
then a running whole-GPU job and a running shard job)."""
import json
from pathlib import Path

import pytest

from policy_service.slurm.queue import queue_state
from policy_service.slurm.slurm_text import (job_gpu_indices, parse_sacct_json, parse_sinfo_gpus,
                                             parse_squeue_pending, scontrol_field)
from policy_service.core.dialect import dialect_for, parse_release
from policy_service.core.request import gpu_request, parse_gres_entries, shard_rewrite
from policy_service.core import policy
from policy_service.core.request import job_request
from policy_service.core.types import Action, GresKind, ReasonCode

from tests.unit.core.test_policy import NO_OVERSUB, history

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
RELEASES = ("22.05", "24.11", "26.05")

# case name (the held job's --job-name) -> (kind, GPUs or shards per node, type, source field)
REQUESTS = {
    "gres_gpu": (GresKind.GPU, 1, "", "tres_per_node"),
    "gres_typed": (GresKind.GPU, 1, "h100", "tres_per_node"),
    "gpus": (GresKind.GPU, 1, "", "tres_per_job"),
    "gpus_per_node": (GresKind.GPU, 1, "", "tres_per_node"),
    "gpus_per_task": (GresKind.GPU, 1, "", "tres_per_task"),
    "gpus_per_task_cpus": (GresKind.GPU, 1, "", "tres_per_task"),
    "gres_zero": (GresKind.NONE, 0, "", ""),
    "gres_shard": (GresKind.SHARD, 2, "", "tres_per_node"),
    "gres_gpu2": (GresKind.GPU, 2, "", "tres_per_node"),
}
# Held jobs with options a user expresses per GPU, --exclusive and --oversubscribe (captured after
# the cases above): case -> (the reason the job keeps its request, or None: it may share; the
# option named in that reason). Every one asks for one GPU.
KEEPS = {
    "cpus_per_gpu": (ReasonCode.PER_GPU_OPTION, "--cpus-per-gpu="),
    "gpus_cpus_per_gpu": (ReasonCode.PER_GPU_OPTION, "--cpus-per-gpu="),
    "mem_per_gpu": (ReasonCode.PER_GPU_OPTION, "--mem-per-gpu="),
    "ntasks_per_gpu": (ReasonCode.PER_GPU_OPTION, "--ntasks-per-gpu=2"),
    "gpu_freq": (ReasonCode.PER_GPU_OPTION, "--gpu-freq="),
    "gpu_bind": (ReasonCode.PER_GPU_OPTION, "--gpu-bind="),
    "gpu_bind_map": (ReasonCode.PER_GPU_OPTION, "--gpu-bind="),
    "exclusive": (ReasonCode.EXCLUSIVE, "--exclusive=node"),
    "exclusive_user": (ReasonCode.EXCLUSIVE, "--exclusive=user"),
    "oversubscribe": (None, ""),
}


def _read(release: str, name: str) -> str:
    return (GOLDEN / release / name).read_text()


def _dialect(release: str):
    return dialect_for(parse_release(release))


def _job_descs(release: str) -> dict[str, dict]:
    rows = [json.loads(line) for line in _read(release, "job_desc.jsonl").splitlines() if line.strip()]
    return {r["name"]: r for r in rows}


def test_golden_files_are_from_the_release_they_are_named_after():
    for release in RELEASES:
        assert _read(release, "version.txt").split()[-1].startswith(f"{release}.")  # "slurm-wlm 24.11.5"
        assert _read(release, "sacct_arg.txt").strip() == _dialect(release).sacct_json_arg


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("case", sorted(REQUESTS))
def test_job_desc_gres_fields_parse_to_the_request_the_user_made(release, case):
    jd = _job_descs(release)[case]
    assert jd["batch"] is True
    req = gpu_request({k: v for k, v in jd.items() if k.startswith("tres_per_")})
    kind, count, gres_type, field = REQUESTS[case]
    assert (req.kind, req.per_node, req.gpu_type, req.source_field) == (kind, count, gres_type, field), jd


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("case", ["gres_gpu", "gpus", "gpus_per_node", "gpus_per_task", "gpus_per_task_cpus"])
def test_rewrite_speaks_the_release_and_keeps_other_tres(release, case):
    jd = _job_descs(release)[case]
    fields = {k: v for k, v in jd.items() if k.startswith("tres_per_")}
    req = gpu_request(fields)
    out = shard_rewrite(fields, req.source_field, 3, _dialect(release))
    assert out["tres_per_node"] == _dialect(release).gres("shard", 3)
    assert gpu_request({**fields, **out}).kind is GresKind.SHARD  # no gpu entry is left anywhere
    if "cpu=2" in fields.get("tres_per_task", ""):  # 24.11+: cpu=2 stays where the user put it
        assert [e.text for e in parse_gres_entries(out["tres_per_task"])] == ["cpu=2"]


@pytest.mark.parametrize("release", RELEASES)
def test_squeue_pending_rows_and_the_gpu_demand_they_make(release):
    rows = parse_squeue_pending(_read(release, "squeue_pending.txt"))[:len(REQUESTS)]  # submitted first
    assert len(rows) == len(REQUESTS) and all(r.reason == "JobHeldUser" for r in rows)
    assert rows[0].tres_per_node == _dialect(release).gres("gpu", 1)
    per_task = [r for r in rows if r.tres_per_task]
    assert len(per_task) == 2  # --gpus-per-task: a GPU job on every release, whatever the spelling
    for r in rows:
        r_req = gpu_request({"tres_per_node": r.tres_per_node, "tres_per_job": r.tres_per_job,
                             "tres_per_task": r.tres_per_task})
        assert r_req.kind in (GresKind.GPU, GresKind.SHARD, GresKind.NONE)
    # held jobs wait on nothing the cluster can give: no pressure
    assert queue_state(rows, 4, 8).pending_gpus == 0.0
    runnable = [r.__class__(**{**r.__dict__, "reason": "Resources"}) for r in rows]
    # gpu:1 x6 (gres, typed, gpus, per node, two per task) + gpu:2 = 8 GPUs; shard:2 of 8 = 0.25
    assert queue_state(runnable, 4, 8).pending_gpus == pytest.approx(8.25)


@pytest.mark.parametrize("release", RELEASES)
def test_scontrol_show_job_fields(release):
    line = _read(release, "scontrol_show_job_o_held_gpu.txt")
    assert scontrol_field(line, "TresPerNode") == _dialect(release).gres("gpu", 1)
    assert scontrol_field(line, "Comment") == "gres_gpu"  # 24.11 leaves a space before StdErr=
    assert scontrol_field(line, "JobState") == "PENDING"


@pytest.mark.parametrize("release", RELEASES)
def test_scontrol_show_job_detail_gives_the_gpu_index(release):
    assert job_gpu_indices(_read(release, "scontrol_show_job_d_gpu.txt")) == (0,)
    # the shard job ran on the next free GPU: (IDX:1) on 22.05, (0/8,2/8,0/8,0/8) on 24.11+
    assert job_gpu_indices(_read(release, "scontrol_show_job_d_shard.txt")) == (1,)


@pytest.mark.parametrize("release", RELEASES)
def test_sinfo_counts_typed_gpus(release):
    assert parse_sinfo_gpus(_read(release, "sinfo_nodes.txt")) == 4


@pytest.mark.parametrize("release", RELEASES)
def test_sacct_json_of_the_pinned_parser(release):
    gpu, shard = sorted(parse_sacct_json(_read(release, "sacct.json")), key=lambda j: j.job_id)
    if release != "22.05":  # 22.05's sacct --json (dbv0.0.38) names both jobs "allocation"
        assert (gpu.job_name, shard.job_name) == ("run_gpu", "run_shard")
    assert shard.state.startswith("CANCELLED") and shard.user == "root"
    assert shard.admin_comment.startswith("swapaware:v1 id=golden")
    assert "gres/shard=2" in shard.tres_alloc and "gres/gpu=1" in gpu.tres_alloc
    assert shard.start_time > 0 and shard.end_time >= shard.start_time


def _lua_facts(jd: dict) -> dict:
    """What job_submit.lua sends of a captured job_desc (slurm_plugin/swapaware.lua: num16, exclusive)."""
    def num16(v):
        return 0 if v is None or v >= 65534 else int(v)
    shared = jd.get("shared")
    exclusive = "" if shared is None or shared == 1 or shared >= 65534 else {0: "node", 2: "user", 3: "mcs"}.get(
        shared, str(shared))
    return {"cpus_per_tres": jd.get("cpus_per_tres", ""), "mem_per_tres": jd.get("mem_per_tres", ""),
            "ntasks_per_tres": num16(jd.get("ntasks_per_tres")), "tres_bind": jd.get("tres_bind", ""),
            "tres_freq": jd.get("tres_freq", "")}, exclusive


def _decide_captured(release: str, case: str):
    """The captured job_desc of ``case`` as job_submit.lua sends it, decided for a class that would
    share (one observed 3 GiB run): (job_desc, request, decision)."""
    jd = _job_descs(release)[case]
    fields = {k: jd[k] for k in ("tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket") if k in jd}
    per_gpu, exclusive = _lua_facts(jd)
    req, access = job_request(user="u", account="a", partition="gpu", job_name="train", script_fingerprint="fp",
                              gres_fields=fields, num_tasks=jd.get("num_tasks", 1), per_gpu=per_gpu,
                              exclusive=exclusive)
    d = policy.decide(req, history(3), NO_OVERSUB, decision_id="d", now=1.0, job_class="c", gres_fields=fields,
                      access=access, dialect=_dialect(release))
    return jd, req, d


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("case", sorted(KEEPS))
def test_per_gpu_options_and_exclusive_keep_the_request_on_every_release(release, case):
    """A class that would share (one observed 3 GiB run): a job with an option expressed per GPU,
    or --exclusive, keeps its request exactly (no rewrite, not even as all of a GPU's shards on
    22.05), and the reason names the option; --oversubscribe shares as a plain request does."""
    jd, req, d = _decide_captured(release, case)
    assert req.gpu.kind is GresKind.GPU and req.gpu.per_node == 1, jd
    code, option = KEEPS[case]
    if code is None:
        assert d.action is Action.SHARE and d.rewrite.tres_per_node == _dialect(release).gres("shard", 1), d
        return
    assert (d.action, d.shards) == (Action.WHOLE_GPU, 0), d.reasons
    assert all(getattr(d.rewrite, f) is None for f in ("tres_per_node", "tres_per_job", "tres_per_task",
                                                      "tres_per_socket")), d.rewrite
    (reason,) = [r for r in d.reasons if r.code is code]
    assert option in reason.message, reason.message
    assert f"{code.value}" in d.rewrite.admin_comment


@pytest.mark.parametrize("release", RELEASES)
def test_lua_sees_per_gpu_options_in_the_release_spelling(release):
    jds = _job_descs(release)
    pre = _dialect(release).gres_prefix
    assert jds["cpus_per_gpu"]["cpus_per_tres"] == f"{pre}gpu:2"
    assert jds["gpus_cpus_per_gpu"]["cpus_per_tres"] == f"{pre}gpu:2"
    assert jds["mem_per_gpu"]["mem_per_tres"] == f"{pre}gpu:1024"  # MiB
    assert jds["ntasks_per_gpu"]["ntasks_per_tres"] == 2
    assert jds["gpu_bind"]["tres_bind"].endswith("closest") and jds["gpu_freq"]["tres_freq"].endswith("high")
    for case, want in (("exclusive", 0), ("exclusive_user", 2), ("oversubscribe", 1), ("gres_gpu", 65534)):
        assert jds[case]["shared"] == want, (case, jds[case])


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("case", ["gpus_per_task", "gpus_per_task_cpus"])
def test_the_binding_slurm_gives_gpus_per_task_is_cleared_with_a_shard_rewrite(release, case):
    """24.11+ bind a --gpus-per-task job to its GPUs themselves (tres_bind gres/gpu:per_task:1): not a
    user's option, so the job shares, and the binding goes with the gpu request it belongs to."""
    jd, req, d = _decide_captured(release, case)
    assert req.per_gpu_options == ()
    assert d.action is Action.SHARE
    assert d.rewrite.tres_bind == ("" if "tres_bind" in jd else None), (jd, d.rewrite)
    assert ("tres_bind" in jd) is (release != "22.05")
