"""The shards the controller in control reports (sinfo %G), read with each queue poll: a GPU there
with none is not offered to a shard job. Measured on Slurm 22.05 (docs/slurm-releases.md): a backup
that took over with `scontrol takeover` shows `shard:<type>:0` on every node and refuses every shard
job; a controller whose nodes have not registered yet shows slurm.conf's untyped count."""
import dataclasses

import pytest

from policy_service.slurm.partitions import partition_defaults
from policy_service.slurm.slurm_files import parse_gres_conf, parse_slurm_conf
from policy_service.slurm.slurm_text import parse_sinfo_nodes
from policy_service.core import policy
from policy_service.core.dialect import SLURM_22_05
from policy_service.core.request import history_keys, job_request
from policy_service.core.types import Action, KeyLevel, LiveShards, ReasonCode

from tests.unit.slurm.test_fleet import GRES_CONF, SLURM_24_11, SLURM_CONF
from tests.unit.core.test_policy import NO_OVERSUB, history

# What the 22.05 dev cluster's controllers showed (docs/slurm-releases.md, "22.05: shards after a takeover")
IN_CONTROL = "node1|gpu:a100:2,gpu:h100:2,shard:a100:8,shard:h100:16|idle\nnode2|gpu:l4:1|idle\n"
BACKUP_AFTER_TAKEOVER = "node1|gpu:a100:2,gpu:h100:2,shard:a100:0,shard:h100:0|idle\nnode2|gpu:l4:1|idle\n"
NOT_REGISTERED = "node1|gpu:a100:2,gpu:h100:2,shard:24|unknown*\n"
NOT_REGISTERED_IDLE = "node1|gpu:a100:2,gpu:h100:2,shard:24|idle\n"
# What 24.11 and 26.05 showed right after a slurmctld restart or `scontrol reconfigure`: typed
# shards, State=UNKNOWN, typed shard jobs refused until the node registered
RESTARTED_TYPED = "node1|gpu:a100:2,gpu:h100:2,shard:a100:8,shard:h100:16|unknown\nnode2|gpu:l4:1|idle\n"


@pytest.mark.parametrize("text,gpus,shards", [
    (IN_CONTROL, 5, {"node1": {"a100": 8, "h100": 16}}),
    (BACKUP_AFTER_TAKEOVER, 5, {"node1": {"a100": 0, "h100": 0}}),
    (NOT_REGISTERED, 0, {}),  # a node that takes no jobs lists nothing
    (NOT_REGISTERED_IDLE, 4, {"node1": {"": 24}}),
    ("n1|gpu:a100:4(S:0-1),shard:a100:32(S:0-1)|mixed\nn1|gpu:a100:4(S:0-1),shard:a100:32(S:0-1)|mixed\n", 4,
     {"n1": {"a100": 32}}),  # a node in two partitions: once
    ("n1|(null)|idle\n", 0, {}),
])
def test_sinfo_gives_each_nodes_gpus_and_shards(text, gpus, shards):
    nodes = parse_sinfo_nodes(text)
    assert (nodes.gpus, nodes.shards) == (gpus, shards)
    assert nodes.unregistered == (frozenset({"node1"}) if text == NOT_REGISTERED else frozenset())


def test_a_node_not_registered_since_the_controller_started_refuses_shard_jobs(parts):
    """State=UNKNOWN (with or without its shards shown): every shard job there is refused, typed or
    not, until the node registers; other nodes are unaffected."""
    nodes = parse_sinfo_nodes(RESTARTED_TYPED)
    assert (nodes.gpus, nodes.unregistered) == (1, frozenset({"node1"}))
    got = live(RESTARTED_TYPED)
    for gpu_type in ("a100", "h100", None):
        assert "State=UNKNOWN" in got.refuses("node1", gpu_type)
    assert got.refuses("node2", None) == ""
    assert "node1" in got.zero
    counts, refused = parts.live_shard_counts("gpu", "a100", got)
    assert counts == () and refused and refused[0].startswith("node1: the node has not registered")
    assert parts.shards_refused(got) and parts.shards_refused(live(RESTARTED_TYPED.replace("unknown", "idle"))) == ()


