"""The queue rule: squeue/sinfo parsers, pending GPU demand, the policy's queue gate and its config."""
from dataclasses import replace

import pytest

from policy_service.slurm.queue import WAITING_REASONS, gpus_asked, queue_state
from policy_service.slurm.slurm import (PendingJob, SlurmError, parse_qos_priorities, parse_sinfo_gpus,
                                       parse_squeue_pending)
from policy_service.config import ConfigError, load_config
from policy_service.core import policy
from policy_service.core.request import history_keys, job_request
from policy_service.core.types import Action, KeyLevel, QueueState, ReasonCode

from tests.unit.core.test_policy import NO_OVERSUB, history, make

# Captured on the dev cluster's Slurm 22.05:
#   squeue -h -a -t PENDING -O "JobID:|,tres-per-node:|,tres-per-job:|,tres-per-task:|,NumNodes:|,NumTasks:|,QOS:|,Reason:"
# (jobs 5 and 6 verbatim; the others from a capture without the QOS column, with their QoS, normal, put back)
SQUEUE_CAPTURED = """\
5|gres:shard:8|N/A|N/A|1|1|normal|Resources
6|gres:shard:8|N/A|N/A|1|1|high|Priority
7|gres:shard:8|N/A|N/A|1|1|normal|Priority
3|gres:shard:8|N/A|N/A|1|1|normal|Nodes required for job are DOWN, DRAINED or reserved for jobs in higher priority partitions
1|gres:shard:8|N/A|N/A|1|1|normal|launch failed requeued held
9|N/A|N/A|gres:gpu:1|1|2|normal|launch failed requeued held
8|gres:shard:8|N/A|N/A|1|1|normal|JobHeldUser
"""
#   sinfo -h -N -o "%N|%G|%T"
SINFO_CAPTURED = "vm|gpu:4,shard:32|drained\n"

QUEUE_CODES = {ReasonCode.QUEUE_SHORT, ReasonCode.QUEUE_UNKNOWN}


def pj(job_id=1, node="", job="", task="", nodes=1, tasks=1, reason="Priority", qos=""):
    return PendingJob(job_id, node, job, task, nodes, tasks, reason, qos)


# ----------------------------------------------------------------------------- squeue
def test_squeue_captured_output():
    assert parse_squeue_pending(SQUEUE_CAPTURED) == [
        PendingJob(5, "gres:shard:8", "", "", 1, 1, "Resources", "normal"),
        PendingJob(6, "gres:shard:8", "", "", 1, 1, "Priority", "high"),
        PendingJob(7, "gres:shard:8", "", "", 1, 1, "Priority", "normal"),
        PendingJob(3, "gres:shard:8", "", "", 1, 1,
                   "Nodes required for job are DOWN, DRAINED or reserved for jobs in higher priority partitions",
                   "normal"),
        PendingJob(1, "gres:shard:8", "", "", 1, 1, "launch failed requeued held", "normal"),
        PendingJob(9, "", "", "gres:gpu:1", 1, 2, "launch failed requeued held", "normal"),
        PendingJob(8, "gres:shard:8", "", "", 1, 1, "JobHeldUser", "normal"),
    ]


@pytest.mark.parametrize("line,expected", [
    ("", []),
    ("\n\n", []),
    ("12_3|(null)|gres:gpu:2|(null)|2|4|normal|Resources", [PendingJob(12, "", "gres:gpu:2", "", 2, 4, "Resources", "normal")]),
    ("13|gres:gpu:1|N/A|N/A|0|0|(null)|None", [PendingJob(13, "gres:gpu:1", "", "", 1, 1, "None", "")]),
    ("14|N/A|N/A|N/A|1|1|low|odd|reason", [PendingJob(14, "", "", "", 1, 1, "odd|reason", "low")]),
], ids=["empty", "blank-lines", "array-null", "zero-counts", "pipe-in-reason"])
def test_squeue_rows(line, expected):
    assert parse_squeue_pending(line) == expected


