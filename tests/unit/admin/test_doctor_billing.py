"""doctor's billing of shared jobs on real-shaped slurm.conf / gres.conf variants: TRESBillingWeights
(GRES/shard weights, typed GPUs, units, MAX_TRES, PartitionName=DEFAULT), AccountingStorageTRES, a
weight with no short decimal, the partitions considered, how weights are written, and the parsers
keeping partitions and GRES types. (test_billing_doctor.py applies each line doctor recommends.)

The good files and helpers are test_doctor.py's."""
from __future__ import annotations

from fractions import Fraction

import pytest

from policy_service.admin import parse_gres_conf, parse_slurm_conf
from policy_service.admin.billing import billing_checks, format_weight
from policy_service.admin.check import Check

from tests.unit.admin.test_doctor import GOOD_GRES_CONF, GOOD_SLURM_CONF, _checks_by_name, _sub


GPU_PARTITION = "PartitionName=gpu Nodes=gpu[01-02] Default=YES MaxTime=INFINITE State=UP"
TYPED_TRES = ("AccountingStorageTRES=gres/gpu,gres/shard", "AccountingStorageTRES=gres/gpu,gres/shard,gres/gpu:a100,"
                                                           "gres/shard:a100,gres/gpu:h100,gres/shard:h100")
A100_H100 = ("Name=gpu File=/dev/nvidia[0-3]\n", "Name=gpu Type=a100 File=/dev/nvidia[0-1]\n"
                                                 "Name=gpu Type=h100 File=/dev/nvidia[2-3]\n")
ALL_A100 = ("Name=gpu File=/dev/nvidia[0-3]\n", "Name=gpu Type=a100 File=/dev/nvidia[0-3]\n")


def _weights(value: str) -> tuple[str, str]:
    return GPU_PARTITION, f"{GPU_PARTITION} TRESBillingWeights={value}"


