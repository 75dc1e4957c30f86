import threading

import grpc
import pytest
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.history.store import HistoryStore

from tests.adapter.conftest import socket_call

GIB = 1024**3


def facts(name="train", gres="gres:gpu:1", user="alice", **kw):
    return pb.JobFacts(user=user, account="proj", partition="gpu", job_name=name, tres_per_node=gres,
                       script_fingerprint="00000001deadbeef", **kw)


def run_job(client, slurm_jobs, job_id, job, *, peak=None, exit_code=0, gpus=(0,), start=1000.0, end=1100.0,
            oom=False):
    """Admit a job, 'submit' it (slurmctld keeps the admin comment), start and finish it."""
    d = client.admit(job).decision
    slurm_jobs.comments[job_id] = d.rewrite.admin_comment
    client.call("JobStarted", pb.JobStartedRequest(job_id=job_id, node="n1", gpu_indices=list(gpus),
                                                   started_at=start, event_id=f"s{job_id}"))
    fin = pb.JobFinishedRequest(job_id=job_id, node="n1", gpu_indices=list(gpus), finished_at=end,
                                exit_code=exit_code, event_id=f"f{job_id}", oom_detected=oom,
                                telemetry_source="fake-nvml" if peak else "none")
    if peak is not None:
        fin.peak_gpu_bytes = peak
    return d, client.call("JobFinished", fin)


def test_health_service_serving(service):
    with grpc.insecure_channel(f"127.0.0.1:{service.grpc_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", "swapaware.v1.PolicyService"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=2)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_unknown_job_gets_whole_gpu_and_a_record(client, service):
    d = client.admit(facts()).decision
    assert d.action == pb.ACTION_WHOLE_GPU
    assert d.rewrite.tres_per_node == "gres:shard:8" and d.shards == 8
    assert d.rewrite.admin_comment.startswith("swapaware:v1 id=" + d.decision_id)
    assert "no_history" in {r.code for r in d.reasons}
    service.handler.flush()  # decisions are recorded off the reply's path
    assert service.store.decision(d.decision_id) is not None


def test_learning_loop_moves_class_to_shards(client, slurm_jobs, service):
    d1, fin = run_job(client, slurm_jobs, 11, facts(), peak=3 * GIB)
    assert d1.action == pb.ACTION_WHOLE_GPU and fin.applied and fin.decision_id == d1.decision_id
    d2 = client.admit(facts()).decision
    assert d2.action == pb.ACTION_SHARE and d2.shards == 1
    assert d2.rewrite.tres_per_node == "gres:shard:1"
    assert d2.estimate.source == pb.ESTIMATE_SOURCE_CLASS and d2.estimate.peak_bytes == 3 * GIB
    # another job name of the same user learns nothing from it at class level, but user+name differs too
    other = client.admit(facts(name="eval")).decision
    assert other.action == pb.ACTION_WHOLE_GPU


def test_replayed_finish_is_applied_once(client, slurm_jobs, service):
    _, fin = run_job(client, slurm_jobs, 12, facts(), peak=2 * GIB)
    again = pb.JobFinishedRequest(job_id=12, node="n1", finished_at=1100.0, event_id="f12", peak_gpu_bytes=9 * GIB)
    assert client.call("JobFinished", again).applied is False
    keys = service.store.decision(fin.decision_id).keys
    stats = service.store.stats(keys)
    assert all(s.runs == 1 for s in stats.values()) and len(stats) == 4


def test_runtime_and_corunners_from_the_service_records(client, slurm_jobs, service):
    # a on GPU 1 [1000, 1100]; b on GPU 1 [1050, 1150]; c on GPU 2 [1050, 1150]; events in time order
    for jid, name in ((21, "a"), (22, "b"), (23, "c")):
        slurm_jobs.comments[jid] = client.admit(facts(name=name)).decision.rewrite.admin_comment
    for jid, gpu, start in ((21, 1, 1000.0), (22, 1, 1050.0), (23, 2, 1050.0)):
        client.call("JobStarted", pb.JobStartedRequest(job_id=jid, node="n1", gpu_indices=[gpu], started_at=start,
                                                       event_id=f"s{jid}"))
    for jid, end in ((21, 1100.0), (22, 1150.0), (23, 1150.0)):
        client.call("JobFinished", pb.JobFinishedRequest(job_id=jid, node="n1", finished_at=end, event_id=f"f{jid}"))
    obs = {o.job_id: o for o in service.store.observations()}
    assert obs[21].runtime_s == 100.0 and obs[21].gpu_indices == (1,)  # GPUs taken from the start record
    assert obs[21].co_runners == 1 and obs[22].co_runners == 1  # they overlapped on GPU 1
    assert obs[23].co_runners == 0  # other GPU