@pytest.mark.parametrize("line", [
    "7|gres:shard:8|N/A|N/A|1|1|Priority",  # a column short (no QOS)
    "7|gres:gpu:1",
    "x7|gres:gpu:1|N/A|N/A|1|1|normal|Priority",  # job id not a number
    "7|gres:gpu:1|N/A|N/A|one|1|normal|Priority",  # node count not a number
    "7|gres:gpu:1|N/A|N/A|1|two|normal|Priority",  # task count not a number
], ids=["seven-columns", "two-columns", "bad-id", "bad-nodes", "bad-tasks"])
def test_squeue_malformed_line_raises(line):
    with pytest.raises(SlurmError, match="unexpected squeue line"):
        parse_squeue_pending("6|gres:shard:2|N/A|N/A|1|1|normal|Priority\n" + line + "\n")


# ----------------------------------------------------------------------------- sinfo
@pytest.mark.parametrize("text,gpus", [
    (SINFO_CAPTURED, 0),  # the captured node is drained
    ("vm|gpu:4,shard:32|idle\n", 4),
    ("vm|gpu:4,shard:32|mixed\n", 4),
    ("vm|gpu:4,shard:32|allocated\n", 4),
    ("vm|gpu:4,shard:32|down*\n", 0),
    ("vm|gpu:4,shard:32|draining\n", 0),
    ("vm|gpu:4,shard:32|drained*\n", 0),
    ("vm|gpu:4,shard:32|idle\nvm|gpu:4,shard:32|idle\n", 4),  # node in two partitions: counted once
    ("n1|gpu:a100:4(S:0-1),shard:a100:32|mixed\nn2|gpu:a100:4(S:0-1),shard:a100:32|idle\n", 8),
    ("n1|gpu:a100:4(S:0-1),shard:a100:32|mixed\nn2|gpu:a100:4(S:0-1),shard:a100:32|down*\n", 4),
    ("n1|gpu:a100:2,gpu:v100:2(S:0)|idle\n", 4),
    ("n1|(null)|idle\n", 0),
    ("cpu1|(null)|idle\ngpu1|gpu:8|allocated\n", 8),
    ("", 0),
    ("garbage line\n|gpu:4|idle\n", 0),
], ids=["captured-drained", "idle", "mixed", "allocated", "down", "draining", "drained-star", "two-partitions",
        "typed-socket", "typed-one-down", "two-types", "null-gres", "cpu-and-gpu-node", "empty", "junk"])
def test_sinfo_gpus(text, gpus):
    assert parse_sinfo_gpus(text) == gpus


# ----------------------------------------------------------------------------- demand
@pytest.mark.parametrize("job,spg,gpus", [
    (pj(node="gres:gpu:1"), 8, 1.0),
    (pj(node="gres:gpu:2", nodes=3), 8, 6.0),  # per node x nodes
    (pj(node="gres:gpu:a100:2", nodes=2), 8, 4.0),
    (pj(node="gres/gpu:2"), 8, 2.0),  # newer Slurm spelling
    (pj(node="gres:shard:8"), 8, 1.0),
    (pj(node="gres:shard:2"), 8, 0.25),
    (pj(node="gres:shard:2"), 4, 0.5),
    (pj(node="gres:shard:4", nodes=2), 8, 1.0),
    (pj(task="gres:gpu:1", tasks=2), 8, 2.0),  # per task x tasks
    (pj(task="gres:gpu:2", tasks=3, nodes=2), 8, 6.0),
    (pj(job="gres:gpu:4", nodes=2, tasks=8), 8, 4.0),  # per job: neither nodes nor tasks multiply
    (pj(), 8, 0.0),
    (pj(node="gres:nvme:1"), 8, 0.0),
    (pj(node="gres:mps:100"), 8, 0.0),
    (pj(node="gres:gpu:a:b:c"), 8, 0.0),  # unparseable: not counted, no exception
], ids=["gpu1", "gpu-x-nodes", "typed-x-nodes", "gres-slash", "shard8", "shard2", "shard2-of-4", "shard-x-nodes",
        "per-task", "per-task-x-tasks", "per-job", "no-gres", "non-gpu", "mps", "malformed"])
def test_gpus_asked(job, spg, gpus):
    assert gpus_asked(job, spg) == pytest.approx(gpus)


