"""The harness of the admission differential tests (test_admission_differential.py,
test_admission_differential_archive.py): the service fixture per Slurm release, the queues of each
phase, one Lua state over a batch of jobs (tests/adapter/admission_diff_driver.lua), the history's
training through the handler's own Admit / JobStarted / JobFinished path, and the gate and table
reads the comparison needs. Skips (outside CI) where lua5.1 with lua-posix and lua-cjson is missing."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from google.protobuf import json_format

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.slurm.slurm import PendingJob
from policy_service.config import load_config
from policy_service.core import admission
from policy_service.core.admission_format import read_table
from policy_service.serving.server import start_service
from tests import admission_jobs as gen
from tests.waiting import wait_for

from tests.adapter.admission.test_admission_publish import plain

ROOT = Path(__file__).resolve().parents[3]
DRIVER = Path(__file__).parents[1] / "admission_diff_driver.lua"
GIB = 1024 ** 3
UID = 1000
SEED = 21
POOL = 1500  # distinct jobs (keys)
POLL_S = 1.5  # policy.queue_poll_s: the gate file is valid 3 x this after its snapshot

if shutil.which("lua5.1") is None or subprocess.run(["lua5.1", "-e", 'require("posix.sys.stat") require("cjson")'],
                                                     capture_output=True).returncode != 0:
    if os.environ.get("CI"):
        raise RuntimeError("lua5.1 with lua-posix and lua-cjson is missing: contrib/dev-cluster/cluster.sh install")
    pytest.skip("lua5.1 with lua-posix and lua-cjson not installed", allow_module_level=True)

# (mode, queue) in the order they run; "none": no snapshot was ever taken, "stale": the last one
# is older than 3 x queue_poll_s (the publisher rewrites the gate file naming every view
# "unknown"), "stopped": the same with the publisher stopped first (the service died): the gate
# file still names the last states, past its valid_until
ALL_PHASES = (("enforce", "none"), ("enforce", "short"), ("enforce", "mixed"), ("enforce", "long"),
              ("enforce", "stale"), ("shadow", "short"), ("shadow", "mixed"), ("shadow", "long"),
              ("shadow", "stopped"))
# the other releases wait out 3 x queue_poll_s once, not twice (a release's own part is its keys and
# rewrites, not how the gate goes stale)
FEWER_PHASES = ALL_PHASES[:4] + ALL_PHASES[5:]
# (release, jobs per phase, phases, the phase before which classes learn more and the table is
# published again: same mode as the phase before it): 12,600 jobs spelled as 22.05 spells them,
# 4,000 each as 24.11 and 26.05 do
RELEASES = (("22.05", 1400, ALL_PHASES, 4), ("24.11", 500, FEWER_PHASES, 3), ("26.05", 500, FEWER_PHASES, 3))


# time limits the differential jobs carry in turn (minutes; NO_VAL: none given)
TIME_LIMITS = (gen.NO_VAL, 1, 60, 240, 1440, 43200)

def pending(gpus_by_qos: dict[str, int]) -> list[PendingJob]:
    out, n = [], 0
    for qos, gpus in gpus_by_qos.items():
        for _ in range(gpus):
            n += 1
            out.append(PendingJob(9000 + n, "gres:gpu:1", "", "", 1, 1, "Resources", qos))
    return out


# 4 GPUs; share_min_queue 0.25, overcommit_compute_min_queue 0.75 (the fixture's env)
QUEUES = {
    "short": pending({}),
    # ahead of high and protected: 0 (short); of normal: 2 of 4 (normal); of low and of any QoS
    # not in the QoS table, the whole queue: 4 of 4 (long)
    "mixed": pending({"normal": 2, "low": 2}),
    "long": pending({"high": 8}),
}


@pytest.fixture(params=RELEASES, ids=[r[0] for r in RELEASES])
def release(request):
    return request.param


@pytest.fixture
def svc(service_env, slurm_jobs, tmp_path, release):
    (tmp_path / "run").mkdir()
    env = dict(service_env, SWAPAWARE_SERVICE__SLURM_RELEASE=release[0], SWAPAWARE_ADMISSION__TABLE_PATH=str(tmp_path / "run" / "admission.json"),
               SWAPAWARE_ADMISSION__REFRESH_S="1000", SWAPAWARE_ADMISSION__VALID_S="3000",
               SWAPAWARE_POLICY__SHARE_MIN_QUEUE="0.25", SWAPAWARE_POLICY__OVERCOMMIT_COMPUTE_MIN_QUEUE="0.75",
               SWAPAWARE_POLICY__QUEUE_POLL_S=str(POLL_S), SWAPAWARE_POLICY__WHOLE_GPU_QOS=gen.PROTECTED_QOS,
               SWAPAWARE_ESTIMATOR__MIN_SAMPLES="3")
    slurm_jobs.qos_table = dict(gen.QOS_PRIORITIES)
    slurm_jobs.pending = None  # squeue fails until a phase gives it a queue: no snapshot yet
    s = start_service(load_config(env=env), slurm=slurm_jobs)
    try:
        yield s
    finally:
        s.stop(0)


def plugin_conf(tmp_path: Path, table: Path, release: str) -> Path:
    conf = tmp_path / "etc"
    conf.mkdir(exist_ok=True)
    (conf / "swapaware_plugin.conf").write_text(
        f"socket={tmp_path}/none.sock\ntable={table}\ntable_check_ms=0\ntable_uids=0,{os.getuid()}\n"
        f"slurm_release={release}\n")
    return conf


def run_lua(tmp_path: Path, conf: Path, jobs: list[dict], facts_only: bool = False) -> tuple[list[dict], dict]:
    """One Lua state over ``jobs``: one answer per job, and the table path's counters."""
    path = tmp_path / "jobs.jsonl"
    path.write_text("".join(json.dumps({"job": j, "uid": UID}) + "\n" for j in jobs))
    args = ["lua5.1", str(DRIVER), str(ROOT / "slurm_plugin"), str(conf), str(path)] + (["facts"] if facts_only else [])
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(lines) == len(jobs) + 1, proc.stderr
    for out in lines[:-1]:
        out["user"] = out.get("user") or []  # lua-cjson writes an empty list as {}
    return lines[:-1], lines[-1]["counters"]


