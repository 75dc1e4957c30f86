"""doctor's billing check against each line it recommends: for each fleet, the TRESBillingWeights
(and AccountingStorageTRES) doctor prints is applied to slurm.conf and the check run again, until it
passes or says exactly which GPU jobs keep their request there; and what doctor says a partition's
weights do is what the service decides for its jobs (slurm/billing_weights.py, one rule for both)."""
from __future__ import annotations

import re

import pytest

from policy_service.admin.billing import billing_checks
from policy_service.admin.check import Check
from policy_service.slurm.partitions import partition_defaults
from policy_service.slurm.slurm_files import parse_gres_conf, parse_slurm_conf

TRES = "AccountingStorageTRES=gres/gpu,gres/shard,gres/gpu:a100,gres/gpu:h100\n"


def _gres(types: list[str | None], counts: list[int], node: str = "") -> str:
    """gres.conf lines for one node's GPUs (``node``: its NodeName=, "" every node)."""
    at = f"NodeName={node} " if node else ""
    return "".join([f"{at}Name=gpu{f' Type={t}' if t else ''} File=/dev/nvidia{i}\n" for i, t in enumerate(types)]
                   + [f"{at}Name=shard Count={c} File=/dev/nvidia{i}\n" for i, c in enumerate(counts)])


# (slurm.conf nodes and partitions, gres.conf) of each fleet; {w} is the partitions' TRESBillingWeights
PLAIN = ("NodeName=gpu[01-02] Gres=gpu:4,shard:32\nPartitionName=gpu Nodes=gpu[01-02] TRESBillingWeights={w}\n",
         _gres([None] * 4, [8] * 4))
MIXED = ("NodeName=gpu01 Gres=gpu:4,shard:24\nPartitionName=gpu Nodes=gpu01 TRESBillingWeights={w}\n",
         _gres([None] * 4, [4, 4, 8, 8]))  # 40, 48, 80 and 80 GiB GPUs, 10 GiB shards
TYPED = ("NodeName=gpu01 Gres=gpu:a100:2,gpu:h100:2,shard:24\nPartitionName=gpu Nodes=gpu01 TRESBillingWeights={w}\n",
         _gres(["a100", "a100", "h100", "h100"], [4, 4, 8, 8]))  # the dev cluster's fleet on 24.11 and 26.05
TYPED8 = (TYPED[0], _gres(["a100", "a100", "h100", "h100"], [8] * 4))
PER_TYPE = ("NodeName=a[01-02] Gres=gpu:a100:4,shard:32\nNodeName=h01 Gres=gpu:h100:4,shard:32\n"
            "PartitionName=a100 Nodes=a[01-02] TRESBillingWeights={w}\n"
            "PartitionName=h100 Nodes=h01 TRESBillingWeights={w2}\n",
            _gres(["a100"] * 4, [8] * 4, "a[01-02]") + _gres(["h100"] * 4, [8] * 4, "h01"))


def _conf(fleet: tuple[str, str], w: str, w2: str = "") -> tuple[str, str]:
    return TRES + fleet[0].format(w=w, w2=w2), fleet[1]


def _billing(slurm: str, gres: str) -> dict[str, Check]:
    return {c.name: c for c in billing_checks(parse_slurm_conf(slurm), parse_gres_conf(gres), 8)}


def _apply(slurm: str, fix: str) -> str:
    """slurm.conf with the lines doctor's ``fix`` sets (a partition's TRESBillingWeights,
    AccountingStorageTRES) set."""
    for line, part in re.findall(r'set TRESBillingWeights="([^"]*)" on PartitionName=([^\s,]+)', fix):
        slurm = re.sub(rf"^(PartitionName={re.escape(part)} .*TRESBillingWeights=)\S+", rf"\g<1>{line}", slurm,
                       flags=re.M)
    for tres in re.findall(r"AccountingStorageTRES=(\S+), then restart", fix):
        slurm = re.sub(r"^AccountingStorageTRES=\S+", f"AccountingStorageTRES={tres}", slurm, flags=re.M)
    return slurm


