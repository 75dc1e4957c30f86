"""The policy across Slurm releases: the rewrite's spelling, whole GPUs held as shards only where
a release needs it, and requests that are never rewritten (typed GPUs, srun/salloc allocations)."""
from dataclasses import replace

import pytest

from policy_service.config import WholeGpuAsShards
from policy_service.core import policy
from policy_service.core.dialect import DIALECTS
from policy_service.core.request import gpu_request, history_keys, job_request
from policy_service.core.types import Action, KeyLevel, ReasonCode

from tests.unit.core.test_policy import CFG, NO_OVERSUB, history, telling

D22, D24, D26 = DIALECTS[(22, 5)], DIALECTS[(24, 11)], DIALECTS[(26, 5)]


def with_as_shards(setting, cfg=CFG):
    return replace(cfg, policy=replace(cfg.policy, whole_gpu_as_shards=setting))


def decide(fields, stats=None, cfg=CFG, dialect=D22, is_batch=True, nodes=1):
    # is_batch "het": a batch job that is a component of a heterogeneous job
    r, access = job_request(user="u", account="a", partition="gpu", job_name="train", script_fingerprint="fp",
                            gres_fields=fields, is_batch=bool(is_batch), min_nodes=nodes, het_job=is_batch == "het")
    return policy.decide(r, stats or {}, cfg, decision_id="d1", now=1.0, job_class=history_keys(r)[KeyLevel.CLASS],
                         gres_fields=fields, access=access, dialect=dialect)


def codes(d):
    return {r.code for r in d.reasons}


@pytest.mark.parametrize("fields,dialect,expected", [
    ({"tres_per_node": "gres:gpu:1"}, D22, {"tres_per_node": "gres:shard:1"}),
    ({"tres_per_node": "gres/gpu:1"}, D24, {"tres_per_node": "gres/shard:1"}),
    ({"tres_per_node": "gres/gpu:1"}, D26, {"tres_per_node": "gres/shard:1"}),
    ({"tres_per_job": "gres/gpu:1"}, D24, {"tres_per_node": "gres/shard:1", "tres_per_job": ""}),
    ({"tres_per_task": "cpu=2,gres/gpu=1"}, D24, {"tres_per_node": "gres/shard:1", "tres_per_task": "cpu=2"}),
    ({"tres_per_task": "gres/gpu=1"}, D26, {"tres_per_node": "gres/shard:1", "tres_per_task": ""}),
])
def test_shared_job_is_rewritten_in_the_release_spelling(fields, dialect, expected):
    d = decide(fields, history(3), NO_OVERSUB, dialect)
    assert (d.action, d.shards) == (Action.SHARE, 1)
    got = {f: getattr(d.rewrite, f) for f in ("tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket")
           if getattr(d.rewrite, f) is not None}
    assert got == expected
    assert gpu_request({**fields, **got}).per_node == 1  # what was written parses back


@pytest.mark.parametrize("fields", [{"tres_per_node": "gres/gpu:0"}, {"tres_per_task": "cpu=2,gres/gpu=0"},
                                    {"tres_per_task": "cpu=2"}])
def test_zero_gpus_and_other_tres_ask_for_no_gpu(fields):
    d = decide(fields, history(3), dialect=D24)
    assert d.action is Action.PASS_THROUGH and d.reasons[0].code is ReasonCode.NO_GPU
    assert d.rewrite.tres_per_node is None and d.rewrite.tres_per_task is None


# setting -> {release: held as shards?}
@pytest.mark.parametrize("setting,held", [
    (WholeGpuAsShards.AUTO, {D22: True, D24: False, D26: False}),
    (WholeGpuAsShards.ON, {D22: True, D24: True, D26: True}),
    (WholeGpuAsShards.OFF, {D22: False, D24: False, D26: False}),
])
def test_whole_gpu_as_shards_by_setting_and_release(setting, held):
    for dialect, as_shards in held.items():
        d = decide({"tres_per_node": dialect.gres("gpu", 1)}, cfg=with_as_shards(setting), dialect=dialect)
        assert d.action is Action.WHOLE_GPU and ReasonCode.NO_HISTORY in codes(d)
        assert policy.whole_gpu_as_shards(with_as_shards(setting), dialect) is as_shards
        if as_shards:
            assert d.shards == 8 and d.rewrite.tres_per_node == dialect.gres("shard", 8)
            (reason,) = [r for r in d.reasons if r.code is ReasonCode.WHOLE_GPU_AS_SHARDS]
            assert f"Slurm {dialect.name}" in reason.message
        else:
            assert d.shards == 0 and d.rewrite.tres_per_node is None
            assert ReasonCode.WHOLE_GPU_AS_SHARDS not in codes(d)


def test_whole_gpu_as_shards_accepts_a_plain_boolean():
    assert policy.whole_gpu_as_shards(with_as_shards(False), D22) is False
    assert policy.whole_gpu_as_shards(with_as_shards(True), D26) is True


