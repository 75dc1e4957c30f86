"""Who may do what: pure decisions, each with the reason it gives (docs/admin-guide.md,
"Identity and access").

A ``Caller`` is what a transport learned about the other end: a MUNGE credential (gRPC), the
hooks' shared token (gRPC), the kernel's word on a local-socket peer (SO_PEERCRED), or nothing.
The functions here take that, the service's ``Trust`` settings and what the caller's identity
implies (``Standing``; looked up by ``policy_service.trust.access``) and return a ``Verdict``:

* events (JobStarted, JobFinished, ReportEvents) feed the model: from root or SlurmUser on a node
  or controller of the cluster (MUNGE), from a holder of the hooks' token (when accepted), or over
  the local socket from root or the service's own user;
* Admit is recorded only for slurmctld: MUNGE from root or SlurmUser on a controller host, or a
  local-socket peer that is root, SlurmUser or the service's user (job_submit.lua runs inside
  slurmctld); anyone else's Admit is answered as a dry run, recorded nowhere;
* Explain of a recorded job: its own user, root, SlurmUser, the service's user, Slurm operators
  and administrators, members of auth.admin_group, token holders; Explain of job facts (what
  would be decided) is open to all, in full to those who may explain a recorded job of the user
  the facts name, to anyone else only its action and shard count (handler.PolicyHandler._shown).

With no identity mechanism at all (MUNGE off or unavailable, no token), gRPC callers cannot be
told apart and are trusted as before (the service warns at start; bind gRPC to loopback).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import grpc

ADMIN_LEVELS = ("operator", "administrator")  # Slurm AdminLevels that may see every job


class Via(enum.Enum):
    MUNGE = "munge"
    TOKEN = "token"
    PEER = "peer"  # local Unix socket: uid/gid from SO_PEERCRED
    ANONYMOUS = "anonymous"


@dataclass(frozen=True)
class Caller:
    via: Via
    uid: int | None = None
    gid: int | None = None
    addr: str = ""  # MUNGE: IPv4 address of the host whose munged encoded the credential
    token: bool = False  # presented the hooks' token, and it is accepted
    problem: str = ""  # a credential or token was presented and refused: why
    refused: str = ""  # a MUNGE credential was refused: why, as a metric label (access.Authorizer.identify)

    @classmethod
    def peer(cls, uid: int | None, gid: int | None = None) -> "Caller":
        return cls(Via.PEER, uid, gid) if uid is not None else cls(Via.ANONYMOUS)

    def describe(self) -> str:
        if self.via is Via.MUNGE:
            return f"MUNGE uid {self.uid} gid {self.gid} from {self.addr}"
        if self.via is Via.PEER:
            return f"local-socket peer uid {self.uid}"
        if self.via is Via.TOKEN:
            return "holder of the hooks' token"
        return "anonymous caller"


@dataclass(frozen=True)
class Trust:
    """The service's settings, resolved once at start."""

    munge: bool  # MUNGE credentials are checked
    token: bool  # a token is configured and accepted (service.token_file, auth.accept_token)
    slurm_uid: int  # SlurmUser's uid
    service_uid: int  # the service's own euid

    @property
    def open(self) -> bool:
        """No identity mechanism: gRPC callers are not told apart."""
        return not self.munge and not self.token

    @property
    def slurm_uids(self) -> frozenset[int]:
        return frozenset({0, self.slurm_uid})


@dataclass(frozen=True)
class Addresses:
    """The cluster's hosts by IPv4 address (address -> name); ``error``: why they may be incomplete."""

    nodes: Mapping[str, str] = field(default_factory=dict)
    controllers: Mapping[str, str] = field(default_factory=dict)
    error: str = ""


@dataclass(frozen=True)
class Standing:
    """What a caller's uid implies, looked up outside: its user name, membership of
    auth.admin_group, its Slurm AdminLevel (None: not looked up yet, "": unknown)."""

    name: str = ""
    admin_group: bool = False
    admin_level: str | None = None