def _settle(slurm: str, gres: str) -> tuple[str, dict[str, Check], int]:
    """Apply doctor's billing fixes until it prints none: (slurm.conf, checks, fixes applied)."""
    for applied in range(4):
        checks = _billing(slurm, gres)
        fixes = [c.fix for c in checks.values() if (c.warn or not c.ok) and "TRESBillingWeights=" in c.fix
                 or not c.ok and c.name == "accounting_tres"]
        if not fixes:
            return slurm, checks, applied
        before = slurm
        for fix in fixes:
            slurm = _apply(slurm, fix)
        assert slurm != before, f"doctor's fix repeats what is set: {fixes}"
    raise AssertionError(f"doctor's fixes do not settle: {checks}")


def _service(slurm: str, gres: str, partition: str, kinds: tuple[str, ...]) -> dict[str, str]:
    """What the service decides for a GPU job of each kind ("" untyped, else its type) in ``partition``:
    kind -> why it keeps its request ("" it may share)."""
    parts = partition_defaults(parse_slurm_conf(slurm), parse_gres_conf(gres))
    return {k: parts.unbilled(partition, k)[0] for k in kinds}


def _agree(check: Check, slurm: str, gres: str, partition: str) -> None:
    """The GPU jobs doctor says keep their request in ``partition`` are those the service keeps."""
    kinds = ("", "a100", "h100") if "Type=" in gres else ("",)
    service = _service(slurm, gres, partition, kinds)
    kept = sorted(f"gpu:{k}" if k else "gpu" for k, why in service.items() if why)
    if check.ok and not check.warn:
        assert kept == [], (check, service)
    else:
        said = re.search(r"keep their request \(reason shards_unbilled\): ([^;()]*)", check.detail)
        assert said and sorted(said.group(1).strip().split(", ")) == kept, (check, service)
    for why in filter(None, service.values()):
        assert why.startswith(f"partition {partition} (TRESBillingWeights=") and "the fix: " in why, why


# (fleet, weights, what the settled check says, what it says of the GPU jobs kept, fixes applied)
CASES = [
    ("plain", PLAIN, ("CPU=1,GRES/gpu=10",), "GRES/shard=1.25 = GRES/gpu=10 / 8 shards per GPU", "", 1),
    ("plain, right already", PLAIN, ("CPU=1,GRES/gpu=10,GRES/shard=1.25",), "a 1-shard job bills 1.25", "", 0),
    ("untyped, mixed 4+8", MIXED, ("CPU=1,GRES/gpu=10",),
     "on a GPU with 4 shards all 4 bill 5 of its 10 (their memory's worth)", "", 1),
    # the admin guide's line on a 4+8 fleet: doctor failed it and its "fix" repeated the value set
    ("untyped, mixed 4+8, the guide's line", MIXED, ("CPU=1.0,Mem=0.25G,GRES/gpu=10,GRES/shard=1.25",),
     "GRES/shard=1.25 = GRES/gpu=10 / 8 shards per GPU of the largest GPUs (gpu01)", "", 0),
    ("the dev cluster", TYPED, ('"CPU=1.0,GRES/gpu=8,GRES/shard=1"',), "a shard bills its memory", "", 0),
    ("typed multi-type", TYPED, ("CPU=1,GRES/gpu:a100=12,GRES/gpu:h100=16",),
     "a100: GRES/gpu:a100=12 for 4 shards; h100: GRES/gpu:h100=16 for 8 shards",
     "keep their request (reason shards_unbilled): gpu, gpu:a100, gpu:h100", 0),
    ("typed multi-type, 8 shards each", TYPED8, ("CPU=1,GRES/gpu:a100=12,GRES/gpu:h100=16",),
     "a100: GRES/gpu:a100=12 for 8 shards", "keep their request (reason shards_unbilled): gpu, gpu:a100, gpu:h100",
     0),
    ("typed multi-type, the old guide's typed shard weights", TYPED8,
     ("CPU=1,GRES/gpu:a100=12,GRES/shard:a100=1.5,GRES/gpu:h100=16,GRES/shard:h100=2",),
     "no weight bills each its fraction", "keep their request (reason shards_unbilled): gpu, gpu:a100, gpu:h100", 1),
    ("typed, one type per partition", PER_TYPE, ("CPU=1,GRES/gpu:a100=12", "CPU=1,GRES/gpu:h100=16"),
     "GRES/shard=", "", 1),
]


