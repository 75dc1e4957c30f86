"""Values that reach the model are bounded, over the real gRPC service on loopback: events whose
peak, device size, utilisation, times or exit status are out of range are refused (INVALID_ARGUMENT,
a reason, a log line, a count in swapaware_events_refused_total) and never folded into the
statistics; a poisoned row written straight into the history cannot take Admit or Explain down."""
from __future__ import annotations

import json
import logging
import math
import sqlite3
import time

import grpc
import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.core.bounds import MAX_NODE_BYTES
from policy_service.core.types import KeyLevel

from tests.adapter.serving.test_service import GIB, facts, run_job

U64_MAX = 2**64 - 1


def refused(service, why: str) -> float:
    return service.handler.metrics.registry.get_sample_value("swapaware_events_refused_total", {"why": why}) or 0.0


def started(client, slurm_jobs, job_id: int, name: str = "train") -> pb.Decision:
    d = client.admit(facts(name=name)).decision
    slurm_jobs.comments[job_id] = d.rewrite.admin_comment
    client.call("JobStarted", pb.JobStartedRequest(job_id=job_id, node="n1", gpu_indices=[0], started_at=1000.0,
                                                   event_id=f"s{job_id}"))
    return d


def finish(job_id: int, **kw) -> pb.JobFinishedRequest:
    base = dict(job_id=job_id, node="n1", gpu_indices=[0], finished_at=1100.0, event_id=f"f{job_id}",
                telemetry_source="nvml")
    base.update(kw)
    return pb.JobFinishedRequest(**base)


def class_stats(service, decision_id: str) -> dict:
    service.handler.flush()
    return service.store.stats(service.store.decision(decision_id).keys)