def test_queue_state_of_captured_queue_counts_only_jobs_waiting_for_resources():
    jobs = parse_squeue_pending(SQUEUE_CAPTURED)
    q = queue_state(jobs, total_gpus=4, shards_per_gpu=8)
    # jobs 5 (Resources), 6 and 7 (Priority) wait, 8 shards = 1 GPU each; 3 waits on drained
    # nodes, 1, 9 and 8 are held
    assert q == QueueState(pending_gpus=3.0, total_gpus=4, age_s=0.0)
    assert q.pressure == pytest.approx(0.75)
    assert queue_state(jobs, total_gpus=parse_sinfo_gpus(SINFO_CAPTURED), shards_per_gpu=8).total_gpus == 0


def test_queue_ahead_of_each_qos_counts_pending_jobs_of_equal_or_higher_qos_priority():
    jobs = parse_squeue_pending(SQUEUE_CAPTURED)  # waiting: 5 normal, 6 high, 7 normal
    q = queue_state(jobs, total_gpus=4, shards_per_gpu=8, qos_priorities={"normal": 0, "high": 100, "low": -1})
    assert dict(q.ahead_by_qos) == {"high": 1.0, "normal": 3.0, "low": 3.0}
    assert q.pending_for("high") == 1.0 and q.pressure_for("high") == 0.25
    assert q.pending_for("") == 3.0 and q.pending_for("unlisted") == 3.0  # unknown QoS: the whole queue
    # a pending job whose QoS the table lacks counts ahead of everyone
    odd = [pj(reason="Priority", node="gres:gpu:2", qos="gone")]
    assert dict(queue_state(odd, 4, 8, {"normal": 0, "high": 100}).ahead_by_qos) == {"high": 2.0, "normal": 2.0}
    assert queue_state(jobs, 4, 8, {}).ahead_by_qos == ()  # accounting unreadable: no per-QoS view


def test_qos_priorities_parser():
    assert parse_qos_priorities("normal|0\nhigh|100\n\n") == {"normal": 0, "high": 100}
    with pytest.raises(SlurmError):
        parse_qos_priorities("normal|zero\n")


def test_long_queue_of_lower_qos_does_not_make_a_high_qos_job_share():
    cfg = replace(NO_OVERSUB, policy=replace(NO_OVERSUB.policy, share_min_queue=0.05))
    q = QueueState(3.0, 4, ahead_by_qos=(("high", 0.0), ("normal", 3.0)))
    high = gated(q, cfg=cfg, qos="high")
    assert high.action is Action.WHOLE_GPU and ReasonCode.QUEUE_SHORT in {r.code for r in high.reasons}
    assert "at or above QoS 'high'" in next(r.message for r in high.reasons if r.code is ReasonCode.QUEUE_SHORT)
    assert gated(q, cfg=cfg, qos="normal").action is Action.SHARE
    assert gated(q, cfg=cfg, qos="").action is Action.SHARE  # no --qos: the whole queue
    whole_queue = replace(cfg, policy=replace(cfg.policy, queue_per_qos=False))
    assert gated(q, cfg=whole_queue, qos="high").action is Action.SHARE


@pytest.mark.parametrize("reason,counted", [
    ("Priority", True), ("Resources", True), ("None", True),
    ("Dependency", False), ("JobHeldUser", False), ("JobHeldAdmin", False), ("BeginTime", False),
    ("launch failed requeued held", False), ("QOSMaxGRESPerUser", False), ("priority", False),
])
def test_queue_state_reasons(reason, counted):
    assert (reason in WAITING_REASONS) is counted
    jobs = [pj(1, node="gres:gpu:2", reason=reason), pj(2, node="gres:gpu:1", reason="Resources")]
    assert queue_state(jobs, 8, 8).pending_gpus == (3.0 if counted else 1.0)


def test_queue_pressure():
    assert QueueState(1.0, 4).pressure == 0.25
    assert QueueState(6.0, 4).pressure == 1.5
    assert QueueState(0.0, 4).pressure == 0.0
    # Every GPU node down or drained: waiting GPU work makes the queue long, not short.
    assert QueueState(1.25, 0).pressure == float("inf")
    assert QueueState(0.0, 0).pressure == 0.0


