"""doctor: can SlurmUser open the service's socket and read the admission table? The rule
(policy_service/admin/perms.py) on made-up stat results, then the checks (access_checks.py) on
real files and a real Unix socket, judged for a made-up SlurmUser (uid 64030)."""
from __future__ import annotations

import os
import socket
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from policy_service.admin.access_checks import slurmuser_socket_check, slurmuser_table_check
from policy_service.admin.perms import READ, SEARCH, WRITE, Who, allowed, blocker, me, refusal, stat_chain, who

from tests.unit.doctor_layout import open_dir  # noqa: F401  (fixture)

SLURM = Who("slurm", 64030, frozenset({64030}))
ROOT = Who("root", 0, frozenset({0}))
DIR, SOCK, FILE = stat.S_IFDIR, stat.S_IFSOCK, stat.S_IFREG


def st(kind: int, mode: int, uid: int = 0, gid: int = 0):
    return SimpleNamespace(st_mode=kind | mode, st_uid=uid, st_gid=gid)


# ------------------------------------------------------------------------------------ the rule
@pytest.mark.parametrize("who_, need, node, ok", [
    (SLURM, WRITE, st(SOCK, 0o660), False),  # root:root 0660: neither owner nor group
    (SLURM, WRITE, st(SOCK, 0o660, gid=64030), True),  # its group
    (SLURM, WRITE, st(SOCK, 0o660, uid=64030), True),  # its own
    (SLURM, WRITE, st(SOCK, 0o666), True),  # anyone
    (SLURM, WRITE, st(SOCK, 0o600), False),
    (SLURM, WRITE, st(SOCK, 0o066, uid=64030, gid=64030), False),  # the owner's bits decide for the owner
    (SLURM, WRITE, st(SOCK, 0o606, gid=64030), False),  # ... and the group's for a member
    (SLURM, READ, st(FILE, 0o640, gid=64030), True),
    (SLURM, READ, st(FILE, 0o600, gid=64030), False),
    (SLURM, SEARCH, st(DIR, 0o750, gid=1), False),
    (SLURM, SEARCH, st(DIR, 0o711), True),
    (ROOT, WRITE, st(SOCK, 0o000, uid=64030), True),  # root passes DAC checks
])
def test_allowed(who_, need, node, ok):
    assert allowed(who_, need, node) is ok


def test_blocker_names_the_first_component_that_stops_the_user():
    chain = [("/", st(DIR, 0o755)), ("/run", st(DIR, 0o755)), ("/run/swapaware", st(DIR, 0o700)),
             ("/run/swapaware/policy.sock", st(SOCK, 0o666))]
    path, _, want = blocker(SLURM, chain, WRITE)
    assert (path, want) == ("/run/swapaware", SEARCH)
    assert "slurm has no search (x) permission on /run/swapaware (mode 0700, owner root:root)" in \
        refusal(SLURM, chain, WRITE)
    chain[2] = ("/run/swapaware", st(DIR, 0o755))
    assert blocker(SLURM, chain, WRITE) is None and refusal(SLURM, chain, WRITE) == ""


def test_who_and_me():
    root = who("root")
    assert root is not None and root.uid == 0 and 0 in root.gids
    assert who("0") == root
    assert who("no-such-user-swapaware") is None
    assert me().uid == os.geteuid()


def test_stat_chain_says_where_it_stops(tmp_path):
    chain, stop = stat_chain(tmp_path / "no" / "sock")
    assert stop == f"{tmp_path / 'no'} does not exist" and chain[-1][0] == str(tmp_path) and chain[0][0] == "/"
    (tmp_path / "f").write_text("x")
    chain, stop = stat_chain(tmp_path / "f")
    assert stop == "" and chain[-1][0] == str(tmp_path / "f") and stat.S_ISREG(chain[-1][1].st_mode)


