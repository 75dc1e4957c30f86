"""The real service speaking a release's dialect: chosen once at start (service.slurm_release here),
written into every rewrite, and used when re-deciding pending jobs."""
import logging

import pytest
from google.protobuf import json_format

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.serving.redecide import candidates
from policy_service.slurm.slurm import PendingJob
from policy_service.serving.client import PolicyClient
from policy_service.config import load_config
from policy_service.core.policy import parse_admin_comment
from policy_service.core.types import QueueState
from policy_service.serving.server import start_service
from tests.waiting import wait_for

from tests.adapter.conftest import socket_call
from tests.adapter.serving.test_service import GIB, facts, run_job


@pytest.fixture
def start(service_env, slurm_jobs):
    started = []

    def _start(release="24.11", **env):
        svc = start_service(load_config(env=dict(service_env, SWAPAWARE_SERVICE__SLURM_RELEASE=release, **env)),
                            slurm=slurm_jobs)
        started.append(svc)
        return svc, PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0)

    yield _start
    for svc in started:
        svc.stop(0)


def test_the_dialect_is_logged_once_at_start(start, caplog):
    with caplog.at_level(logging.INFO, logger="swapaware.service"):
        start("24.11")
    lines = [m for m in caplog.messages if m.startswith("slurm dialect:")]
    assert lines == ["slurm dialect: 24.11 (gres/ spelling, sacct --json=v0.0.42, gpu-beside-shard bug: no, "
                     "multiple sharing GRES per job: yes, SLUID: no, shards unread after a takeover: no), "
                     "from service.slurm_release"]


@pytest.mark.parametrize("release,as_shards,whole,shared", [
    ("22.05", "auto", "gres:shard:8", "gres:shard:1"),
    ("24.11", "auto", None, "gres/shard:1"),  # no gpu-beside-shard bug: the gpu request stays
    ("24.11", "true", "gres/shard:8", "gres/shard:1"),
    ("26.05", "auto", None, "gres/shard:1"),
])
def test_rewrites_are_spelled_as_the_release_spells_them(start, slurm_jobs, release, as_shards, whole, shared):
    _, client = start(release, SWAPAWARE_POLICY__WHOLE_GPU_AS_SHARDS=as_shards)
    with client:
        job = facts(gres="gres/gpu:1", is_batch=True)
        d1, _ = run_job(client, slurm_jobs, 11, job, peak=3 * GIB)
        assert d1.action == pb.ACTION_WHOLE_GPU
        assert (d1.rewrite.tres_per_node if d1.rewrite.HasField("tres_per_node") else None) == whole
        d2 = client.admit(job).decision
        assert (d2.action, d2.rewrite.tres_per_node) == (pb.ACTION_SHARE, shared)
        task = client.admit(pb.JobFacts(user="alice", job_name="train", tres_per_task="cpu=2,gres/gpu=1",
                                        script_fingerprint="00000001deadbeef")).decision
        assert (task.rewrite.tres_per_node, task.rewrite.tres_per_task) == (shared, "cpu=2")


def test_srun_and_salloc_allocations_keep_their_request(start, slurm_jobs):
    svc, client = start("24.11", SWAPAWARE_POLICY__WHOLE_GPU_AS_SHARDS="true")
    with client:
        run_job(client, slurm_jobs, 11, facts(gres="gres/gpu:1"), peak=3 * GIB)  # the class would share
        # job_submit.lua sends isBatch = (job_desc.script ~= nil): false for srun/salloc allocations
        resp = socket_call(svc.socket_path, {"method": "Admit", "request": {"job": {
            "user": "alice", "account": "proj", "partition": "gpu", "jobName": "train", "tresPerNode": "gres/gpu:1",
            "scriptFingerprint": "00000001deadbeef", "isBatch": False}}})
        d = json_format.ParseDict(resp["response"], pb.AdmitResponse()).decision
        assert d.action == pb.ACTION_WHOLE_GPU and [r.code for r in d.reasons][0] == "interactive"
        assert not d.rewrite.HasField("tres_per_node") and "why=interactive" in d.rewrite.admin_comment
        typed = client.admit(facts(gres="gres/gpu:a100:1")).decision  # learned from alice/train's run
        assert typed.action == pb.ACTION_SHARE and "typed_gpu" not in [r.code for r in typed.reasons]
        assert typed.rewrite.tres_per_node == "gres/shard:a100:1"  # shares within its type
        unset = client.admit(facts(gres="gres/gpu:1")).decision  # a client that does not say: batch
        assert unset.action == pb.ACTION_SHARE


def pending(job_id, tres, **kw):
    return PendingJob(job_id, tres, kw.get("job", ""), "", kw.get("nodes", 1), 1, kw.get("reason", "Priority"), "")


@pytest.mark.parametrize("whole_shards,tres,chosen", [
    ({8}, "gres:shard:8", True), ({8}, "gres/shard:8", True), ({8}, "gres/shard:2", False),
    ({4, 8}, "gres/shard:4", True),  # a fleet of 4 and 8 shard GPUs: either is a whole GPU
    ({8}, "gres/gpu:1", True),  # 22.05 on a mixed fleet keeps a whole GPU as gpu:1
    ({8}, "gres/shard:8,gres/nvme:1", False), ({8}, "gres/shard:a:b:c", False),
    ((), "gres/gpu:1", True), ((), "gres:gpu:1", True), ((), "gres/gpu:a100:1", True), ({8}, "gres:shard:a100:8", True),
    ((), "gres/gpu:2", False), ((), "gres/shard:8", False),
])
def test_candidates_compare_parsed_entries(whole_shards, tres, chosen):
    assert bool(candidates([pending(1, tres)], whole_shards)) is chosen


@pytest.mark.parametrize("as_shards,held", [("auto", "gres/gpu:1"), ("true", "gres/shard:8")])
def test_pending_job_is_redecided_on_24_11(start, slurm_jobs, as_shards, held):
    svc, client = start("24.11", SWAPAWARE_POLICY__WHOLE_GPU_AS_SHARDS=as_shards,
                        SWAPAWARE_POLICY__REDECIDE_PENDING="true", SWAPAWARE_POLICY__QUEUE_POLL_S="300")
    wait_for(lambda: svc.queue_monitor.snapshot() is not None, 5.0, "first poll")
    with client:
        job = facts(name="burst", gres="gres/gpu:1")
        first = client.admit(job).decision
        slurm_jobs.comments[12] = first.rewrite.admin_comment
        run_job(client, slurm_jobs, 10, job, peak=3 * GIB)
        svc.queue_monitor.on_poll([pending(12, held)], QueueState(0.0, 4))  # as squeue shows it on 24.11
    assert slurm_jobs.tres == {12: "gres/shard:1"}
    assert parse_admin_comment(slurm_jobs.comments[12])["why"].startswith("redecided,")