def test_finish_without_decision_is_kept(client, service):
    resp = client.call("JobFinished", pb.JobFinishedRequest(job_id=99, node="n1", finished_at=5.0, event_id="x99"))
    assert resp.applied and resp.decision_id == ""
    assert [o.job_id for o in service.store.observations(job_id=99)] == [99]


@pytest.mark.parametrize("method,request_msg,code", [
    ("Admit", pb.AdmitRequest(job=pb.JobFacts(user="")), grpc.StatusCode.INVALID_ARGUMENT),
    ("Admit", pb.AdmitRequest(job=pb.JobFacts(user="u", tres_per_node="gres:gpu:a:b:c")), grpc.StatusCode.INVALID_ARGUMENT),
    ("JobStarted", pb.JobStartedRequest(), grpc.StatusCode.INVALID_ARGUMENT),
    ("JobFinished", pb.JobFinishedRequest(job_id=1), grpc.StatusCode.INVALID_ARGUMENT),
    ("Explain", pb.ExplainRequest(job_id=424242), grpc.StatusCode.NOT_FOUND),
    ("Explain", pb.ExplainRequest(decision_id="nope"), grpc.StatusCode.NOT_FOUND),
    ("Explain", pb.ExplainRequest(), grpc.StatusCode.INVALID_ARGUMENT),
])
def test_errors_are_status_codes(client, method, request_msg, code):
    with pytest.raises(grpc.RpcError) as err:
        client.call(method, request_msg)
    assert err.value.code() == code


def test_explain_by_job_and_dry_run(client, slurm_jobs, service):
    d, _ = run_job(client, slurm_jobs, 31, facts(), peak=5 * GIB)
    resp = client.explain(pb.ExplainRequest(job_id=31))
    assert resp.decision.decision_id == d.decision_id and resp.job.job_name == "train"
    assert [o.peak_gpu_bytes for o in resp.observations] == [5 * GIB]
    service.handler.flush()
    before = sum(1 for _ in service.store.decisions())
    dry = client.explain(pb.ExplainRequest(job=facts())).decision
    assert dry.action == pb.ACTION_SHARE
    service.handler.flush()
    assert sum(1 for _ in service.store.decisions()) == before  # nothing recorded


def test_socket_speaks_proto3_json_of_the_same_messages(service, client):
    resp = socket_call(service.socket_path, {"method": "Admit", "request": {"job": {"user": "bob", "tresPerNode": "gres:gpu:1"}}})
    msg = json_format.ParseDict(resp["response"], pb.AdmitResponse())
    assert msg.decision.action == pb.ACTION_WHOLE_GPU
    service.handler.flush()
    assert service.store.decision(msg.decision.decision_id) is not None
    # the same handler: grpc Explain sees the socket's decision
    assert client.explain(pb.ExplainRequest(decision_id=msg.decision.decision_id)).job.user == "bob"


@pytest.mark.parametrize("payload,code", [
    (b"not json\n", "INVALID_ARGUMENT"),
    (b'["Admit"]\n', "INVALID_ARGUMENT"),
    (b'{"method": "Nope", "request": {}}\n', "UNIMPLEMENTED"),
    (b'{"method": "Admit", "request": {"job": {"user": "u", "bogus": 1}}}\n', "INVALID_ARGUMENT"),
    (b'{"method": "Admit", "request": {"job": {"user": ""}}}\n', "INVALID_ARGUMENT"),
])
def test_socket_errors(service, payload, code):
    assert socket_call(service.socket_path, payload)["error"]["code"] == code


