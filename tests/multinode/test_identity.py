"""Identity the Slurm way, attacked on the multi-node cluster as a local user or a node would:
credentials are made by each host's real munged (``munge`` run as that user, with the payload
that binds them to their call as swapaware's clients make it), sent to the service's gRPC port as
any client could; credentials Slurm itself minted, captured as a user's ``srun`` receives them,
are refused at every method. Each attack fails cleanly and leaves no trace in the
history: a forged Admit is a dry run, another user's job cannot be explained, events need a fresh
credential from root on a node, oversize fields are refused, a history the service does not own
stops it from starting."""
from __future__ import annotations

import os
import tomllib
import uuid
from typing import Callable

import grpc
import pytest

from policy_service.trust import cred_binding
from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.serving.client import MUNGE_METADATA, message_types, method_path, serialised
from tests.adapter.conftest import socket_call
from tests.slurm_stack import decision_of, job_field
from tests.waiting import wait_for

NOBODY = "nobody"


def config(cluster) -> dict:
    return tomllib.loads((cluster.state / "etc" / "swapaware.toml").read_text())


def channel(cluster) -> grpc.Channel:
    """A channel to the service's gRPC port as any client on the cluster opens it: TLS with the
    dev stack's CA where its config has one."""
    conf = config(cluster)
    address, ca = conf["service"]["grpc_address"], conf.get("tls", {}).get("ca")
    if not ca:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=open(ca, "rb").read()))


Maker = Callable[[str, object], str]  # (method, request) -> a credential for that call


def credential(cluster, user: str, node: str | None = None) -> Maker:
    """A maker of MUNGE credentials by ``user`` through the munged of ``node`` (None: the
    controller), each bound to its call as swapaware's clients bind theirs."""
    def make(method: str, request) -> str:
        payload = cred_binding.payload(method_path(method), serialised(request)).decode()
        argv = ("runuser", "-u", user, "--", "munge", "-s", payload, "-t", str(cred_binding.CLIENT_TTL_S),
                "-S", str(cluster.state / "node" / "munge" / "munge.socket.2"))
        r = cluster.node(node, *argv) if node else cluster.run(*argv)
        return r.stdout.strip()
    return make


def call(cluster, method: str, request, cred: str | Maker | None = None):
    """Call ``method``; ``cred``: a credential, or a maker of one for this call."""
    if callable(cred):
        cred = cred(method, request)
    with channel(cluster) as ch:
        rpc = ch.unary_unary(method_path(method), request_serializer=serialised,
                                  response_deserializer=message_types(method)[1].FromString)
        return rpc(request, timeout=15, metadata=((MUNGE_METADATA, cred),) if cred else None)