def test_waiting_work_on_a_drained_cluster_does_not_keep_jobs_whole():
    d = gated(QueueState(1.25, 0), cfg=replace(NO_OVERSUB, policy=replace(NO_OVERSUB.policy, share_min_queue=0.05)))
    assert d.action is Action.SHARE
    assert ReasonCode.QUEUE_SHORT not in {r.code for r in d.reasons}


# ----------------------------------------------------------------------------- the policy gate
def gated(queue, stats=None, cfg=NO_OVERSUB, qos="", **kw):
    r, fields, access = make(**kw)
    r = replace(r, qos=qos)
    return policy.decide(r, history(3) if stats is None else stats, cfg, decision_id="q1", now=1.0,
                         job_class=history_keys(r)[KeyLevel.CLASS], gres_fields=fields, access=access, queue=queue)


def codes(d):
    return {r.code for r in d.reasons}


def with_policy(**kw):
    return replace(NO_OVERSUB, policy=replace(NO_OVERSUB.policy, **kw))


OFF = with_policy(share_min_queue=0.0)
PROTECTED = with_policy(whole_gpu_qos=("high", "interactive"))


@pytest.mark.parametrize("cfg,queue,action,shards,queue_code", [
    (OFF, None, Action.SHARE, 1, None),
    (OFF, QueueState(0.0, 4), Action.SHARE, 1, None),
    (OFF, QueueState(0.0, 4, age_s=1e6), Action.SHARE, 1, None),
    (NO_OVERSUB, None, Action.SHARE, 1, ReasonCode.QUEUE_UNKNOWN),
    (NO_OVERSUB, QueueState(0.0, 4, age_s=45.001), Action.SHARE, 1, ReasonCode.QUEUE_UNKNOWN),  # > 3 x 15 s
    (NO_OVERSUB, QueueState(0.0, 4, age_s=45.0), Action.WHOLE_GPU, 8, ReasonCode.QUEUE_SHORT),  # still fresh
    (NO_OVERSUB, QueueState(0.0, 4), Action.WHOLE_GPU, 8, ReasonCode.QUEUE_SHORT),
    (NO_OVERSUB, QueueState(0.1, 4, age_s=3.0), Action.WHOLE_GPU, 8, ReasonCode.QUEUE_SHORT),  # 2.5 %
    (NO_OVERSUB, QueueState(1.0, 20), Action.SHARE, 1, None),  # exactly 5 %
    (NO_OVERSUB, QueueState(1.0, 4), Action.SHARE, 1, None),
    (NO_OVERSUB, QueueState(12.0, 4), Action.SHARE, 1, None),
    (with_policy(share_min_queue=0.5), QueueState(1.0, 4), Action.WHOLE_GPU, 8, ReasonCode.QUEUE_SHORT),
    (with_policy(share_min_queue=0.5, queue_poll_s=1.0), QueueState(1.0, 4, age_s=3.5), Action.SHARE, 1,
     ReasonCode.QUEUE_UNKNOWN),
], ids=["off-none", "off-empty", "off-stale", "none", "stale", "age-at-limit", "empty", "below", "at-threshold",
        "above", "far-above", "higher-threshold", "short-poll-stale"])
def test_queue_gate(cfg, queue, action, shards, queue_code):
    d = gated(queue, cfg=cfg)
    assert (d.action, d.shards) == (action, shards)
    assert codes(d) & QUEUE_CODES == ({queue_code} if queue_code else set())
    if action is Action.SHARE:
        assert ReasonCode.FITS_IN_SHARDS in codes(d) and d.rewrite.tres_per_node == "gres:shard:1"
    else:
        assert ReasonCode.FITS_IN_SHARDS not in codes(d)
        assert ReasonCode.WHOLE_GPU_AS_SHARDS in codes(d) and d.rewrite.tres_per_node == "gres:shard:8"
        assert d.rewrite.user_message is None


