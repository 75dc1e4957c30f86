"""Pure parsers: Slurm's job_desc strings -> typed requests, and GRES rewriting.

Slurm keeps GRES requests as comma-separated entries in ``tres_per_node`` (``--gres``),
``tres_per_job`` (``--gpus``), ``tres_per_task`` (``--gpus-per-task``) and ``tres_per_socket``,
spelled by release (SLURM_VERSIONS.md):

* 22.05: ``gres:<name>[:<type>]:<count>`` (``gres:gpu:1``, ``gres:gpu:a100:2``);
* 23.02+: ``gres/<name>[:<type>]:<count>`` (``gres/gpu:1``), and in ``tres_per_task``
  ``gres/<name>[:<type>]=<count>`` beside TRES that are not GRES (``cpu=2,gres/gpu=1``).

Parsing accepts every spelling; rewriting writes the running release's (``SlurmDialect``).
"""
from __future__ import annotations

import functools

import hashlib
import re
from dataclasses import dataclass

from policy_service.config import AccessClass
from policy_service.core.dialect import SlurmDialect
from policy_service.core.types import GpuRequest, GresKind, JobRequest, KeyLevel

GRES_FIELDS = ("tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket")
SLURM_NO_VAL = 4294967294  # job_desc numbers read this when unset

_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.I)
_HINT_RE = re.compile(r"(?:^|[\s,;])swapaware:([a-z_]+)=([^\s,;]+)", re.I)


class RequestError(ValueError):
    """The job's facts cannot be understood (bad input, not a policy decision)."""


@dataclass(frozen=True)
class GresEntry:
    """One entry of a tres_per_* field. ``gres`` is False for a TRES that is not a GRES
    (``cpu=2`` beside ``gres/gpu=1``): it is kept as written and never asks for a GPU."""

    name: str
    gres_type: str
    count: int
    text: str  # exactly as Slurm had it
    gres: bool = True

    def render(self) -> str:
        return self.text


MAX_SIZE_BYTES = 1 << 60  # 1 EiB: no GPU memory hint is larger


def parse_size_bytes(text: str) -> int:
    """'12G' -> 12 GiB. Slurm convention: suffixes are binary (K=KiB, M=MiB, ...)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise RequestError(f"not a memory size: {text!r} (use e.g. 12G, 800M, 1.5T)")
    try:
        size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    except (OverflowError, ValueError):
        size = MAX_SIZE_BYTES + 1
    if size > MAX_SIZE_BYTES:
        raise RequestError(f"not a plausible memory size: {text[:40]!r}{'...' if len(text) > 40 else ''} "
                           f"(at most 1E)")
    return size


_GRES_PREFIXES = ("gres:", "gres/")
GPU_GRES = ("gpu", "shard", "mps")  # the GRES a job's GPU request is made of
_SUFFIXED_RE = re.compile(r"\d+[kKmMgG]")


def _count(text: str, raw: str) -> int:
    if text.isdigit():
        return int(text)
    if _SUFFIXED_RE.fullmatch(text):
        raise RequestError(f"GRES count with suffix is not supported: {raw!r}")
    raise RequestError(f"cannot parse GRES entry {raw!r}")


def parse_entry(raw: str) -> GresEntry:
    """One entry in any release's spelling: 'gres:gpu:a100:2', 'gres/gpu:1', 'gres/gpu=1',
    'gpu:1' (no prefix), or a TRES that is not a GRES ('cpu=2', 'license/x=1')."""
    prefixed = raw.startswith(_GRES_PREFIXES)
    body = raw[len("gres:"):] if prefixed else raw
    if not prefixed and ("=" in raw or "/" in raw.split(":", 1)[0]):
        return GresEntry(name=raw.partition("=")[0], gres_type="", count=0, text=raw, gres=False)
    spec, eq, eq_count = body.partition("=")
    name, *rest = spec.split(":")
    if not name:
        raise RequestError(f"cannot parse GRES entry {raw!r}")
    if eq:  # name[:type]=count
        count = _count(eq_count, raw)
    elif rest and rest[-1].isdigit():  # name[:type]:count
        count, rest = int(rest[-1]), rest[:-1]
    elif rest and _SUFFIXED_RE.fullmatch(rest[-1]):
        raise RequestError(f"GRES count with suffix is not supported: {raw!r}")
    else:  # name[:type], one of it
        count = 1
    if len(rest) > 1 or (rest and not rest[0]):
        raise RequestError(f"cannot parse GRES entry {raw!r}")
    return GresEntry(name=name, gres_type=rest[0] if rest else "", count=count, text=raw)


@functools.lru_cache(maxsize=4096)  # pure; Admit parses the same few spellings again and again
def parse_gres_entries(value: str) -> tuple[GresEntry, ...]:
    """Parse 'gres:gpu:h100:2,gres:nvme:1' (or 'cpu=2,gres/gpu=1') into entries. '' -> ()."""
    if not value:
        return ()
    return tuple(parse_entry(raw) for raw in (part.strip() for part in value.split(",")) if raw)


def _is_gpu_entry(e: GresEntry) -> bool:
    return e.gres and e.name == "gpu"


def gpu_request(fields: dict[str, str]) -> GpuRequest:
    """Find the job's GPU/shard request across the tres_per_* fields (a count of 0, as in
    'gpu:0', asks for none)."""
    found: list[tuple[str, GresEntry]] = []
    for fname in GRES_FIELDS:
        for entry in parse_gres_entries(fields.get(fname, "") or ""):
            if entry.gres and entry.name in GPU_GRES and entry.count > 0:
                found.append((fname, entry))
    if not found:
        return GpuRequest(kind=GresKind.NONE)
    if len(found) > 1:
        raw = ";".join(f"{f}={e.text}" for f, e in found)
        return GpuRequest(kind=GresKind.OTHER, raw=raw, source_field=found[0][0])
    fname, entry = found[0]
    kind = {"gpu": GresKind.GPU, "shard": GresKind.SHARD}.get(entry.name, GresKind.OTHER)
    return GpuRequest(kind=kind, per_node=entry.count, gpu_type=entry.gres_type,
                      source_field=fname, raw=entry.text)


def shard_rewrite(fields: dict[str, str], source_field: str, shards: int, dialect: SlurmDialect,
                  gpu_type: str = "") -> dict[str, str]:
    """New values for the GRES fields: the GPU request becomes ``<k>`` shards in tres_per_node,
    written in the dialect's spelling (``gres/shard:<k>`` on 23.02+), of the GPU type the job
    asked for (``gres/shard:a100:<k>``: shards take their GPU's type where gres.conf gives GPUs a
    ``Type=``, on every supported release); every other entry stays as it was written, and every
    gpu entry of every field is cleared."""
    out: dict[str, str] = {}
    for fname in GRES_FIELDS:
        old = fields.get(fname, "") or ""
        kept = [e.render() for e in parse_gres_entries(old) if not _is_gpu_entry(e)]
        if fname == "tres_per_node":
            kept.append(dialect.gres("shard", shards, gpu_type))
        new = ",".join(kept)
        if new != old or fname == source_field:
            out[fname] = new
    return out


_SLASH_EQ_RE = re.compile(r"gres/([^,;=]+)=(\d+)")


def legacy_spelling(text: str) -> str:
    """GRES text in the 22.05 spelling ('gres/gpu=1' and 'gres/gpu:1' -> 'gres:gpu:1'), so a
    job's history keys stay the same across releases."""
    return _SLASH_EQ_RE.sub(r"gres/\1:\2", text).replace("gres/", "gres:")


