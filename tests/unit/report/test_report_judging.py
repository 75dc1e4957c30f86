"""``swapaware report``, judging one job: a job's accounting record joined with its decision, run
and observation (as decided, overridden and why, no record, not judged), what it held and saved, and
the join by instance when a job id is reused.

The accounting records and the small world come from test_report.py."""
from __future__ import annotations

import json

import pytest

from policy_service import report as R
from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.slurm.slurm import JobInstance, parse_sacct_json
from policy_service.core.types import GresKind
from tests.unit.report.test_report import GIB, T0, build, sacct_record, sacct_text, world  # noqa: F401  (the fixture)


# ----------------------------------------------------------------------------- judging
def _hd(action, shards=0, asked=GresKind.GPU, asked_gpus=1):
    return R.HistoryDecision("d1", action, shards, 3 * GIB, GIB // 3, asked, asked_gpus)


S, O, N, J = R.RecordStatus.AS_DECIDED, R.RecordStatus.OVERRIDDEN, R.RecordStatus.NO_RECORD, R.RecordStatus.NOT_JUDGED
Why = R.OverrideReason
SHARE2 = {"id": "d1", "action": "share", "shards": "2"}
WHOLE = {"id": "d1", "action": "whole_gpu", "shards": "0"}
WHOLE8 = {"id": "d1", "action": "whole_gpu", "shards": "8"}  # held as all shards of one GPU
PASS = {"id": "d1", "action": "pass_through", "shards": "0"}


@pytest.mark.parametrize("case, started, tres, comment, hist, run_id, expected", [
    ("shared as decided", True, (0, 2), SHARE2, _hd("share", 2), "d1", (S, None)),
    ("oversubscribed as decided", True, (0, 2), {**SHARE2, "action": "share_oversubscribed"},
     _hd("share_oversubscribed", 2), "", (S, None)),
    ("decided shards, ran on a GPU", True, (1, 0), SHARE2, _hd("share", 2), "d1", (O, Why.RAN_WHOLE_GPU_NOT_SHARDS)),
    ("decided 2 shards, ran on 4", True, (0, 4), SHARE2, _hd("share", 2), "d1", (O, Why.RAN_OTHER_SHARD_COUNT)),
    ("decided shards, ran without GPU", True, (0, 0), SHARE2, None, "", (O, Why.RAN_WITHOUT_GPU)),
    ("whole GPU as decided", True, (1, 0), WHOLE, _hd("whole_gpu"), "d1", (S, None)),
    ("two whole GPUs as decided", True, (2, 0), WHOLE, _hd("whole_gpu", asked_gpus=2), "d1", (S, None)),
    ("decided whole GPU, ran on shards", True, (0, 8), WHOLE, _hd("whole_gpu"), "d1",
     (O, Why.RAN_SHARDS_NOT_WHOLE_GPU)),
    ("whole GPU held as all shards", True, (0, 8), WHOLE8, _hd("whole_gpu", 8), "d1", (S, None)),
    ("whole GPU as shards, ran on a gpu", True, (1, 0), WHOLE8, _hd("whole_gpu", 8), "d1",
     (O, Why.RAN_WHOLE_GPU_NOT_SHARDS)),
    ("whole GPU as shards, ran on 2 shards", True, (0, 2), WHOLE8, _hd("whole_gpu", 8), "d1",
     (O, Why.RAN_OTHER_SHARD_COUNT)),
    ("comment edited after the decision", True, (0, 2), SHARE2, _hd("share", 1), "d1", (O, Why.COMMENT_EDITED)),
    ("comment names another decision", True, (0, 2), SHARE2, _hd("share", 2), "d9", (O, Why.COMMENT_REPLACED)),
    ("comment removed, history knows", True, (1, 0), {}, _hd("whole_gpu"), "d1", (O, Why.COMMENT_REMOVED)),
    ("no record at all", True, (1, 0), {}, None, "", (N, None)),
    ("pending without record", False, (0, 0), {}, None, "", (N, None)),
    ("pending with a decision", False, (0, 0), SHARE2, _hd("share", 2), "", (J, None)),
    ("pass-through of a shard request", True, (0, 3), PASS, _hd("pass_through", asked=GresKind.SHARD), "", (S, None)),
    ("pass-through of shards, ran on a GPU", True, (1, 0), PASS, _hd("pass_through", asked=GresKind.SHARD), "",
     (O, Why.RAN_WHOLE_GPU_NOT_SHARDS)),
    ("pass-through, facts unknown", True, (1, 0), PASS, None, "", (J, None)),
    ("unknown comment (live job), history run", True, (0, 2), None, _hd("share", 2), "d1", (S, None)),
    ("unknown comment (live job), run on a GPU", True, (1, 0), None, _hd("share", 2), "d1",
     (O, Why.RAN_WHOLE_GPU_NOT_SHARDS)),
    ("unknown comment (live job), no history", True, (1, 0), None, None, "", (J, None)),
])
def test_judge(case, started, tres, comment, hist, run_id, expected):
    got = R.judge(started=started, tres=R.TresCounts(*tres), comment=comment, hist=hist, run_decision_id=run_id)
    assert got == expected, case


@pytest.mark.parametrize("case, start, alloc_list", [
    ("pending", 0, []),
    ("held, cancelled", 0, []),
    ("cancelled while pending: start = cancel time, nothing allocated", T0 + 30, []),
])
def test_jobs_that_never_ran_are_not_judged_nor_counted(case, start, alloc_list):
    rec = sacct_record(9, user="u", comment="swapaware:v1 id=dx action=share shards=1", alloc={"shard": 1},
                       submit=T0, start=start, end=start, state="CANCELLED")
    rec["tres"]["allocated"] = alloc_list
    row = R.join_job(parse_sacct_json(sacct_text([rec]))[0], R.HistorySnapshot(), shards_per_gpu=8, now=0.0)
    assert not row.started and row.wait_s is None and row.elapsed_s == 0, case
    assert row.status is R.RecordStatus.NOT_JUDGED and not row.shared and not row.whole_gpu
    assert row.gpu_hours_used == 0 and row.gpu_hours_saved == 0


@pytest.mark.parametrize("text, held", [("billing=1,cpu=1,mem=256M,node=1", True), ("", False),
                                        ("energy=None", False), ("cpu=0,mem=0", False), ("mem=1.5G", True)])
def test_allocated_anything(text, held):
    assert R.allocated_anything(text) is held


@pytest.mark.parametrize("alloc, shared, whole", [
    ({"shard": 1}, True, False), ({"shard": 7}, True, False),
    ({"shard": 8}, False, True),  # all shards of one GPU: a whole GPU (whole_gpu_as_shards)
    ({"gpu": 1}, False, True), ({"gpu": 2}, False, True),
])
def test_shared_means_part_of_one_gpu(alloc, shared, whole):
    job = parse_sacct_json(sacct_text([sacct_record(9, user="u", alloc=alloc, submit=T0, start=T0, end=T0 + 60)]))[0]
    row = R.join_job(job, R.HistorySnapshot(), shards_per_gpu=8, now=0.0)
    assert (row.shared, row.whole_gpu) == (shared, whole)
    assert row.gpu_hours_used == pytest.approx(60 / 3600 * (alloc.get("gpu", 0) + alloc.get("shard", 0) / 8))


@pytest.mark.parametrize("facts, kind, gpus", [
    ({"tresPerNode": "gres:gpu:1"}, GresKind.GPU, 1),
    ({"tresPerJob": "gres:gpu:1"}, GresKind.GPU, 1),
    ({"tresPerNode": "gres:gpu:1", "minNodes": 2}, GresKind.GPU, 2),
    ({"tresPerTask": "gres:gpu:1", "numTasks": 4}, GresKind.GPU, 4),
    ({"tresPerNode": "gres:gpu:a100:2"}, GresKind.GPU, 2),
    ({"tresPerNode": "gres:shard:3"}, GresKind.SHARD, 0),
    ({}, GresKind.NONE, 0),
])
def test_decision_facts_give_what_the_job_asked_for(facts, kind, gpus):
    hd = R.decision_from_row("d", "whole_gpu", 0, json.dumps({"user": "u", **facts}), "{}")
    assert (hd.asked_kind, hd.asked_gpus, hd.peak_bytes) == (kind, gpus, 0)


@pytest.mark.parametrize("k, saved_frac", [(1, 7 / 8), (2, 6 / 8), (4, 4 / 8), (8, 0.0)])
def test_gpu_hours_saved_is_elapsed_times_unused_fraction(k, saved_frac):
    job = parse_sacct_json(sacct_text([sacct_record(
        9, user="u", comment=f"swapaware:v1 id=dx action=share shards={k}", alloc={"shard": k},
        submit=T0, start=T0, end=T0 + 7200)]))[0]
    hist = R.HistorySnapshot(decisions={"dx": _hd("share", k)})
    row = R.join_job(job, hist, shards_per_gpu=8, now=0.0)
    assert row.gpu_hours_used == pytest.approx(2 * k / 8)
    assert row.gpu_hours_saved == pytest.approx(2 * saved_frac)


@pytest.mark.parametrize("asked, asked_gpus, alloc, saved", [
    (GresKind.GPU, 1, {"shard": 2}, True),   # asked one GPU, ran on shards
    (GresKind.SHARD, 0, {"shard": 2}, False),  # asked shards itself: nothing saved by swapaware
    (GresKind.GPU, 2, {"shard": 2}, False),  # asked two GPUs (not a case the policy shares)
    (GresKind.GPU, 1, {"gpu": 1}, False),    # ran on a GPU
])
def test_saved_only_for_one_whole_gpu_asked_and_shards_allocated(asked, asked_gpus, alloc, saved):
    job = parse_sacct_json(sacct_text([sacct_record(9, user="u", comment="swapaware:v1 id=dx action=share shards=2",
                                                    alloc=alloc, submit=T0, start=T0, end=T0 + 3600)]))[0]
    hist = R.HistorySnapshot(decisions={"dx": _hd("share", 2, asked, asked_gpus)})
    row = R.join_job(job, hist, shards_per_gpu=8, now=0.0)
    assert (row.gpu_hours_saved > 0) is saved


def test_observation_of_an_earlier_job_with_the_same_id_is_not_joined():
    job = parse_sacct_json(sacct_text([sacct_record(9, user="u", comment="swapaware:v1 id=dnew action=whole_gpu "
                                                    "shards=0", alloc={"gpu": 1}, submit=T0, start=T0,
                                                    end=T0 + 60)]))[0]
    old = R.HistoryObservation(9, "dold", T0 + 50, 5 * GIB, True, "nvml")  # other decision
    ancient = R.HistoryObservation(9, "", T0 - 86400, 6 * GIB, True, "nvml")  # long before this job started
    row = R.join_job(job, R.HistorySnapshot(observations={9: (old, ancient)}), shards_per_gpu=8, now=0.0)
    assert row.observed_peak_bytes is None and row.oom is None
    mine = R.HistoryObservation(9, "dnew", T0 + 60, 2 * GIB, False, "nvml")
    row = R.join_job(job, R.HistorySnapshot(observations={9: (old, mine, ancient)}), shards_per_gpu=8, now=0.0)
    assert row.observed_peak_bytes == 2 * GIB and row.oom is False


def test_report_joins_a_reused_job_id_by_instance(world):
    """Job 1 ran twice (ids restart after a Slurm state reset): each accounting record is joined with
    its own instance's run and observation (job id + submit time), not with the newest job 1."""
    h = world.handler
    runs = {}
    for tag, submit, peak in (("old", T0, 2 * GIB), ("new", T0 + 1000, 5 * GIB)):
        world.now = float(submit)
        d = h.admit(pb.AdmitRequest(job=pb.JobFacts(user="alice", job_name=tag, tres_per_node="gres:gpu:1"))).decision
        world.slurm.live[1] = JobInstance(1, "swapaware-dev", submit, submit + 10, 0, d.rewrite.admin_comment,
                                          "RUNNING", source="squeue")
        h.report_events(pb.ReportEventsRequest(events=[
            pb.JobEvent(started=pb.JobStartedRequest(job_id=1, node="vm", gpu_indices=[0], started_at=submit + 10,
                                                     event_id=f"s-{tag}")),
            pb.JobEvent(finished=pb.JobFinishedRequest(job_id=1, node="vm", gpu_indices=[0], finished_at=submit + 100,
                                                       event_id=f"f-{tag}", peak_gpu_bytes=peak,
                                                       telemetry_source="fake-nvml"))]))
        runs[tag] = (d, submit, peak)
        world.now = submit + 100.0  # the service's clock moves on (it refuses events from its future)
    world.flush()
    for tag in ("old", "new"):
        d, submit, peak = runs[tag]
        # the AdminComment was removed from accounting afterwards: only the history links the job
        world.slurm.records = [sacct_record(1, user="alice", comment="", alloc={"gpu": 1}, submit=submit,
                                            start=submit + 10, end=submit + 100)]
        (job,) = build(world).jobs
        assert (job.decision_id, job.observed_peak_bytes) == (d.decision_id, peak), tag
