"""doctor's checks of the processes on the other end: which user the policy service runs as (the
uid behind its socket), and whether the node agent answers (or cannot be asked as this user).
The checks are pure over what was seen; ``peer_uid`` is the I/O."""
from __future__ import annotations

import pwd
import socket
import struct
from typing import Sequence

from policy_service.admin.check import Check
from policy_service.admin.perms import WRITE, StatLike, Who, blocker, describe, group_name, user_name

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
    own user and group, mode 0660 (adapters/local_socket.py), and job_submit.lua connects as
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
