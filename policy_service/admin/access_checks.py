"""doctor's checks that SlurmUser (slurmctld, and job_submit.lua inside it) can open the service's
Unix socket and read the admission table with its gate. Pure over the user and the stat results
(``perms.stat_chain``); the rule is ``perms.allowed``."""
from __future__ import annotations

import stat as statmod
from typing import Sequence

from policy_service.admin.check import Check
from policy_service.admin.perms import READ, WRITE, StatLike, Who, blocker, describe, group_name, refusal, user_name

Chain = Sequence[tuple[str, StatLike]]
RESTART = "restart slurmctld, which keeps the groups it started with"


def no_slurm_user(check: str, name: str) -> Check:
    return Check(check, False, f"SlurmUser={name} (slurm.conf) has no passwd entry on this host",
                 "create the user here (the same uid as on every host) or fix SlurmUser= in slurm.conf")


def _unstattable(check: str, stop: str, me: Who) -> Check:
    return Check(check, True, f"not checked as {me.name}: {stop}; run doctor as root or as the service's user",
                 skipped=True)


def _fix_for(user: Who, path: str, st: StatLike, need: int, what: str) -> str:
    """How to give ``user`` the permission it lacks on ``path`` (a directory on the way: search)."""
    if statmod.S_ISDIR(st.st_mode):
        return f"chmod o+x {path} (or a+x): {user.name} must pass through it to reach the {what}"
    group = group_name(st.st_gid)
    made = ("it makes its socket 0660 with its own user and group" if what == "socket" else
            f"as {user.name} or root it gives the table and its gate mode 0640 and {user.name}'s primary group")
    bit = "g+w" if need == WRITE else "g+r"
    return (f"run the service as {user.name} (User= and Group= in swapaware.service): {made}; or add {user.name} to "
            f"group {group} (usermod -aG {group} {user.name}"
            + (f", chmod {bit} {path}" if not (st.st_mode >> 3) & need else "") + f") and {RESTART}")


def slurmuser_socket_check(user: Who | None, user_label: str, path: str, chain: Chain, stop: str, me: Who) -> Check:
    """Can SlurmUser connect to the service's socket (write on it, search on every directory above)?
    ``chain``/``stop``: perms.stat_chain of ``path`` as doctor's user saw it."""
    name = "slurmuser_socket"
    if user is None:
        return no_slurm_user(name, user_label)
    if stop:
        if "does not exist" not in stop:
            return _unstattable(name, stop, me)
        return Check(name, False, f"no socket at {path} ({stop}): the service is not running on this controller, "
                     "or listens elsewhere; every GPU job passes unchanged",
                     "start the service (systemctl enable --now swapaware) and keep service.socket_path and "
                     "swapaware_plugin.conf's socket= the same")
    hit = blocker(user, chain, WRITE)
    sock = describe(path, chain[-1][1])
    if hit is None:
        return Check(name, True, f"SlurmUser {user.name} (uid {user.uid}) can connect to {sock}")
    why = refusal(user, chain, WRITE)
    return Check(name, False, f"{why}: slurmctld's job_submit.lua, running as SlurmUser, cannot connect (EACCES) "
                 "and every GPU job passes unchanged", _fix_for(user, *hit, what="socket"))


def slurmuser_table_check(user: Who | None, user_label: str, files: Sequence[tuple[str, Chain, str]],
                          uids: frozenset[int], me: Who) -> Check:
    """Can SlurmUser read the admission table and its ``.gate`` (read on each, search above), and
    would swapaware_table.lua use them (owner in table_uids, not group or other writable)?
    ``files``: (path, stat chain, why the chain stops) of the table and the gate."""
    name = "slurmuser_table"
    if user is None:
        return no_slurm_user(name, user_label)
    fails, warns, seen = [], [], []
    fix_fail = fix_warn = ""
    for path, chain, stop in files:
        if stop:
            if "does not exist" not in stop:
                return _unstattable(name, stop, me)
            warns.append(f"{path} is not there yet (the service publishes it within [admission] refresh_s of "
                         "its start): until then every GPU job takes the round trip")
            fix_warn = fix_warn or "start the service and check its log for 'admission table' lines"
            continue
        st = chain[-1][1]
        hit = blocker(user, chain, READ)
        if hit is not None:
            fails.append(f"{refusal(user, chain, READ)}: swapaware_table.lua cannot read it")
            fix_fail = fix_fail or _fix_for(user, *hit, what="table")
            continue
        if st.st_uid not in uids:
            warns.append(f"{describe(path, st)} is owned by uid {st.st_uid}, not one of table_uids="
                         f"{','.join(map(str, sorted(uids)))}: swapaware_table.lua does not use it (jobs take the "
                         "round trip)")
            fix_warn = fix_warn or (f"add table_uids={','.join(map(str, sorted(uids | {st.st_uid})))} "
                                    f"({user_name(st.st_uid)}, the service's user) to swapaware_plugin.conf")
        elif st.st_mode & 0o022:
            warns.append(f"{describe(path, st)} is group or other writable: swapaware_table.lua does not use it")
            fix_warn = fix_warn or f"chmod go-w {path} (the service writes it 0640)"
        else:
            seen.append(describe(path, st))
    if fails:
        return Check(name, False, "; ".join(fails + warns), fix_fail)
    if warns:
        return Check(name, True, "; ".join(warns + [f"readable: {s}" for s in seen]), fix_warn, warn=True)
    return Check(name, True, f"SlurmUser {user.name} can read " + " and ".join(seen))
