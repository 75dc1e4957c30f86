"""A private MariaDB server for the history tests (the flags of contrib/dev-cluster/cluster.sh's
start_mariadb): a datadir made by mariadb-install-db in a temporary directory, no TCP
(--skip-networking), a Unix socket beside it, run as root with --user=root, stopped by its pid.

``MariaDbServer.start()`` waits until the server answers; ``database(name)`` creates a database
and a user of that name with a password (written to a 0600 file, as ``history.password_file``
wants it) and returns the HistoryConfig that reaches it. Used by the session fixture
``mariadb`` (tests/adapter/conftest.py) and by the benches.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from policy_service.history.config import HistoryConfig



def missing() -> str:
    """Why no server can be started here ("": it can)."""
    for tool in ("mariadbd", "mariadb-install-db", "mariadb"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"{tool} is not installed (apt-get install mariadb-server mariadb-client)"
    if os.geteuid() != 0:
        return "a private mariadbd is started as root (--user=root) and these tests do not run as root"
    return ""


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@dataclass
class MariaDbServer:
    root: Path
    proc: subprocess.Popen | None = None
    buffer_pool: str = "64M"

    @property
    def socket(self) -> Path:
        return self.root / "mysqld.sock"

    @property
    def log(self) -> Path:
        return self.root / "mariadb.log"

    @classmethod
    def start(cls, timeout_s: float = 120.0, buffer_pool: str = "64M") -> "MariaDbServer":
        root = Path(tempfile.mkdtemp(prefix="swapaware-mariadb-"))
        os.chmod(root, 0o711)
        data = root / "data"
        with open(root / "install.log", "wb") as out:
            subprocess.run([_tool("mariadb-install-db"), "--no-defaults", f"--datadir={data}", "--user=root",
                            "--auth-root-authentication-method=socket", "--skip-test-db", "--skip-name-resolve",
                            "--innodb-log-file-size=16M"], stdin=subprocess.DEVNULL, stdout=out,
                           stderr=subprocess.STDOUT, check=True, timeout=timeout_s)
        server = cls(root, buffer_pool=buffer_pool)
        server.launch(timeout_s)
        return server

    def launch(self, timeout_s: float = 120.0) -> None:
        """Start mariadbd on this datadir and wait until it answers (again, after ``shutdown``)."""
        self.proc = subprocess.Popen(
            [_tool("mariadbd"), "--no-defaults", "--user=root", f"--datadir={self.root / 'data'}",
             f"--socket={self.socket}", f"--pid-file={self.root / 'mysqld.pid'}", "--skip-networking",
             "--skip-name-resolve", f"--log-error={self.log}", "--skip-log-bin",
             f"--innodb-buffer-pool-size={self.buffer_pool}", "--innodb-log-file-size=16M",
             "--innodb-flush-log-at-trx-commit=2", "--innodb-lock-wait-timeout=5"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mariadbd exited ({self.proc.returncode}); see {self.log}")
            if self.socket.exists() and self.sql("SELECT 1", check=False).returncode == 0:
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mariadbd did not answer within {timeout_s:.0f} s; see {self.log}")
            time.sleep(0.1)  # polling the server's socket until it answers

    def shutdown(self) -> None:
        """Stop mariadbd (by its pid), keeping its datadir (``launch`` starts it again)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def sql(self, text: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run SQL as the server's root (socket authentication)."""
        return subprocess.run([_tool("mariadb"), "--no-defaults", f"--socket={self.socket}", "-uroot", "-N", "-e",
                               text], capture_output=True, text=True, check=check, timeout=60)

    def database(self, name: str) -> HistoryConfig:
        """A new, empty database ``name`` and a user of the same name that may use it (with the
        grants docs/history-backends.md names), and its config."""
        password = secrets.token_hex(16)
        self.sql(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4; "
                 f"CREATE USER '{name}'@'localhost' IDENTIFIED BY '{password}'; "
                 f"GRANT SELECT, INSERT, UPDATE, DELETE, CREATE, ALTER, INDEX ON `{name}`.* TO '{name}'@'localhost';")
        pw_file = self.root / f"{name}.password"
        fd = os.open(pw_file, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        return HistoryConfig(backend="mariadb", unix_socket=str(self.socket), database=name, user=name,
                             password_file=str(pw_file))

    def drop(self, name: str) -> None:
        self.sql(f"DROP DATABASE IF EXISTS `{name}`; DROP USER IF EXISTS '{name}'@'localhost'")

    def stop(self) -> None:
        self.shutdown()
        shutil.rmtree(self.root, ignore_errors=True)


# --------------------------------------------------------------------------- pytest fixtures
# (imported by tests/adapter/conftest.py)
import itertools  # noqa: E402

import pytest  # noqa: E402

_names = itertools.count(1)


@pytest.fixture(scope="session")
def mariadb_server():
    """One private mariadbd for the session, stopped by its pid at the end."""
    why = missing()
    if why:
        pytest.skip(f"the MariaDB history backend is not tested here: {why}")
    server = MariaDbServer.start()
    yield server
    server.stop()


@dataclass
class Backend:
    """A history under test: ``env`` (the SWAPAWARE_HISTORY__* variables that select it, for a
    service process or load_config), ``open(db_path, ...)`` a HistoryStore on it."""

    name: str
    history: HistoryConfig

    @property
    def env(self) -> dict[str, str]:
        if self.name == "sqlite":
            return {}
        h = self.history
        return {"SWAPAWARE_HISTORY__BACKEND": "mariadb", "SWAPAWARE_HISTORY__UNIX_SOCKET": h.unix_socket,
                "SWAPAWARE_HISTORY__DATABASE": h.database, "SWAPAWARE_HISTORY__USER": h.user,
                "SWAPAWARE_HISTORY__PASSWORD_FILE": h.password_file}

    def open(self, db_path, accept_empty: bool = False, fence: str | None = None):
        from policy_service.history.store import HistoryStore  # noqa: PLC0415
        return HistoryStore(db_path, accept_empty, fence=fence,
                            mariadb=self.history if self.name == "mariadb" else None)


@pytest.fixture(params=["sqlite", "mariadb"])
def history_backend(request) -> Backend:
    """Each history test once on SQLite and once on a new database of the session's MariaDB."""
    if request.param == "sqlite":
        yield Backend("sqlite", HistoryConfig())
        return
    server = request.getfixturevalue("mariadb_server")
    name = f"swapaware_t{next(_names)}"
    yield Backend("mariadb", server.database(name))
    server.drop(name)


@pytest.fixture
def mariadb_backend(mariadb_server) -> Backend:
    """A new database of the session's MariaDB (tests of MariaDB alone)."""
    name = f"swapaware_m{next(_names)}"
    yield Backend("mariadb", mariadb_server.database(name))
    mariadb_server.drop(name)
