"""doctor's checks of the processes on the other end: which user the policy service runs as (the
uid behind its socket), whether the node agent answers (or cannot be asked as this user), and
whether this host's MUNGE credentials carry an origin the service accepts. The checks are pure
over what was seen; ``peer_uid`` and ``unmunge_origin`` are the I/O."""
from __future__ import annotations

import ipaddress
import pwd
import re
import socket
import struct
import subprocess
from typing import Sequence

from policy_service.admin.check import Check
from policy_service.admin.perms import WRITE, StatLike, Who, blocker, describe, group_name, user_name
from policy_service.trust.authz import Addresses, Verdict

Chain = Sequence[tuple[str, StatLike]]

# ----------------------------------------------------------------------------- the service's user

PERMISSION_DENIED = "permission denied"


def peer_uid(path: str, timeout_s: float = 1.0) -> tuple[int | None, str]:
    """The uid of the process listening on the Unix socket ``path`` (SO_PEERCRED after connecting),
    or None and why it could not be asked."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect(path)
        raw = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", raw)[1], ""
    except PermissionError:
        return None, PERMISSION_DENIED
    except FileNotFoundError:
        return None, "no such socket"
    except ConnectionRefusedError:
        return None, "connection refused"
    except OSError as exc:
        return None, exc.strerror or str(exc)
    finally:
        s.close()


def service_user_check(path: str, uid: int | None, error: str, chain: Chain, slurm_user: Who | None,
                       me: Who) -> Check:
    """The service must not run as root where SlurmUser is not root: it creates its socket with its
    own user and group, mode 0660 (serving/local_socket.py), and job_submit.lua connects as
    SlurmUser. Its authorization would take that Admit (authz.admit_verdict accepts root, SlurmUser
    and the service's user alike): the socket's owner and mode are what shut slurmctld out."""
    name = "service_user"
    if uid is None:
        if error == PERMISSION_DENIED:
            return Check(name, True, f"not checked as {me.name}: connecting to {path} is refused to this user "
                         "(permission denied); run doctor as root or as SlurmUser on the controller", skipped=True)
        if error == "connection refused":
            return Check(name, False, f"nothing listens on {path}: a socket left by a service that is not running; "
                         "every GPU job passes unchanged", "start the service: systemctl restart swapaware")
        return Check(name, True, f"not checked: {path}: {error}", skipped=True)
    who = f"{user_name(uid)} (uid {uid})"
    if uid != 0:
        same = slurm_user is not None and slurm_user.uid == uid
        return Check(name, True, f"the service runs as {who}" + (", SlurmUser" if same else ""))
    if slurm_user is not None and slurm_user.uid == 0:
        return Check(name, True, "the service runs as root, and so does slurmctld (SlurmUser=root)")
    label = slurm_user.name if slurm_user is not None else "SlurmUser"
    fix = (f"run the service as SlurmUser: User={label} and Group={group_name(_primary(slurm_user))} in "
           "/etc/systemd/system/swapaware.service (as in contrib/systemd/swapaware.service), chown -R "
           f"{label}: /var/lib/swapaware (service.db_path's directory: the service refuses a history another user "
           "owns), then systemctl daemon-reload && systemctl restart swapaware")
    sock = describe(path, chain[-1][1]) if chain else path
    if slurm_user is not None and chain and blocker(slurm_user, chain, WRITE) is None:
        return Check(name, True, f"the service runs as root (SO_PEERCRED uid 0); SlurmUser {label} can open {sock} "
                     "only through its group or mode, which the service sets again (0660, root's group) at every "
                     "start", fix, warn=True)
    return Check(name, False, f"the service runs as root (SO_PEERCRED uid 0): it makes its socket with its own user "
                 f"and group, mode 0660, here {sock}, and SlurmUser {label} is neither, so job_submit.lua's connect "
                 "inside slurmctld fails with EACCES and every GPU job passes unchanged (slurmctld's log: 'job passes "
                 f"unchanged (fail-open): connect {path}: permission denied'). No uid rule of the service refuses it "
                 "(authz.admit_verdict takes root, SlurmUser and its own user): the socket's owner and mode shut "
                 "it out", fix)


def _primary(user: Who | None) -> int:
    if user is None:
        return 0
    try:
        return pwd.getpwuid(user.uid).pw_gid
    except KeyError:
        return min(user.gids, default=0)


# ------------------------------------------------------------------------------------ node agent

def agent_check(path: str, chain: Chain, stop: str, me: Who, answered: bool | None, gpu_node: bool,
                hostname: str, listens_on: str) -> Check:
    """Does the node agent answer at hooks.agent_socket? ``answered`` None: not asked, because
    ``me`` may not connect (the agent's socket is root's, 0600: only the root hooks talk to it).
    ``listens_on``: agent.socket_path, where the agent listens."""
    name = "agent"
    fix = ("start it: systemctl enable --now swapaware-agent (contrib/systemd/swapaware-agent.service); without it "
           "the epilog gets no GPU memory figure and nothing is learned of this node's jobs")
    if path != listens_on:
        return Check(name, False, f"hooks.agent_socket={path} but the agent listens on agent.socket_path="
                     f"{listens_on}: the prolog and epilog never reach it, and nothing is learned of this node's jobs",
                     "set both to the same path (one swapaware.toml on every host)")
    if stop:
        if "does not exist" not in stop:
            return Check(name, True, f"not checkable as {me.name} ({stop}): run doctor as root on the node",
                         skipped=True)
        if not gpu_node:
            return Check(name, True, f"no agent socket at {path}: {hostname} is no GPU node of slurm.conf, "
                         "none is needed here", skipped=True)
        return Check(name, False, f"no agent socket at {path}: swapaware-agent is not running on this GPU node",
                     fix)
    if answered is None or blocker(me, chain, WRITE) is not None:
        st = chain[-1][1]
        return Check(name, True, f"not checkable as {me.name} (socket owned by {user_name(st.st_uid)}, "
                     f"{st.st_mode & 0o7777:04o}): run doctor as root on the node", skipped=True)
    if not answered:
        return Check(name, False, f"node agent at {path} does not answer", "systemctl status swapaware-agent; "
                     "journalctl -u swapaware-agent (restart it: systemctl restart swapaware-agent)")
    return Check(name, True, f"node agent at {path} answers")


# ----------------------------------------------------------------------------------------- MUNGE

_IPV4 = re.compile(r"\b(\d{1,3}(?:\.\d{1,3}){3})\b")


def parse_unmunge(text: str) -> str | None:
    """The origin address in unmunge's output: its ENCODE_HOST line ('ENCODE_HOST: 10.0.0.5',
    or 'ENCODE_HOST: gpu01 (10.0.0.5)' without -N); None when there is none."""
    for line in text.splitlines():
        if line.strip().upper().startswith("ENCODE_HOST"):
            for found in reversed(_IPV4.findall(line)):
                try:
                    return str(ipaddress.IPv4Address(found))
                except ValueError:
                    continue
            return None
    return None


def unmunge_origin(munge_socket: str, timeout_s: float = 5.0) -> tuple[str | None, str]:
    """(origin address, "") of a credential made and decoded through munged at ``munge_socket``
    (``munge -n | unmunge -N``), or (None, why)."""
    try:
        cred = subprocess.run(["munge", "-n", "-S", munge_socket], capture_output=True, text=True, timeout=timeout_s)
        if cred.returncode != 0:
            return None, f"munge -n: {cred.stderr.strip() or f'exit {cred.returncode}'}"
        out = subprocess.run(["unmunge", "-N", "-S", munge_socket], input=cred.stdout, capture_output=True, text=True,
                             timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"munge -n | unmunge: {exc}"
    if out.returncode != 0:
        return None, f"unmunge: {out.stderr.strip() or f'exit {out.returncode}'}"
    origin = parse_unmunge(out.stdout)
    return (origin, "") if origin else (None, "unmunge printed no ENCODE_HOST address")


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def own_address(addrs: Addresses, hostname: str) -> str:
    """This host's address as the service knows it (slurm.conf's NodeAddr / NodeHostName,
    SlurmctldHost resolved), "" when it is not among them."""
    short = hostname.split(".", 1)[0]
    for table in (addrs.nodes, addrs.controllers):
        for addr, host in table.items():
            if host.split(".", 1)[0] == short:
                return addr
    return ""


def munge_origin_check(origin: str | None, error: str, verdict: Verdict | None, addrs: Addresses | None,
                       hostname: str, token: bool, munge_socket: str) -> Check:
    """Will the service accept this host's hook events by their MUNGE credential? ``verdict``:
    the service's own rule (authz.event_verdict) for a credential of root from ``origin``;
    ``token``: the hooks also send the shared token, which the service takes instead."""
    name = "munge_origin"
    if origin is None:
        return Check(name, True, f"munged at {munge_socket} gave no credential ({error}): this host's hooks send "
                     "none, and their events count only where the hooks' token is set", "start munged (systemctl "
                     "enable --now munge) with the cluster's key", warn=True)
    mine = own_address(addrs, hostname) if addrs is not None else ""
    addr = mine or "<this node's address>"
    fix = (f"start munged with --origin={addr} (MUNGE >= 0.5.15; Debian 12: OPTIONS=\"--origin={addr}\" in "
           f"/etc/default/munge), or make {hostname} resolve to that address (/etc/hosts); then systemctl restart munge")
    unspecified = ipaddress.IPv4Address(origin).is_unspecified
    if verdict is None and not unspecified:
        return Check(name, True, f"origin {origin}: not checked against the cluster's addresses (Slurm not read)",
                     skipped=True)
    if unspecified or (verdict is not None and not verdict.allowed):
        if addrs is not None and addrs.error and not unspecified:
            return Check(name, True, f"origin {origin}: not checked, the cluster's addresses could not be read "
                         f"({addrs.error})", skipped=True)
        why = f"'{_one_line(verdict.reason)}'" if verdict is not None else "no host of the cluster has that address"
        null = (" (the null address: munged found no address for this host, its name or --origin did not resolve; "
                "munged logs 'Continuing with origin set to null address')" if unspecified else "")
        detail = f"munged here encodes credentials with origin {origin}{null}; the service refuses this host's hook " \
                 f"events: {why}"
        if token:
            return Check(name, True, detail + "; they are taken on the hooks' token instead", fix, warn=True)
        return Check(name, False, detail + ": nothing is learned of the jobs that run here", fix)
    return Check(name, True, f"origin {origin}: {verdict.reason}")

