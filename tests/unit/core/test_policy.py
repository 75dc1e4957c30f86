import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy_service.config import AccessClass, Config, EstimatorConfig, GpuConfig, PolicyConfig, WholeGpuAsShards
from policy_service.core import estimator, policy
from policy_service.core.request import history_keys, job_request
from policy_service.core.types import Action, ClassStats, JobObservation, KeyLevel, ReasonCode

GIB = 1024**3
CFG = Config(gpu=GpuConfig(memory_bytes=80 * GIB, shards_per_gpu=8),  # 10 GiB shards
             estimator=EstimatorConfig(min_samples=1))  # decisions from one run on (the default waits for 3)


def make(fields=None, nodes=1, comment="", tasks=1):
    fields = fields if fields is not None else {"tres_per_node": "gres:gpu:1"}
    r, access = job_request(user="u", account="a", partition="gpu", job_name="train", script_fingerprint="fp",
                            gres_fields=fields, min_nodes=nodes, num_tasks=tasks, comment=comment)
    return r, fields, access


def decide(stats=None, cfg=CFG, **kw):
    r, fields, access = make(**kw)
    return policy.decide(r, stats or {}, cfg, decision_id="d1", now=1.0, job_class=history_keys(r)[KeyLevel.CLASS],
                         gres_fields=fields, access=access)


def history(*peaks_gib, **overrides):
    s = ClassStats()
    for p in peaks_gib:
        s = estimator.observe(s, JobObservation(100.0, 0, int(p * GIB), False, True, 0), CFG.estimator)
    return {KeyLevel.CLASS: replace(s, **overrides)}


NO_OVERSUB = replace(CFG, policy=replace(CFG.policy, allow_oversubscription=False))


def telling(cfg):
    """``cfg`` with policy.tell_users on (a message to the user on a rewrite; off by default)."""
    return replace(cfg, policy=replace(cfg.policy, tell_users=True))


@pytest.mark.parametrize("kw,stats,action,shards,code", [
    (dict(fields={}), None, Action.PASS_THROUGH, 0, ReasonCode.NO_GPU),
    (dict(fields={"tres_per_node": "gres:shard:2"}), None, Action.PASS_THROUGH, 0, ReasonCode.ALREADY_SHARDS),
    (dict(), None, Action.WHOLE_GPU, 8, ReasonCode.NO_HISTORY),
    (dict(nodes=2), history(3), Action.WHOLE_GPU, 0, ReasonCode.MULTI_NODE),
    (dict(fields={"tres_per_node": "gres:gpu:2"}), history(3), Action.WHOLE_GPU, 0, ReasonCode.MULTI_GPU),
    (dict(), history(3), Action.SHARE, 1, ReasonCode.FITS_IN_SHARDS),  # 3.3 GiB -> 1 shard
    (dict(), history(19), Action.SHARE, 3, ReasonCode.FITS_IN_SHARDS),  # 20.9 GiB -> 3 shards
    (dict(), history(75), Action.WHOLE_GPU, 8, ReasonCode.TOO_LARGE_TO_SHARE),
    (dict(), history(90), Action.WHOLE_GPU, 8, ReasonCode.TOO_LARGE_TO_SHARE),  # beyond the device
    (dict(), history(3, whole_gpu_runs_left=1), Action.WHOLE_GPU, 8, ReasonCode.OOM_PENALTY),
    (dict(fields={"tres_per_task": "gres:gpu:1"}, tasks=4), history(3), Action.WHOLE_GPU, 0, ReasonCode.MULTI_GPU),
    (dict(fields={"tres_per_task": "gres:gpu:1"}, tasks=1), history(3), Action.SHARE, 1, ReasonCode.FITS_IN_SHARDS),
    (dict(fields={"tres_per_socket": "gres:gpu:1"}), history(3), Action.WHOLE_GPU, 0, ReasonCode.MULTI_GPU),
    (dict(fields={"tres_per_job": "gres:gpu:1"}), history(3), Action.SHARE, 1, ReasonCode.FITS_IN_SHARDS),
])
def test_decision_table(kw, stats, action, shards, code):
    d = decide(stats, cfg=NO_OVERSUB, **kw)
    assert (d.action, d.shards) == (action, shards)
    assert code in {r.code for r in d.reasons}
    assert d.decision_id in (d.rewrite.admin_comment or d.decision_id)