@pytest.mark.parametrize("by_node,node,gpu_type,refused", [
    ({"n1": {"a100": 8}}, "n1", "a100", False),
    ({"n1": {"a100": 0, "h100": 16}}, "n1", "a100", True),
    ({"n1": {"a100": 0, "h100": 16}}, "n1", "h100", False),
    ({"n1": {"": 24}}, "n1", "a100", True),  # untyped where gres.conf types them: not registered yet
    ({"n1": {"": 24}}, "n1", None, False),  # an untyped fleet: untyped is what it always shows
    ({"n1": {"": 0}}, "n1", None, True),
    ({"n1": {"a100": 0}}, "n1", None, True),
    ({"n1": {"a100": 0}}, "n2", "a100", False),  # a node the controller does not list: nothing known
    ({"n1": {"a100": 8}}, "n1", "v100", False),  # a type it does not list: nothing known
])
def test_which_gpus_the_controller_refuses_shards_on(by_node, node, gpu_type, refused):
    assert bool(LiveShards(by_node).refuses(node, gpu_type)) is refused
    assert LiveShards(by_node, unread="switched").refuses(node, gpu_type) == "switched"


@pytest.fixture(scope="module")
def parts():
    return partition_defaults(parse_slurm_conf(SLURM_CONF), parse_gres_conf(GRES_CONF))


def live(text: str) -> LiveShards:
    nodes = parse_sinfo_nodes(text)
    return LiveShards(nodes.shards, unregistered=nodes.unregistered)


def test_the_gpus_a_job_can_land_on_are_those_the_controller_takes_shard_jobs_on(parts):
    assert parts.live_shard_counts("gpu", "", live(IN_CONTROL)) == ((4, 8), ())
    assert parts.live_shard_counts("gpu", "", None) == ((4, 8), ())
    counts, refused = parts.live_shard_counts("gpu", "", live(BACKUP_AFTER_TAKEOVER))
    assert counts == () and refused == ("node1: the controller in control reports 0 a100 shards",)
    only_a100 = live("node1|gpu:a100:2,gpu:h100:2,shard:a100:0,shard:h100:16|idle\n")
    assert parts.live_shard_counts("gpu", "", only_a100)[0] == (8,)
    assert parts.live_shard_counts("gpu", "h100", only_a100) == ((8,), ())
    assert parts.live_shard_counts("gpu", "a100", only_a100)[0] == ()
    assert parts.live_shard_counts("gpu", "", live(NOT_REGISTERED_IDLE))[0] == ()
    assert parts.live_shard_counts("nowhere", "", live(BACKUP_AFTER_TAKEOVER)) == (None, ())
    assert parts.shards_refused(live(BACKUP_AFTER_TAKEOVER)) == (
        "node1: the controller in control reports 0 a100 shards",)
    assert parts.shards_refused(live(IN_CONTROL)) == () and parts.shards_refused(None) == ()


def test_the_poll_works_out_every_partitions_refusals_so_that_no_admit_does(monkeypatch):
    parts = partition_defaults(parse_slurm_conf(SLURM_CONF), parse_gres_conf(GRES_CONF))  # its own memo
    worked_out = []
    real = type(parts)._live_counts
    monkeypatch.setattr(type(parts), "_live_counts", lambda self, *a: worked_out.append(a[:2]) or real(self, *a))
    assert parts.warm_live(live(IN_CONTROL)) == 0 and parts.warm_live(None) == 0   # nothing refused
    unread = dataclasses.replace(live(BACKUP_AFTER_TAKEOVER), unread="role change")
    assert parts.warm_live(unread) == 0 and worked_out == []
    refusing = live(BACKUP_AFTER_TAKEOVER)
    pairs = parts.warm_live(refusing)
    assert pairs == len(set(worked_out)) == len(worked_out) and ("gpu", "a100") in worked_out
    assert ("", "") in worked_out and ("big", "h100") in worked_out
    fresh = partition_defaults(parse_slurm_conf(SLURM_CONF), parse_gres_conf(GRES_CONF))
    before = len(worked_out)
    for partition, gpu_type in (("gpu", ""), ("", ""), ("gpu", "A100"), ("big", "h100"), ("small", "")):
        assert parts.live_shard_counts(partition, gpu_type, refusing) == fresh.live_shard_counts(
            partition, gpu_type, refusing)
    assert len(worked_out) == before + 5     # only ``fresh`` worked anything out: ``parts`` had it all


def _decide(peak_gib, counts, refused, fields=None, dialect=SLURM_24_11):
    fields = fields or {"tres_per_node": "gres/gpu:1"}
    req, access = job_request(user="u", account="a", partition="gpu", job_name="t", script_fingerprint="fp",
                              gres_fields=fields, gpu_shard_counts=counts)
    req = dataclasses.replace(req, shards_refused=refused)
    return policy.decide(req, history(peak_gib) if peak_gib else {}, NO_OVERSUB, decision_id="d", now=1.0,
                         job_class=history_keys(req)[KeyLevel.CLASS], gres_fields=fields, access=access,
                         dialect=dialect)


