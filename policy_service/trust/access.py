"""The service's access checks: who a gRPC caller is (MUNGE credential, the hooks' token) and
what ``policy_service.trust.authz`` then allows, with the lookups its pure rules need: the cluster's
node and controller addresses (from Slurm, cached), SlurmUser's uid, user names and groups
(NSS), Slurm AdminLevels (sacctmgr, cached).
"""
from __future__ import annotations

import grp
import hmac
import logging
import os
import pwd
import threading
import time
from typing import Callable, Iterable, Sequence

import grpc

from policy_service.trust import cred_binding, munge
from policy_service.trust.munge import MUNGE_METADATA  # the gRPC metadata key carrying a MUNGE credential
from policy_service.trust.auth_config import AuthConfig, MungeMode
from policy_service.trust.authz import (
    Addresses,
    Caller,
    Owner,
    Standing,
    Trust,
    Verdict,
    Via,
    admit_verdict,
    event_nodes_verdict,
    event_verdict,
    explain_precheck,
    explain_verdict,
)
from policy_service.config import ConfigError

log = logging.getLogger("swapaware.access")


class AccessUnavailable(Exception):
    """The service cannot check identities now (its munged is unreachable)."""


def munge_active(auth: AuthConfig) -> tuple[bool, str]:
    """Whether MUNGE is used here, and why (``ConfigError`` for ``on`` where it cannot work)."""
    if auth.munge is MungeMode.OFF:
        return False, "auth.munge = off"
    if not munge.available():
        if auth.munge is MungeMode.ON:
            raise ConfigError(f"auth.munge = on but {munge.LIBRARY} does not load (install libmunge2)")
        return False, f"auth.munge = auto and {munge.LIBRARY} does not load"
    if not auth.munge_socket.is_socket():
        if auth.munge is MungeMode.ON:
            raise ConfigError(f"auth.munge = on but munged's socket {auth.munge_socket} does not exist "
                              f"(is munged running? set auth.munge_socket)")
        return False, f"auth.munge = auto and munged's socket {auth.munge_socket} does not exist"
    return True, f"auth.munge = {auth.munge.value}, munged at {auth.munge_socket}"


def resolve_slurm_uid(auth: AuthConfig, slurm) -> tuple[int, str]:
    """SlurmUser's uid and where it came from: auth.slurm_user, else Slurm's config, else the
    user "slurm", else root."""
    if auth.slurm_user:
        if auth.slurm_user.isdigit():
            return int(auth.slurm_user), "auth.slurm_user"
        try:
            return pwd.getpwnam(auth.slurm_user).pw_uid, "auth.slurm_user"
        except KeyError:
            raise ConfigError(f"auth.slurm_user: no user named {auth.slurm_user!r}") from None
    ask = getattr(slurm, "slurm_user", None)
    if ask is not None:
        try:
            name, uid = ask()
            if uid is not None:
                return uid, "scontrol show config"
            if name:
                return pwd.getpwnam(name).pw_uid, "scontrol show config"
        except Exception as exc:  # Slurm down, unknown name: fall back
            log.info("SlurmUser from Slurm: %s", exc)
    try:
        return pwd.getpwnam("slurm").pw_uid, 'the user "slurm" (Slurm did not say)'
    except KeyError:
        return 0, "root (Slurm did not say, no user named slurm)"


