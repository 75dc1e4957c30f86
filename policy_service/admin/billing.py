"""``swapaware doctor``'s check of how shared jobs are billed.

Slurm bills a job (fairshare usage, billing limits, sacct's billing=) with its partition's
TRESBillingWeights. A job swapaware rewrote to shards holds gres/shard, not gres/gpu, and Slurm
records no gres/shard:<type> (measured on 24.11), so the one GRES/shard weight bills it whatever GPU
it is on. Which weights bill a job its fraction of the GPU, and which keep its request, is
``slurm/billing_weights.py``'s rule, the one the service applies: doctor says the same per
partition, and prints a TRESBillingWeights line that the rule accepts where one exists. Pure:
parsed slurm.conf and gres.conf in, checks out.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Sequence

from policy_service.admin.check import Check, _check, _list_values
from policy_service.slurm.billing_weights import (  # noqa: F401  (format_weight: doctor's tests use it)
    FIX_PER_TYPE,
    WEIGHT_ROUND_DIGITS,
    BillingWeights,
    ShardBilling,
    Weight,
    fmt,
    format_weight,
    read_weights,
    shard_billing,
)
from policy_service.slurm.fleet import GpuShards, partition_gpus
from policy_service.slurm.slurm_files import GresConf, PartitionLine, SlurmConf

MEASURED = "Slurm records no gres/shard:<type> for a shard job, measured on 24.11"


def _max_tres_note(conf: SlurmConf, example_shard_bill: str) -> str:
    flags = _list_values(conf.get("PriorityFlags"))
    if "max_tres_gres" in flags:
        return (f"; PriorityFlags=MAX_TRES_GRES: GRES weights add to the largest CPU/Mem weight, so a 1-shard "
                f"job bills max(CPU, Mem) + {example_shard_bill}")
    if "max_tres" in flags:
        return (f"; PriorityFlags=MAX_TRES: a job bills its largest weighted CPU, Mem or GRES, so a 1-shard job "
                f"bills max(CPU, Mem, {example_shard_bill}) rather than the sum")
    return ""


def _tracked_tres(conf: SlurmConf) -> list[str]:
    return [v.strip() for v in conf.get("AccountingStorageTRES").split(",") if v.strip()]


def _kinds(w: BillingWeights, gpus: Sequence[GpuShards]) -> tuple[list[str], list[str]]:
    """(the GPU jobs of the partition that share, those that keep their request) under ``w``, as the
    service decides them: untyped jobs, and those of each type (gpu:<type>) the partition holds."""
    shared, kept = [], []
    for t in ["", *sorted({(g.type or "").lower() for g in gpus} - {""})]:
        on = [g for g in gpus if not t or not g.type or g.type.lower() == t]
        (shared if shard_billing(w, gpus, on).ok else kept).append(f"gpu:{t}" if t else "gpu")
    return shared, kept


def _line(w: BillingWeights, per_shard: Fraction | None) -> str:
    """The partition's TRESBillingWeights with GRES/shard billing ``per_shard`` (None: left as it is;
    0: removed), after the last GPU weight where it was not set, and without GRES/shard:<type>."""
    out = [x for x in w.weights if x not in w.typed_shards]
    if per_shard is not None and w.shard is not None:
        out = [Weight(x.key, w.shard_text(per_shard)) if x == w.shard else x for x in out if x != w.shard or per_shard]
    elif per_shard:
        at = max(i for i, x in enumerate(out) if x.gres("gpu")[0])
        out.insert(at + 1, Weight("GRES/shard", w.shard_text(per_shard)))
    return ",".join(f"{x.key}={x.value}" for x in out)


def _ok_detail(w: BillingWeights, verdict: ShardBilling, gpus: Sequence[GpuShards], source: str) -> str:
    """Why the GRES/shard weight bills a shard job its fraction (exact, or by memory)."""
    assert w.shard is not None and verdict.per_shard is not None
    largest = [g for g in gpus if int(g.shards) == verdict.largest]
    terms = w.price_terms(largest[0].type if largest else None)
    terms = f"({terms})" if "+" in terms else terms
    exact = format_weight(verdict.per_shard)[1]
    said = (f"{w.shard.key}={w.shard.value} {'=' if exact else '~'} {terms} / {verdict.largest} shards per GPU"
            f"{source}")
    if verdict.rule != "memory":
        return said
    smaller = sorted({int(g.shards) for g in gpus} - {verdict.largest})
    nodes = sorted({g.node for g in largest})
    nodes_said = ",".join(nodes[:3]) + (f" and {len(nodes) - 3} more nodes" if len(nodes) > 3 else "")
    return (f"{said} of the largest GPUs ({nodes_said}): a shard bills its memory "
            "as a fraction of the partition's largest GPU, so on a GPU with "
            + " or ".join(f"{c} shards all {c} bill {fmt(c * verdict.per_shard)}" for c in smaller)
            + f" of its {fmt(w.price(largest[0].type if largest else None))} (their memory's worth); a whole GPU "
              "held as shards there (Slurm 22.05) keeps its gpu request (shards_unbilled)")


def _billing_check(conf: SlurmConf, part: PartitionLine, gres: GresConf, shards_per_gpu: int) -> Check:
    name = f"billing[{part.name}]"
    raw = part.get("TRESBillingWeights")
    w = read_weights(raw)
    where = (f"PartitionName=DEFAULT (partition {part.name} inherits it)" if "tresbillingweights" in part.inherited
             else f"PartitionName={part.name}")
    if w.unreadable:
        return Check(name, False, f"TRESBillingWeights={raw}: {', '.join(w.unreadable)} is not a number",
                     f"write {', '.join(w.unreadable)} as a number in TRESBillingWeights on {where}")
    if not w.bills_gpus and w.shard is None and not w.typed_shards:
        return Check(name, True, f"TRESBillingWeights={raw or '(unset)'}: no GRES/gpu weight, billing of GPUs is "
                                 "not configured in this partition: nothing to do for shards", "")
    gpus = [g for g in partition_gpus(conf, part, gres) if int(g.shards) > 0]
    source = "" if gpus else " (gpu.shards_per_gpu: gres.conf shows no GPUs with shards on this partition's nodes)"
    verdict = shard_billing(w, gpus, gpus, shards_per_gpu)
    shared, kept = _kinds(w, gpus) if gpus else ((["gpu"], []) if verdict.ok else ([], ["gpu"]))
    dead = ",".join(f"{x.key}={x.value}" for x in w.typed_shards)
    dead_said = (f"{dead} bill{'s' if len(w.typed_shards) == 1 else ''} nothing ({MEASURED}), and would add to "
                 "GRES/shard where a release records it")
    set_line = f'set TRESBillingWeights="{{}}" on {where}, then scontrol reconfigure'
    if verdict.per_shard is None:  # no one GRES/shard weight bills every GPU of the partition its fraction
        detail = (f"TRESBillingWeights={raw}: {verdict.why}: GPU jobs here keep their request (reason "
                  f"shards_unbilled): {', '.join(kept)}" + (f"; shared: {', '.join(shared)}" if shared else ""))
        fix = f"to share them, {FIX_PER_TYPE}"
        if dead:
            fix += f"; {dead_said}: {set_line.format(_line(w, None))}"
        return Check(name, True, detail, fix, warn=True)
    example = w.shard_text(verdict.per_shard)
    note = _max_tres_note(conf, example)
    if verdict.ok:
        detail = (f"TRESBillingWeights={raw}: shards are billed as the fraction of a GPU they hold: "
                  f"{_ok_detail(w, verdict, gpus, source)}; a 1-shard job bills {example} for its GPU part{note}"
                  if w.shard is not None else f"TRESBillingWeights={raw}: its GPUs bill nothing, nor do shards")
        if dead:
            return Check(name, True, f"{detail}; {dead_said}", f"remove {dead}: {set_line.format(_line(w, None))}",
                         warn=True)
        return Check(name, True, detail, "")
    problems = [verdict.why + source] + ([dead_said] if dead else [])
    line = _line(w, verdict.per_shard)
    fix = set_line.format(line)
    if not format_weight(verdict.per_shard)[1]:
        fix += (f" ({example} ~ {fmt(verdict.per_shard * verdict.largest)}/{verdict.largest}: rounded to "
                f"{WEIGHT_ROUND_DIGITS} significant digits; Slurm keeps weights as doubles and truncates a job's "
                "billing= to an integer in AllocTRES)")
    if "gres/shard" in line.lower() and "gres/shard" not in {t.lower() for t in _tracked_tres(conf)}:
        fix += ("; first add gres/shard to AccountingStorageTRES (see accounting_tres): slurmctld refuses a weight "
                "for a TRES it does not track (fatal: failed to parse tres weights str)")
    until = (f"; until then GPU jobs here keep their request (reason shards_unbilled): {', '.join(kept)}"
             + (f" (shared: {', '.join(shared)})" if shared else "")) if gpus else ""
    return Check(name, False, f"TRESBillingWeights={raw}: " + "; ".join(problems) + note + until, fix)


def _accounting_tres_check(conf: SlurmConf, gpu_types: Sequence[str], shard_types: Sequence[str]) -> Check:
    raw = conf.get("AccountingStorageTRES")
    have = _tracked_tres(conf)
    need = (["gres/gpu", "gres/shard"] + [f"gres/gpu:{t}" for t in gpu_types]
            + [f"gres/shard:{t}" for t in shard_types])
    missing = [n for n in dict.fromkeys(need) if n.lower() not in {h.lower() for h in have}]
    detail = f"AccountingStorageTRES={raw or '(unset)'}"
    if gpu_types:
        detail += f" (typed GPU billing weights: {', '.join(gpu_types)})"
    fix = (f"add {','.join(missing)}: AccountingStorageTRES={','.join(have + missing)}, then restart slurmctld. "
           "Without gres/shard sacct's AllocTRES shows no shards (swapaware report counts them) and slurmctld "
           "refuses a GRES/shard billing weight")
    if gpu_types or shard_types:
        fix += "; a typed weight (GRES/gpu:<type>) needs its typed TRES (gres/gpu:<type>)"
    return _check("accounting_tres", not missing, detail, fix)


def billing_checks(conf: SlurmConf, gres: GresConf, shards_per_gpu: int) -> list[Check]:
    """Does a job rewritten to shards bill the fraction of a GPU it holds, and which GPU jobs keep
    their request instead? One check per partition with GPU nodes or a GRES/gpu billing weight, and
    one for AccountingStorageTRES."""
    checks = []
    gpu_types: list[str] = []
    shard_types: list[str] = []
    for part in conf.partitions:
        w = read_weights(part.get("TRESBillingWeights"))
        has_gpus = any(node.gres.get("gpu", 0) > 0 for node in map(conf.node, part.nodes) if node is not None)
        if has_gpus or any(x.gres("gpu")[0] for x in w.weights):
            checks.append(_billing_check(conf, part, gres, shards_per_gpu))
        for x in w.weights:
            for kind, into in (("gpu", gpu_types), ("shard", shard_types)):
                t = x.gres(kind)[1]
                if t and t.lower() not in {y.lower() for y in into}:
                    into.append(t)
    return checks + [_accounting_tres_check(conf, gpu_types, shard_types)]
