"""The model's bounds, table-driven: events checked at the door (policy_service.trust.event_bounds),
statistics read back from the history (core.bounds.sane_stats) and the reply builders' saturation
(policy_service.trust.proto_bounds)."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.history.schema import ObservationRow, checked_stats, stats_from_json
from policy_service.core.bounds import MAX_NODE_BYTES, MAX_RUNTIME_S, sane_stats
from policy_service.core.types import (Action, ClassStats, Decision, DemandEstimate, EstimateSource, Rewrite)
from policy_service.trust.event_bounds import Refused, check_event
from policy_service.serving.decision_proto import decision_to_proto
from policy_service.trust.proto_bounds import U64_MAX, observation_to_proto

GIB = 1024**3
NOW = 1_800_000_000.0


def fin(**kw) -> pb.JobFinishedRequest:
    base = dict(job_id=7, node="n1", gpu_indices=[0], event_id="e", started_at=NOW - 100, finished_at=NOW - 10)
    base.update(kw)
    return pb.JobFinishedRequest(**base)


def why(kind, req) -> Refused | None:
    r = check_event(kind, req, now=NOW, gpu_memory_bytes=80 * GIB)
    return None if r is None else r.why


@pytest.mark.parametrize("req,expect", [
    (fin(peak_gpu_bytes=80 * GIB), None),
    (fin(peak_gpu_bytes=int(80 * GIB * 1.01)), None),  # within the tolerance
    (fin(peak_gpu_bytes=82 * GIB), Refused.PEAK),
    (fin(peak_gpu_bytes=2**63 - 1), Refused.PEAK),
    (fin(peak_gpu_bytes=2**64 - 1), Refused.PEAK),
    (fin(peak_gpu_bytes=150 * GIB, gpu_indices=[0, 1]), None),  # two GPUs of gpu.memory_bytes
    (fin(peak_gpu_bytes=140 * GIB, gpus=[pb.GpuUsage(gpu_index=0, total_bytes=141 * GIB)]), None),  # a larger GPU
    (fin(peak_gpu_bytes=100 * GIB, gpus=[pb.GpuUsage(gpu_index=0, total_bytes=40 * GIB),
                                         pb.GpuUsage(gpu_index=1, total_bytes=40 * GIB)]), Refused.PEAK),
    (fin(gpus=[pb.GpuUsage(gpu_index=0, total_bytes=(1 << 40) + 1)]), Refused.DEVICE),
    (fin(gpus=[pb.GpuUsage(gpu_index=0, mean_bytes=41 * GIB, total_bytes=40 * GIB)]), Refused.DEVICE),
    (fin(gpus=[pb.GpuUsage(gpu_index=0, util_mean_pct=100.0)]), None),
    (fin(gpus=[pb.GpuUsage(gpu_index=0, util_mean_pct=100.5)]), Refused.UTILISATION),
    (fin(gpus=[pb.GpuUsage(gpu_index=0, util_mean_pct=math.inf)]), Refused.UTILISATION),
    (fin(exit_code=255, exit_signal=127, derived_exit_code=255), None),
    (fin(exit_code=256), Refused.EXIT_STATUS),
    (fin(derived_exit_code=-1), Refused.EXIT_STATUS),
    (fin(started_at=0.0, finished_at=0.0), None),  # unknown times: the service's records and clock
    (fin(finished_at=NOW + 500), None),  # a node's clock a little ahead
    (fin(finished_at=NOW + 700), Refused.TIME),
    (fin(started_at=NOW - 10, finished_at=NOW - 100), Refused.TIME),
    (fin(started_at=NOW - MAX_RUNTIME_S - 100), Refused.TIME),
    (fin(finished_at=math.nan), Refused.TIME),
    (fin(gpu_indices=list(range(64))), None),
    (fin(gpu_indices=[64]), Refused.GPUS),
    (fin(gpus=[pb.GpuUsage(gpu_index=500)]), Refused.GPUS),
    (fin(event_id=""), Refused.FIELDS),
    (fin(job_id=2**32), Refused.FIELDS),
])
def test_finished_events(req, expect):
    assert why("finished", req) == expect


@pytest.mark.parametrize("req,expect", [
    (pb.JobStartedRequest(job_id=1, gpu_indices=[0, 7], started_at=NOW), None),
    (pb.JobStartedRequest(job_id=1, gpu_indices=[0], started_at=NOW + 3600), Refused.TIME),
    (pb.JobStartedRequest(job_id=1, gpu_indices=[2**32 - 1]), Refused.GPUS),
    (pb.JobStartedRequest(job_id=0), Refused.FIELDS),
])
def test_started_events(req, expect):
    assert why("started", req) == expect


def test_not_an_event():
    assert why(None, None) is Refused.FIELDS


def test_statistics_the_service_wrote_read_back_unchanged():
    s = ClassStats(samples=5, runs=6, ewma_peak_bytes=3.5 * GIB, ewma_absdev_bytes=0.2 * GIB, max_peak_bytes=4 * GIB,
                   last_peak_bytes=3 * GIB, oom_count=1, margin_multiplier=1.5, whole_gpu_runs_left=1, solo_runs=2,
                   shared_runs=3, ewma_solo_runtime_s=100.0, ewma_shared_runtime_s=130.0, ewma_corunners=1.4,
                   util_runs=2, ewma_solo_util=0.6, recent_ratios=(1.0, 1.1), recent_peaks=(3 * GIB, 4 * GIB))
    assert checked_stats(json.dumps(dataclasses.asdict(s))) == (s, ())


@pytest.mark.parametrize("stored,field,expect", [
    ({"samples": 2, "ewma_peak_bytes": 1e300, "max_peak_bytes": 2**70}, "ewma_peak_bytes", float(MAX_NODE_BYTES)),
    ({"samples": 2, "ewma_peak_bytes": 1e300, "max_peak_bytes": 2**70}, "max_peak_bytes", MAX_NODE_BYTES),
    ({"samples": 2, "ewma_peak_bytes": -1.0, "max_peak_bytes": 5}, "samples", 0),  # memory figures void
    ({"samples": 2, "ewma_peak_bytes": math.nan, "recent_peaks": [1, 2]}, "recent_peaks", ()),
    ({"samples": "many"}, "samples", 0),
    ({"margin_multiplier": 1e9}, "margin_multiplier", 64.0),
    ({"margin_multiplier": 0.1}, "margin_multiplier", 1.0),
    ({"ewma_solo_util": 7.5}, "ewma_solo_util", 1.0),
    ({"ewma_corunners": -2}, "ewma_corunners", 0.0),
    ({"ewma_solo_runtime_s": 1e-300}, "ewma_solo_runtime_s", 0.0),
    ({"ewma_shared_runtime_s": math.inf}, "ewma_shared_runtime_s", MAX_RUNTIME_S),
    ({"recent_ratios": [1.0, math.nan, 1e9, "x"]}, "recent_ratios", (1.0, 64.0)),
    ({"recent_peaks": list(range(300))}, "recent_peaks", tuple(range(44, 300))),
])
def test_statistics_out_of_range_are_brought_within_bounds(stored, field, expect):
    s, changed = sane_stats(stored)
    assert getattr(s, field) == expect and changed


@pytest.mark.parametrize("text", ["not json", "[1, 2]", "null", '{"samples": NaN}'])
def test_unreadable_statistics_start_again(text):
    assert stats_from_json(text).samples == 0


def test_the_reply_builder_saturates():
    est = DemandEstimate(peak_bytes=2**70, margin_bytes=-5, source=EstimateSource.CLASS, samples=2**40,
                         observed_max_bytes=2**65)
    d = Decision("d1", "m", Action.WHOLE_GPU, 2**33, 2**40, est, 1.0, 2**80, 0.0, (), Rewrite(), "c", NOW)
    msg = decision_to_proto(d)
    assert (msg.estimate.peak_bytes, msg.estimate.margin_bytes, msg.estimate.samples) == (U64_MAX, 0, 2**32 - 1)
    assert msg.swap_cost.offloaded_bytes == U64_MAX and msg.site_factor == 2**31 - 1 and msg.shards == 2**32 - 1


def test_an_observation_out_of_range_is_shown_not_failed():
    row = ObservationRow("e", -3, "d", "n", (0, -1, 2**40), None, NOW, None, 2**40, -5, False, -1, False, "x", NOW)
    ob = observation_to_proto(row)
    assert (ob.job_id, ob.exit_code, ob.co_runners, list(ob.gpu_indices)) == (0, 2**31 - 1, 0, [0])
    assert not ob.HasField("peak_gpu_bytes")
    ok = observation_to_proto(dataclasses.replace(row, peak_bytes=3 * GIB))
    assert ok.peak_gpu_bytes == 3 * GIB
