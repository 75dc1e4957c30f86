"""The admission table: what the service would decide, published for the job_submit plugin. Pure.

The service writes a *class table* (per job key, the decision under each queue gate state) and a
*gate file* (the gate state of each queue view); slurm_plugin/swapaware_table.lua decides from
them with no socket I/O (docs/admission-table.md, /run/swapaware/admission.json by default).

The key: every fact ``policy.decide`` reads, in ``KEY_FIELDS`` order, joined by "\\x1f" (strings as
the plugin's M.facts gives them, integers in decimal, booleans "1"/"0"). A key is used as it is,
never hashed. Facts whose strings hold the separator are never published (``publishable``): every
published key then splits into exactly ``len(KEY_FIELDS)`` fields, so a job whose own fields
hold the separator (a crafted --comment) builds a key with more fields, which matches no entry.

Gate states: "short" (the queue gate keeps the GPU whole), "normal", "long" (sized by memory
alone), "unknown" (no fresh queue snapshot). An entry holds "*" alone when every state decides the
same (same job_desc assignments and AdminComment fields).

The AdminComment template: the decision's AdminComment built with the placeholder id
``PLACEHOLDER_ID``, with ``tbl=<version>:<i><g>`` inserted after the id token and cut again to
policy.admin_comment_max_chars (``<i>`` with ENTRY_DIGITS digits). ``<g>`` is the state's letter (``STATE_LETTER``): s, n, l, u, or
``a`` for an entry held as "*" (the state did not matter). Each template is complete: the plugin
only replaces ``id=IDIDIDIDIDIDIDID`` by ``id=<its new id>``, nothing else.
"""
from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass
from typing import Mapping

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.config import Config
from policy_service.core.estimator import usable_level
from policy_service.core.policy import parse_admin_comment
from policy_service.core.queue_rules import queue_gate_state
from policy_service.core.types import ClassStats, KeyLevel, QueueState, Reason, ReasonCode, Rewrite

TABLE_FORMAT = "swapaware-admission/2"  # the compact, line-oriented file: core/admission_format.py
GATE_FORMAT = "swapaware-gate/1"
SEP = "\x1f"
PLACEHOLDER_ID = "IDIDIDIDIDIDIDID"  # 16 characters, as a decision id: truncation is the same
ALL_STATES = "*"

# (proto field, kind) in key order: s string, i integer, b boolean
KEY_FIELDS: tuple[tuple[str, str], ...] = (
    ("user", "s"), ("account", "s"), ("partition", "s"), ("job_name", "s"), ("tres_per_node", "s"),
    ("tres_per_job", "s"), ("tres_per_task", "s"), ("tres_per_socket", "s"),
    ("script_fingerprint", "s"), ("comment", "s"), ("env_mem_hint", "s"), ("min_nodes", "i"), ("num_tasks", "i"),
    ("is_batch", "b"), ("het_job", "b"), ("qos", "s"), ("cpus_per_tres", "s"), ("mem_per_tres", "s"),
    ("ntasks_per_tres", "i"), ("tres_bind", "s"), ("tres_freq", "s"), ("exclusive", "s"),
)


class GateState(enum.Enum):
    SHORT = "short"
    NORMAL = "normal"
    LONG = "long"
    UNKNOWN = "unknown"


STATE_LETTER = {GateState.SHORT.value: "s", GateState.NORMAL.value: "n", GateState.LONG.value: "l",
                GateState.UNKNOWN.value: "u", ALL_STATES: "a"}
LETTER_STATE = {v: k for k, v in STATE_LETTER.items()}

# The entry number is written with ENTRY_DIGITS digits: every token of every version has the same
# length, so the archive swaps a version's tokens for a placeholder of that length inside the stored
# records (protobuf bytes) and keeps one copy of what consecutive versions hold alike.
ENTRY_DIGITS = 7
MAX_ENTRY = 10 ** ENTRY_DIGITS - 1
TOKEN_CHARS = len("tbl=") + 16 + 1 + ENTRY_DIGITS + 1
_TBL = re.compile(r"^([0-9a-f]{16}):([0-9]{%d})([snlua])$" % ENTRY_DIGITS)


@dataclass(frozen=True)
class TableRef:
    """Where a table-made decision came from: table version, entry number, gate state (a
    ``GateState`` value, or "*" for an entry held alike in every state)."""

    version: str
    entry: int
    state: str

    @property
    def token(self) -> str:
        return f"tbl={self.version}:{self.entry:0{ENTRY_DIGITS}d}{STATE_LETTER[self.state]}"


def _field(job: pb.JobFacts, name: str, kind: str) -> str:
    if name == "is_batch":  # unset (older clients) counts as batch, as the handler reads it
        return "1" if (job.is_batch if job.HasField("is_batch") else True) else "0"
    value = getattr(job, name)
    if kind == "b":
        return "1" if value else "0"
    if kind == "i":
        return str(int(value))
    return value