REFUSED = ("node1: the controller in control reports 0 a100 shards",)


def test_a_job_that_would_share_keeps_its_request_where_slurm_would_refuse_shards():
    shared = _decide(3, (4, 8), ())
    assert (shared.action, shared.rewrite.tres_per_node) == (Action.SHARE, "gres/shard:1")
    d = _decide(3, (), REFUSED)
    assert (d.action, d.shards, d.rewrite.tres_per_node) == (Action.WHOLE_GPU, 0, None)
    (why,) = [r.message for r in d.reasons if r.code is ReasonCode.SHARDS_REFUSED]
    assert "node1: the controller in control reports 0 a100 shards" in why and "request stays" in why, why
    assert " why=shards_refused," in d.rewrite.admin_comment, d.rewrite.admin_comment  # what sacct shows


def test_22_05_does_not_hold_a_whole_gpu_as_shards_the_controller_refuses():
    held = _decide(0, (4,), (), fields={"tres_per_node": "gres:gpu:a100:1"}, dialect=SLURM_22_05)
    assert held.rewrite.tres_per_node == "gres:shard:a100:4"
    d = _decide(0, (), REFUSED, fields={"tres_per_node": "gres:gpu:a100:1"}, dialect=SLURM_22_05)
    assert (d.action, d.shards, d.rewrite.tres_per_node) == (Action.WHOLE_GPU, 0, None)
    codes = [r.code for r in d.reasons]
    assert codes.count(ReasonCode.SHARDS_REFUSED) == 1 and ReasonCode.WHOLE_GPU_AS_SHARDS not in codes, codes
    shared = _decide(3, (), REFUSED, fields={"tres_per_node": "gres:gpu:a100:1"}, dialect=SLURM_22_05)
    assert [r.code for r in shared.reasons].count(ReasonCode.SHARDS_REFUSED) == 1
    assert shared.rewrite.tres_per_node is None


@pytest.mark.parametrize("release,unread", [((22, 5), True), ((23, 11), True), ((24, 5), True),
                                            ((24, 11), False), ((25, 11), False), ((26, 5), False)])
def test_releases_whose_backup_may_refuse_shards_after_a_takeover(release, unread):
    """Measured: 22.05 yes; 24.11 and 26.05 no. Releases between 22.05 and 24.11 not measured: as 22.05."""
    from policy_service.core.dialect import dialect_for
    assert dialect_for(release).takeover_zero_shards is unread


def naive_live_shard_counts(parts, partition, gpu_type, live):
    """Every GPU of the partition checked (what live_shard_counts computes from the suspects alone)."""
    from policy_service.slurm.fleet import shard_counts
    counts = parts.shard_counts(partition, gpu_type)
    if counts is None:
        return counts, set()
    want = gpu_type.lower()
    gpus = [g for n in parts._names(partition) for g in parts.gpus.get(n, ())
            if not want or not g.type or g.type.lower() == want]
    refused = {g.node for g in gpus if live.refuses(g.node, g.type)}
    kept = [g for g in gpus if not live.refuses(g.node, g.type)]
    return (counts if not refused else shard_counts(kept)), refused


MIXED_SLURM_CONF = SLURM_CONF + "NodeName=node3 CPUs=8 Gres=gpu:2,shard:16\nPartitionName=mix Nodes=node1,node3\n"


def test_looking_at_the_suspect_nodes_alone_decides_as_looking_at_every_gpu():
    import random
    parts = partition_defaults(parse_slurm_conf(MIXED_SLURM_CONF), parse_gres_conf(GRES_CONF))
    rng = random.Random(7)
    shapes = [{"a100": 8, "h100": 16}, {"a100": 0, "h100": 16}, {"a100": 0, "h100": 0}, {"": 24}, {"": 0},
              {"a100": 8}, {}, {"": 16}]
    for _ in range(400):
        by_node = {n: rng.choice(shapes) for n in ("node1", "node2", "node3") if rng.random() < 0.9}
        live = LiveShards({n: c for n, c in by_node.items() if c})
        for partition in ("gpu", "big", "small", "mix", "gpu,mix", "nowhere"):
            for gpu_type in ("", "a100", "H100", "v100"):
                counts, refused = parts.live_shard_counts(partition, gpu_type, live)
                want_counts, want_refused = naive_live_shard_counts(parts, partition, gpu_type, live)
                assert counts == want_counts, (by_node, partition, gpu_type)
                assert {r.split(":")[0] for r in refused} == want_refused, (by_node, partition, gpu_type, refused)
