"""The service's Prometheus endpoint, scraped over HTTP from a real service (real gRPC, real local
socket, real SQLite): every series moves with what the service did."""
from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.serving.client import PolicyClient
from policy_service.config import load_config
from policy_service.config import split_host_port as split_address
from policy_service.serving.metrics import ERROR_BUCKETS, ServiceMetrics
from policy_service.serving.server import start_service

from tests.adapter.conftest import SlurmJobs, socket_call


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def service(short_dir):
    cfg = load_config(env={"SWAPAWARE_SERVICE__DB_PATH": str(short_dir / "h.sqlite3"),
                           "SWAPAWARE_SERVICE__SOCKET_PATH": str(short_dir / "s.sock"),
                           "SWAPAWARE_SERVICE__GRPC_ADDRESS": "127.0.0.1:0",
                           "SWAPAWARE_SERVICE__METRICS_ADDRESS": "127.0.0.1:0",
                           "SWAPAWARE_POLICY__SHARE_MIN_QUEUE": "0", "SWAPAWARE_POLICY__REDECIDE_PENDING": "false"})
    slurm = SlurmJobs()
    svc = start_service(cfg, slurm=slurm)
    try:
        yield svc, cfg, slurm, svc.metrics_server.server_port
    finally:
        svc.stop()


def admit_line(name: str, plugin: dict | None = None) -> dict:
    req = {"brief": True, "job": {"user": "root", "uid": 0, "jobName": name, "tresPerNode": "gres:gpu:1"}}
    if plugin is not None:
        req["plugin"] = plugin
    return {"method": "Admit", "request": req}


def test_every_series_moves_with_what_the_service_did(service):
    svc, cfg, slurm, port = service
    before = scrape(port)
    assert 0 <= value(before, "swapaware_queue_snapshot_age_seconds") < 60  # polled before serving
    assert value(before, "swapaware_history_bytes") > 0

    # Three Admits over the socket (slurmctld's), one over gRPC (no identity set up here: trusted).
    ids = []
    for i in range(3):
        reply = socket_call(cfg.service.socket_path, admit_line("train", {"instance": "a", "breakerOpen": 2 * i,
                                                                          "serviceError": i}))
        d = reply["response"]["decision"]
        ids.append(d["decisionId"])
        slurm.set_admin_comment(100 + i, d["rewrite"]["adminComment"])
    PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0).admit(pb.JobFacts(user="u", job_name="x", tres_per_node="gres:gpu:1"))
    # a new Lua state (slurmctld restarted): its counts start again
    socket_call(cfg.service.socket_path, admit_line("train", {"instance": "b", "breakerOpen": 1, "serviceError": 0}))

    # Runs: one within its prediction, one far above it and out of memory.
    for job_id, peak, oom in ((100, 4 << 30, False), (101, 40 << 30, True)):
        svc.handler.job_finished(pb.JobFinishedRequest(job_id=job_id, node="n1", gpu_indices=[0], started_at=1.0,
                                                       finished_at=100.0, exit_code=1 if oom else 0,
                                                       peak_gpu_bytes=peak, oom_detected=oom,
                                                       event_id=f"e{job_id}"))
    s = scrape(port)
    decided = sum(v for (name, _), v in s.items() if name == "swapaware_decisions_total")
    assert decided == 5
    assert value(s, "swapaware_decisions_total", action="whole_gpu", reason="no_history", mode="enforce") >= 1
    assert value(s, "swapaware_admit_seconds_count", transport="socket") == 4
    assert value(s, "swapaware_admit_seconds_count", transport="grpc") == 1
    assert value(s, "swapaware_plugin_fail_open_total", why="breaker_open") == 4 + 1  # 0, 2, 4, then 1 anew
    assert value(s, "swapaware_plugin_fail_open_total", why="service_error") == 2
    assert value(s, "swapaware_ooms_total", shared="false") == 1
    assert value(s, "swapaware_peak_error_ratio_count") == 0  # no prediction yet for their class's first runs
    assert value(s, "swapaware_history_bytes") >= value(before, "swapaware_history_bytes")

    # Another run of a class with history: predicted, shared, and it uses more than its shards.
    svc.handler.job_finished(pb.JobFinishedRequest(job_id=102, node="n1", gpu_indices=[0], started_at=1.0,
                                                   finished_at=100.0, exit_code=0, peak_gpu_bytes=3 << 30,
                                                   event_id="e102"))
    d = socket_call(cfg.service.socket_path, admit_line("train"))["response"]["decision"]
    assert d["action"].startswith("ACTION_SHARE"), d
    slurm.set_admin_comment(103, d["rewrite"]["adminComment"])
    predicted = svc.handler.explain(pb.ExplainRequest(decision_id=d["decisionId"])).decision.estimate.peak_bytes
    peak = d["shards"] * cfg.gpu.shard_bytes + (1 << 30)
    svc.handler.job_finished(pb.JobFinishedRequest(job_id=103, node="n1", gpu_indices=[0], started_at=1.0,
                                                   finished_at=100.0, exit_code=0, peak_gpu_bytes=peak,
                                                   event_id="e103"))
    s = scrape(port)
    assert value(s, "swapaware_peak_error_ratio_count") == 1
    err = (predicted - peak) / peak  # (no _sum: a histogram with negative buckets exposes none)
    upper = min(b for b in ERROR_BUCKETS if b >= err)
    lower = max((b for b in ERROR_BUCKETS if b < err), default=None)
    assert value(s, "swapaware_peak_error_ratio_bucket", le=str(upper)) == 1
    if lower is not None:
        assert value(s, "swapaware_peak_error_ratio_bucket", le=str(lower)) == 0
    assert value(s, "swapaware_charge_overruns_total") == 1


def test_plugin_counters_are_deltas_per_lua_state():
    m = ServiceMetrics()
    for instance, total in (("a", 3), ("a", 3), ("a", 5), ("b", 2), ("a", 1)):
        m.plugin_report(instance, "breaker_open", total)
    m.plugin_report("a", "no_such_reason", 9)
    assert m.fail_open.labels(why="breaker_open")._value.get() == 3 + 2 + 2 + 1  # "a" went down: started over


@pytest.mark.parametrize("text,expect", [("127.0.0.1:9851", ("127.0.0.1", 9851)), ("[::1]:80", ("::1", 80)),
                                         (":9851", ("0.0.0.0", 9851))])
def test_split_address(text, expect):
    assert split_address(text) == expect


@pytest.mark.parametrize("text", ["9851", "host:", "host:99999", "host:x"])
def test_bad_metrics_address_is_refused_by_the_config(text):
    from policy_service.config import ConfigError
    with pytest.raises(ConfigError, match="metrics_address"):
        load_config(env={"SWAPAWARE_SERVICE__METRICS_ADDRESS": text})
