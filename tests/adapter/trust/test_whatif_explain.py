"""What the service tells a stranger about a job that is nobody's record (a what-if Explain of job
facts, an Admit answered as a dry run): only the action and the shard count, never the estimate
learned from other users' jobs; the job's own user and admins see all of it. Over the real local
socket, each caller a real uid (SO_PEERCRED)."""
from __future__ import annotations

from policy_service._generated.swapaware.v1 import policy_pb2 as pb

from tests.adapter.as_user import NOBODY
from tests.adapter.conftest import socket_call
from tests.adapter.trust.test_socket_peer import call_as, needs_root, open_socket_service  # noqa: F401  (the fixture)

GIB = 1024**3
ALICE = {"user": "alice", "uid": 4321, "account": "proj", "partition": "gpu", "jobName": "train",
         "tresPerNode": "gres:gpu:1", "scriptFingerprint": "00000001deadbeef"}
BRIEF = {"decisionId", "action", "shards", "mode"}  # the id of a dry run: recorded nowhere


def learn(svc, slurm_jobs, job: dict, job_id: int, peak: int) -> None:
    """One run of ``job``'s class, recorded and observed (root over the socket: slurmctld and the hooks)."""
    path = svc.socket_path
    d = socket_call(path, {"method": "Admit", "request": {"job": job}})["response"]["decision"]
    slurm_jobs.comments[job_id] = d["rewrite"]["adminComment"]
    fin = pb.JobFinishedRequest(job_id=job_id, node="n1", gpu_indices=[0], started_at=1000.0, finished_at=1100.0,
                                event_id=f"f{job_id}", peak_gpu_bytes=peak, telemetry_source="nvml")
    svc.handler.job_finished(fin)


def whatif(job: dict) -> dict:
    return {"method": "Explain", "request": {"job": job}}


@needs_root
def test_a_stranger_sees_only_the_action_and_shards(open_socket_service, slurm_jobs):
    svc = open_socket_service
    path = svc.socket_path
    path.chmod(0o666)  # as if nobody were in the socket's group
    learn(svc, slurm_jobs, ALICE, 11, 3 * GIB)
    full = socket_call(path, whatif(ALICE))["response"]["decision"]  # root: an admin
    assert full["action"] == "ACTION_SHARE" and int(full["estimate"]["peakBytes"]) == 3 * GIB
    assert full["reasons"] and full["rewrite"]["adminComment"]

    seen = call_as(NOBODY, path, whatif(ALICE))["response"]["decision"]
    assert set(seen) <= BRIEF and (seen["action"], seen["shards"]) == (full["action"], full["shards"]), seen
    dry = call_as(NOBODY, path, {"method": "Admit", "request": {"job": ALICE, "dryRun": True}})["response"]
    assert set(dry["decision"]) <= BRIEF, dry
    # an Admit that is not slurmctld's is a dry run too: the same, and why it was not recorded
    plain = call_as(NOBODY, path, {"method": "Admit", "request": {"job": ALICE}})["response"]["decision"]
    assert set(plain) <= BRIEF | {"reasons"}
    assert [r["code"] for r in plain["reasons"]] == ["dry_run_not_slurmctld"]


@needs_root
def test_the_jobs_own_user_sees_the_whole_what_if(open_socket_service, slurm_jobs):
    svc = open_socket_service
    path = svc.socket_path
    path.chmod(0o666)
    own = {**ALICE, "user": "nobody", "uid": NOBODY}
    learn(svc, slurm_jobs, own, 12, 5 * GIB)
    seen = call_as(NOBODY, path, whatif(own))["response"]["decision"]
    assert int(seen["estimate"]["peakBytes"]) == 5 * GIB and seen["reasons"], seen
    # a user's facts with no uid: the peer's user name stands for it
    by_name = call_as(NOBODY, path, whatif({k: v for k, v in own.items() if k != "uid"}))["response"]["decision"]
    assert "estimate" in by_name