def table_key(facts: pb.JobFacts) -> str:
    """The class table's key of a job: all facts decide() reads (module doc)."""
    return SEP.join(_field(facts, name, kind) for name, kind in KEY_FIELDS)


def publishable(facts: pb.JobFacts) -> bool:
    """Whether a job's key may be published: none of its strings holds the separator."""
    return not any(kind == "s" and SEP in getattr(facts, name) for name, kind in KEY_FIELDS)


def parse_table_ref(admin_comment: str) -> TableRef | None:
    """The table reference an AdminComment carries (``tbl=<version>:<i><g>``); None when none."""
    return table_ref_of(parse_admin_comment(admin_comment))


def table_ref_of(fields: dict[str, str]) -> TableRef | None:
    """``parse_table_ref`` of an AdminComment already parsed (``parse_admin_comment``)."""
    m = _TBL.match(fields.get("tbl", ""))
    if m is None:
        return None
    return TableRef(m.group(1), int(m.group(2)), LETTER_STATE[m.group(3)])


def with_table_ref(comment: str, ref: TableRef, max_chars: int) -> str | None:
    """``comment`` (built with PLACEHOLDER_ID) with ``ref``'s token after the id token, cut to
    ``max_chars``; None when the id token or the whole reference would not survive the cut."""
    id_token = f"id={PLACEHOLDER_ID}"
    at = comment.find(id_token)
    if at < 0:
        return None
    end = at + len(id_token)
    text = f"{comment[:end]} {ref.token}{comment[end:]}"[:max_chars]
    return text if parse_table_ref(text) == ref else None


# ---------------------------------------------------------------------- gate states
def queue_view(qos: str, cfg: Config) -> str:
    """The queue a job of ``qos`` is gated on: its QoS under policy.queue_per_qos, else ""."""
    return qos if cfg.policy.queue_per_qos else ""


def state_queues(cfg: Config) -> dict[str, QueueState | None]:
    """A queue snapshot for each gate state some snapshot can reach under ``cfg``, in which every
    view is in that state (None: no snapshot, "unknown"). A state no pressure reaches (e.g. "short"
    with policy.share_min_queue = 0) is left out: the gate file never names it."""
    smq, ocmq = cfg.policy.share_min_queue, cfg.policy.overcommit_compute_min_queue
    out: dict[str, QueueState | None] = {}
    for state, pressure in ((GateState.SHORT, 0.0), (GateState.NORMAL, smq), (GateState.LONG, max(smq, ocmq))):
        q = QueueState(pending_gpus=pressure, total_gpus=1)  # pressure = pending / 1 exactly
        if queue_gate_state(q, "", cfg) == state.value:
            out[state.value] = q
    out[GateState.UNKNOWN.value] = None
    return out


def gate_file(snapshot: QueueState | None, cfg: Config, now: float, rpc_only: str = "", controller: str = "") -> dict:
    """The gate file: the state of each QoS the snapshot lists, "other" for the rest (the whole
    queue), valid while decide() would call the snapshot fresh (age <= 3 * policy.queue_poll_s).
    ``rpc_only``: why every job takes the RPC path now (the table's decisions assume what the
    service no longer sees, e.g. nodes whose shards the controller refuses); ``controller``: the
    host name of the slurmctld the service follows ([ha]): the plugin on another host takes the RPC
    path (swapaware_table.lua, T.gate_state). ``taken_at``: when the snapshot was taken (wall
    clock): a slurmctld that started after it takes the RPC path (its nodes may not have
    registered with it, which the snapshot cannot show)."""
    fresh_for = 3 * cfg.policy.queue_poll_s
    extra = {k: v for k, v in (("rpc_only", rpc_only), ("controller", controller)) if v}
    if snapshot is None:
        return {"format": GATE_FORMAT, "generated_at": now, "valid_until": now, "views": {},
                "other": GateState.UNKNOWN.value, **extra}
    taken = now - snapshot.age_s
    whole = dataclasses.replace(snapshot, ahead_by_qos=())
    if cfg.policy.queue_per_qos:
        views = {name: queue_gate_state(snapshot, name, cfg) for name, _ in snapshot.ahead_by_qos}
        other = queue_gate_state(whole, "", cfg)
    else:
        other = queue_gate_state(snapshot, "", cfg)
        views = {"": other}
    return {"format": GATE_FORMAT, "generated_at": now, "taken_at": taken, "valid_until": taken + fresh_for,
            "views": views, "other": other, **extra}