@dataclass(frozen=True)
class Owner:
    """Whose job a recorded decision is (from its JobFacts)."""

    uid: int
    user: str


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: str
    code: grpc.StatusCode | None = None  # the status of a refusal (None: allowed, or a dry run)


def _ok(reason: str) -> Verdict:
    return Verdict(True, reason)


def _no(code: grpc.StatusCode, reason: str) -> Verdict:
    return Verdict(False, reason, code)


def credential_verdict(caller: Caller) -> Verdict:
    """A credential or token that was presented and does not check out is refused, whatever the method."""
    if caller.problem:
        return _no(grpc.StatusCode.UNAUTHENTICATED, caller.problem)
    return _ok("no refused credential")


def _host(addr: str, addrs: Addresses) -> str:
    if addr in addrs.controllers:
        return f"controller {addrs.controllers[addr]}"
    if addr in addrs.nodes:
        return f"node {addrs.nodes[addr]}"
    return ""


def _unknown_origin(caller: Caller, addrs: Addresses, what: str) -> str:
    why = f"; the address list may be incomplete: {addrs.error}" if addrs.error else ""
    return f"{caller.describe()}: {caller.addr} is not {what} of this cluster{why}"


def event_nodes_verdict(method: str, caller: Caller, addrs: Addresses, nodes: Iterable[str]) -> Verdict:
    """A node's hooks speak for their own node: events that a MUNGE credential from a node's
    address (not a controller's) carries may name that node alone (an event's node is covered by
    the credential's digest, so it cannot be changed on the way). A token, the local socket and a
    controller (which replays nothing of other nodes' but may host a node itself) are not limited."""
    if caller.via is not Via.MUNGE or caller.problem or caller.token:
        return _ok("not a node's credential")
    own = addrs.nodes.get(caller.addr)
    if not own or caller.addr in addrs.controllers:
        return _ok(f"{caller.addr} is not a compute node's address alone")
    others = sorted({n for n in nodes if n and n != own})
    if others:
        return _no(grpc.StatusCode.PERMISSION_DENIED,
                   f"{method} from {own} ({caller.addr}) names other nodes ({', '.join(others[:5])}): a node's "
                   "hooks send the events of their own node only")
    return _ok(f"events of {own}")


def event_verdict(method: str, caller: Caller, trust: Trust, addrs: Addresses) -> Verdict:
    if caller.problem:
        return credential_verdict(caller)
    if caller.token:  # the token is the fallback: it stands even where a credential's origin does not
        return _ok(f"{caller.describe()} holds the hooks' token")
    if caller.via is Via.PEER:
        if caller.uid in (0, trust.service_uid):
            return _ok(f"{caller.describe()} is root or the service's user")
        return _no(grpc.StatusCode.PERMISSION_DENIED,
                   f"{method} over the local socket is for root and the service's user (uid {trust.service_uid}); "
                   f"the peer is uid {caller.uid}")
    if caller.via is Via.MUNGE:
        if caller.uid not in trust.slurm_uids:
            return _no(grpc.StatusCode.PERMISSION_DENIED,
                       f"{method} is for the cluster's hooks: {caller.describe()} is neither root nor SlurmUser "
                       f"(uid {trust.slurm_uid})")
        host = _host(caller.addr, addrs)
        if not host:
            return _no(grpc.StatusCode.PERMISSION_DENIED,
                       f"{method} is for the cluster's hooks: " + _unknown_origin(caller, addrs, "a node or controller"))
        return _ok(f"{caller.describe()} ({host})")
    if trust.open:
        return _ok("no identity mechanism is configured (MUNGE off or unavailable, no token): callers are trusted")
    needs = []
    if trust.munge:
        needs.append("a MUNGE credential (metadata x-swapaware-munge) from root or SlurmUser on a cluster node")
    if trust.token:
        needs.append("the hooks' token (metadata authorization: Bearer <token>)")
    return _no(grpc.StatusCode.UNAUTHENTICATED, f"{method} needs {', or '.join(needs)}; the caller sent none")