def refused(cluster, method: str, request, cred: str | Maker | None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(cluster, method, request, cred)
    return err.value


def recorded(cluster, decision_id: str) -> bool:
    with cluster.history() as db:
        return db.execute("SELECT 1 FROM decisions WHERE decision_id=?", (decision_id,)).fetchone() is not None


def held_job(cluster) -> tuple[int, str]:
    """A held GPU job of root's (its decision is made at submit): (job id, decision id)."""
    job = cluster.sbatch("#!/bin/sh\ntrue\n", "--hold", "--gres=gpu:1", f"--job-name=id-{uuid.uuid4().hex[:6]}")
    decision = decision_of(job_field(cluster.show_job(job), "AdminComment"))
    assert decision, cluster.show_job(job)
    wait_for(lambda: recorded(cluster, decision["id"]), 30, f"job {job}'s decision in the history", 0.2)
    return job, decision["id"]


def test_admit_from_a_user_or_a_compute_node_is_a_dry_run_recorded_nowhere(cluster):
    """Before: any local user's Admit was recorded, under whatever user the facts named."""
    facts = pb.JobFacts(user="root", uid=0, tres_per_node=cluster.gres("gpu", 1), job_name="forged",
                        work_dir="/root")
    forged = []
    for user, node in ((NOBODY, None), ("root", "node1"), (NOBODY, "node2")):
        d = call(cluster, "Admit", pb.AdmitRequest(job=facts), credential(cluster, user, node)).decision
        assert "dry_run_not_slurmctld" in [r.code for r in d.reasons], (user, node, d)
        forged.append(d.decision_id)
    d = call(cluster, "Admit", pb.AdmitRequest(job=facts)).decision  # no credential at all
    assert "dry_run_not_slurmctld" in [r.code for r in d.reasons]
    forged.append(d.decision_id)
    job, real = held_job(cluster)  # decisions are written in order: the forged ones would be in by now
    try:
        assert recorded(cluster, real)
        assert not [f for f in forged if recorded(cluster, f)]
    finally:
        cluster.run("scancel", str(job))


def test_explain_shows_a_job_to_its_user_and_admins_only(cluster):
    """Before: Explain(job_id=N) returned any user's job facts to anyone."""
    job, decision_id = held_job(cluster)
    try:
        ask = pb.ExplainRequest(job_id=job)
        err = refused(cluster, "Explain", ask, credential(cluster, NOBODY))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "another user" in err.details()
        assert refused(cluster, "Explain", ask, None).code() == grpc.StatusCode.UNAUTHENTICATED
        assert refused(cluster, "Explain", pb.ExplainRequest(decision_id=decision_id),
                       credential(cluster, NOBODY, "node3")).code() == grpc.StatusCode.PERMISSION_DENIED
        # the job's user (root here) sees it, from any host of the cluster; so does `swapaware explain`
        assert call(cluster, "Explain", ask, credential(cluster, "root", "node1")).decision.decision_id == decision_id
        assert decision_id in cluster.swapaware("explain", str(job)).stdout
    finally:
        cluster.run("scancel", str(job))


def test_events_need_a_fresh_credential_of_root_on_a_cluster_node(cluster):
    """Before: events needed only a shared plaintext token (or nothing on the local socket)."""
    job_id = 900000 + int(uuid.uuid4().int % 90000)

    def finished(tag: str) -> pb.JobFinishedRequest:
        return pb.JobFinishedRequest(job_id=job_id, node="node1", event_id=f"attack-{job_id}-{tag}",
                                     finished_at=1.0, exit_code=0)

    assert refused(cluster, "JobFinished", finished("none"), None).code() == grpc.StatusCode.UNAUTHENTICATED
    err = refused(cluster, "JobFinished", finished("user"), credential(cluster, NOBODY, "node1"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "neither root nor SlurmUser" in err.details()
    batch = pb.ReportEventsRequest(events=[pb.JobEvent(finished=finished("batch"))])
    assert refused(cluster, "ReportEvents", batch, credential(cluster, NOBODY, "node2")).code() == \
        grpc.StatusCode.PERMISSION_DENIED
    cred = credential(cluster, "root", "node1")("JobFinished", finished("root"))
    assert call(cluster, "JobFinished", finished("root"), cred).applied
    err = refused(cluster, "JobFinished", finished("replayed"), cred)  # the same credential again
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "replay" in err.details().lower(), err.details()
    assert [o[0] for o in cluster.observations(job_id)] == ["node1"]


def test_oversize_fields_are_refused_and_the_history_does_not_grow(cluster):
    """Before: ten Admits with a 4 MB work_dir grew the history by 44 MB."""
    sock = config(cluster)["service"]["socket_path"]
    db = cluster.state / "lib" / "history.sqlite3"
    before = db.stat().st_size
    for field in ("workDir", "comment", "jobName"):
        reply = socket_call(sock, {"method": "Admit", "request": {"job": {
            "user": "root", "tresPerNode": cluster.gres("gpu", 1), field: "x" * 100_000}}}, timeout_s=15)
        assert reply["error"]["code"] == "INVALID_ARGUMENT" and "too large" in reply["error"]["message"], reply
    err = refused(cluster, "JobFinished", pb.JobFinishedRequest(job_id=1, node="n" * 10_000, event_id="big"),
                  credential(cluster, "root", "node1"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    job, _ = held_job(cluster)
    cluster.run("scancel", str(job))
    assert db.stat().st_size - before < 1_000_000


def test_the_service_refuses_a_history_it_does_not_own(cluster):
    db = cluster.state / "lib" / "history.sqlite3"
    assert db.stat().st_mode & 0o077 == 0  # private: created owner-only by the service
    cluster.stack("service-stop")
    os.chown(db, 65534, 65534)
    try:
        r = cluster.swapaware("serve", "--config", str(cluster.state / "etc" / "swapaware.toml"), check=False)
        assert r.returncode != 0 and "belongs to uid 65534" in r.stdout + r.stderr, (r.returncode, r.stderr[-2000:])
    finally:
        os.chown(db, 0, 0)
        cluster.stack("service-start")
    cluster.wait_for_decisions()
