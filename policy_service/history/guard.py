"""The history's file: the service's own (``private_history_file``), and never silently restarted:
a service that finds no history where files beside it show one existed refuses to start, naming
those files and the flag that accepts an empty start (``swapaware serve --accept-empty-history``);
creating a new history is always logged.

Evidence that a history existed at ``<db>``: its marker ``<db>.created`` (written when the history
is created, or found without one), SQLite's ``<db>-wal`` / ``<db>-shm`` / ``<db>-journal``, the
decision journal ``<db>.journal``, a copy made before a migration (``<db>.schema<N>.bak``), a file
the service found in its place (``<db>.replaced-<time>``) or a restore it did not finish
(``<db>.restoring``). "No history" is no file, an empty file, or a database without swapaware's
tables. The flag is a command-line option only, never a setting: accepting an empty start is a
decision for one start, not a standing one.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("swapaware.service")

MARKER_SUFFIX = ".created"
ACCEPT_FLAG = "--accept-empty-history"
# SQLite's own files beside a database: applied to a new database of the same name, they would put
# pages of the old one into it. Set aside (renamed, never deleted) when an empty start is accepted.
_SQLITE_SIDE = ("-wal", "-shm", "-journal")


class HistoryOwnerError(RuntimeError):
    """The history file belongs to another user: the service refuses to use it."""


def private_history_file(path: Path) -> None:
    """Make ``path`` the service's own: a new history is created 0600 in a 0700 directory (SQLite
    gives its -wal/-shm files the database's mode); an existing one must belong to this user
    (else ``HistoryOwnerError``), and a group- or world-readable one is narrowed to 0600."""
    if not path.parent.exists():
        path.parent.mkdir(parents=True, mode=0o700)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)
        return
    except FileExistsError:
        pass
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        raise HistoryOwnerError(f"{path} belongs to uid {st.st_uid}, not to this service (uid {os.geteuid()}): "
                                "refusing to use a history another user can change; chown it or start the "
                                "service as its owner")
    if st.st_mode & 0o077:
        log.warning("history %s was mode %o: now 0600 (only the service reads the job facts it holds)",
                    path, st.st_mode & 0o777)
        os.chmod(path, 0o600)


class HistoryMissing(RuntimeError):
    """No history where one existed, and an empty start was not accepted."""


def marker(db: Path) -> Path:
    return Path(f"{db}{MARKER_SUFFIX}")


def evidence(db: Path) -> list[Path]:
    """The files beside ``db`` that show a history existed there."""
    named = [marker(db), Path(f"{db}.journal"), Path(f"{db}.restoring")] + [Path(f"{db}{s}") for s in _SQLITE_SIDE]
    found = [p for p in named if p.exists()]
    found += sorted(db.parent.glob(f"{db.name}.schema*.bak")) + sorted(db.parent.glob(f"{db.name}.replaced-*"))
    return found


def before_new_history(db: Path, accept_empty: bool, what: str) -> None:
    """Called when no history is at ``db`` (``what`` says how: "is missing", "is empty", ...),
    before one is created there: raises ``HistoryMissing`` when files show one existed, unless
    ``accept_empty``; then SQLite's files of the old history are set aside and the start logged."""
    found = evidence(db)
    if not found:
        return
    names = ", ".join(str(p) for p in found)
    if not accept_empty:
        raise HistoryMissing(
            f"history {db} {what}, but {names} show that a history existed there: refusing to start on an "
            f"empty history (its decisions and everything learned would be gone without a word). Restore "
            f"{db} (from a backup, or where it was moved), or start once with `swapaware serve {ACCEPT_FLAG}` "
            "to begin a new, empty history")
    stamp = int(time.time())
    for suffix in _SQLITE_SIDE:
        side = Path(f"{db}{suffix}")
        if side.exists():
            aside = Path(f"{side}.orphaned-{stamp}")
            os.replace(side, aside)
            log.warning("history %s: %s belongs to the history that is gone: kept as %s, never applied", db, side, aside)
    log.warning("history %s %s although %s show that one existed: an empty start accepted (%s)", db, what, names,
                ACCEPT_FLAG)


def note_history(db: Path, created: bool) -> None:
    """Log a new history, and leave the marker beside every history (one found without it too)."""
    m = marker(db)
    if created:
        log.warning("history %s: a new, empty history created (marker %s)", db, m)
    if m.exists():
        return
    fd = os.open(m, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"history": str(db), "marked_at": time.time(), "new": created}, f)
        f.write("\n")
    if not created:
        log.info("history %s: marker %s written (a history that is missing later stops the service)", db, m)