# (id, slurm.conf changes, gres.conf changes, failing checks beyond nvml, text in the named check's detail or fix)
BILLING_CASES = [
    ("no billing weights", [], [], set(),
     {"billing[gpu]": ["billing of GPUs is not configured", "nothing to do"]}),
    ("cpu and memory weights only", [_weights('"CPU=1.0,Mem=0.25G"')], [], set(),
     {"billing[gpu]": ["no GRES/gpu weight"]}),
    ("gpu weight without shard weight", [_weights('"CPU=1.0,Mem=0.25G,GRES/gpu=10"')], [], {"billing[gpu]"},
     {"billing[gpu]": ["no GRES/shard weight", "a job holding shards bills nothing for its GPU",
                       'TRESBillingWeights="CPU=1.0,Mem=0.25G,GRES/gpu=10,GRES/shard=1.25" on PartitionName=gpu']}),
    ("correct shard weight", [_weights('"CPU=1.0,Mem=0.25G,GRES/gpu=10,GRES/shard=1.25"')], [], set(),
     {"billing[gpu]": ["GRES/shard=1.25 = GRES/gpu=10 / 8 shards per GPU", "a 1-shard job bills 1.25"]}),
    ("same weight, other spelling", [_weights("cpu=1,gres/gpu=10.0,gres/shard=1.250")], [], set(), {}),
    ("wrong shard weight corrected in place", [_weights("CPU=1,GRES/shard=10,GRES/gpu=10,Mem=0.25G")], [],
     {"billing[gpu]"},
     {"billing[gpu]": ["GRES/shard=10, should be 1.25",
                       'TRESBillingWeights="CPU=1,GRES/shard=1.25,GRES/gpu=10,Mem=0.25G"']}),
    ("weight with a unit suffix keeps it", [_weights("CPU=1,GRES/gpu=10K")], [], {"billing[gpu]"},
     {"billing[gpu]": ["GRES/gpu=10K,GRES/shard=1.25K"]}),
    # no Slurm TRES carries a typed shard's price (a shard job is counted under gres/shard alone): a
    # partition whose GPU types bill different prices per shard keeps its GPU jobs whole, and says so
    ("typed weights", [_weights("CPU=1,GRES/gpu:a100=12,GRES/gpu:h100=16"), TYPED_TRES], [A100_H100],
     set(),
     {"billing[gpu]": ["a100: GRES/gpu:a100=12 for 8 shards; h100: GRES/gpu:h100=16 for 8 shards",
                       "GPU jobs here keep their request (reason shards_unbilled): gpu, gpu:a100, gpu:h100",
                       "partitions of one GPU type each"]}),
    ("typed shard weights bill nothing", [_weights("CPU=1,GRES/gpu:a100=12,GRES/shard:a100=1.5,GRES/gpu:h100=16,"
                                                   "GRES/shard:h100=2"), TYPED_TRES], [A100_H100], set(),
     {"billing[gpu]": ["GRES/shard:a100=1.5,GRES/shard:h100=2 bill nothing",
                       "keep their request (reason shards_unbilled)",
                       'set TRESBillingWeights="CPU=1,GRES/gpu:a100=12,GRES/gpu:h100=16"']}),
    ("one GPU type: one untyped shard weight", [_weights("CPU=1,GRES/gpu:a100=12,GRES/shard:a100=1.5")], [ALL_A100],
     {"billing[gpu]", "accounting_tres"},
     {"billing[gpu]": ["no GRES/shard weight", "GRES/gpu:a100=12 / 8 shards per GPU gives GRES/shard=1.5",
                       'TRESBillingWeights="CPU=1,GRES/gpu:a100=12,GRES/shard=1.5" on PartitionName=gpu'],
      "accounting_tres": ["add gres/gpu:a100,gres/shard:a100",
                          "AccountingStorageTRES=gres/gpu,gres/shard,gres/gpu:a100,gres/shard:a100"]}),
    ("untyped and typed weights add up: one shard weight", [_weights("CPU=1,GRES/gpu=2,GRES/gpu:a100=12"),
                                                             TYPED_TRES],
     [ALL_A100], {"billing[gpu]"},
     {"billing[gpu]": ["(GRES/gpu=2 + GRES/gpu:a100=12 = 14) / 8 shards per GPU gives GRES/shard=1.75",
                       '"CPU=1,GRES/gpu=2,GRES/gpu:a100=12,GRES/shard=1.75"']}),
    ("mixed shard counts within a type",
     [_weights("CPU=1,GRES/gpu:a100=12,GRES/shard:a100=1.5"), TYPED_TRES,
      ("Gres=gpu:4,shard:32", "Gres=gpu:4,shard:28")],
     [A100_H100, ("Name=shard Count=8 File=/dev/nvidia1", "Name=shard Count=4 File=/dev/nvidia1")],
     set(),
     {"billing[gpu]": ["a100: GRES/gpu:a100=12 for 4 shards; a100: GRES/gpu:a100=12 for 8 shards; "
                       "h100: nothing for 8 shards",
                       "keep their request (reason shards_unbilled): gpu, gpu:a100; shared: gpu:h100",
                       "GRES/shard:a100=1.5 bills nothing"]}),
    ("AccountingStorageTRES without gres/shard", [("AccountingStorageTRES=gres/gpu,gres/shard",
                                                   "AccountingStorageTRES=gres/gpu")], [], {"accounting_tres"},
     {"accounting_tres": ["add gres/shard: AccountingStorageTRES=gres/gpu,gres/shard", "restart slurmctld"]}),
    ("AccountingStorageTRES unset", [("AccountingStorageTRES=gres/gpu,gres/shard\n", "")], [], {"accounting_tres"},
     {"accounting_tres": ["AccountingStorageTRES=(unset)", "add gres/gpu,gres/shard"]}),
    ("shard weight asks for its TRES first",
     [_weights("CPU=1,GRES/gpu=10"), ("AccountingStorageTRES=gres/gpu,gres/shard", "AccountingStorageTRES=gres/gpu")],
     [], {"billing[gpu]", "accounting_tres"},
     {"billing[gpu]": ["first add gres/shard to AccountingStorageTRES", "fatal: failed to parse tres weights str"]}),
    ("MAX_TRES", [_weights("CPU=1,GRES/gpu=10,GRES/shard=1.25"), ("PriorityType=", "PriorityFlags=MAX_TRES\n"
                                                                                  "PriorityType=")], [], set(),
     {"billing[gpu]": ["PriorityFlags=MAX_TRES", "max(CPU, Mem, 1.25) rather than the sum"]}),
    ("weights from PartitionName=DEFAULT",
     [(GPU_PARTITION, "PartitionName=DEFAULT TRESBillingWeights=CPU=1,GRES/gpu=10\n" + GPU_PARTITION)], [],
     {"billing[gpu]"}, {"billing[gpu]": ['GRES/shard=1.25" on PartitionName=DEFAULT (partition gpu inherits it)']}),
]


@pytest.mark.parametrize("slurm_changes, gres_changes, failing, texts", [c[1:] for c in BILLING_CASES],
                         ids=[c[0] for c in BILLING_CASES])
def test_billing_of_shared_jobs(slurm_changes: list[tuple[str, str]], gres_changes: list[tuple[str, str]],
                                failing: set[str], texts: dict[str, list[str]]) -> None:
    slurm, gres = GOOD_SLURM_CONF, GOOD_GRES_CONF
    for change in slurm_changes:
        slurm = _sub(slurm, *change)
    for change in gres_changes:
        gres = _sub(gres, *change)
    checks = _checks_by_name(slurm, gres)
    # the typed cases type the GPUs alone (their shards untyped in Gres=): shard_types, tested below, says so
    assert {n for n, c in checks.items() if not c.ok and not n.startswith("shard_types[")} - {"nvml"} == failing
    assert all(bool(c.fix) == (c.warn or not c.ok) for c in checks.values())
    for name, wanted in texts.items():
        said = f"{checks[name].detail}\nfix: {checks[name].fix}"
        for text in wanted:
            assert text in said, said