def test_socket_rejects_oversized_request(service):
    big = b'{"method":"Admit","request":{"job":{"user":"' + b"x" * 300_000 + b'"}}}\n'
    assert socket_call(service.socket_path, big)["error"]["message"] == "request too large"


def test_concurrent_finishes_of_one_class_lose_no_update(client, slurm_jobs, service):
    job = facts(name="many")
    ids = list(range(100, 140))
    for jid in ids:
        d = client.admit(job).decision
        slurm_jobs.comments[jid] = d.rewrite.admin_comment

    def finish(jid):
        client.call("JobFinished", pb.JobFinishedRequest(job_id=jid, node="n1", finished_at=10.0, event_id=f"c{jid}",
                                                         peak_gpu_bytes=GIB, started_at=1.0))

    threads = [threading.Thread(target=finish, args=(j,)) for j in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    row = service.store.decision(service.store.observations(job_id=ids[0])[0].decision_id)
    assert service.store.stats(row.keys)[next(iter(row.keys))].runs == len(ids)


def test_history_survives_restart(tmp_path, history_backend):
    path = tmp_path / "h.sqlite3"
    s = history_backend.open(path)
    s.record_start(event_id="e", job_id=5, decision_id="", node="n", gpus=[0], started_at=1.0, received_at=1.0)
    s.close()
    s2 = history_backend.open(path)
    assert s2.run(5).started_at == 1.0 and s2.event_seen("e")
    s2.close()


def test_socket_takes_a_burst_of_concurrent_connections(service):
    """slurmctld may submit many jobs back to back; a small listen backlog would make connects fail."""
    import socket as socketlib

    conns = []
    try:
        for _ in range(64):  # connect all before any is served
            c = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
            c.setblocking(False)
            c.connect(str(service.socket_path))
            conns.append(c)
        for c in conns:
            c.setblocking(True)
            c.settimeout(10)
            c.sendall(b'{"method":"Admit","request":{"job":{"user":"u","tresPerNode":"gres:gpu:1"}}}\n')
        replies = [c.makefile("rb").readline() for c in conns]
    finally:
        for c in conns:
            c.close()
    assert all(b'"response"' in r for r in replies)


def test_stop_records_every_decision_handed_out(service_env, slurm_jobs, history_backend):
    from policy_service.config import load_config
    from policy_service.serving.server import start_service

    svc = start_service(load_config(env={**service_env, **history_backend.env}), slurm=slurm_jobs)
    ids = [svc.handler.admit(pb.AdmitRequest(job=facts(name=f"n{i}"))).decision.decision_id for i in range(200)]
    svc.stop(0)
    store = history_backend.open(service_env["SWAPAWARE_SERVICE__DB_PATH"])
    assert {d.decision_id for d in store.decisions()} >= set(ids)
    store.close()


def test_brief_admit_carries_the_rewrite_and_records_everything(client, service):
    full = client.admit(facts(name="brief")).decision
    brief = client.call("Admit", pb.AdmitRequest(job=facts(name="brief"), brief=True)).decision
    assert brief.rewrite.tres_per_node == full.rewrite.tres_per_node and brief.action == full.action
    assert not brief.reasons and brief.decision_id
    explained = client.explain(pb.ExplainRequest(decision_id=brief.decision_id)).decision
    assert explained.reasons and explained.rewrite.admin_comment == brief.rewrite.admin_comment


def test_shared_run_dying_at_its_cap_sends_the_class_back_to_a_whole_gpu(client, slurm_jobs, service):
    run_job(client, slurm_jobs, 51, facts(name="grows"), peak=3 * GIB)
    d, _ = run_job(client, slurm_jobs, 52, facts(name="grows"), peak=int(9.8 * GIB), exit_code=1)
    assert d.action == pb.ACTION_SHARE and d.shards == 1  # 10 GiB charge, died at 9.8 GiB
    (obs,) = service.store.observations(job_id=52)
    assert obs.oom and obs.shared
    again = client.admit(facts(name="grows")).decision
    assert again.action == pb.ACTION_WHOLE_GPU and "oom_penalty" in {r.code for r in again.reasons}