def test_queue_short_reason_carries_the_figures_and_lands_in_the_record():
    d = gated(QueueState(0.1, 4))
    short = d.reasons[0]
    assert short.code is ReasonCode.QUEUE_SHORT
    assert "0.10 of 4 GPUs" in short.message
    assert "2.5% < policy.share_min_queue 5.0%" in short.message
    assert "queue_short" in policy.parse_admin_comment(d.rewrite.admin_comment)["why"].split(",")
    assert policy.parse_admin_comment(d.rewrite.admin_comment)["action"] == "whole_gpu"


def test_unknown_queue_is_not_mentioned_when_the_job_keeps_a_whole_gpu_anyway():
    d = gated(None, stats=history(75))
    assert d.action is Action.WHOLE_GPU and ReasonCode.TOO_LARGE_TO_SHARE in codes(d)
    assert not codes(d) & QUEUE_CODES


@pytest.mark.parametrize("queue", [None, QueueState(0.0, 4), QueueState(8.0, 4), QueueState(0.0, 4, age_s=1e6)],
                         ids=["none", "empty", "long", "stale"])
def test_job_without_history_stays_whole_for_no_history(queue):
    d = gated(queue, stats={})
    assert (d.action, d.shards) == (Action.WHOLE_GPU, 8)
    assert d.reasons[0].code is ReasonCode.NO_HISTORY
    assert not codes(d) & QUEUE_CODES


@pytest.mark.parametrize("qos", ["high", "interactive"])
def test_protected_qos_keeps_a_whole_gpu_even_with_a_long_queue(qos):
    d = gated(QueueState(8.0, 4), cfg=PROTECTED, qos=qos)
    assert (d.action, d.shards) == (Action.WHOLE_GPU, 8)
    assert d.reasons[0].code is ReasonCode.PROTECTED_QOS
    (why,) = [r for r in d.reasons if r.code is ReasonCode.PROTECTED_QOS]
    assert repr(qos) in why.message
    assert not codes(d) & (QUEUE_CODES | {ReasonCode.FITS_IN_SHARDS})
    assert "protected_qos" in policy.parse_admin_comment(d.rewrite.admin_comment)["why"].split(",")


def test_protected_qos_wins_over_no_history():
    d = gated(None, stats={}, cfg=PROTECTED, qos="high")
    assert (d.action, d.shards) == (Action.WHOLE_GPU, 8)
    assert d.reasons[0].code is ReasonCode.PROTECTED_QOS  # the routing reason (the estimate adds no_history)


@pytest.mark.parametrize("cfg,qos", [(PROTECTED, "normal"), (PROTECTED, ""), (PROTECTED, "hig"),
                                     (NO_OVERSUB, "high")],
                         ids=["other-qos", "default-qos", "prefix", "nothing-protected"])
def test_qos_not_listed_shares(cfg, qos):
    d = gated(QueueState(8.0, 4), cfg=cfg, qos=qos)
    assert (d.action, d.shards) == (Action.SHARE, 1)
    assert ReasonCode.PROTECTED_QOS not in codes(d)


def test_job_request_carries_the_qos():
    common = dict(user="u", account="a", partition="gpu", job_name="t", script_fingerprint="fp",
                  gres_fields={"tres_per_node": "gres:gpu:1"})
    assert job_request(**common, qos="high")[0].qos == "high"
    assert job_request(**common)[0].qos == ""


# ----------------------------------------------------------------------------- config
@pytest.fixture
def empty_toml(tmp_path):
    f = tmp_path / "empty.toml"
    f.write_text("")
    return f


def test_queue_rule_defaults(empty_toml):
    p = load_config(empty_toml, env={}).policy
    assert (p.share_min_queue, p.whole_gpu_qos, p.queue_poll_s) == (0.05, (), 15.0)