def test_the_user_is_told_of_a_rewrite_only_where_the_site_asks():
    """Off by default (sbatch's stderr as without swapaware); policy.tell_users on: one line."""
    quiet = decide(history(3), cfg=NO_OVERSUB)
    told = decide(history(3), cfg=telling(NO_OVERSUB))
    assert quiet.action is told.action is Action.SHARE and quiet.rewrite.tres_per_node == told.rewrite.tres_per_node
    assert quiet.rewrite.user_message is None
    assert told.rewrite.user_message == "swapaware: gpu request rewritten to 1 shard(s) of one GPU (predicted peak 3.0GiB)"


def test_share_rewrite_clears_gpu_fields():
    d = decide(history(3), cfg=NO_OVERSUB, fields={"tres_per_job": "gres:gpu:1"})
    assert d.rewrite.tres_per_node == "gres:shard:1" and d.rewrite.tres_per_job == ""


def test_whole_gpu_is_held_as_all_shards_of_one_gpu():
    d = decide(None, fields={"tres_per_job": "gres:gpu:1"})
    assert d.action is Action.WHOLE_GPU and d.shards == CFG.gpu.shards_per_gpu
    assert (d.rewrite.tres_per_node, d.rewrite.tres_per_job) == ("gres:shard:8", "")
    assert ReasonCode.WHOLE_GPU_AS_SHARDS in {r.code for r in d.reasons}
    assert d.rewrite.user_message is None


def test_whole_gpu_as_gpu_when_configured_and_passthrough_leave_gres_alone():
    plain = replace(CFG, policy=replace(CFG.policy, whole_gpu_as_shards=WholeGpuAsShards.OFF))
    disabled = replace(CFG, policy=replace(CFG.policy, enable_sharing=False))
    for d in (decide(None, cfg=plain), decide(history(3), cfg=disabled), decide(None, fields={}),
              decide(history(3), nodes=2)):
        assert d.rewrite.tres_per_node is None and d.rewrite.tres_per_job is None and d.shards == 0


def test_no_gpu_job_gets_no_record():
    d = decide(None, fields={})
    assert d.rewrite.admin_comment is None and d.rewrite.site_factor is None


def test_observed_max_raises_the_charge():
    stats = history(3)
    stats[KeyLevel.CLASS] = replace(stats[KeyLevel.CLASS], max_peak_bytes=25 * GIB)
    d = decide(stats, cfg=NO_OVERSUB)
    assert d.shards == 3 and ReasonCode.RAISED_TO_OBSERVED_MAX in {r.code for r in d.reasons}


def test_oversubscription_only_within_budget():
    # 10.5 GiB peak + 1.05 margin = 11.55 GiB; one shard is 10 GiB: 1.55 GiB would live in host memory
    d = decide(history(10.5), comment="swapaware:access=compute_bound")
    assert d.action is Action.SHARE_OVERSUBSCRIBED and d.shards == 1
    assert d.swap_slowdown <= CFG.policy.max_victim_slowdown and d.offloaded_bytes > 0
    strict = replace(CFG, policy=replace(CFG.policy, max_victim_slowdown=1.0))
    d2 = decide(history(10.5), cfg=strict, comment="swapaware:access=compute_bound")
    assert d2.action is Action.SHARE and d2.shards == 2
    assert ReasonCode.OVERSUBSCRIPTION_TOO_COSTLY not in {r.code for r in d2.reasons}


def test_streaming_job_is_not_oversubscribed_by_much():
    d = decide(history(18.0))  # 19.8 GiB needed: 2 shards fit, 1 shard would offload ~9.8 GiB streaming
    assert d.shards == 2


def test_sharing_disabled():
    cfg = replace(CFG, policy=replace(CFG.policy, enable_sharing=False))
    assert decide(history(3), cfg=cfg).action is Action.WHOLE_GPU


def test_contention_degree_seed_formula():
    s = ClassStats(solo_runs=2, shared_runs=2, ewma_solo_runtime_s=100, ewma_shared_runtime_s=160, ewma_corunners=2)
    assert policy.contention_degree(s, 1) == pytest.approx((160 - 100) / 100 / 2)
    assert policy.contention_degree(replace(s, solo_runs=0), 1) is None