class Authorizer:
    """Caches and lookups around the pure rules; one per service, shared by its threads."""

    def __init__(self, trust: Trust, auth: AuthConfig, slurm=None, token: str | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.trust, self.auth, self.slurm = trust, auth, slurm
        self._token = token if trust.token else None
        self.clock = clock
        self._lock = threading.Lock()
        self._addrs = Addresses(error="not read yet")
        self._fetched_at = self._tried_at = float("-inf")
        self._levels: dict[str, tuple[str, float]] = {}

    @classmethod
    def from_config(cls, auth: AuthConfig, slurm, token: str | None) -> "Authorizer":
        use_munge, why = munge_active(auth)
        slurm_uid, source = resolve_slurm_uid(auth, slurm)
        trust = Trust(munge=use_munge, token=bool(token) and auth.accept_token, slurm_uid=slurm_uid,
                      service_uid=os.geteuid())
        log.info("access: MUNGE %s (%s); token fallback %s; SlurmUser uid %d (%s)",
                 "on" if use_munge else "off", why, "on" if trust.token else "off", slurm_uid, source)
        if trust.open:
            log.warning("access: no identity mechanism (no MUNGE, no token): every gRPC caller is trusted "
                        "to send events and record decisions; bind service.grpc_address to loopback")
        return cls(trust, auth, slurm, token)

    # ------------------------------------------------------------------ who is calling
    def identify(self, metadata: Sequence[tuple[str, str | bytes]] | None, method: str, raw: bytes) -> Caller:
        """The caller of a gRPC request of ``method`` (full gRPC name) whose bytes were ``raw``,
        from its metadata. A MUNGE credential counts only with the payload that binds it to this
        method and these bytes (policy_service/trust/cred_binding.py), whatever its uid. Raises
        ``AccessUnavailable`` when a credential came and munged cannot be asked."""
        cred = bearer = None
        for key, value in metadata or ():
            text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            if key == MUNGE_METADATA and cred is None:
                cred = text
            elif key == "authorization" and bearer is None:
                bearer = text
        token_ok = token_problem = None
        if bearer is not None and self._token is not None:
            token_ok = hmac.compare_digest(bearer.encode(), f"Bearer {self._token}".encode())
            token_problem = None if token_ok else "the bearer token is not the hooks' token"
        munge_problem = refused = ""
        if cred is not None and self.trust.munge:
            try:
                c = munge.decode(cred, socket=str(self.auth.munge_socket))
            except munge.MungeError as exc:
                if exc.code in (munge.MungeCode.SOCKET, munge.MungeCode.LIBRARY_MISSING):
                    raise AccessUnavailable(f"cannot check MUNGE credentials now: {exc.message}") from None
                munge_problem = f"MUNGE credential refused: {exc.message} ({exc.code.name})"
                refused = exc.code.name.lower()
            else:
                # Each check says its own piece, so the log shows every reason (Slurm's step
                # credential: a foreign payload and a TTL of 300 s); the payload's is counted first.
                unbound = cred_binding.check(c.payload, method, raw)
                whys = [unbound.explain(method)] if unbound is not None else []
                if c.ttl > self.auth.max_ttl_s:
                    whys.append(f"made to live {c.ttl} s, more than auth.max_ttl_s = {self.auth.max_ttl_s}")
                if not whys:
                    return Caller(Via.MUNGE, c.uid, c.gid, c.addr, token=bool(token_ok))
                munge_problem = f"MUNGE credential of uid {c.uid} from {c.addr} refused: {'; '.join(whys)}"
                refused = unbound.value if unbound is not None else "over_ttl"
        if token_ok:
            if munge_problem:
                log.info("%s; accepted on the hooks' token", munge_problem)
            return Caller(Via.TOKEN, token=True, refused=refused)
        return Caller(Via.ANONYMOUS, problem=munge_problem or token_problem or "", refused=refused)

    # ------------------------------------------------------------------ the cluster's hosts
    def addresses(self, addr: str = "") -> Addresses:
        """The cluster's node and controller addresses: re-read after auth.address_cache_s, or when
        ``addr`` is not among them, at most every auth.address_refresh_min_s."""
        with self._lock:
            now = self.clock()
            a = self._addrs
            expired = now - self._fetched_at >= self.auth.address_cache_s
            miss = bool(addr) and addr not in a.nodes and addr not in a.controllers
            if (expired or miss) and now - self._tried_at >= self.auth.address_refresh_min_s:
                self._refresh(now)
            return self._addrs

    def _refresh(self, now: float) -> None:
        self._tried_at = now
        old, errors = self._addrs, []
        found = {}
        for what, attr in (("nodes", "node_addresses"), ("controllers", "controller_addresses")):
            ask = getattr(self.slurm, attr, None)
            if ask is None:
                errors.append(f"the Slurm access in use cannot list {what}")
                found[what] = getattr(old, what)
                continue
            try:
                found[what] = dict(ask())
            except Exception as exc:  # Slurm down: keep what was known
                errors.append(f"reading the {what} from Slurm failed: {exc}")
                found[what] = getattr(old, what)
        self._addrs = Addresses(found["nodes"], found["controllers"], "; ".join(errors))
        if errors:
            log.warning("cluster addresses: %s", self._addrs.error)
        else:
            self._fetched_at = now
            log.info("cluster addresses: %d node, %d controller", len(self._addrs.nodes),
                     len(self._addrs.controllers))

    # ------------------------------------------------------------------ what a uid implies
    def standing(self, caller: Caller, with_level: bool) -> Standing:
        if caller.uid is None:
            return Standing()
        try:
            pw = pwd.getpwuid(caller.uid)
            name, primary = pw.pw_name, pw.pw_gid
        except KeyError:
            name, primary = "", caller.gid
        return Standing(name=name, admin_group=self._in_admin_group(name, caller.gid, primary),
                        admin_level=self.admin_level(name) if with_level and name else None)

    def _in_admin_group(self, name: str, gid: int | None, primary: int | None) -> bool:
        group = self.auth.admin_group
        if not group:
            return False
        try:
            g = grp.getgrgid(int(group)) if group.isdigit() else grp.getgrnam(group)
        except KeyError:
            log.warning("auth.admin_group %r does not exist", group)
            return False
        if g.gr_gid in (gid, primary) or name in g.gr_mem:
            return True
        try:
            return bool(name) and g.gr_gid in os.getgrouplist(name, primary if primary is not None else g.gr_gid)
        except OSError:
            return False

    def admin_level(self, name: str) -> str:
        """The user's Slurm AdminLevel, cached auth.admin_level_cache_s ("" when unknown)."""
        now = self.clock()
        with self._lock:
            hit = self._levels.get(name)
            if hit is not None and now < hit[1]:
                return hit[0]
        ask = getattr(self.slurm, "admin_level", None)
        level, ttl = "", self.auth.admin_level_cache_s
        if ask is not None:
            try:
                level = ask(name)
            except Exception as exc:
                log.warning("AdminLevel of %s: %s", name, exc)
                ttl = min(ttl, self.auth.address_refresh_min_s)  # retry a failed lookup sooner
        with self._lock:
            self._levels[name] = (level, now + ttl)
        return level

    # ------------------------------------------------------------------ verdicts
    def _hosts_for(self, caller: Caller) -> Addresses:
        """Only a MUNGE caller's origin is checked: other callers never cost a Slurm query (an
        Admit over the local socket comes from slurmctld, which waits for it holding its locks)."""
        return self.addresses(caller.addr) if caller.via is Via.MUNGE and not caller.problem else Addresses()

    def events(self, method: str, caller: Caller) -> Verdict:
        return event_verdict(method, caller, self.trust, self._hosts_for(caller))

    def event_nodes(self, method: str, caller: Caller, nodes: Iterable[str]) -> Verdict:
        """May ``caller`` send events naming ``nodes`` (a node's hooks: their own node only)."""
        return event_nodes_verdict(method, caller, self._hosts_for(caller), nodes)

    def admit(self, caller: Caller) -> Verdict:
        return admit_verdict(caller, self.trust, self._hosts_for(caller))

    def explain(self, caller: Caller, owner: Owner | None = None) -> Verdict:
        """None: before the decision is looked up; else may ``caller`` see ``owner``'s job."""
        if owner is None:
            return explain_precheck(caller, self.trust)
        v = explain_verdict(caller, self.trust, owner, self.standing(caller, with_level=False))
        if v.allowed or v.code is grpc.StatusCode.UNAUTHENTICATED:
            return v
        return explain_verdict(caller, self.trust, owner, self.standing(caller, with_level=True))
