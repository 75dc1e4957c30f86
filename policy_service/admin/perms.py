"""Whether a user can open a path, from stat results alone (``swapaware doctor``): a Unix socket
needs write permission on the socket and search (x) on every directory above it; a file to read
needs read on it and search above it. Pure over (uid, groups) and the stat results; the lookups
(``who``, ``stat_chain``) are the only I/O. POSIX ACLs and capabilities other than root's are not
looked at."""
from __future__ import annotations

import grp
import os
import pwd
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

READ, WRITE, SEARCH = 4, 2, 1
_WHAT = {READ: "read", WRITE: "write", SEARCH: "search (x)"}


class StatLike(Protocol):
    st_mode: int
    st_uid: int
    st_gid: int


@dataclass(frozen=True)
class Who:
    """A user as the kernel checks it: uid and every group (primary and supplementary)."""

    name: str
    uid: int
    gids: frozenset[int]


ANYONE = Who("any user", -1, frozenset())  # a user of no group that owns nothing: the "other" bits


def allowed(who: Who, need: int, st: StatLike) -> bool:
    """The kernel's rule for ``need`` (READ | WRITE | SEARCH bits) on one inode: root may do
    anything (CAP_DAC_OVERRIDE); else the owner's bits if ``who`` owns it, else the group's if
    it is in the file's group, else the others' (the first class that matches decides)."""
    if who.uid == 0:
        return True
    mode = st.st_mode
    if who.uid == st.st_uid:
        bits = (mode >> 6) & 7
    elif st.st_gid in who.gids:
        bits = (mode >> 3) & 7
    else:
        bits = mode & 7
    return bits & need == need


def blocker(who: Who, chain: Sequence[tuple[str, StatLike]], need: int) -> tuple[str, StatLike, int] | None:
    """The first component of ``chain`` (every directory from ``/`` down, then the target) that
    stops ``who``: (path, its stat, the permission it lacks); None when ``who`` gets through."""
    for i, (path, st) in enumerate(chain):
        want = need if i == len(chain) - 1 else SEARCH
        if not allowed(who, want, st):
            return path, st, want
    return None


def describe(path: str, st: StatLike) -> str:
    """``/run/swapaware/policy.sock (mode 0660, owner root:root)``."""
    return f"{path} (mode {st.st_mode & 0o7777:04o}, owner {user_name(st.st_uid)}:{group_name(st.st_gid)})"


def refusal(who: Who, chain: Sequence[tuple[str, StatLike]], need: int) -> str:
    """Why ``who`` cannot open the chain's target ("" when it can)."""
    hit = blocker(who, chain, need)
    if hit is None:
        return ""
    path, st, want = hit
    return f"{who.name} has no {_WHAT[want]} permission on {describe(path, st)}"


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except (KeyError, OverflowError):
        return str(gid)


def who(name_or_uid: str) -> Who | None:
    """The user named (or numbered) so, with every group it is in (None: no passwd entry)."""
    try:
        pw = pwd.getpwuid(int(name_or_uid)) if name_or_uid.isdigit() else pwd.getpwnam(name_or_uid)
    except (KeyError, OverflowError):
        return None
    try:
        gids = os.getgrouplist(pw.pw_name, pw.pw_gid)
    except OSError:
        gids = [pw.pw_gid]
    return Who(pw.pw_name, pw.pw_uid, frozenset(gids))


def me() -> Who:
    """The user running doctor (its effective uid and groups)."""
    uid = os.geteuid()
    return Who(user_name(uid), uid, frozenset({os.getegid(), *os.getgroups()}))


def stat_chain(path: Path) -> tuple[list[tuple[str, os.stat_result]], str]:
    """Every directory from ``/`` down to ``path``, then ``path`` itself (symbolic links followed,
    as open and connect follow them), with their stat results; and "" or why the chain stops
    early (the first component that does not exist or cannot be stat'ed)."""
    path = Path(os.path.abspath(path))
    chain: list[tuple[str, os.stat_result]] = []
    for p in [*reversed(path.parents), path]:
        try:
            chain.append((str(p), os.stat(p)))
        except FileNotFoundError:
            return chain, f"{p} does not exist"
        except OSError as exc:
            return chain, f"{p}: {exc.strerror or exc}"
    return chain, ""
