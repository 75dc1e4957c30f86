"""A GPU job whose shards would not bill its fraction of the GPU under its partition's
TRESBillingWeights keeps its request (reason shards_unbilled), and a whole GPU is held as shards
(Slurm 22.05) only where all of them bill what the GPU bills. The adapter reads each partition's
weights (slurm/partitions.py, billing_weights.py) and the core decides with what the request
carries (core/policy.py)."""
from dataclasses import replace

import pytest

from policy_service.slurm.partitions import partition_defaults
from policy_service.slurm.slurm_files import parse_gres_conf, parse_slurm_conf
from policy_service.core import policy
from policy_service.core.request import job_request
from policy_service.core.types import Action, ReasonCode

from tests.unit.core.test_policy import NO_OVERSUB, history

GRES = ("Name=gpu Type=a100 File=/dev/nvidia[0-1]\nName=gpu Type=h100 File=/dev/nvidia[2-3]\n"
        "Name=shard Count=4 File=/dev/nvidia0\nName=shard Count=4 File=/dev/nvidia1\n"
        "Name=shard Count=8 File=/dev/nvidia2\nName=shard Count=8 File=/dev/nvidia3\n")  # 40, 48, 80, 80 GiB


def _parts(*weights: str, gres: str = GRES):
    """Partitions p0, p1 ... of one node with the dev cluster's GPUs, each with the weights given."""
    conf = "NodeName=n1 CPUs=8 Gres=gpu:a100:2,gpu:h100:2,shard:24\n" + "".join(
        f"PartitionName=p{i} Nodes=n1{' Default=YES' if not i else ''} TRESBillingWeights={w}\n"
        for i, w in enumerate(weights))
    return partition_defaults(parse_slurm_conf(conf), parse_gres_conf(gres))


# (weights, job's GPU type, shared?, words of why not, whole GPU as shards bills the GPU?)
CASES = [
    # the dev cluster: a shard bills its memory as a fraction of the largest GPU; all 4 shards of a 40
    # GiB GPU bill half of it (an untyped whole GPU is not held as shards there anyway: 4 or 8)
    ('"CPU=1.0,GRES/gpu=8,GRES/shard=1"', "", True, [], False),
    ('"CPU=1.0,GRES/gpu=8,GRES/shard=1"', "h100", True, [], True),
    ('"CPU=1.0,GRES/gpu=8,GRES/shard=1"', "a100", True, [], False),  # 4 shards bill 4, the GPU 8
    ("CPU=1", "", True, [], True),  # GPUs bill nothing, nor do shards
    ("CPU=1,GRES/gpu=10", "", False,
     ["partition p0 (TRESBillingWeights=CPU=1,GRES/gpu=10)", "no GRES/shard weight",
      "a job holding shards bills nothing for its GPU", "the fix: GRES/shard=1.25"], False),
    ("CPU=1,GRES/gpu=10,GRES/shard=2", "", False, ["GRES/shard=2, should be 1.25", "the fix: GRES/shard=1.25"],
     False),
    ("CPU=1,GRES/gpu=10,GRES/shard=2.5", "a100", True, [], True),  # exact on the 4-shard a100s it lands on
    ("CPU=1,GRES/gpu:a100=12,GRES/gpu:h100=16", "", False,
     ["its GPUs bill different prices per shard", "Slurm records no gres/shard:<type>",
      "the fix: partitions of one GPU type each"], False),
    ("CPU=1,GRES/gpu:a100=12,GRES/gpu:h100=16", "a100", False,
     ["the GPUs this job can land on would need GRES/shard=3"], False),
    # typed shard weights bill nothing: the one the old admin guide printed changes nothing
    ("CPU=1,GRES/gpu:a100=12,GRES/shard:a100=3,GRES/gpu:h100=16,GRES/shard:h100=2", "h100", False,
     ["(no GRES/shard weight; Slurm records no gres/shard:<type>)"], False),
    ("CPU=1,GRES/gpu:a100=12", "h100", True, [], True),  # h100s bill nothing here
    ("CPU=1,GRES/shard=1", "", False, ["GRES/shard=1 bills a shard where its GPU bills nothing",
                                       "the fix: remove GRES/shard"], False),
]


