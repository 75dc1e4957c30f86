"""Spool replay edge cases against real gRPC servers on loopback: a service without ReportEvents
(an older release: the real handler behind a servicer that answers UNIMPLEMENTED), batches that
would exceed the service's message size, and per-event results that keep or set aside an event."""
from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service._generated.swapaware.v1 import policy_pb2_grpc
from policy_service.serving.grpc_server import PolicyServicer, add_servicer
from policy_service.serving.client import PolicyClient
from policy_service.trust.limits import MAX_REQUEST_BYTES
from slurm_plugin.hooks import spool


class OlderServicer(PolicyServicer):
    """The service as a release before ReportEvents answered: the generated base's UNIMPLEMENTED."""

    ReportEvents = policy_pb2_grpc.PolicyServiceServicer.ReportEvents


@pytest.fixture
def older_client(service):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    add_servicer(OlderServicer(service.handler), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with PolicyClient(f"127.0.0.1:{port}", 5.0) as c:
            yield c
    finally:
        server.stop(0)


class Recording:
    def __init__(self, send):
        self.send, self.calls = send, []

    def __call__(self, method, request):
        self.calls.append((method, request.ByteSize()))
        return self.send(method, request)

    def count(self, method: str) -> int:
        return sum(1 for m, _ in self.calls if m == method)


def finished(job_id: int, heavy: bool = False, event_id: str | None = None) -> pb.JobFinishedRequest:
    req = pb.JobFinishedRequest(job_id=job_id, node="n1", gpu_indices=list(range(8)) if heavy else [0],
                                started_at=1000.0 + job_id, finished_at=2000.0 + job_id,
                                event_id=f"f-{job_id}" if event_id is None else event_id)
    if heavy:  # what an epilog sends for an 8-GPU job the agent saw fill its GPUs and fail
        req.exit_code, req.telemetry_source, req.peak_gpu_bytes = 1, "nvml", 80 << 30
        req.oom_detected, req.oom_evidence = True, "x" * 500
        for i in range(8):
            req.gpus.add(gpu_index=i, peak_bytes=80 << 30, mean_bytes=40 << 30, total_bytes=80 << 30)
    return req


def spool_finished(spool_dir, jobs, heavy: bool = False) -> int:
    for j in jobs:
        req = finished(j, heavy)
        spool.spool_event(spool_dir, "JobFinished", req, req.event_id)
    return len(jobs)


def test_an_older_service_gets_the_events_one_by_one(service, older_client, tmp_path):
    spool_dir = tmp_path / "spool"
    n = spool_finished(spool_dir, range(1, 121))
    send = Recording(older_client.call)
    result = spool.replay(spool_dir, send, max_events=10_000)
    assert (result.sent, result.rejected, result.left, result.stopped_by) == (n, 0, 0, "")
    assert (send.count("ReportEvents"), send.count("JobFinished")) == (1, n)  # asked once, then one by one
    assert len(service.store.observations()) == n
    # an invalid event is still set aside by its own call's INVALID_ARGUMENT
    spool.spool_event(spool_dir, "JobFinished", finished(999, event_id=""), "no-id")
    result = spool.replay(spool_dir, older_client.call, max_events=10)
    assert (result.sent, result.rejected, result.left) == (0, 1, 0)
    assert next((spool_dir / "rejected").glob("*.why")).read_text().startswith("INVALID_ARGUMENT")


def test_batches_stay_under_the_services_message_size(service, client, tmp_path):
    """500 heavy events are ~450 KB, over the service's 256 KB: sent as one ReportEvents the
    service refuses them (RESOURCE_EXHAUSTED) on every try and the spool would never drain."""
    spool_dir = tmp_path / "spool"
    n = spool_finished(spool_dir, range(1, 501), heavy=True)
    send = Recording(client.call)
    # replayed as the agent replays: again while events are left. A batch may outlast the client's
    # deadline on a loaded machine (CI, six clusters beside it: 336 of 500 sent, then DEADLINE_EXCEEDED);
    # the service still applies it and the next replay's duplicates are taken. A batch over the
    # service's size would stop every replay with RESOURCE_EXHAUSTED.
    sent, stops = 0, []
    for _ in range(10):
        result = spool.replay(spool_dir, send, max_events=10_000)
        sent += result.sent
        if result.left == 0:
            break
        stops.append(result.stopped_by)
    assert (result.left, result.stopped_by) == (0, ""), stops
    assert all("Deadline" in why for why in stops), stops
    assert sent >= n and send.count("ReportEvents") >= 2 and not send.count("JobFinished")
    assert max(size for _, size in send.calls) < MAX_REQUEST_BYTES
    assert len(service.store.observations()) == n


def test_results_decide_per_event_what_is_taken_kept_or_set_aside(tmp_path):
    """Applied and duplicate are taken (deleted), a permanent refusal is set aside, a failure inside
    the service (INTERNAL) keeps that event for the next replay, and the replay stops there."""
    spool_dir = tmp_path / "spool"
    spool_finished(spool_dir, range(1, 6))
    codes = {"f-1": (0, True), "f-2": (0, False), "f-3": (9, False), "f-4": (13, False), "f-5": (0, True)}

    def send(method, request):
        assert method == "ReportEvents"
        return pb.ReportEventsResponse(results=[
            pb.EventResult(event_id=ev.finished.event_id, code=codes[ev.finished.event_id][0],
                           applied=codes[ev.finished.event_id][1]) for ev in request.events])

    result = spool.replay(spool_dir, send, max_events=100)
    assert (result.sent, result.rejected, result.left) == (3, 1, 1) and result.stopped_by.startswith("code 13")
    assert [p.name.split("-", 1)[1] for p in spool.pending(spool_dir)] == ["f-4.json"]
    assert next((spool_dir / "rejected").glob("*.why")).read_text().startswith("FAILED_PRECONDITION")


def test_the_replayer_reports_its_last_result_and_stops_when_told(service, tmp_path):
    import threading

    from slurm_plugin.hooks.replayer import SpoolReplayer
    from tests.waiting import wait_for

    spool_dir = tmp_path / "spool"
    n = spool_finished(spool_dir, range(1, 11))
    replayer = SpoolReplayer(spool_dir, lambda: PolicyClient(f"127.0.0.1:{service.grpc_port}", 5.0),
                             interval_s=0.05, max_backoff_s=0.2)
    assert replayer.status()["replay_last"] is None
    stop = threading.Event()
    replayer.start(stop)
    try:
        last = wait_for(lambda: replayer.status()["replay_last"], 15, "a replay")
        assert last == {"sent": n, "rejected": 0, "left": 0, "stopped_by": ""}
        assert replayer.status()["spool_depth"] == 0
    finally:
        stop.set()
    assert replayer.join(5.0)


def test_an_admins_replay_waits_for_the_agents_to_end(tmp_path):
    """`swapaware replay-spool` while the agent replays: it waits for the lock (bounded) and then
    delivers what is left, instead of failing; the agent's own replay does not wait."""
    import fcntl
    import threading

    spool_dir = tmp_path / "spool"
    spool_finished(spool_dir, range(1, 4))

    def send(method, request):
        return pb.ReportEventsResponse(results=[pb.EventResult(event_id=ev.finished.event_id, applied=True)
                                                for ev in request.events])

    held, release = threading.Event(), threading.Event()

    def other_replay():
        with open(spool_dir / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            held.set()
            release.wait(10)

    t = threading.Thread(target=other_replay)
    t.start()
    assert held.wait(10)
    busy = spool.replay(spool_dir, send, max_events=100)  # the agent's: no wait
    assert busy.stopped_by == "another replay holds the spool lock" and busy.left == 3
    threading.Timer(0.3, release.set).start()
    done = spool.replay(spool_dir, send, max_events=100, wait_s=30)
    t.join(10)
    assert (done.sent, done.left, done.stopped_by) == (3, 0, "") and not spool.pending(spool_dir)
