"""Same decisions (issue 21, item 3), what is recorded: what catch-up records for a table-made
decision (the archived template) is what Admit records for the same job in the same queue state, but
for its id, time, table token and the queue gate's figures.

The harness (fixtures, training, gate reads) is differential_harness.py's."""
from __future__ import annotations

import pytest
from google.protobuf import json_format

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.core import admission
from policy_service.core.admission_format import read_table
from policy_service.core.types import ReasonCode

from tests.adapter.admission.test_admission_publish import plain
from tests.adapter.admission.differential_harness import QUEUES, queue_state_of, release, svc, train  # noqa: F401


# The queue gate's reasons: Admit words them with the snapshot's figures, a table-made decision
# with the gate state the job was decided in (core/admission.template_reasons): compared by code.
QUEUE_FIGURE_CODES = {ReasonCode.QUEUE_SHORT.value, ReasonCode.COMPUTE_OVERCOMMITTED.value}


def record_view(decision_pb: bytes) -> dict:
    """A recorded decision as its user and `swapaware explain` see it, less what differs by
    construction between a table-made one and Admit's (id, time, the table token, the queue
    figures of the moment)."""
    d = pb.Decision.FromString(decision_pb)
    d.ClearField("decision_id")
    d.ClearField("decided_at")  # catch-up fills both in from Slurm
    for r in d.reasons:
        if r.code in QUEUE_FIGURE_CODES:
            r.message = ""
    d.rewrite.admin_comment = " ".join(f"{k}={v}" for k, v in sorted(plain(d.rewrite.admin_comment).items()))
    return json_format.MessageToDict(d)


@pytest.mark.parametrize("release", [("22.05", 0)], indirect=True)
def test_the_archived_template_is_what_admit_records(svc, slurm_jobs, release):
    """What catch-up records for a table-made decision (the archived template) is what Admit
    records for the same job in the same queue state, but for its id, time and table token."""
    s = svc
    h, publisher = s.handler, s.admission_publisher
    job = pb.JobFacts(user="enough0", account="proj", partition="gpu", job_name="train", tres_per_node="gres:gpu:1",
                      script_fingerprint="00000001deadbeef")
    train(s, slurm_jobs, {"enough0": job})  # a class that shares where the queue lets it
    pub = publisher.publish("test")
    entry = read_table(publisher.table.read_bytes())["entries"][admission.table_key(job)]
    seen, gated = set(), 0
    for queue in ("short", "mixed", "long"):
        slurm_jobs.pending = QUEUES[queue]
        h.queue.poll_once()
        state = queue_state_of(h)[1]  # the whole queue's (the job gives no QoS)
        slot = state if state in entry else admission.ALL_STATES
        template = s.admission_archive.lookup(pub.version, entry["i"], slot)
        d = h.admit(pb.AdmitRequest(job=job)).decision
        h.flush()
        recorded = h.store.decision(d.decision_id)
        seen.add(state)
        assert record_view(template.decision_pb) == record_view(recorded.decision_pb), state
        said = [r.message for r in pb.Decision.FromString(template.decision_pb).reasons if r.code in QUEUE_FIGURE_CODES]
        assert all(f"queue gate '{state}'" in m for m in said), (state, said)  # the state it was decided in
        gated += len(said)
    assert gated  # a queue reason was compared at all (the short queue keeps the GPU whole)
    assert seen == {"short", "long"}
