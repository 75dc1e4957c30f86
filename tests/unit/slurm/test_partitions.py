"""Per-GPU defaults of a job's partition (slurm.conf DefCpuPerGPU / DefMemPerGPU): read from
slurm.conf, re-read when it changes, and a GPU job there keeps its request."""
import logging
import os

import pytest

from policy_service.slurm.partitions import PartitionDefaults, SlurmConfWatch, partition_defaults
from policy_service.slurm.slurm_files import parse_slurm_conf
from policy_service.core import policy
from policy_service.core.request import job_request
from policy_service.core.types import Action, ReasonCode

from tests.unit.core.test_policy import NO_OVERSUB, history

CONF = """
NodeName=n[1-2] CPUs=8 Gres=gpu:4,shard:32
DefMemPerGPU=1024
PartitionName=DEFAULT State=UP
PartitionName=gpu Nodes=n[1-2] Default=YES
PartitionName=cpu2 Nodes=n1 DefCpuPerGPU=2 DefMemPerGPU=0
PartitionName=both Nodes=n2 DefCpuPerGPU=4
"""


@pytest.mark.parametrize("partition,expected", [
    ("gpu", ("DefMemPerGPU=1024",)),  # the cluster-wide default
    ("", ("DefMemPerGPU=1024",)),  # no -p: the Default=YES partition
    ("cpu2", ("DefCpuPerGPU=2",)),  # 0 is "not set"
    ("both", ("DefCpuPerGPU=4", "DefMemPerGPU=1024")),
    ("cpu2,both", ("DefCpuPerGPU=2", "DefCpuPerGPU=4", "DefMemPerGPU=1024")),  # -p a,b: any of them
    ("unknown", ()),
])
def test_partition_defaults_from_slurm_conf(partition, expected):
    assert partition_defaults(parse_slurm_conf(CONF)).for_job(partition) == expected


def test_no_per_gpu_defaults_anywhere():
    conf = "NodeName=n1 Gres=gpu:1\nPartitionName=gpu Nodes=n1 Default=YES\n"
    parts = partition_defaults(parse_slurm_conf(conf))
    assert (parts.by_partition, parts.default_partition, parts.for_job("")) == ({}, "gpu", ())
    assert parts.shard_counts("gpu") == ()  # its GPU has no shards: no job there can share


def test_a_gpu_job_of_such_a_partition_keeps_its_request_on_every_release():
    req, access = job_request(user="u", account="a", partition="cpu2", job_name="t", script_fingerprint="fp",
                              gres_fields={"tres_per_node": "gres:gpu:1"},
                              partition_gpu_defaults=("DefCpuPerGPU=2",))
    d = policy.decide(req, history(3), NO_OVERSUB, decision_id="d", now=1.0, job_class="c",
                      gres_fields={"tres_per_node": "gres:gpu:1"}, access=access)  # 22.05: not even as shards
    assert (d.action, d.shards, d.rewrite.tres_per_node) == (Action.WHOLE_GPU, 0, None)
    (reason,) = [r for r in d.reasons if r.code is ReasonCode.PER_GPU_DEFAULT]
    assert "partition cpu2 gives each GPU DefCpuPerGPU=2" in reason.message
    plain, _ = job_request(user="u", account="a", partition="gpu", job_name="t", script_fingerprint="fp",
                           gres_fields={"tres_per_node": "gres:gpu:1"})
    assert policy.decide(plain, history(3), NO_OVERSUB, decision_id="d", now=1.0, job_class="c",
                         gres_fields={"tres_per_node": "gres:gpu:1"}, access=access).action is Action.SHARE


def test_the_watch_rereads_slurm_conf_when_it_changes_and_keeps_the_last_good_one(tmp_path, caplog):
    path = tmp_path / "slurm.conf"
    now = [0.0]
    watch = SlurmConfWatch(path, check_every_s=5.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "swapaware.service"):
        assert watch.current().by_partition == {}  # missing: none known, and said once
        now[0] += 10
        watch.current()
    assert sum("cannot read slurm.conf" in r.message for r in caplog.records) == 1
    path.write_text("NodeName=n1 Gres=gpu:1\nPartitionName=gpu Nodes=n1 Default=YES DefCpuPerGPU=2\n")
    assert watch.current().for_job("") == ()  # checked again only after check_every_s
    now[0] += 10
    assert watch.current().for_job("") == ("DefCpuPerGPU=2",)
    path.write_text("NodeName=n1 Gres=gpu:1\nPartitionName=gpu Nodes=n1 Default=YES DefCpuPerGPU=3\n")
    os.utime(path, (1, 1))  # a change of mtime is seen even when the size is the same
    now[0] += 10
    assert watch.current().for_job("gpu") == ("DefCpuPerGPU=3",)
    path.unlink()
    now[0] += 10
    assert watch.current().for_job("gpu") == ("DefCpuPerGPU=3",)  # the last good reading stays
