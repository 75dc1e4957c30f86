"""Request size limits (policy_service/trust/limits.py), table-driven over the real messages."""
import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.trust import limits
from policy_service.trust.limits import DEFAULT_STRING_BYTES, MAX_REPEATED, STRING_BYTES, oversize


@pytest.mark.parametrize("msg,expected", [
    (pb.AdmitRequest(job=pb.JobFacts(user="alice", work_dir="/home/alice/" + "d" * 4000)), []),
    (pb.AdmitRequest(job=pb.JobFacts(user="alice", work_dir="w" * 4097)), ["job.work_dir is 4097 bytes, at most 4096"]),
    (pb.AdmitRequest(job=pb.JobFacts(user="u" * 1025)), [f"job.user is 1025 bytes, at most {DEFAULT_STRING_BYTES}"]),
    # bytes, not characters: 600 two-byte characters are 1200 bytes
    (pb.AdmitRequest(job=pb.JobFacts(user="alice", job_name="é" * 600)), ["job.job_name is 1200 bytes, at most 1024"]),
    (pb.AdmitRequest(job=pb.JobFacts(user="alice", comment="swapaware:mem=2G " + "x" * 5000, qos="q" * 2000)),
     ["job.comment is 5017 bytes, at most 4096", "job.qos is 2000 bytes, at most 1024"]),
    (pb.JobStartedRequest(job_id=1, node="n1", event_id="e" * 129), ["event_id is 129 bytes, at most 128"]),
    (pb.JobFinishedRequest(job_id=1, node="n1", gpu_indices=list(range(MAX_REPEATED + 1))),
     [f"gpu_indices has {MAX_REPEATED + 1} entries, at most {MAX_REPEATED}"]),
    (pb.JobFinishedRequest(job_id=1, node="n1", gpus=[pb.GpuUsage(gpu_index=i) for i in range(3)], oom_evidence="x" * 4096), []),
    (pb.ExplainRequest(job_id=5), []),
])
def test_oversize_names_each_field_over_its_limit(msg, expected):
    assert oversize(msg) == expected


def test_every_named_limit_is_a_string_field_of_the_api():
    names = set()
    for m in (pb.JobFacts, pb.AdmitRequest, pb.JobStartedRequest, pb.JobFinishedRequest, pb.ExplainRequest,
              pb.GpuUsage):
        names |= {f.name for f in m.DESCRIPTOR.fields if f.type == f.TYPE_STRING}
    assert set(STRING_BYTES) <= names


def test_report_events_batch_is_bounded_and_its_events_are_checked_one_by_one():
    from policy_service.trust.limits import REPEATED_MAX

    one = pb.JobEvent(started=pb.JobStartedRequest(job_id=1, node="n1", event_id="e"))
    most = REPEATED_MAX["events"]
    assert most == 500 and oversize(pb.ReportEventsRequest(events=[one] * most)) == []
    assert oversize(pb.ReportEventsRequest(events=[one] * (most + 1))) == [f"events has {most + 1} entries, at most {most}"]
    # an oversized event does not refuse the batch: the handler refuses that event alone
    big = pb.JobEvent(finished=pb.JobFinishedRequest(job_id=2, event_id="f", oom_evidence="x" * 5000))
    assert oversize(pb.ReportEventsRequest(events=[one, big])) == []
    assert oversize(big) == ["finished.oom_evidence is 5000 bytes, at most 4096"]


def test_sluid_is_bounded():
    assert oversize(pb.JobStartedRequest(job_id=1, sluid="s" * 64)) == []
    assert oversize(pb.JobFinishedRequest(job_id=1, sluid="s" * 65)) == ["sluid is 65 bytes, at most 64"]


def test_field_rules_are_kept_once_per_field_not_per_request():
    """The per-field rules are cached by descriptor: many requests must not grow the cache (it
    would if the protobuf runtime handed out a new descriptor object per message)."""
    from policy_service.serving import json_codec
    for i in range(2000):
        msg = pb.AdmitRequest(job=pb.JobFacts(user=f"u{i}", job_name="n", work_dir="/w" * (i % 7)), brief=True)
        assert oversize(msg) == []
        json_codec.to_dict(msg)
    def fields(desc) -> int:
        return len(desc.fields) + sum(fields(d) for d in desc.nested_types)
    # every field of every message this project defines (other tests fill the caches too)
    n_fields = sum(fields(d) for d in pb.DESCRIPTOR.message_types_by_name.values())
    assert 0 < len(limits._RULES) <= n_fields
    assert 0 < len(json_codec._OUT) <= n_fields
