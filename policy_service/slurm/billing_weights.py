"""How a partition's TRESBillingWeights bill a job that holds shards, and whether that is the
fraction of a GPU it holds. Pure: a TRESBillingWeights value and the partition's GPUs in, a verdict
out. ``swapaware doctor`` (admin/billing.py) and the service (slurm/partitions.py, the request's
``shards_unbilled``) both decide with ``shard_billing``, so they accept exactly the same weights.

Slurm bills a job sum(weight x count) over the TRES it holds (PriorityFlags=MAX_TRES: the largest).
A job holding GPU g is counted under gres/gpu and gres/gpu:<g's type>, so it bills

    price(g) = GRES/gpu + GRES/gpu:<type of g>            (a weight not set counts 0)

A job holding k shards is counted under gres/shard alone: Slurm records no gres/shard:<type> (measured
on 24.11: AllocTRES gres/shard=1 on an a100, with gres/shard:a100 tracked), so it bills k x GRES/shard
on any GPU, and a GRES/shard:<type> weight bills nothing. A job holding shards bills its fraction when

  exact:   GRES/shard x N_g = price(g) for every GPU g it can land on (N_g: g's shards): k shards of
           N bill k/N of what the GPU bills, all N exactly what the GPU bills; or
  memory:  every GPU of the partition bills one price P and GRES/shard x N_max = P (N_max: the most
           shards a GPU of the partition has): a shard bills its memory as a fraction of the
           partition's largest GPU (the dev cluster: CPU=1,GRES/gpu=8,GRES/shard=1 with 4 and 8
           shards per GPU), exactly k/N on the largest GPUs, its memory's worth on smaller ones.

Anything else keeps the job's request (reason ``shards_unbilled``). A whole GPU held as all N_g of
its shards (Slurm 22.05) bills what gpu:1 bills only where N_g x GRES/shard = price(g). A weight with
a unit suffix (K, M, G, T, P) is per that many (Slurm divides it by 1024, 1024^2, ...).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation, localcontext
from fractions import Fraction
from typing import Mapping, Sequence

from policy_service.slurm.fleet import GpuShards

WEIGHT_EXACT_DIGITS = 12  # a terminating decimal up to this many significant digits is printed exactly
WEIGHT_ROUND_DIGITS = 6  # otherwise it is rounded to this many
SUFFIXES = "KMGTP"
FIX_PER_TYPE = ("partitions of one GPU type each (a partition holds whole nodes), with GRES/shard = "
                "GRES/gpu:<type> / N there (N: the shards per GPU of that type; swapaware doctor prints each line)")

_WEIGHT = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([KMGTP]?)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Weight:
    key: str  # as written, e.g. "GRES/gpu:a100"
    value: str  # as written, e.g. "12" or "0.25G"

    @property
    def norm(self) -> str:
        return self.key.strip().lower()

    def gres(self, name: str) -> tuple[bool, str | None]:
        """(this is a GRES/<name>[:<type>] weight, the type as written or None)."""
        prefix = f"gres/{name}"
        if self.norm == prefix:
            return True, None
        if self.norm.startswith(prefix + ":") and self.norm != prefix + ":":
            return True, self.key.strip()[len(prefix) + 1:]
        return False, None


def parse_weights(raw: str) -> tuple[Weight, ...]:
    out = []
    for item in raw.split(","):
        key, sep, value = item.partition("=")
        if key.strip():
            out.append(Weight(key.strip(), value.strip() if sep else ""))
    return tuple(out)


def number(value: str) -> tuple[Fraction, str] | None:
    """``"10"`` -> (10, ""), ``"0.25G"`` -> (1/4, "G"); None when Slurm would not read a number."""
    match = _WEIGHT.match(value)
    if not match:
        return None
    try:
        return Fraction(Decimal(match.group(1))), match.group(2).upper()
    except (InvalidOperation, ValueError):
        return None


def unit(suffix: str) -> int:
    """How many of a TRES a weight with this suffix is per: "" 1, "K" 1024, "M" 1024^2 ..."""
    return 1024 ** (SUFFIXES.index(suffix.upper()) + 1) if suffix else 1


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


def weight_matches(have: Fraction, want: Fraction) -> bool:
    """Equal, or (where the exact weight has no short decimal) equal to 6 significant digits."""
    if have == want:
        return True
    if format_weight(want)[1] or want == 0:
        return False
    with localcontext() as ctx:
        ctx.prec = 30
        exponent = (Decimal(want.numerator) / Decimal(want.denominator)).adjusted()
    return abs(have - want) <= Fraction(1, 2) * Fraction(10) ** (exponent - WEIGHT_ROUND_DIGITS + 1)


def fmt(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else format_weight(x)[0]


@dataclass(frozen=True)
class BillingWeights:
    """The GRES weights of one partition's TRESBillingWeights, per GPU or shard (suffixes applied)."""

    raw: str = ""
    weights: tuple[Weight, ...] = ()
    gpu: Fraction = Fraction(0)  # GRES/gpu
    typed: Mapping[str, Fraction] = field(default_factory=dict)  # lower-case type -> GRES/gpu:<type>
    shard: Weight | None = None  # GRES/shard as written
    unreadable: tuple[str, ...] = ()  # "GRES/gpu=ten": GPU or shard weights Slurm would not read

    @property
    def bills_gpus(self) -> bool:
        return self.gpu != 0 or any(self.typed.values())

    @property
    def typed_shards(self) -> tuple[Weight, ...]:
        """GRES/shard:<type> weights: they bill nothing (no shard job is counted under a typed shard TRES)."""
        return tuple(w for w in self.weights if w.gres("shard")[0] and w.gres("shard")[1])

    def price(self, gpu_type: str | None) -> Fraction:
        """What a job holding one GPU of ``gpu_type`` (None: not typed) bills for it."""
        return self.gpu + (self.typed.get(gpu_type.lower(), Fraction(0)) if gpu_type else 0)

    def price_terms(self, gpu_type: str | None) -> str:
        """The weights a GPU of ``gpu_type`` bills, as written: "GRES/gpu=2 + GRES/gpu:a100=12 = 14"."""
        terms = [f"{w.key}={w.value}" for w in self.weights
                 if w.gres("gpu")[0] and (w.gres("gpu")[1] is None
                                          or (gpu_type or "").lower() == (w.gres("gpu")[1] or "").lower())]
        if not terms:
            return "nothing"
        return " + ".join(terms) + (f" = {fmt(self.price(gpu_type))}" if len(terms) > 1 else "")

    @property
    def shard_unit(self) -> str:
        """The suffix a GRES/shard weight is written with (its own; else that of the GPU weights)."""
        if self.shard is not None:
            parsed = number(self.shard.value)
            return parsed[1] if parsed else ""
        for w in self.weights:
            parsed = number(w.value) if w.gres("gpu")[0] else None
            if parsed:
                return parsed[1]
        return ""

    def shard_value(self) -> Fraction:
        """GRES/shard as written, in shard_unit (0: none)."""
        parsed = number(self.shard.value) if self.shard is not None else None
        return parsed[0] if parsed else Fraction(0)

    def shard_bills(self, per_shard: Fraction) -> bool:
        """Whether GRES/shard bills ``per_shard`` (per shard, no suffix) for a shard."""
        return weight_matches(self.shard_value(), per_shard * unit(self.shard_unit))

    def shard_text(self, per_shard: Fraction) -> str:
        """GRES/shard's value for ``per_shard`` (per shard), as it would be written."""
        return format_weight(per_shard * unit(self.shard_unit))[0] + self.shard_unit


