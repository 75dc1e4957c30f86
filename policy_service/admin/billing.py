"""``swapaware doctor``'s check of how shared jobs are billed.

Slurm bills a job (fairshare usage, billing limits, sacct's billing=) with its partition's
TRESBillingWeights: the sum (PriorityFlags=MAX_TRES: the largest) of weight x allocated count over
the TRES the job holds. A job swapaware rewrote to shards holds gres/shard, not gres/gpu, so the
GRES/gpu weight no longer applies: its GPU is billed only where GRES/shard carries the GPU's weight
divided by its shards (then k shards of N bill k/N of a GPU, and N shards exactly one GPU). Pure:
parsed slurm.conf and gres.conf in, checks out.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation, localcontext
from fractions import Fraction
from typing import Sequence

from policy_service.admin.check import Check, _check, _list_values
from policy_service.adapters.fleet import partition_gpus
from policy_service.adapters.slurm_files import GresConf, PartitionLine, SlurmConf

WEIGHT_EXACT_DIGITS = 12  # a terminating decimal up to this many significant digits is printed exactly
WEIGHT_ROUND_DIGITS = 6  # otherwise it is rounded to this many

_WEIGHT = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([KMGTP]?)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class _Weight:
    key: str  # as written, e.g. "GRES/gpu:a100"
    value: str  # as written, e.g. "12" or "0.25G"

    @property
    def norm(self) -> str:
        return self.key.strip().lower()


def _parse_weights(raw: str) -> list[_Weight]:
    out = []
    for item in raw.split(","):
        key, sep, value = item.partition("=")
        if key.strip():
            out.append(_Weight(key.strip(), value.strip() if sep else ""))
    return out


def _gres_weight_type(weight: _Weight, gres_name: str) -> tuple[bool, str | None]:
    """(``weight`` is a GRES/<gres_name>[:<type>] weight, the type as written or None)."""
    prefix = f"gres/{gres_name}"
    if weight.norm == prefix:
        return True, None
    if weight.norm.startswith(prefix + ":") and weight.norm != prefix + ":":
        return True, weight.key.strip()[len(prefix) + 1:]
    return False, None


def _number(value: str) -> tuple[Fraction, str] | None:
    """``"10"`` -> (10, ""), ``"0.25G"`` -> (1/4, "G"); None when Slurm would not read a number."""
    match = _WEIGHT.match(value)
    if not match:
        return None
    try:
        return Fraction(Decimal(match.group(1))), match.group(2).upper()
    except (InvalidOperation, ValueError):
        return None


def _terminating(x: Fraction) -> bool:
    den = x.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    return den == 1


def format_weight(x: Fraction) -> tuple[str, bool]:
    """A billing weight as Slurm reads it (plain decimal, no exponent) and whether it is exact:
    ``10/8`` -> ``("1.25", True)``, ``10/3`` -> ``("3.33333", False)`` (6 significant digits)."""
    if _terminating(x):
        with localcontext() as ctx:
            ctx.prec = 200
            exact = (Decimal(x.numerator) / Decimal(x.denominator)).normalize()
        if len(exact.as_tuple().digits) <= WEIGHT_EXACT_DIGITS:
            return format(exact, "f"), True
    with localcontext() as ctx:
        ctx.prec = WEIGHT_ROUND_DIGITS
        rounded = (Decimal(x.numerator) / Decimal(x.denominator)).normalize()
    return format(rounded, "f"), False


def _weight_matches(have: Fraction, want: Fraction) -> bool:
    """Equal, or (where the exact weight has no short decimal) equal to 6 significant digits."""
    if have == want:
        return True
    if format_weight(want)[1] or want == 0:
        return False
    with localcontext() as ctx:
        ctx.prec = 30
        exponent = (Decimal(want.numerator) / Decimal(want.denominator)).adjusted()
    return abs(have - want) <= Fraction(1, 2) * Fraction(10) ** (exponent - WEIGHT_ROUND_DIGITS + 1)


def _fmt_count(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else format_weight(x)[0]


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


def _billing_check(conf: SlurmConf, part: PartitionLine, gres: GresConf, shards_per_gpu: int) -> Check:
    name = f"billing[{part.name}]"
    raw = part.get("TRESBillingWeights")
    weights = _parse_weights(raw)
    gpu_weights = [(w, t) for w in weights for is_gpu, t in [_gres_weight_type(w, "gpu")] if is_gpu]
    if not gpu_weights:
        return Check(name, True, f"TRESBillingWeights={raw or '(unset)'}: no GRES/gpu weight, billing of GPUs is "
                                 "not configured in this partition: nothing to do for shards", "")
    gpus = partition_gpus(conf, part, gres)
    suggested = [(w.key, w.value) for w in weights]
    problems: list[str] = []
    fine: list[str] = []
    inexact: list[str] = []
    mixed_fix: list[str] = []
    example = ""
    for gpu_w, gpu_type in gpu_weights:
        prefix_len = len("gres/")
        shard_key = gpu_w.key.strip()[:prefix_len] + "shard" + gpu_w.key.strip()[prefix_len + len("gpu"):]
        existing = next((w for w in weights if w.norm == shard_key.lower()), None)
        parsed = _number(gpu_w.value)
        if parsed is None:
            problems.append(f"{gpu_w.key}={gpu_w.value} is not a number")
            continue
        gpu_weight, suffix = parsed
        of_type = [g for g in gpus if gpu_type is None or (g.type or "").lower() == gpu_type.lower()]
        counts = sorted({g.shards for g in of_type})
        what = f"{gpu_type} GPUs" if gpu_type else "GPUs"
        source = ""
        if not counts:
            shards = Fraction(shards_per_gpu)
            source = (f" (gpu.shards_per_gpu: gres.conf shows no {what} with shards on this partition's nodes)")
        elif len(counts) > 1:
            shards = Fraction(shards_per_gpu)
            by_count = "; ".join(
                f"{_fmt_count(c)} shards on " + ",".join(sorted({g.node for g in of_type if g.shards == c}))
                + f" (would need {shard_key}={format_weight(gpu_weight / c)[0]}{suffix})" for c in counts)
            problems.append(f"the partition's {what} have different shard counts ({by_count}): no single "
                            f"{shard_key} weight bills them exactly (one weight bills k shards at k x weight, so a "
                            "GPU with fewer shards bills less than a whole GPU, and one with more bills more)")
            mixed_fix.append(f"a shard is the same memory on every GPU, so {what} of different memory have "
                             "different counts: give each memory size its own Type= in gres.conf (e.g. a100-40g, "
                             "a100-80g) and a GRES/gpu:<type> and GRES/shard:<type> weight each, or put GPUs with "
                             "different counts in different partitions")
        else:
            shards = counts[0]
        want = gpu_weight / shards
        text, exact = format_weight(want)
        want_value = text + suffix
        derivation = f"{gpu_w.key}={gpu_w.value} / {_fmt_count(shards)} shards per GPU{source}"
        if not exact:
            inexact.append(f"{want_value} ~ {_fmt_count(gpu_weight)}/{_fmt_count(shards)}")
        if not example:
            example = want_value
        have = _number(existing.value) if existing is not None else None
        if existing is None:
            problems.append(f"no {shard_key} weight: a job holding shards bills nothing for its GPU ({derivation} "
                            f"gives {shard_key}={want_value})")
        elif have is None or have[1] != suffix or not _weight_matches(have[0], want):
            problems.append(f"{existing.key}={existing.value}, should be {want_value} ({derivation})")
        else:
            fine.append(f"{existing.key}={existing.value} {'=' if exact else '~'} {derivation}")
        if existing is None:
            at = next(i for i, (k, _) in enumerate(suggested) if k == gpu_w.key)
            suggested.insert(at + 1, (shard_key, want_value))
        else:
            suggested = [(k, want_value if k == existing.key else v) for k, v in suggested]
    note = _max_tres_note(conf, example) if example else ""
    where = (f"PartitionName=DEFAULT (partition {part.name} inherits it)" if "tresbillingweights" in part.inherited
             else f"PartitionName={part.name}")
    if not problems:
        return Check(name, True, f"TRESBillingWeights={raw}: shards are billed as the fraction of a GPU they hold: "
                                 f"{'; '.join(fine)}; a 1-shard job bills {example} for its GPU part{note}", "")
    line = ",".join(f"{k}={v}" for k, v in suggested)
    fix = f'set TRESBillingWeights="{line}" on {where}, then scontrol reconfigure'
    if mixed_fix:
        fix = "; ".join(dict.fromkeys(mixed_fix)) + f"; or, taking {shards_per_gpu} shards per GPU, {fix}"
    if inexact:
        fix += (f" ({', '.join(inexact)}: rounded to {WEIGHT_ROUND_DIGITS} significant digits; Slurm keeps weights as "
                "doubles and truncates a job's billing= to an integer in AllocTRES)")
    tracked = {t.lower() for t in _tracked_tres(conf)}
    untracked = [k.lower() for k, _ in suggested if _gres_weight_type(_Weight(k, ""), "shard")[0]
                 and k.lower() not in tracked]
    if untracked:
        fix += (f"; first add {','.join(untracked)} to AccountingStorageTRES (see accounting_tres): slurmctld "
                "refuses a weight for a TRES it does not track (fatal: failed to parse tres weights str)")
    return Check(name, False, f"TRESBillingWeights={raw}: " + "; ".join(problems) + note, fix)


def _accounting_tres_check(conf: SlurmConf, gpu_types: Sequence[str]) -> Check:
    raw = conf.get("AccountingStorageTRES")
    have = _tracked_tres(conf)
    need = ["gres/gpu", "gres/shard"] + [f"gres/{g}:{t}" for t in gpu_types for g in ("gpu", "shard")]
    missing = [n for n in dict.fromkeys(need) if n.lower() not in {h.lower() for h in have}]
    detail = f"AccountingStorageTRES={raw or '(unset)'}"
    if gpu_types:
        detail += f" (typed GPU billing weights: {', '.join(gpu_types)})"
    fix = (f"add {','.join(missing)}: AccountingStorageTRES={','.join(have + missing)}, then restart slurmctld. "
           "Without gres/shard sacct's AllocTRES shows no shards (swapaware report counts them) and slurmctld "
           "refuses a GRES/shard billing weight")
    if gpu_types:
        fix += "; a typed weight (GRES/shard:<type>) needs its typed TRES (gres/shard:<type>)"
    return _check("accounting_tres", not missing, detail, fix)


def billing_checks(conf: SlurmConf, gres: GresConf, shards_per_gpu: int) -> list[Check]:
    """Is a job rewritten to shards billed like the fraction of a GPU it holds? One check per partition
    with GPU nodes or a GRES/gpu billing weight, and one for AccountingStorageTRES."""
    checks = []
    gpu_types: list[str] = []
    for part in conf.partitions:
        weights = _parse_weights(part.get("TRESBillingWeights"))
        typed = [t for w in weights for is_gpu, t in [_gres_weight_type(w, "gpu")] if is_gpu and t]
        has_gpus = any(node.gres.get("gpu", 0) > 0 for node in map(conf.node, part.nodes) if node is not None)
        if has_gpus or any(_gres_weight_type(w, "gpu")[0] for w in weights):
            checks.append(_billing_check(conf, part, gres, shards_per_gpu))
        gpu_types += [t for t in typed if t.lower() not in {x.lower() for x in gpu_types}]
    return checks + [_accounting_tres_check(conf, gpu_types)]
