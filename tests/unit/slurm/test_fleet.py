"""A mixed fleet: GPUs of different memory have different shard counts (a shard is a fixed amount
of memory on every GPU); the policy sizes each job for the GPUs it can land on."""
import pytest

from policy_service.slurm.fleet import file_index, node_gpus, shard_counts, shard_memory_mismatch
from policy_service.slurm.partitions import partition_defaults
from policy_service.slurm.slurm_files import parse_gres_conf, parse_slurm_conf
from policy_service.core import policy
from policy_service.core.dialect import DIALECTS, SLURM_22_05
from policy_service.core.request import history_keys, job_request
from policy_service.core.types import Action, KeyLevel, ReasonCode

from tests.unit.core.test_policy import NO_OVERSUB, history

SLURM_24_11 = DIALECTS[(24, 11)]

# node1: a100 40 GiB (4 x 10 GiB), a100 48 GiB (4), h100 80 GiB x 2 (8 each); node2: l4 24 GiB, no shards
SLURM_CONF = """
NodeName=node1 CPUs=8 Gres=gpu:a100:2,gpu:h100:2,shard:24
NodeName=node2 CPUs=8 Gres=gpu:l4:1
PartitionName=gpu Nodes=node1 Default=YES
PartitionName=big Nodes=node1,node2
PartitionName=small Nodes=node2
"""
GRES_CONF = """
AutoDetect=off
NodeName=node1 Name=gpu Type=a100 File=/dev/nvidia[0-1]
NodeName=node1 Name=gpu Type=h100 File=/dev/nvidia[2-3]
NodeName=node1 Name=shard Count=4 File=/dev/nvidia0
NodeName=node1 Name=shard Count=4 File=/dev/nvidia1
NodeName=node1 Name=shard Count=8 File=/dev/nvidia2
NodeName=node1 Name=shard Count=8 File=/dev/nvidia3
NodeName=node2 Name=gpu Type=l4 File=/dev/nvidia0
"""


@pytest.fixture(scope="module")
def parts():
    return partition_defaults(parse_slurm_conf(SLURM_CONF), parse_gres_conf(GRES_CONF))


def test_each_gpu_has_the_shard_count_gres_conf_gives_it_with_its_type():
    gpus = node_gpus(parse_slurm_conf(SLURM_CONF), parse_gres_conf(GRES_CONF), "node1")
    assert [(g.type, int(g.shards)) for g in gpus] == [("a100", 4), ("a100", 4), ("h100", 8), ("h100", 8)]
    assert shard_counts(gpus) == (4, 8)


@pytest.mark.parametrize("partition,gpu_type,counts", [
    ("gpu", "", (4, 8)), ("", "", (4, 8)), ("gpu", "a100", (4,)), ("gpu", "H100", (8,)), ("gpu", "v100", ()),
    ("big", "", (4, 8)), ("small", "", ()), ("gpu,small", "", (4, 8)), ("nowhere", "", None),
])
def test_the_counts_a_job_can_land_on(parts, partition, gpu_type, counts):
    assert parts.shard_counts(partition, gpu_type) == counts


def test_without_gres_conf_the_node_line_gives_shards_per_gpu_untyped():
    parts = partition_defaults(parse_slurm_conf("NodeName=n1 Gres=gpu:4,shard:32\nPartitionName=p Nodes=n1\n"))
    assert parts.shard_counts("p", "a100") == (8,)  # the type is not known there: any may be one


def _decide(peak_gib, counts, fields=None, dialect=SLURM_24_11, cfg=NO_OVERSUB, stats=None):
    fields = fields or {"tres_per_node": "gres/gpu:1"}
    req, access = job_request(user="u", account="a", partition="gpu", job_name="t", script_fingerprint="fp",
                              gres_fields=fields, gpu_shard_counts=counts)
    stats = stats if stats is not None else (history(peak_gib) if peak_gib else {})
    return policy.decide(req, stats, cfg, decision_id="d", now=1.0, job_class=history_keys(req)[KeyLevel.CLASS],
                         gres_fields=fields, access=access, dialect=dialect)