def read_weights(raw: str) -> BillingWeights:
    weights = parse_weights(raw)
    gpu, typed, shard, bad = Fraction(0), {}, None, []
    for w in weights:
        is_gpu, gpu_type = w.gres("gpu")
        is_shard, shard_type = w.gres("shard")
        if not (is_gpu or is_shard):
            continue
        parsed = number(w.value)
        if parsed is None:
            bad.append(f"{w.key}={w.value}")
            continue
        per = parsed[0] / unit(parsed[1])
        if is_gpu and gpu_type:
            typed[gpu_type.lower()] = per
        elif is_gpu:
            gpu = per
        elif not shard_type:
            shard = w
    return BillingWeights(raw, weights, gpu, typed, shard, tuple(bad))


def _shards(g: GpuShards) -> int:
    return int(g.shards)


def distinct_gpus(gpus: Sequence[GpuShards]) -> list[GpuShards]:
    """One GPU of each (type, whole shards) with shards: all a verdict depends on (a fleet of
    thousands of GPUs has a few kinds)."""
    return list({((g.type or "").lower(), _shards(g)): g for g in gpus if _shards(g) > 0}.values())


@dataclass(frozen=True)
class ShardBilling:
    """Whether a job holding shards of some GPUs of a partition bills its fraction of a GPU there."""

    ok: bool
    rule: str  # "exact", "memory", "unbilled" (GPUs and shards bill nothing); "" where not ok
    per_shard: Fraction | None  # what GRES/shard should bill a shard (None: no one weight does)
    largest: int  # N_max, the most shards a GPU of the partition has
    why: str = ""  # what a job holding shards would bill, where not ok
    mixed: bool = False  # the partition's GPUs have different shard counts