def test_a_peak_of_2_63_is_refused_and_learns_nothing(client, slurm_jobs, service, caplog):
    d = started(client, slurm_jobs, 11)
    before = refused(service, "peak_bytes")
    with caplog.at_level(logging.WARNING, logger="swapaware.decisions"):
        with pytest.raises(grpc.RpcError) as err:
            client.call("JobFinished", finish(11, peak_gpu_bytes=2**63 - 1,
                                              gpus=[pb.GpuUsage(gpu_index=0, total_bytes=80 * GIB)]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "peak_gpu_bytes" in err.value.details() and "80.0GiB" in err.value.details()
    assert refused(service, "peak_bytes") == before + 1
    assert any("refused" in r.getMessage() and "peak_gpu_bytes" in r.getMessage() for r in caplog.records)
    assert all(s.runs == 0 for s in class_stats(service, d.decision_id).values())
    assert service.store.observations(job_id=11) == []
    # the class is still unknown: a whole GPU, not "too large to share" at 8 EiB
    again = client.admit(facts()).decision
    assert again.estimate.peak_bytes == 0 and "too_large_to_share" not in {r.code for r in again.reasons}


def test_a_negative_peak_is_refused(client, slurm_jobs, service):
    """-1 as an int64 on the wire (what a signed sender puts there) reads as 2^64-1: it once made
    the service fail with INTERNAL (SQLite cannot hold it)."""
    started(client, slurm_jobs, 12)
    raw = finish(12).SerializeToString() + bytes([8 << 3]) + b"\xff" * 9 + b"\x01"  # field 8, varint -1
    assert pb.JobFinishedRequest.FromString(raw).peak_gpu_bytes == U64_MAX
    call = client._channel.unary_unary("/swapaware.v1.PolicyService/JobFinished",
                                       response_deserializer=pb.JobFinishedResponse.FromString)
    with pytest.raises(grpc.RpcError) as err:
        call(raw, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "peak_gpu_bytes" in err.value.details()
    assert service.store.observations(job_id=12) == []


def test_a_peak_within_the_jobs_gpus_is_applied(client, slurm_jobs, service):
    d, fin = run_job(client, slurm_jobs, 13, facts(), peak=79 * GIB)
    assert fin.applied
    assert class_stats(service, d.decision_id)[KeyLevel.CLASS].max_peak_bytes == 79 * GIB


@pytest.mark.parametrize("why,fields", [
    ("peak_bytes", dict(peak_gpu_bytes=200 * GIB)),  # one 80 GiB GPU (gpu.memory_bytes): no report
    ("peak_bytes", dict(peak_gpu_bytes=100 * GIB, gpus=[pb.GpuUsage(gpu_index=0, total_bytes=80 * GIB)])),
    ("device_bytes", dict(gpus=[pb.GpuUsage(gpu_index=0, total_bytes=2**62)])),
    ("device_bytes", dict(gpus=[pb.GpuUsage(gpu_index=0, peak_bytes=90 * GIB, total_bytes=80 * GIB)])),
    ("utilisation", dict(gpus=[pb.GpuUsage(gpu_index=0, util_mean_pct=250.0)])),
    ("utilisation", dict(gpus=[pb.GpuUsage(gpu_index=0, util_mean_pct=-1.0)])),
    ("utilisation", dict(gpus=[pb.GpuUsage(gpu_index=0, util_mean_pct=math.nan)])),
    ("time", dict(started_at=1200.0)),  # finished before it started
    ("time", dict(started_at=1000.0, finished_at=time.time() + 10 * 86400)),  # in the future
    ("time", dict(started_at=1.0, finished_at=1.0 + 10 * 365 * 86400)),  # a ten-year run
    ("exit_status", dict(exit_code=-1)),
    ("exit_status", dict(exit_signal=1000)),
    ("gpus", dict(gpu_indices=[4096])),
    ("gpus", dict(gpu_indices=list(range(100)))),
])
def test_out_of_range_values_in_a_batch_are_refused_the_rest_applied(client, slurm_jobs, service, why, fields):
    d = started(client, slurm_jobs, 21)
    started(client, slurm_jobs, 22, name="other")
    before = refused(service, why)
    bad = finish(21, peak_gpu_bytes=GIB, **{k: v for k, v in fields.items() if k != "peak_gpu_bytes"})
    if "peak_gpu_bytes" in fields:
        bad.peak_gpu_bytes = fields["peak_gpu_bytes"]
    good = finish(22, peak_gpu_bytes=2 * GIB)
    results = client.call("ReportEvents", pb.ReportEventsRequest(
        events=[pb.JobEvent(finished=bad), pb.JobEvent(finished=good)])).results
    assert [r.code for r in results] == [grpc.StatusCode.INVALID_ARGUMENT.value[0], 0], results
    assert results[0].message and not results[0].applied and results[1].applied
    assert refused(service, why) == before + 1
    assert KeyLevel.CLASS not in class_stats(service, d.decision_id)  # the good one is of another class


def test_a_finish_before_the_recorded_start_is_refused(client, slurm_jobs, service):
    started(client, slurm_jobs, 31)  # started at 1000
    with pytest.raises(grpc.RpcError) as err:
        client.call("JobFinished", finish(31, finished_at=900.0, peak_gpu_bytes=GIB))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "before" in err.value.details()
    assert service.store.observations(job_id=31) == []


def test_a_start_out_of_range_is_refused(client, slurm_jobs, service):
    before = refused(service, "gpus")
    with pytest.raises(grpc.RpcError) as err:
        client.call("JobStarted", pb.JobStartedRequest(job_id=41, node="n1", gpu_indices=[2**32 - 1],
                                                       started_at=1000.0, event_id="s41"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused(service, "gpus") == before + 1
    with pytest.raises(grpc.RpcError) as err:
        client.call("JobStarted", pb.JobStartedRequest(job_id=41, node="n1", gpu_indices=[0],
                                                       started_at=time.time() + 86400, event_id="s41b"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "future" in err.value.details()


POISON = {"samples": 3, "runs": 3, "ewma_peak_bytes": 1e300, "ewma_absdev_bytes": -5.0,
          "max_peak_bytes": 2**70, "last_peak_bytes": -(2**70), "margin_multiplier": 1e12,
          "whole_gpu_runs_left": 0, "solo_runs": 2, "shared_runs": 2, "ewma_solo_runtime_s": 1e-300,
          "ewma_shared_runtime_s": 1e308, "ewma_corunners": -3.0, "util_runs": 2, "ewma_solo_util": 7.5,
          "recent_ratios": [1e300, -1.0, 2.0, 3.0, 4.0], "recent_peaks": [2**70, -1, 5, 6, 7]}


@pytest.mark.parametrize("poison", [POISON, {**POISON, "ewma_peak_bytes": "NaN"}, {"samples": 1, "runs": 1,
                                    "ewma_peak_bytes": 2**63 - 1, "max_peak_bytes": 2**64 + 7}])
def test_a_poisoned_row_in_the_history_cannot_take_admit_down(client, slurm_jobs, service, poison):
    d, _ = run_job(client, slurm_jobs, 51, facts(), peak=3 * GIB)
    keys = service.store.decision(d.decision_id).keys
    text = json.dumps(poison).replace('"NaN"', "NaN")
    with sqlite3.connect(service.store.path) as db:  # what someone with write access to the file could do
        db.executemany("UPDATE class_stats SET stats_json=? WHERE key=?", [(text, k) for k in keys.values()])
    for brief in (False, True):  # beyond any node's GPUs, or not a number at all: never shared on it
        reply = client.call("Admit", pb.AdmitRequest(job=facts(), brief=brief)).decision
        assert reply.action == pb.ACTION_WHOLE_GPU, reply
    full = client.admit(facts()).decision
    assert 0 <= full.estimate.peak_bytes <= MAX_NODE_BYTES
    assert full.estimate.observed_max_bytes <= MAX_NODE_BYTES
    assert 0 <= full.site_factor <= 1000 and math.isfinite(full.swap_cost.slowdown)
    # an account's other classes: predicted within what a node's GPUs hold, never 8 EiB
    other = client.admit(facts(name="eval")).decision
    assert other.estimate.peak_bytes <= MAX_NODE_BYTES


def test_a_poisoned_observation_cannot_take_explain_down(client, slurm_jobs, service):
    run_job(client, slurm_jobs, 61, facts(), peak=3 * GIB)
    with sqlite3.connect(service.store.path) as db:
        db.execute("UPDATE observations SET peak_bytes=?, co_runners=?, exit_code=?, gpu_indices=? WHERE job_id=61",
                   (-5, -1, 2**40, "[-1, 99999999999]"))
    resp = client.explain(pb.ExplainRequest(job_id=61))
    (o,) = resp.observations
    assert not o.HasField("peak_gpu_bytes") and o.co_runners == 0