@pytest.mark.parametrize("weights, gpu_type, shared, words, whole", CASES,
                         ids=[f"{c[0]}:{c[1] or 'untyped'}" for c in CASES])
def test_what_the_partition_weights_bill_a_job_holding_shards(weights, gpu_type, shared, words, whole):
    share_why, whole_why = _parts(weights).unbilled("p0", gpu_type)
    assert (share_why == "") is shared, share_why
    for word in words:
        assert word in share_why, share_why
    assert (whole_why == "") is whole, whole_why
    if not whole:
        assert whole_why.startswith("partition p0 (TRESBillingWeights="), whole_why


def test_a_job_that_may_run_in_several_partitions_shares_only_where_each_bills_it():
    parts = _parts('"CPU=1.0,GRES/gpu=8,GRES/shard=1"', "CPU=1,GRES/gpu=8")
    assert parts.unbilled("p0")[0] == "" == parts.unbilled("")[0]  # "": the Default=YES partition
    why, _ = parts.unbilled("p0,p1")
    assert why.startswith("partition p1 (TRESBillingWeights=CPU=1,GRES/gpu=8): no GRES/shard weight"), why
    assert parts.unbilled("elsewhere") == ("", "")  # a partition slurm.conf does not name: nothing known


def test_a_memory_rule_whole_gpu_says_why_it_is_not_held_as_shards():
    _, why = _parts('"CPU=1.0,GRES/gpu=8,GRES/shard=1"').unbilled("p0", "a100")
    assert ("all 4 shards of one a100 GPU would bill 4 x 1 = 4 and the GPU bills GRES/gpu=8: a shard bills its "
            "memory as a fraction of the partition's largest GPU (8 shards)") in why, why


def _request(**kw):
    return job_request(user="u", account="a", partition="p0", job_name="t", script_fingerprint="fp",
                       gres_fields={"tres_per_node": "gres:gpu:1"}, **kw)


def _decide(req, access, stats):
    return policy.decide(req, stats, NO_OVERSUB, decision_id="d", now=1.0, job_class="c",
                         gres_fields={"tres_per_node": "gres:gpu:1"}, access=access)


def test_a_job_whose_shards_would_not_bill_its_gpu_keeps_its_request():
    req, access = _request()
    why = _parts("CPU=1,GRES/gpu=10").unbilled("p0")
    kept = _decide(replace(req, shards_unbilled=why[0], whole_shards_unbilled=why[1]), access, history(3))
    assert (kept.action, kept.shards, kept.rewrite.tres_per_node) == (Action.WHOLE_GPU, 0, None)
    assert kept.reasons[0].code is ReasonCode.SHARDS_UNBILLED
    assert kept.reasons[0].message == f"not shared: {why[0]}; the job keeps its request"
    assert "why=shards_unbilled" in kept.rewrite.admin_comment
    assert [r.code for r in kept.reasons].count(ReasonCode.SHARDS_UNBILLED) == 1  # not again as whole-as-shards
    shared = _decide(req, access, history(3))  # the same job where its shards bill their fraction
    assert (shared.action, shared.rewrite.tres_per_node) == (Action.SHARE, "gres:shard:1")


def test_on_22_05_a_whole_gpu_is_held_as_shards_only_where_they_bill_the_gpu():
    req, access = _request()
    held = _decide(req, access, {})  # no history: a whole GPU, held as all 8 shards of one on 22.05
    assert (held.action, held.rewrite.tres_per_node) == (Action.WHOLE_GPU, "gres:shard:8")
    kept = _decide(replace(req, whole_shards_unbilled="partition p0 (...): all 8 shards ..."), access, {})
    assert (kept.action, kept.shards, kept.rewrite.tres_per_node) == (Action.WHOLE_GPU, 0, None)
    (reason,) = [r for r in kept.reasons if r.code is ReasonCode.SHARDS_UNBILLED]
    assert reason.message == "not held as shards: partition p0 (...): all 8 shards ...; the gpu request stays as typed"
    assert kept.reasons[0].code is ReasonCode.NO_HISTORY