def shard_billing(w: BillingWeights, partition_gpus: Sequence[GpuShards], on: Sequence[GpuShards],
                  shards_per_gpu: int = 8) -> ShardBilling:
    """Does a job holding k shards of one of ``on`` (the GPUs with shards it can land on) bill k/N of
    what that GPU bills (exact), or k/N_max of the partition's one GPU price (memory)?
    ``partition_gpus``: all of the partition's GPUs with shards (none known: one GPU per weighted
    type, or an untyped one, with ``shards_per_gpu`` shards)."""
    part = distinct_gpus(partition_gpus) or [
        GpuShards("", t, Fraction(shards_per_gpu)) for t in (sorted(w.typed) or [None])]
    on = distinct_gpus(on) if partition_gpus else part
    largest = max(_shards(g) for g in part)
    mixed = len({_shards(g) for g in part}) > 1
    prices = {w.price(g.type) for g in part}
    per_shard = {w.price(g.type) / _shards(g) for g in part}
    want = (next(iter(prices)) / largest if len(prices) == 1
            else next(iter(per_shard)) if len(per_shard) == 1 else None)
    if w.unreadable:
        return ShardBilling(False, "", want, largest, f"{', '.join(w.unreadable)} is not a number Slurm reads", mixed)
    if not on or all(w.shard_bills(w.price(g.type) / _shards(g)) for g in on):
        billed = w.shard_value() != 0 or any(w.price(g.type) for g in on)
        return ShardBilling(True, "exact" if billed else "unbilled", want, largest, mixed=mixed)
    if len(prices) == 1 and want and w.shard_bills(want):
        return ShardBilling(True, "memory", want, largest, mixed=mixed)
    shard = f"{w.shard.key}={w.shard.value}" if w.shard is not None else "no GRES/shard weight"
    if want is None:
        kinds = "; ".join(f"{t or 'untyped'}: {w.price_terms(t)} for {n} shards"
                          for t, n in sorted({(g.type, _shards(g)) for g in part}, key=lambda x: (x[0] or "", x[1])))
        why = (f"its GPUs bill different prices per shard ({kinds}) and a job holding shards is billed by the "
               f"one GRES/shard weight ({shard}; Slurm records no gres/shard:<type>): no weight bills each its "
               "fraction")
        here = {w.price(g.type) / _shards(g) for g in on}
        if len(here) == 1 and next(iter(here)):  # one weight would bill these GPUs, not the partition's others
            why += f" (the GPUs this job can land on would need GRES/shard={w.shard_text(next(iter(here)))})"
        return ShardBilling(False, "", None, largest, why, mixed)
    terms = w.price_terms(on[0].type)
    derived = (f"{f'({terms})' if '+' in terms else terms} / {largest} shards per GPU"
               f"{' of its largest GPUs' if mixed else ''} gives GRES/shard={w.shard_text(want)}")
    if want == 0:
        why = f"{shard} bills a shard where its GPU bills nothing: a job holding shards would bill more than its GPU"
    elif w.shard is None:
        why = f"no GRES/shard weight: a job holding shards bills nothing for its GPU ({derived})"
    else:
        why = f"{shard}, should be {w.shard_text(want)} ({derived})"
    return ShardBilling(False, "", want, largest, why, mixed)


def unbilled_reason(partition: str, w: BillingWeights, verdict: ShardBilling) -> str:
    """Why a job holding shards keeps its request, naming the partition, the weight and the fix."""
    if verdict.ok:
        return ""
    if verdict.per_shard is None:
        fix = FIX_PER_TYPE
    elif verdict.per_shard == 0:
        fix = "remove GRES/shard from its TRESBillingWeights (or bill its GPUs)"
    else:
        fix = (f"GRES/shard={w.shard_text(verdict.per_shard)} in its TRESBillingWeights (swapaware doctor prints "
               "the line)")
    return f"partition {partition} (TRESBillingWeights={w.raw or '(unset)'}): {verdict.why}; the fix: {fix}"


def whole_unbilled(partition: str, w: BillingWeights, on: Sequence[GpuShards], verdict: ShardBilling) -> str:
    """Why all the shards of one of ``on`` would not bill what gpu:1 bills there ("": they would).
    ``verdict``: shard_billing's for ``on``."""
    for g in distinct_gpus(on):
        n, price = _shards(g), w.price(g.type)
        if n <= 0 or w.shard_bills(price / n):
            continue
        per = w.shard_value() / unit(w.shard_unit)
        head = (f"partition {partition} (TRESBillingWeights={w.raw or '(unset)'}): all {n} shards of one "
                f"{g.type + ' ' if g.type else ''}GPU would bill {n} x {fmt(per)} = {fmt(n * per)} and the GPU bills "
                f"{w.price_terms(g.type)}")
        if verdict.rule == "memory":
            return (f"{head}: a shard bills its memory as a fraction of the partition's largest GPU "
                    f"({verdict.largest} shards), and this GPU has fewer")
        return f"{head}; the fix: " + (f"GRES/shard={w.shard_text(price / n)}" if price else "remove GRES/shard")
    return ""