def _billing(slurm: str, gres: str = "", shards_per_gpu: int = 8) -> dict[str, Check]:
    return {c.name: c for c in billing_checks(parse_slurm_conf(slurm), parse_gres_conf(gres), shards_per_gpu)}


def test_billing_with_a_weight_that_has_no_short_decimal() -> None:
    slurm = ("AccountingStorageTRES=gres/gpu,gres/shard\nNodeName=n1 Gres=gpu:1,shard:3\n"
             "PartitionName=p Nodes=n1 TRESBillingWeights=CPU=1,GRES/gpu=10{}\n")
    gres = "Name=gpu File=/dev/nvidia0\nName=shard Count=3 File=/dev/nvidia0\n"
    missing = _billing(slurm.format(""), gres)["billing[p]"]
    assert not missing.ok and 'TRESBillingWeights="CPU=1,GRES/gpu=10,GRES/shard=3.33333"' in missing.fix
    assert "3.33333 ~ 10/3: rounded to 6 significant digits" in missing.fix and "truncates" in missing.fix
    assert _billing(slurm.format(",GRES/shard=3.33333"), gres)["billing[p]"].ok
    assert _billing(slurm.format(",GRES/shard=3.333333333"), gres)["billing[p]"].ok
    assert not _billing(slurm.format(",GRES/shard=3.3333"), gres)["billing[p]"].ok
    # without shard lines in gres.conf, the node's Gres= gives the count
    assert "GRES/shard=3.33333" in _billing(slurm.format(""))["billing[p]"].fix


def test_billing_partitions_considered() -> None:
    slurm = ("AccountingStorageTRES=gres/gpu,gres/shard\nNodeName=g1 Gres=gpu:2,shard:16\nNodeName=c1 CPUs=8\n"
             "NodeSet=gpus Nodes=g1\n"
             "PartitionName=cpu Nodes=c1\n"
             "PartitionName=viaset Nodes=gpus TRESBillingWeights=GRES/gpu=4\n"
             "PartitionName=all Nodes=ALL TRESBillingWeights=GRES/gpu=4,GRES/shard=0.5\n"
             "PartitionName=cpuweights Nodes=c1 TRESBillingWeights=CPU=1,GRES/gpu=4\n")
    checks = _billing(slurm)
    assert set(checks) == {"billing[viaset]", "billing[all]", "billing[cpuweights]", "accounting_tres"}
    assert not checks["billing[viaset]"].ok and "GRES/gpu=4,GRES/shard=0.5" in checks["billing[viaset]"].fix
    assert checks["billing[all]"].ok
    # no GPU node: the weight follows gpu.shards_per_gpu, and says so
    assert "gpu.shards_per_gpu" in checks["billing[cpuweights]"].detail
    assert "GRES/shard=0.5" in checks["billing[cpuweights]"].fix
    assert "GRES/shard=1" in _billing(slurm, shards_per_gpu=4)["billing[cpuweights]"].fix


@pytest.mark.parametrize("value, text, exact", [
    (Fraction(10, 8), "1.25", True),
    (Fraction(12, 16), "0.75", True),
    (Fraction(10), "10", True),
    (Fraction(1, 1024), "0.0009765625", True),
    (Fraction(10, 3), "3.33333", False),
    (Fraction(200, 3), "66.6667", False),
    (Fraction(1, 3000), "0.000333333", False),
])
def test_format_weight(value: Fraction, text: str, exact: bool) -> None:
    assert format_weight(value) == (text, exact)


def test_parsers_keep_partitions_and_gres_types() -> None:
    conf = parse_slurm_conf("NodeName=n[1-2] Gres=gpu:1,shard:8 Features=a100\nNodeSet=fa Feature=a100\n"
                            "PartitionName=DEFAULT MaxTime=10 TRESBillingWeights=CPU=1\n"
                            'PartitionName=p Nodes=fa TRESBillingWeights="CPU=2,GRES/gpu=10"\n'
                            "PartitionName=q Nodes=n1\n")
    p, q = conf.partitions
    assert (p.name, p.nodes, p.get("MaxTime")) == ("p", ("n1", "n2"), "10")
    assert p.get("tresbillingweights") == "CPU=2,GRES/gpu=10" and p.inherited == {"maxtime"}
    assert q.get("TRESBillingWeights") == "CPU=1" and q.inherited == {"maxtime", "tresbillingweights"}
    assert "partitionname" not in conf.params and "tresbillingweights" not in conf.params
    gres = parse_gres_conf("Name=gpu Type=a100 File=/dev/nvidia0\nName=shard Count=8 File=/dev/nvidia0\n")
    assert [g.type for g in gres.lines] == ["a100", None]