KEEPS = [  # (fields, is_batch, reason code)
    ({"tres_per_node": "gres:gpu:1"}, False, ReasonCode.INTERACTIVE),
    ({"tres_per_node": "gres/gpu:1"}, False, ReasonCode.INTERACTIVE),
    ({"tres_per_node": "gres/gpu:2"}, False, ReasonCode.INTERACTIVE),
    ({"tres_per_node": "gres/gpu:1"}, "het", ReasonCode.HET_JOB),
    ({"tres_per_node": "gres:gpu:1"}, "het", ReasonCode.HET_JOB),
]


@pytest.mark.parametrize("dialect", [D22, D24, D26])
@pytest.mark.parametrize("setting", list(WholeGpuAsShards))
@pytest.mark.parametrize("stats", [None, history(3)])
@pytest.mark.parametrize("fields,is_batch,code", KEEPS)
def test_interactive_and_het_requests_stay_as_typed(fields, is_batch, code, stats, setting, dialect):
    d = decide(fields, stats, with_as_shards(setting, NO_OVERSUB), dialect, is_batch=is_batch)
    assert (d.action, d.shards) == (Action.WHOLE_GPU, 0)
    assert code in codes(d) and ReasonCode.WHOLE_GPU_AS_SHARDS not in codes(d)
    r = d.rewrite
    assert (r.tres_per_node, r.tres_per_job, r.tres_per_task, r.tres_per_socket) == (None, None, None, None)
    assert r.site_factor is not None and f"why={code.value}" in r.admin_comment and r.user_message is None


@pytest.mark.parametrize("fields,dialect,expected", [
    ({"tres_per_node": "gres:gpu:a100:1"}, D22, {"tres_per_node": "gres:shard:a100:1"}),
    ({"tres_per_node": "gres/gpu:a100:1"}, D24, {"tres_per_node": "gres/shard:a100:1"}),
    ({"tres_per_job": "gres/gpu:h100:1"}, D26, {"tres_per_node": "gres/shard:h100:1", "tres_per_job": ""}),
    ({"tres_per_task": "cpu=2,gres/gpu:a100=1"}, D24, {"tres_per_node": "gres/shard:a100:1", "tres_per_task": "cpu=2"}),
])
def test_typed_requests_share_within_their_type(fields, dialect, expected):
    """Shards take their GPU's type (gres.conf Type= with the same File=, on every release): a
    typed request shares only GPUs of its type."""
    d = decide(fields, history(3), telling(NO_OVERSUB), dialect)
    assert (d.action, d.shards) == (Action.SHARE, 1)
    got = {f: getattr(d.rewrite, f) for f in ("tres_per_node", "tres_per_job", "tres_per_task") if getattr(d.rewrite, f)
           is not None}
    assert got == expected
    back = gpu_request({**fields, **got})
    assert (back.kind.value, back.gpu_type) == ("shard", "a100" if "a100" in str(fields) else "h100")
    assert ReasonCode.TYPED_GPU not in codes(d) and "of one " + back.gpu_type + " GPU" in d.rewrite.user_message


@pytest.mark.parametrize("dialect,held", [(D22, "gres:shard:a100:8"), (D24, None), (D26, None)])
def test_a_typed_whole_gpu_is_held_as_the_shards_of_its_type_where_the_release_needs_it(dialect, held):
    d = decide({"tres_per_node": dialect.gres("gpu", 1, "a100")}, None, dialect=dialect)
    assert d.action is Action.WHOLE_GPU and d.rewrite.tres_per_node == held
    if held:
        assert "all 8 shards of one a100 GPU" in next(r.message for r in d.reasons
                                                       if r.code is ReasonCode.WHOLE_GPU_AS_SHARDS)


def test_typed_multi_gpu_and_multi_node_requests_stay_whole():
    assert ReasonCode.MULTI_GPU in codes(decide({"tres_per_node": "gres/gpu:a100:2"}, history(3), dialect=D24))
    assert ReasonCode.MULTI_NODE in codes(decide({"tres_per_node": "gres/gpu:a100:1"}, history(3), dialect=D24,
                                                 nodes=2))


def test_interactive_messages():
    srun = decide({"tres_per_node": "gres/gpu:1"}, history(3), dialect=D24, is_batch=False)
    assert "srun or salloc" in srun.reasons[0].message


@pytest.mark.parametrize("fields,is_batch,code", [
    ({"tres_per_node": "gres/shard:2"}, False, ReasonCode.ALREADY_SHARDS),  # checked first
    ({"tres_per_node": ""}, False, ReasonCode.NO_GPU),
    ({"tres_per_node": "gres/gpu:a100:1", "tres_per_job": "gres/gpu:1"}, True, ReasonCode.UNSUPPORTED_REQUEST),
])
def test_none_shard_and_other_come_first(fields, is_batch, code):
    d = decide(fields, history(3), dialect=D24, is_batch=is_batch)
    assert d.action is Action.PASS_THROUGH and d.reasons[0].code is code