# ---------------------------------------------------------------------- entries
MAX_SITE_FACTOR = 2147483645  # swapaware.lua's M.MAX_SITE_FACTOR
MAX_FIELD_CHARS = 4096  # swapaware.lua's M.validate
_TRES_PER_NODE = re.compile(r"^[A-Za-z0-9:/,._-]+$")
_SET_FIELDS = ("tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket", "tres_bind", "admin_comment")


def tokenised(rw: Rewrite, ref: TableRef, max_chars: int) -> Rewrite | None:
    """``rw`` (its AdminComment built with PLACEHOLDER_ID) with the table token in its
    AdminComment; None when it has no AdminComment that can carry the token (such a decision is
    not published: the service could not learn it back)."""
    if rw.admin_comment is None:
        return None
    comment = with_table_ref(rw.admin_comment, ref, max_chars)
    return None if comment is None else dataclasses.replace(rw, admin_comment=comment)


def table_decision(rw: Rewrite) -> dict | None:
    """The job_desc assignments M.validate makes of the RPC reply carrying ``rw`` (``set``, and
    the user's ``message``); None where M.validate would refuse the reply (the job then takes the
    RPC path, which refuses it the same way)."""
    out: dict = {}
    for name in _SET_FIELDS:
        value = getattr(rw, name)
        if value is not None:
            if len(value.encode()) > MAX_FIELD_CHARS:
                return None
            out[name] = value
    if out.get("tres_per_node") and not _TRES_PER_NODE.match(out["tres_per_node"]):
        return None
    if rw.site_factor is not None:
        if abs(rw.site_factor) > MAX_SITE_FACTOR:
            return None
        out["site_factor"] = rw.site_factor
    decision: dict = {"set": out}
    if rw.user_message is not None:
        decision["message"] = rw.user_message
    return decision


def entry_refs(version: str, entry: int, per_state: Mapping[str, Rewrite]) -> dict[str, TableRef]:
    """The table reference of each state of an entry: one "*" reference when every state decides
    the same (``per_state``: the rewrites built with PLACEHOLDER_ID, one per reachable state)."""
    rewrites = list(per_state.values())
    if rewrites and all(rw == rewrites[0] for rw in rewrites[1:]):
        return {ALL_STATES: TableRef(version, entry, ALL_STATES)}
    return {state: TableRef(version, entry, state) for state in per_state}


def table_file(version: str, generated_at: float, valid_until: float, dialect: str, mode: str, per_qos: bool,
               entries: Mapping[str, dict] | None) -> dict:
    """The class table as a document (``entries``: key -> {"i": n, state: decision}); its file is
    ``render_table`` of it."""
    return {"format": TABLE_FORMAT, "version": version, "generated_at": generated_at, "valid_until": valid_until,
            "dialect": dialect, "mode": mode, "per_qos": per_qos, "entries": entries}


def keys_read(keys: Mapping[KeyLevel, str], stats: Mapping[KeyLevel, ClassStats], cfg: Config, *,
              user: str) -> tuple[str, ...]:
    """The history keys whose statistics a decision for a job of ``user`` read (``stats``: those it
    was given): class and user+name (OOM penalty, utilisation, site factor), and the estimator's
    fallback up to the key it took its estimate from (all of them when none had enough runs).
    Only their learning can change the decision."""
    order = list(KeyLevel)
    level = usable_level(stats, cfg.estimator, user)
    read = set(order if level is None else order[:order.index(level) + 1]) | {KeyLevel.CLASS, KeyLevel.USER_NAME}
    return tuple(keys[lv] for lv in order if lv in read and lv in keys)


def template_reasons(reasons: tuple[Reason, ...], state: str, cfg: Config) -> tuple[Reason, ...]:
    """The reasons a table-made decision is recorded with (its archived template). Admit words
    the queue gate's reasons with the snapshot's figures; a table decision knows only the state
    the gate file named when the job was submitted, so those reasons say that state and the
    threshold instead (``state_queues``' made-up queue would give made-up figures)."""
    where = f"queue gate '{state}' when the job was submitted (the published gate file, at most one queue poll old)"
    said = {
        ReasonCode.QUEUE_SHORT: f"{where}: the pending GPU jobs ahead of it asked for less than "
                                f"policy.share_min_queue {cfg.policy.share_min_queue:.1%} of the cluster's GPUs: the "
                                "job can start on a whole GPU, where no co-runner slows it down",
        ReasonCode.COMPUTE_OVERCOMMITTED: f"{where}: the pending GPU jobs ahead of it asked for at least "
                                          f"policy.overcommit_compute_min_queue "
                                          f"{cfg.policy.overcommit_compute_min_queue:.0%} of the cluster's GPUs: sized "
                                          "by memory alone, co-runners may slow each other down",
    }
    return tuple(Reason(r.code, said[r.code]) if r.code in said else r for r in reasons)
