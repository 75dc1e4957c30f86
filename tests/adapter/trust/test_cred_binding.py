"""A MUNGE credential counts only for the call it was made for (policy_service/trust/cred_binding.py),
against a real private munged and the service over gRPC on loopback: credentials of root and of
SlurmUser whose payload is empty, foreign (a Slurm-like binary payload), for another method or
for another request are refused UNAUTHENTICATED at every method, logged and counted, and nothing
of theirs is applied or recorded. Needs root, as tests/adapter/trust/test_munge.py."""
from __future__ import annotations

import logging

import grpc
import pytest

from policy_service.trust import cred_binding, munge
from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.serving.client import method_path, serialised
from tests.adapter.as_user import NOBODY, run_as
from tests.adapter.trust.test_munge import (  # noqa: F401 (fixtures)
    FACTS, SLURM_UID, call, call_raw, finish, made_by, munge_dir, munge_env, munge_service, munged, observed,
    pytestmark, reason_codes,
)

# One request of each method, as a node or slurmctld would send it.
REQUESTS = {
    "Admit": pb.AdmitRequest(job=FACTS),
    "Explain": pb.ExplainRequest(job=FACTS),
    "JobStarted": pb.JobStartedRequest(job_id=70, node="node1", event_id="s70", gpu_indices=[0], started_at=5.0),
    "JobFinished": finish(71),
    "ReportEvents": pb.ReportEventsRequest(events=[pb.JobEvent(finished=finish(72))]),
}
# Like Slurm's job-step credential: SlurmUser's, with a packed binary structure as its payload.
SLURM_LIKE = b"\x00\x00\x00\x2a\x00\x00\x10\x01job_step_cred\x00" + bytes(range(256))


def refused_count(svc, why: str) -> float:
    return svc.handler.metrics.registry.get_sample_value("swapaware_credentials_refused_total", {"why": why}) or 0.0


def encoded(sock, payload: bytes, uid: int = 0) -> str:
    encode = lambda: munge.encode(payload, socket=str(sock), ttl=60)  # noqa: E731
    return run_as(uid, uid, encode) if uid else encode()


def refusal(svc, method: str, request, cred: str) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call(svc, method, request, cred)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, err.value.details())
    return err.value.details()


def test_a_bound_credential_is_accepted_at_every_method(munge_service, munged):
    svc = munge_service
    for method, request in REQUESTS.items():
        call(svc, method, request, made_by(munged.socket, SLURM_UID, SLURM_UID))
    assert observed(svc) == [71, 72] and svc.store.run(70) is not None
    assert sum(refused_count(svc, u.value) for u in cred_binding.Unbound) == 0


@pytest.mark.parametrize("uid", [0, SLURM_UID])
def test_empty_and_foreign_payloads_are_refused_at_every_method_whatever_the_uid(munge_service, munged, caplog, uid):
    svc = munge_service
    with caplog.at_level(logging.WARNING, logger="policy_service.serving.grpc_server"):
        for method, request in REQUESTS.items():
            why = refusal(svc, method, request, encoded(munged.socket, b"", uid))
            assert f"MUNGE credential of uid {uid} from 127.0.0.1 refused: its payload is empty" in why
            why = refusal(svc, method, request, encoded(munged.socket, SLURM_LIKE, uid))
            assert "its payload is not swapaware's" in why
    logged = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(logged) == 10 and all("MUNGE credential of uid" in m for m in logged), logged
    assert (refused_count(svc, "empty_payload"), refused_count(svc, "foreign_payload")) == (5, 5)
    assert observed(svc) == []
    svc.handler.flush()
    assert list(svc.store.decisions()) == []  # no Admit recorded, not even as a dry run
    assert svc.store.run(70) is None  # JobStarted not applied


def test_a_credential_for_another_method_or_request_is_refused(munge_service, munged):
    svc = munge_service
    slurm = made_by(munged.socket, SLURM_UID, SLURM_UID)
    # made for an Explain, sent with a JobFinished (and the other way round)
    why = refusal(svc, "JobFinished", finish(1), slurm("Explain", REQUESTS["Explain"]))
    assert "made for another method, not /swapaware.v1.PolicyService/JobFinished" in why
    why = refusal(svc, "Explain", REQUESTS["Explain"], slurm("Admit", REQUESTS["Admit"]))
    assert "another method" in why
    # made for one job's JobFinished, sent (never used before) with another job's
    why = refusal(svc, "JobFinished", finish(2), slurm("JobFinished", finish(3)))
    assert "made for another /swapaware.v1.PolicyService/JobFinished request" in why
    # made for a ReportEvents of one event, sent with a batch of 500 forged ones
    forged = pb.ReportEventsRequest(events=[pb.JobEvent(finished=finish(100 + i)) for i in range(500)])
    why = refusal(svc, "ReportEvents", forged, slurm("ReportEvents", REQUESTS["ReportEvents"]))
    assert "another /swapaware.v1.PolicyService/ReportEvents request" in why
    # an Admit made for one job's facts is refused for another's: not even a dry run
    other = pb.AdmitRequest(job=pb.JobFacts(user="root", uid=0, tres_per_node="gres:gpu:1"))
    refusal(svc, "Admit", other, slurm("Admit", REQUESTS["Admit"]))
    assert (refused_count(svc, "other_method"), refused_count(svc, "other_request")) == (2, 3)
    assert observed(svc) == []


def test_the_digest_is_of_the_bytes_as_sent_unknown_fields_included(munge_service, munged):
    """A newer client's request may hold fields this service does not know: the credential is bound
    to the bytes it sent, so they count like any other; bytes added on the way are a different request."""
    svc = munge_service
    unknown = b"\xf8\x3e\x07"  # field 999, varint 7: no field of JobFinishedRequest
    raw = serialised(finish(5)) + unknown
    assert pb.JobFinishedRequest.FromString(raw).job_id == 5
    cred = encoded(munged.socket, cred_binding.payload(method_path("JobFinished"), raw))
    assert call_raw(svc, "JobFinished", raw, cred).applied
    cred = encoded(munged.socket, cred_binding.payload(method_path("JobFinished"), serialised(finish(6))))
    with pytest.raises(grpc.RpcError) as err:
        call_raw(svc, "JobFinished", serialised(finish(6)) + unknown, cred)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "another" in err.value.details()
    assert observed(svc) == [5]


def test_an_admit_refused_for_its_binding_is_not_answered_as_a_dry_run(munge_service, munged):
    """A user's own bound credential still gets a dry run; an unbound one gets nothing."""
    svc = munge_service
    d = call(svc, "Admit", REQUESTS["Admit"], made_by(munged.socket, NOBODY, NOBODY)).decision
    assert "dry_run_not_slurmctld" in reason_codes(d)
    refusal(svc, "Admit", REQUESTS["Admit"], encoded(munged.socket, b"", NOBODY))