def test_a_shard_is_the_same_memory_on_every_gpu_and_the_job_is_sized_for_the_largest_it_can_land_on():
    d = _decide(35, (4, 8))  # 35 GiB + margin: 4 x 10 GiB would be too little; 5 fit only an 80 GiB GPU
    assert (d.action, d.shards, d.rewrite.tres_per_node) == (Action.SHARE, 5, "gres/shard:5")
    (fits,) = [r.message for r in d.reasons if r.code is ReasonCode.FITS_IN_SHARDS]
    assert "on a GPU that has at least 5" in fits and "4 or 8 shards of 10.0GiB" in fits, fits
    small = _decide(3, (4, 8))
    assert (small.action, small.shards) == (Action.SHARE, 1)  # 1 shard is 10 GiB on a 40 and on an 80 GiB GPU


def test_a_job_larger_than_every_gpu_it_can_land_on_keeps_a_whole_gpu():
    d = _decide(35, (4,), fields={"tres_per_node": "gres/gpu:a100:1"})  # the a100s hold 40 GiB
    assert (d.action, d.shards) == (Action.WHOLE_GPU, 0)
    (why,) = [r.message for r in d.reasons if r.code is ReasonCode.TOO_LARGE_TO_SHARE]
    assert "40.0GiB" in why, why
    on_h100 = _decide(35, (8,), fields={"tres_per_node": "gres/gpu:h100:1"})
    assert (on_h100.action, on_h100.rewrite.tres_per_node) == (Action.SHARE, "gres/shard:h100:5")


def test_no_gpu_with_shards_where_the_job_can_land_keeps_its_request():
    d = _decide(3, ())
    assert (d.action, d.shards, d.rewrite.tres_per_node) == (Action.WHOLE_GPU, 0, None)
    assert ReasonCode.NO_SHARD_GPUS in {r.code for r in d.reasons}


def test_22_05_holds_a_whole_gpu_as_shards_only_where_one_count_is_a_whole_gpu():
    mixed = _decide(0, (4, 8), fields={"tres_per_node": "gres:gpu:1"}, dialect=SLURM_22_05)  # no history: whole
    assert (mixed.action, mixed.shards, mixed.rewrite.tres_per_node) == (Action.WHOLE_GPU, 0, None)
    (why,) = [r.message for r in mixed.reasons if r.code is ReasonCode.WHOLE_GPU_SIZES_DIFFER]
    assert "4 or 8 shards" in why, why
    typed = _decide(0, (4,), fields={"tres_per_node": "gres:gpu:a100:1"}, dialect=SLURM_22_05)
    assert (typed.action, typed.shards, typed.rewrite.tres_per_node) == (Action.WHOLE_GPU, 4, "gres:shard:a100:4")
    assert ReasonCode.WHOLE_GPU_AS_SHARDS in {r.code for r in typed.reasons}


def test_an_unknown_fleet_is_gpu_shards_per_gpu_everywhere():
    d = _decide(75, None)
    assert (d.action, d.shards) == (Action.WHOLE_GPU, 0)
    assert _decide(3, None).shards == 1


def test_each_gpu_is_known_by_its_device_number(parts):
    assert parts.gpu_shards == {("node1", 0): 4, ("node1", 1): 4, ("node1", 2): 8, ("node1", 3): 8}


@pytest.mark.parametrize("path,index", [("/dev/nvidia2", 2), ("/dev/nvidia13", 13), ("/dev/dri/renderD128", 128),
                                        ("/dev/nvidia", None)])
def test_file_index(path, index):
    assert file_index(path) == index


def test_shards_that_promise_more_memory_than_the_gpu_has_are_named_with_the_fix():
    gib = 1024 ** 3
    assert shard_memory_mismatch("node1", 2, 8, 10 * gib, 80 * gib) == ""
    assert shard_memory_mismatch("node1", 2, 8, 10 * gib, 0) == ""  # nothing reported
    why = shard_memory_mismatch("node1", 0, 8, 10 * gib, 40 * gib)
    assert why.startswith("node1 GPU 0: gres.conf gives it 8 shards of 10.0 GiB (80.0 GiB)") and "Count=4" in why
