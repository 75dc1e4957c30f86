"""MUNGE identities at Admit and Explain, against a real, private munged and the service over gRPC on
loopback: Admit recorded only from root or SlurmUser on the controller (a dry run otherwise), Explain
of one's own job, not another's unless operator, root, SlurmUser or the admin group.

Needs root, as test_munge.py, whose munged fixtures and call helpers it uses."""
from __future__ import annotations

import grpc

from policy_service.trust import munge
from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.config import load_config
from policy_service.serving.server import start_service
from tests.adapter.as_user import NOBODY
from tests.adapter.conftest import socket_call
from tests.adapter.trust.test_munge import (  # noqa: F401 (fixtures)
    FACTS, SLURM_UID, call, finish, made_by, munge_dir, munge_env, munge_service, munged, pytestmark, reason_codes,
    refused,
)


def test_admit_is_recorded_only_from_root_or_slurmuser_on_the_controller(munge_service, munged, slurm_jobs):
    svc = munge_service
    admit = pb.AdmitRequest(job=FACTS)
    recorded = call(svc, "Admit", admit, made_by(munged.socket)).decision
    by_slurm = call(svc, "Admit", admit, made_by(munged.socket, SLURM_UID, SLURM_UID)).decision
    by_user = call(svc, "Admit", admit, made_by(munged.socket, NOBODY, NOBODY)).decision
    anonymous = call(svc, "Admit", admit).decision
    assert "dry_run_not_slurmctld" not in reason_codes(recorded) + reason_codes(by_slurm)
    for d in (by_user, anonymous):
        assert "dry_run_not_slurmctld" in reason_codes(d)
    assert "neither root nor SlurmUser" in [r.message for r in by_user.reasons if r.code == "dry_run_not_slurmctld"][0]
    replayed = made_by(munged.socket)("Admit", admit)
    munge.decode(replayed, socket=str(munged.socket))
    err = refused(svc, "Admit", admit, replayed)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED  # a refused credential is refused, not a dry run
    svc.handler.flush()
    assert svc.store.decision(recorded.decision_id) is not None
    assert svc.store.decision(by_slurm.decision_id) is not None
    for d in (by_user, anonymous):
        assert svc.store.decision(d.decision_id) is None


def test_admit_from_root_on_a_node_that_is_not_the_controller_is_a_dry_run(munge_service, munged, slurm_jobs):
    svc = munge_service
    slurm_jobs.config_text = "SlurmctldHost[0] = ctl(10.255.0.1)\nSlurmUser = slurm(64030)\n"  # read at first use
    d = call(svc, "Admit", pb.AdmitRequest(job=FACTS), made_by(munged.socket)).decision
    assert "127.0.0.1 is not a controller (SlurmctldHost) of this cluster" in " ".join(r.message for r in d.reasons)
    assert "dry_run_not_slurmctld" in reason_codes(d)
    assert call(svc, "JobFinished", finish(1), made_by(munged.socket)).applied  # a node's events
    svc.handler.flush()
    assert svc.store.decision(d.decision_id) is None


def test_explain_own_job_not_anothers_unless_operator_or_admin_group(munge_env, slurm_jobs, munged):
    env = {**munge_env, "SWAPAWARE_AUTH__ADMIN_GROUP": "staff-of-swapaware-test"}
    svc = start_service(load_config(env=env), slurm=slurm_jobs)
    try:
        def record(user: str, uid: int) -> str:
            d = socket_call(svc.socket_path, {"method": "Admit", "request": {"job": {
                "user": user, "uid": uid, "tresPerNode": "gres:gpu:1"}}})["response"]["decision"]
            return d["decisionId"]

        mine, theirs = record("nobody", NOBODY), record("alice", 4321)
        nobody = made_by(munged.socket, NOBODY, NOBODY)
        got = call(svc, "Explain", pb.ExplainRequest(decision_id=mine), nobody)
        assert got.decision.decision_id == mine and got.job.user == "nobody"
        err = refused(svc, "Explain", pb.ExplainRequest(decision_id=theirs), nobody)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert f"this job belongs to another user; you are uid {NOBODY} (nobody)" in err.details()
        err = refused(svc, "Explain", pb.ExplainRequest(decision_id=theirs), None)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        # a what-if is open to all
        assert call(svc, "Explain", pb.ExplainRequest(job=FACTS), nobody).decision.action
        # root, SlurmUser and a Slurm operator see every job
        for cred in (made_by(munged.socket), made_by(munged.socket, SLURM_UID, SLURM_UID)):
            assert call(svc, "Explain", pb.ExplainRequest(decision_id=theirs), cred).decision.decision_id == theirs
        slurm_jobs.admin_levels["nobody"] = "Operator"
        assert call(svc, "Explain", pb.ExplainRequest(decision_id=theirs), nobody).decision.decision_id == theirs
    finally:
        svc.stop(0)


def test_explain_by_the_admin_group(munge_env, slurm_jobs, munged):
    """auth.admin_group: the caller's gid (as its credential names it) or its membership."""
    import grp
    group = grp.getgrgid(NOBODY).gr_name if NOBODY in {g.gr_gid for g in grp.getgrall()} else str(NOBODY)
    svc = start_service(load_config(env={**munge_env, "SWAPAWARE_AUTH__ADMIN_GROUP": group}), slurm=slurm_jobs)
    try:
        theirs = socket_call(svc.socket_path, {"method": "Admit", "request": {"job": {
            "user": "alice", "uid": 4321, "tresPerNode": "gres:gpu:1"}}})["response"]["decision"]["decisionId"]
        got = call(svc, "Explain", pb.ExplainRequest(decision_id=theirs), made_by(munged.socket, NOBODY, NOBODY))
        assert got.decision.decision_id == theirs
        err = refused(svc, "Explain", pb.ExplainRequest(decision_id=theirs), made_by(munged.socket, 4322, 4322))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        svc.stop(0)