def parse_hints(comment: str, env_mem_hint: str) -> tuple[int | None, AccessClass | None, str]:
    """User hints. ``--comment 'swapaware:mem=12G swapaware:access=random'`` or
    ``SWAPAWARE_GPU_MEM=12G`` in the job's environment (the environment wins).
    Returns (bytes or None, access class or None, text of a hint that could not be used)."""
    mem_text, access_text, bad = env_mem_hint.strip(), "", []
    for key, value in _HINT_RE.findall(comment or ""):
        key = key.lower()
        if key == "mem" and not mem_text:
            mem_text = value
        elif key == "access":
            access_text = value
        elif key not in ("mem", "access"):
            bad.append(f"{key}={value}")
    mem_bytes = None
    if mem_text:
        try:
            mem_bytes = parse_size_bytes(mem_text)
        except RequestError:
            bad.append(f"mem={mem_text}")
    access = None
    if access_text:
        try:
            access = AccessClass(access_text.lower())
        except ValueError:
            bad.append(f"access={access_text}")
    return mem_bytes, access, " ".join(bad)


# job_desc fields that hold options a user expressed per GPU, with the option that sets each.
PER_GPU_OPTIONS = (
    ("cpus_per_tres", "--cpus-per-gpu"),
    ("mem_per_tres", "--mem-per-gpu"),
    ("ntasks_per_tres", "--ntasks-per-gpu"),
    ("tres_bind", "--gpu-bind"),
    ("tres_freq", "--gpu-freq"),
    ("step_gpu_bind", "--gpu-bind (a step of the batch script)"),
)
NO_VAL16 = 65534  # job_desc's 16-bit numbers read this when unset


# The binding Slurm gives a --gpus-per-task job itself (tres_bind "gres/gpu:per_task:1", seen on
# 24.11 and 26.05; 22.05 gives none): not an option the user typed.
_IMPLICIT_BIND_RE = re.compile(r"^gres[:/]gpu:per_task:\d+$")


def implicit_gpu_bind(tres_bind: str) -> bool:
    return bool(_IMPLICIT_BIND_RE.match(tres_bind or ""))