@pytest.mark.parametrize("fleet, weights, says, kept, rounds", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_doctors_fix_applied_passes_or_says_which_jobs_keep_their_request(fleet, weights, says, kept, rounds):
    slurm, gres = _conf(fleet, *weights)
    slurm, checks, applied = _settle(slurm, gres)
    assert applied == rounds, checks
    for name, check in checks.items():
        said = f"{check.detail}\nfix: {check.fix}"
        assert check.ok, said
        if name == "accounting_tres":
            continue
        assert says in check.detail, said
        _agree(check, slurm, gres, name[len("billing["):-1])
        if kept:  # no TRESBillingWeights makes them share: doctor says so, and how to share them
            assert check.warn and kept in check.detail and "partitions of one GPU type each" in check.fix, said
            assert "set TRESBillingWeights" not in check.fix, said
        else:
            assert not check.warn and not check.fix, said


def test_one_type_per_partition_gets_its_own_untyped_weight():
    slurm, checks, _ = _settle(*_conf(PER_TYPE, "CPU=1,GRES/gpu:a100=12", "CPU=1,GRES/gpu:h100=16"))
    assert "TRESBillingWeights=CPU=1,GRES/gpu:a100=12,GRES/shard=1.5\n" in slurm
    assert "TRESBillingWeights=CPU=1,GRES/gpu:h100=16,GRES/shard=2\n" in slurm
    assert "GRES/shard=1.5 = GRES/gpu:a100=12 / 8 shards per GPU" in checks["billing[a100]"].detail


AGREEMENT = [
    (PLAIN, "CPU=1,GRES/gpu=10"), (PLAIN, "CPU=1,GRES/gpu=10,GRES/shard=1.25"),
    (PLAIN, "CPU=1,GRES/gpu=10,GRES/shard=2"), (PLAIN, "CPU=1"), (PLAIN, "CPU=1,GRES/shard=1"),
    (MIXED, "CPU=1,GRES/gpu=10,GRES/shard=1.25"),
    (MIXED, "CPU=1,GRES/gpu=10,GRES/shard=2.5"), (TYPED, '"CPU=1.0,GRES/gpu=8,GRES/shard=1"'),
    (TYPED, "CPU=1,GRES/gpu:a100=12,GRES/gpu:h100=16"), (TYPED, "CPU=1,GRES/gpu:a100=12,GRES/gpu:h100=16,GRES/shard=2"),
    (TYPED8, "CPU=1,GRES/gpu=10,GRES/shard=1.25,GRES/gpu:a100=2"), (TYPED8, "CPU=1,GRES/gpu:a100=12,GRES/shard=1.5"),
    (TYPED8, "CPU=1,GRES/gpu:a100=12,GRES/shard:a100=1.5,GRES/gpu:h100=16,GRES/shard:h100=2"),
]


@pytest.mark.parametrize("fleet, w", AGREEMENT, ids=[f"{i}:{w}" for i, (_, w) in enumerate(AGREEMENT)])
def test_doctor_says_what_the_service_decides(fleet, w):
    """A partition doctor passes without a word (OK, no warning) shares every GPU job; one it fails or
    warns about names the jobs that keep their request, exactly those the service keeps."""
    slurm, gres = _conf(fleet, w)
    _agree(_billing(slurm, gres)["billing[gpu]"], slurm, gres, "gpu")
