"""core/requeue.py: when a shared run's OOM requeues the job whole, and what is set back."""
import pytest

from policy_service.core import requeue
from policy_service.core.types import ReasonCode, Rewrite


def test_a_recent_batch_oom_is_requeued_with_its_evidence_in_the_reason():
    c = requeue.requeue_check(enabled=True, is_batch=True, age_s=3.0, evidence="failed after reaching 98% of its 10.0GiB charge")
    assert c.requeue and c.token == "requeued" and c.reason.code is ReasonCode.OOM_REQUEUED
    assert "98% of its 10.0GiB charge" in c.reason.message and "whole GPU" in c.reason.message


@pytest.mark.parametrize("kw, token", [
    ({"enabled": False}, "off"),
    ({"is_batch": False}, "not-batch"),
    ({"age_s": requeue.REQUEUE_MAX_AGE_S + 1}, "late"),
])
def test_not_requeued_says_why(kw, token):
    args = {"enabled": True, "is_batch": True, "age_s": 1.0, **kw}
    c = requeue.requeue_check(evidence="reported by the node", **args)
    assert not c.requeue and c.token == token and c.reason.code is ReasonCode.OOM_NOT_REQUEUED


def test_at_the_age_bound_it_is_still_requeued():
    assert requeue.requeue_check(enabled=True, is_batch=True, age_s=requeue.REQUEUE_MAX_AGE_S, evidence="").requeue


@pytest.mark.parametrize("message, token", [
    ("scontrol requeuehold 7 exited 1: Requested operation is presently disabled for job 7", "no-requeue"),
    ("scontrol requeuehold 7 exited 1: Only batch jobs are accepted or processed", "not-batch"),
    ("scontrol requeuehold 7 exited 1: Invalid job id specified", "job-gone"),
    ("scontrol requeuehold 7 timed out after 5.0s", "slurm-refused"),
])
def test_slurm_refusals_map_to_tokens(message, token):
    assert requeue.slurm_refusal_token(message) == token


def test_fields_the_shared_decision_changed_go_back_to_what_was_submitted():
    submitted = {"tres_per_node": "", "tres_per_job": "gres/gpu:1", "tres_per_task": "", "tres_per_socket": "",
                 "tres_bind": "gres/gpu:per_task:1"}
    shared = {"tres_per_node": "gres/shard:2", "tres_per_job": "", "tres_bind": ""}
    assert requeue.restore_fields(submitted, shared, Rewrite()) == {
        "tres_per_node": "", "tres_per_job": "gres/gpu:1", "tres_bind": "gres/gpu:per_task:1"}


def test_a_whole_gpu_held_as_shards_wins_over_the_submitted_field():
    submitted = {"tres_per_node": "gres:gpu:1"}
    assert requeue.restore_fields(submitted, {"tres_per_node": "gres:shard:1"}, Rewrite(tres_per_node="gres:shard:8")) \
        == {"tres_per_node": "gres:shard:8"}


def test_the_note_is_appended_within_the_comment_limit():
    assert requeue.noted_comment("swapaware: id=ab why=fits_in_shards", "no-requeue", 400) == \
        "swapaware: id=ab why=fits_in_shards oom_requeue=no-requeue"
    long = "x" * 400
    noted = requeue.noted_comment(long, "off", 400)
    assert len(noted) == 400 and noted.endswith(" oom_requeue=off")
    assert requeue.noted_comment("", "late", 400) == "oom_requeue=late"