def per_gpu_options(values: dict[str, str | int]) -> tuple[str, ...]:
    """The per-GPU options a job carries, as 'option=value' in PER_GPU_OPTIONS order: a value
    that is set (a non-empty string, a count other than 0 and NO_VAL16), except the binding Slurm
    gives --gpus-per-task itself."""
    out = []
    for field, option in PER_GPU_OPTIONS:
        value = values.get(field)
        if field == "tres_bind" and implicit_gpu_bind(str(value or "")):
            continue
        if isinstance(value, bool):
            if value:
                out.append(option)
        elif isinstance(value, int):
            if value not in (0, NO_VAL16):
                out.append(f"{option}={value}")
        elif value:
            out.append(f"{option}={value}")
    return tuple(out)


def _num(value: int, default: int) -> int:
    return default if value in (0, SLURM_NO_VAL, SLURM_NO_VAL + 1) else value


def node_count(min_nodes: int) -> int:
    """A job's minimum node count as Slurm's facts give it (NO_VAL and 0: one node)."""
    return _num(min_nodes, 1)


def job_request(*, user: str, account: str, partition: str, job_name: str, script_fingerprint: str,
                gres_fields: dict[str, str], min_nodes: int = 1, num_tasks: int = 1, time_limit_min: int = 0,
                comment: str = "", env_mem_hint: str = "", qos: str = "", is_batch: bool = True,
                het_job: bool = False, per_gpu: dict[str, str | int] | None = None, exclusive: str = "",
                partition_gpu_defaults: tuple[str, ...] = (),
                gpu_shard_counts: tuple[int, ...] | None = None) -> tuple[JobRequest, AccessClass | None]:
    """Build the typed request (and the access-class hint) from job_desc facts. ``is_batch``:
    the job has a batch script (false for the allocations srun and salloc create). ``per_gpu``:
    the job_desc fields of PER_GPU_OPTIONS; ``exclusive``: --exclusive as JobFacts carries it;
    ``partition_gpu_defaults``: what the job's partition gives each GPU (slurm/partitions.py);
    ``gpu_shard_counts``: the shard counts of the GPUs it can land on (None: not known)."""
    if not user:
        raise RequestError("job facts carry no user")
    hint_bytes, access, bad = parse_hints(comment, env_mem_hint)
    bind = str((per_gpu or {}).get("tres_bind") or "")
    req = JobRequest(
        user=user, account=account, partition=partition, job_name=job_name,
        script_fingerprint=script_fingerprint, gpu=gpu_request(gres_fields),
        min_nodes=_num(min_nodes, 1), num_tasks=_num(num_tasks, 1), time_limit_s=_num(time_limit_min, 0) * 60,
        hint_bytes=hint_bytes, hint_text=bad, qos=qos or "", is_batch=is_batch, het_job=het_job,
        per_gpu_options=per_gpu_options(per_gpu or {}), exclusive=exclusive.strip(),
        implicit_gpu_bind=bind if implicit_gpu_bind(bind) else "", partition_gpu_defaults=partition_gpu_defaults,
        gpu_shard_counts=gpu_shard_counts,
    )
    return req, access


def history_keys(req: JobRequest) -> dict[KeyLevel, str]:
    """History keys of a job, narrowest first (the estimator's fallback order)."""
    cls = "\0".join((req.user, req.job_name, req.script_fingerprint, legacy_spelling(req.gpu.raw)))
    return {
        KeyLevel.CLASS: hashlib.sha256(cls.encode()).hexdigest()[:16],
        KeyLevel.USER_NAME: f"{req.user}/{req.job_name}",
        KeyLevel.ACCOUNT: req.account or "(none)",
        KeyLevel.PARTITION: req.partition or "(default)",
    }


FP_MOD1, FP_MUL1 = 2147483647, 31
FP_MOD2, FP_MUL2 = 2147483629, 131


# The fingerprint reads at most FP_LIMIT bytes, so that job_submit.lua spends a bounded fraction
# of a millisecond on any script: all of a script up to that size; of a longer one its first
# FP_HEAD bytes, its last FP_TAIL bytes and its length in decimal digits.
FP_LIMIT, FP_HEAD, FP_TAIL = 4096, 3072, 1024


def _fp_update(h1: int, h2: int, data: bytes) -> tuple[int, int]:
    for b in data:
        h1 = (h1 * FP_MUL1 + b) % FP_MOD1
        h2 = (h2 * FP_MUL2 + b) % FP_MOD2
    return h1, h2


def script_fingerprint(script: bytes) -> str:
    """Fingerprint of a batch script (see FP_LIMIT); job_submit.lua computes the same value in Lua
    5.1 (double arithmetic stays exact: every intermediate is below 2**53). Scripts up to
    FP_LIMIT bytes keep the fingerprint of earlier releases."""
    if len(script) <= FP_LIMIT:
        h1, h2 = _fp_update(0, 0, script)
    else:
        h1, h2 = _fp_update(0, 0, script[:FP_HEAD] + script[-FP_TAIL:] + str(len(script)).encode())
    return f"{h1:08x}{h2:08x}" if script else ""