def to_facts(lua_facts: dict) -> pb.JobFacts:
    return json_format.ParseDict(lua_facts, pb.JobFacts())


# ----------------------------------------------------------------------------- the history
def train(s, slurm_jobs, base_facts: dict[str, pb.JobFacts], round_: int = 0) -> None:
    """Teach the class states through the handler's own Admit / JobStarted / JobFinished path.
    Round 0 makes them (users of state "unknown" run nothing); round 1, after the table was
    published, moves some (few -> enough, an OOM of a shared run for "enough", the first runs
    of "unknown0", compute-bound runs for "util"), so the publisher must decide those keys again."""
    h = s.handler
    job_id = 100 + 1000 * round_
    enforcement = pb.NodeEnforcement(backend="nvml-cgroup", hard_cap=True, victim=True)

    def run(facts, peak, util=None, oom=False):
        nonlocal job_id
        job_id += 1
        d = h.admit(pb.AdmitRequest(job=facts)).decision
        slurm_jobs.comments[job_id] = d.rewrite.admin_comment
        start = 1000.0 + 100 * job_id
        h.job_started(pb.JobStartedRequest(job_id=job_id, node="n1", gpu_indices=[job_id % 4], started_at=start,
                                           event_id=f"s{job_id}", enforcement=enforcement))
        fin = pb.JobFinishedRequest(job_id=job_id, node="n1", gpu_indices=[job_id % 4], finished_at=start + 60,
                                    exit_code=1 if oom else 0, event_id=f"f{job_id}", oom_detected=oom,
                                    peak_gpu_bytes=peak, telemetry_source="fake-nvml")
        if util is not None:
            fin.gpus.append(pb.GpuUsage(gpu_index=job_id % 4, peak_bytes=peak, util_mean_pct=util,
                                        total_bytes=80 * GIB))
        assert h.job_finished(fin).applied
        return d

    for user, facts in base_facts.items():
        state = user.rstrip("0123456789")
        if round_ == 0:
            if state == "few":
                run(facts, 3 * GIB)
            elif state == "enough":
                for peak in (3.0, 3.2, 2.8, 3.1):
                    run(facts, int(peak * GIB))
            elif state == "oom":
                for _ in range(4):
                    run(facts, 2 * GIB)
                assert run(facts, 4 * GIB, oom=True).action == pb.ACTION_SHARE  # a shared run's OOM: the penalty
            elif state == "util":
                for _ in range(4):
                    run(facts, 2 * GIB, util=62.0)
        elif state == "few":
            for _ in range(2):
                run(facts, 3 * GIB)
        elif state == "enough":
            run(facts, 5 * GIB, oom=True)
        elif user == "unknown0":
            for _ in range(3):
                run(facts, 1 * GIB)
        elif state == "util":
            for _ in range(2):
                run(facts, 2 * GIB, util=96.0)
    h.flush()


# ----------------------------------------------------------------------------- comparing
def lua_set(applied: dict) -> dict:
    out = dict(applied)
    out["admin_comment"] = plain(out["admin_comment"])
    return out


def wait_gate(s, want: dict, what: str) -> dict:
    """The gate file once it names ``want`` ({"views": ..., "other": ...})."""
    gate = s.admission_publisher.gate

    def read():
        try:
            doc = json.loads(gate.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return doc if {"views": doc["views"], "other": doc["other"]} == want else None
    return wait_for(read, 20.0, f"gate file {what}: {want}")


def gate_state(doc: dict, qos: str, per_qos: bool, now: float) -> str:
    """The state the plugin reads for a job of ``qos`` (swapaware_table.lua's T.gate_state)."""
    if now > doc["valid_until"]:
        return "unknown"
    return doc["views"].get(qos if per_qos else "", doc["other"])


def unversioned(table: Path) -> dict[str, str]:
    """The class table's entries without the version in their tokens."""
    return {k: re.sub(r"tbl=[0-9a-f]{16}:", "tbl=", json.dumps(v, sort_keys=True))
            for k, v in read_table(table.read_bytes())["entries"].items()}


def queue_state_of(h) -> tuple[dict, str]:
    """The gate states decide() sees now (views and other), from the queue monitor's snapshot."""
    doc = admission.gate_file(h.queue.snapshot(), h.cfg, time.time())
    return doc["views"], doc["other"]