@pytest.mark.parametrize("toml,env,expected", [
    ('[policy]\nwhole_gpu_qos = ["high", "interactive"]\n', {}, ("high", "interactive")),
    ('[policy]\nwhole_gpu_qos = []\n', {}, ()),
    ("", {"SWAPAWARE_POLICY__WHOLE_GPU_QOS": "high,interactive"}, ("high", "interactive")),
    ("", {"SWAPAWARE_POLICY__WHOLE_GPU_QOS": " high , ,interactive,"}, ("high", "interactive")),
    ("", {"SWAPAWARE_POLICY__WHOLE_GPU_QOS": "high"}, ("high",)),
    ("", {"SWAPAWARE_POLICY__WHOLE_GPU_QOS": ""}, ()),
    ('[policy]\nwhole_gpu_qos = ["high"]\n', {"SWAPAWARE_POLICY__WHOLE_GPU_QOS": "urgent,debug"}, ("urgent", "debug")),
], ids=["toml-list", "toml-empty", "env", "env-spaces", "env-one", "env-empty", "env-over-toml"])
def test_whole_gpu_qos_parsing(tmp_path, toml, env, expected):
    f = tmp_path / "c.toml"
    f.write_text(toml)
    assert load_config(f, env=env).policy.whole_gpu_qos == expected


def test_queue_keys_from_toml_and_env(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[policy]\nshare_min_queue = 0.2\nqueue_poll_s = 3\n")
    p = load_config(f, env={}).policy
    assert (p.share_min_queue, p.queue_poll_s) == (0.2, 3.0)
    p = load_config(f, env={"SWAPAWARE_POLICY__SHARE_MIN_QUEUE": "0", "SWAPAWARE_POLICY__QUEUE_POLL_S": "0.05"}).policy
    assert (p.share_min_queue, p.queue_poll_s) == (0.0, 0.05)


@pytest.mark.parametrize("toml,env,match", [
    ("[policy]\nshare_min_queue = -0.01\n", {}, r"policy\.share_min_queue must be in \[0, 100\]"),
    ("", {"SWAPAWARE_POLICY__SHARE_MIN_QUEUE": "-1"}, r"policy\.share_min_queue must be in \[0, 100\]"),
    ("[policy]\nshare_min_queue = 101\n", {}, r"policy\.share_min_queue must be in \[0, 100\]"),
    ("[policy]\nqueue_poll_s = 0\n", {}, r"policy\.queue_poll_s must be > 0"),
    ("", {"SWAPAWARE_POLICY__QUEUE_POLL_S": "-5"}, r"policy\.queue_poll_s must be > 0"),
    ("", {"SWAPAWARE_POLICY__SHARE_MIN_QUEUE": "lots"}, r"policy\.share_min_queue: 'lots' is not a valid float"),
], ids=["share-negative-toml", "share-negative-env", "share-too-large", "poll-zero", "poll-negative", "share-text"])
def test_queue_config_validation(tmp_path, toml, env, match):
    f = tmp_path / "c.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError, match=match):
        load_config(f, env=env)


# ----------------------------------------------------------------------------- re-decisions
def test_a_redecision_names_the_decision_it_replaces_first():
    r, fields, access = make()

    def decide(**kw):
        return policy.decide(r, history(3), NO_OVERSUB, decision_id="r1", now=1.0,
                             job_class=history_keys(r)[KeyLevel.CLASS], gres_fields=fields, access=access, **kw)

    d = decide(replaces="abc123")
    assert d.reasons[0].code is ReasonCode.REDECIDED and d.reasons[0].message.endswith("replaces decision abc123")
    assert policy.parse_admin_comment(d.rewrite.admin_comment)["why"].startswith("redecided,")
    plain = decide()
    assert ReasonCode.REDECIDED not in {x.code for x in plain.reasons}
    assert (plain.action, plain.shards) == (d.action, d.shards) == (Action.SHARE, 1)


@pytest.mark.parametrize("prev,action,replaces", [
    ("whole_gpu", Action.SHARE, True), ("whole_gpu", Action.SHARE_OVERSUBSCRIBED, True),
    ("whole_gpu", Action.WHOLE_GPU, False), ("share", Action.SHARE, False), ("share", Action.WHOLE_GPU, False),
    ("pass_through", Action.SHARE, False),
])
def test_only_a_share_replaces_a_pending_whole_gpu_decision(prev, action, replaces):
    d = gated(None)
    assert policy.replaces_pending(prev, replace(d, action=action)) is replaces