# -------------------------------------------------------------------------- the service's socket
def _listening(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(1)
    return s


def test_slurm_user_cannot_connect_to_a_socket_of_another_user_and_group_then_can(open_dir):
    run = open_dir / "swapaware"
    run.mkdir(mode=0o755)
    sock = run / "policy.sock"
    server = _listening(sock)
    try:
        os.chmod(sock, 0o660)  # as the service makes it: its own user and group
        mine = os.stat(sock)
        c = slurmuser_socket_check(SLURM, "slurm", str(sock), *stat_chain(sock), me())
        assert not c.ok
        assert f"slurm has no write permission on {sock} (mode 0660, owner " in c.detail
        assert "every GPU job passes unchanged" in c.detail
        assert "usermod -aG" in c.fix and "restart slurmctld" in c.fix and "User= and Group=" in c.fix
        # SlurmUser in the socket's group (the service running as SlurmUser, or with its group)
        in_group = Who("slurm", 64030, frozenset({64030, mine.st_gid}))
        c = slurmuser_socket_check(in_group, "slurm", str(sock), *stat_chain(sock), me())
        assert c.ok and not c.fix and f"SlurmUser slurm (uid 64030) can connect to {sock}" in c.detail
        # a directory on the way closed to others: the fix opens the directory
        os.chmod(run, 0o700)
        c = slurmuser_socket_check(in_group, "slurm", str(sock), *stat_chain(sock), me())
        assert not c.ok and f"search (x) permission on {run}" in c.detail and f"chmod o+x {run}" in c.fix
    finally:
        server.close()


def test_socket_missing_or_slurm_user_unknown_fails(open_dir):
    sock = open_dir / "nothing" / "policy.sock"
    c = slurmuser_socket_check(SLURM, "slurm", str(sock), *stat_chain(sock), me())
    assert not c.ok and f"no socket at {sock}" in c.detail and "start the service" in c.fix
    c = slurmuser_socket_check(None, "slurmx", str(sock), *stat_chain(sock), me())
    assert not c.ok and "SlurmUser=slurmx (slurm.conf) has no passwd entry" in c.detail


# ------------------------------------------------------------------------- the admission table
def _table(open_dir: Path, mode: int = 0o640) -> list[tuple[str, list, str]]:
    d = open_dir / "admission"
    d.mkdir(mode=0o755, exist_ok=True)
    out = []
    for name in ("table", "table.gate"):
        (d / name).write_text("{}")
        os.chmod(d / name, mode)
        out.append((str(d / name), *stat_chain(d / name)))
    return out


def test_slurm_user_cannot_read_the_table_then_can(open_dir):
    files = _table(open_dir)
    owner = os.stat(files[0][0])
    uids = frozenset({owner.st_uid})
    c = slurmuser_table_check(SLURM, "slurm", files, uids, me())
    assert not c.ok and "slurm has no read permission on" in c.detail and "table (mode 0640" in c.detail
    assert "swapaware_table.lua cannot read it" in c.detail and "usermod -aG" in c.fix
    reader = Who("slurm", 64030, frozenset({64030, owner.st_gid}))  # SlurmUser's group: what the service sets
    c = slurmuser_table_check(reader, "slurm", files, uids, me())
    assert c.ok and not c.warn and "table.gate" in c.detail, c


def test_a_table_the_lua_would_not_use_warns(open_dir):
    files = _table(open_dir)
    owner = os.stat(files[0][0])
    reader = Who("slurm", 64030, frozenset({64030, owner.st_gid}))
    c = slurmuser_table_check(reader, "slurm", files, frozenset({owner.st_uid + 1}), me())
    assert c.ok and c.warn and "not one of table_uids" in c.detail and "table_uids=" in c.fix
    c = slurmuser_table_check(reader, "slurm", _table(open_dir, 0o664), frozenset({owner.st_uid}), me())
    assert c.ok and c.warn and "group or other writable" in c.detail and "chmod go-w" in c.fix


def test_a_table_not_published_yet_warns(open_dir):
    path = open_dir / "admission" / "table"
    files = [(str(p), *stat_chain(p)) for p in (path, Path(str(path) + ".gate"))]
    c = slurmuser_table_check(SLURM, "slurm", files, frozenset({0}), me())
    assert c.ok and c.warn and "is not there yet" in c.detail
