"""``swapaware report``, parsing: TRES strings, the real 22.05 ``sacct --json`` record, the decisions
the service wrote (proto3 JSON) and the reason a GPU was kept whole.

The accounting records and the small world come from test_report.py."""
from __future__ import annotations

import json

import pytest

from policy_service import report as R
from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.slurm.slurm import parse_sacct_json
from policy_service.core.types import GresKind
from tests.unit.report.test_report import GIB, REAL_SACCT, T0, world  # noqa: F401  (world: the fixture)


# ----------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("text, gpus, shards", [
    ("billing=1,cpu=1,gres/gpu=1,mem=256M,node=1", 1, 0),
    ("billing=1,cpu=1,gres/shard=2,mem=256M,node=1", 0, 2),
    ("billing=1,cpu=1,mem=256M,node=1", 0, 0),
    ("cpu=1,mem=256,energy=None,node=1,billing=1,gres/shard=1", 0, 1),  # _tres_text of a 22.05 list
    ("gres/gpu=2,gres/gpu:a100=2", 2, 0),  # typed entries repeat the untyped total
    ("gres/gpu:a100=1,gres/gpu:h100=2", 3, 0),  # typed only: summed
    ("gres/gpumem=81920M,gres/gpu=4,gres/shard=0", 4, 0),
    ("", 0, 0),
])
def test_parse_tres(text, gpus, shards):
    assert R.parse_tres(text) == R.TresCounts(gpus=gpus, shards=shards)


def test_real_sacct_record_parses_to_a_shared_job_with_its_decision():
    (job,) = parse_sacct_json(json.dumps(REAL_SACCT))
    assert R.parse_tres(job.tres_alloc) == R.TresCounts(0, 1)
    row = R.join_job(job, R.HistorySnapshot(), shards_per_gpu=8, now=0.0)
    assert row.shared and not row.whole_gpu and row.elapsed_s == 2 and row.wait_s == 0
    assert row.decision_id == "83ca41d906784792" and row.action == "share" and row.decided_shards == 1
    assert row.status is R.RecordStatus.AS_DECIDED and not row.in_history
    # not in the history: the share action alone says it asked for one whole GPU
    assert row.gpu_hours_saved == pytest.approx(2 / 3600 * 7 / 8)


def test_decision_row_reads_proto3_json_written_by_the_service(world):
    d = world.job(1, submit=T0, run_s=10, peak=3 * GIB)
    d2 = world.job(2, submit=T0 + 20, run_s=10)
    world.flush()
    from policy_service.history.store import ReadOnlyHistory

    with ReadOnlyHistory(world.db) as h:
        r = h.decisions_by_id([d2.decision_id])[d2.decision_id]
    row = (r.decision_id, r.action, r.shards, r.facts_json, r.decision_json)
    assert '"peakBytes": "' in row[4] or '"peakBytes":"' in row[4]  # uint64 as a JSON string
    hd = R.decision_from_row(*row)
    assert hd.action == "share" and hd.shards == d2.shards == 1
    assert hd.peak_bytes == d2.estimate.peak_bytes == 3 * GIB and hd.margin_bytes == d2.estimate.margin_bytes
    assert hd.asked_kind is GresKind.GPU and hd.asked_gpus == 1
    assert d.action == pb.ACTION_WHOLE_GPU
    assert hd.whole_because == ""  # shared
    with ReadOnlyHistory(world.db) as h:
        r1 = h.decisions_by_id([d.decision_id])[d.decision_id]
    assert R.decision_from_row(r1.decision_id, r1.action, r1.shards, r1.facts_json,
                               r1.decision_json).whole_because == "no_history"


@pytest.mark.parametrize("action,codes,expected", [
    ("whole_gpu", ["no_history", "whole_gpu_as_shards", "priority_default"], "no_history"),
    ("whole_gpu", ["queue_short", "estimate_from_history", "whole_gpu_as_shards"], "queue_short"),
    ("whole_gpu", ["raised_to_observed_max", "too_large_to_share", "estimate_from_history"], "too_large_to_share"),
    ("whole_gpu", ["compute_bound", "estimate_from_history"], "compute_bound"),
    ("whole_gpu", ["protected_qos"], "protected_qos"),
    ("whole_gpu", ["typed_gpu", "estimate_from_history"], "typed_gpu"),
    ("whole_gpu", ["interactive", "no_history"], "interactive"),
    ("whole_gpu", ["priority_default"], ""),
    ("share", ["fits_in_shards", "queue_unknown"], ""),
])
def test_whole_because_is_the_reason_that_kept_the_gpu_whole(action, codes, expected):
    assert R.whole_because(action, codes) == expected
    decision = json.dumps({"reasons": [{"code": c, "message": "m"} for c in codes]})
    assert R.decision_from_row("d", action, 0, "{}", decision).whole_because == expected