def admit_verdict(caller: Caller, trust: Trust, addrs: Addresses) -> Verdict:
    """allowed: the Admit is slurmctld's and is recorded; not allowed: answer it as a dry run
    (``code`` is UNAUTHENTICATED only for a refused credential)."""
    if caller.problem:
        return credential_verdict(caller)
    if caller.via is Via.PEER:
        if caller.uid in trust.slurm_uids | {trust.service_uid}:
            return _ok(f"{caller.describe()} is root, SlurmUser or the service's user (slurmctld's job_submit)")
        return Verdict(False, f"{caller.describe()} is not root, SlurmUser (uid {trust.slurm_uid}) "
                              f"or the service's user (uid {trust.service_uid})")
    if caller.via is Via.MUNGE:
        if caller.uid not in trust.slurm_uids:
            return Verdict(False, f"{caller.describe()} is neither root nor SlurmUser (uid {trust.slurm_uid})")
        if caller.addr not in addrs.controllers:
            return Verdict(False, _unknown_origin(caller, addrs, "a controller (SlurmctldHost)"))
        return _ok(f"{caller.describe()} (controller {addrs.controllers[caller.addr]})")
    if caller.via is Via.TOKEN:
        return Verdict(False, "the hooks' token identifies the nodes' hooks, not slurmctld")
    if trust.open:
        return _ok("no identity mechanism is configured: callers are trusted")
    return Verdict(False, "the caller sent no MUNGE credential")


def is_admin(caller: Caller, trust: Trust, standing: Standing) -> str:
    """Why the caller may explain every job ("" when it may not, as far as ``standing`` tells)."""
    if caller.token:
        return "holds the hooks' token"
    if caller.via in (Via.ANONYMOUS, Via.TOKEN):
        return "no identity mechanism is configured" if trust.open and not caller.problem else ""
    if caller.uid == 0:
        return "is root"
    if caller.uid == trust.slurm_uid:
        return "is SlurmUser"
    if caller.uid == trust.service_uid:
        return "is the service's user"
    if standing.admin_group:
        return "is in auth.admin_group"
    if (standing.admin_level or "").lower() in ADMIN_LEVELS:
        return f"is a Slurm {standing.admin_level}"
    return ""


def owns(caller: Caller, owner: Owner, standing: Standing) -> bool:
    """The job's user: its uid, or (facts without a uid) its user name."""
    if caller.uid is None or caller.via not in (Via.MUNGE, Via.PEER):
        return False
    if owner.uid:
        return caller.uid == owner.uid
    return bool(standing.name) and standing.name == owner.user


def explain_precheck(caller: Caller, trust: Trust) -> Verdict:
    """Before a recorded decision is looked up: a caller who could see no job is refused
    without learning whether the job or decision exists."""
    if caller.problem:
        return credential_verdict(caller)
    if caller.via is Via.ANONYMOUS and not trust.open:
        if not trust.munge:  # the token alone: only its holders (root on the nodes) are identified
            return _no(grpc.StatusCode.UNAUTHENTICATED,
                       "explaining a recorded job needs your identity, and this service checks no MUNGE "
                       "credentials (auth.munge): only holders of the hooks' token may; the caller sent none")
        return _no(grpc.StatusCode.UNAUTHENTICATED,
                   "explaining a recorded job needs your identity: a MUNGE credential "
                   "(swapaware explain sends one where munged runs); the caller sent none")
    return _ok("identified")


def explain_verdict(caller: Caller, trust: Trust, owner: Owner, standing: Standing) -> Verdict:
    """May ``caller`` see the recorded decision of ``owner``'s job?"""
    if caller.problem:
        return credential_verdict(caller)
    why = is_admin(caller, trust, standing)
    if why:
        return _ok(f"{caller.describe()} {why}")
    pre = explain_precheck(caller, trust)
    if not pre.allowed:
        return pre
    if owns(caller, owner, standing):
        return _ok(f"{caller.describe()} is the job's user")
    who = f"uid {caller.uid}" + (f" ({standing.name})" if standing.name else "")
    return _no(grpc.StatusCode.PERMISSION_DENIED,
               f"this job belongs to another user; you are {who}. Only the job's user, root, SlurmUser, "
               f"Slurm operators and administrators and members of auth.admin_group may explain it")