def test_site_factor_scaled_and_capped():
    hot = ClassStats(solo_runs=1, shared_runs=1, ewma_solo_runtime_s=100, ewma_shared_runtime_s=400, ewma_corunners=1)
    value, reason = policy.site_factor(hot, CFG)
    assert value == CFG.policy.site_factor_max and reason.code is ReasonCode.PRIORITY_CONTENTION
    mild = replace(hot, ewma_shared_runtime_s=120)
    assert policy.site_factor(mild, CFG)[0] == round(CFG.policy.site_factor_scale * 0.2)


def test_admin_comment_round_trip_and_bounded():
    d = decide(history(3))
    parsed = policy.parse_admin_comment(d.rewrite.admin_comment)
    assert parsed["id"] == "d1" and parsed["action"] == d.action.value and parsed["shards"] == str(d.shards)
    assert len(d.rewrite.admin_comment) <= CFG.policy.admin_comment_max_chars
    assert policy.parse_admin_comment("someone else's note") == {}


def test_model_version_tracks_parameters():
    other = replace(CFG, gpu=replace(CFG.gpu, shards_per_gpu=4))
    assert policy.model_version(CFG) != policy.model_version(other)
    assert policy.model_version(CFG) == policy.model_version(replace(CFG))


def test_decide_is_pure():
    assert decide(history(3, 4)) == decide(history(3, 4))


peaks = st.lists(st.floats(min_value=0.01, max_value=120.0), min_size=0, max_size=6)


@settings(max_examples=300, deadline=None)
@given(peaks=peaks, spg=st.sampled_from([1, 2, 4, 7, 8, 16]), mem_gib=st.sampled_from([16, 40, 80, 141]),
       oversub=st.booleans(), access=st.sampled_from(list(AccessClass)), hint=st.one_of(st.none(), st.integers(1, 300)))
def test_property_never_more_shards_than_a_gpu_and_never_below_history_silently(peaks, spg, mem_gib, oversub, access, hint):
    cfg = replace(CFG, gpu=GpuConfig(memory_bytes=mem_gib * GIB, shards_per_gpu=spg),
                  policy=replace(CFG.policy, allow_oversubscription=oversub))
    comment = f"swapaware:access={access.value}" + (f" swapaware:mem={hint}G" if hint else "")
    stats = history(*peaks) if peaks else {}
    d = decide(stats, cfg=cfg, comment=comment)
    assert 0 <= d.shards <= spg
    if d.action is Action.WHOLE_GPU:
        assert d.shards in (0, spg)
        assert d.rewrite.tres_per_node == (f"gres:shard:{spg}" if d.shards else None)
    elif d.action in (Action.SHARE, Action.SHARE_OVERSUBSCRIBED):
        assert 1 <= d.shards < spg
        assert d.rewrite.tres_per_node == f"gres:shard:{d.shards}"
        charged = d.shards * cfg.gpu.shard_bytes
        observed = max((int(p * GIB) for p in peaks), default=0)
        if charged < observed:  # less memory than history showed: only with a stated reason
            assert d.action is Action.SHARE_OVERSUBSCRIBED
            assert ReasonCode.OVERSUBSCRIBED in {r.code for r in d.reasons}
            assert d.swap_slowdown <= cfg.policy.max_victim_slowdown
        if d.action is Action.SHARE:
            assert charged >= max(d.estimate.sized_bytes, observed)
    else:
        assert d.rewrite.tres_per_node is None
    if d.action is Action.SHARE_OVERSUBSCRIBED:
        assert d.estimate.sized_bytes <= cfg.gpu.memory_bytes  # never oversubscribe beyond the device
    assert d.reasons and all(r.message for r in d.reasons)
    assert 0 <= d.site_factor <= cfg.policy.site_factor_max
    assert math.isfinite(d.swap_slowdown) and d.swap_slowdown >= 1.0


def test_oom_penalty_of_user_name_applies_to_a_new_class_only():
    penalised = history(3, whole_gpu_runs_left=2)[KeyLevel.CLASS]
    clean = history(3)[KeyLevel.CLASS]
    d_new = decide({KeyLevel.USER_NAME: penalised})
    assert d_new.action is Action.WHOLE_GPU and ReasonCode.OOM_PENALTY in {r.code for r in d_new.reasons}
    d_known = decide({KeyLevel.CLASS: clean, KeyLevel.USER_NAME: penalised}, cfg=NO_OVERSUB)
    assert d_known.action is Action.SHARE
