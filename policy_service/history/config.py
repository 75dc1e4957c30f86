"""The ``[history]`` section of the one Config (policy_service/config.py): where the history lives
(docs/history-backends.md). The default, SQLite at ``service.db_path``, changes nothing."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class HistoryBackend(enum.Enum):
    SQLITE = "sqlite"  # service.db_path on local disk: one service writes it
    MARIADB = "mariadb"  # a MariaDB/MySQL database that the services of every controller host reach


@dataclass(frozen=True)
class HistoryConfig:
    backend: HistoryBackend = HistoryBackend.SQLITE
    # The server: a Unix socket (wins when set), else host:port.
    host: str = ""
    port: int = 3306
    unix_socket: str = ""
    database: str = "swapaware"
    user: str = "swapaware"
    # File holding the user's password (readable by its owner only, checked like service.token_file);
    # "": no password (socket authentication).
    password_file: str = ""
    connect_timeout_s: float = 5.0
    # A writing session idle this long inside a transaction is ended by the server (MariaDB's
    # idle_transaction_timeout; its transaction rolled back, its row locks freed). A service cut
    # off the network between a fenced write's lock of the writer lease and its commit otherwise
    # holds that lock until the server notices the dead peer (hours): the other controller's
    # service could not claim the lease, however long expired. The service's own transactions
    # never wait on their client between statements longer than a moment.
    idle_transaction_timeout_s: int = 10

    def __post_init__(self) -> None:
        if isinstance(self.backend, str):  # HistoryConfig(backend="mariadb") in tests and benches
            object.__setattr__(self, "backend", HistoryBackend(self.backend))

    def __str__(self) -> str:
        return self.where()

    def where(self) -> str:
        """The database, for logs and messages (never the password)."""
        at = self.unix_socket or f"{self.host or '127.0.0.1'}:{self.port}"
        return f"mariadb {self.user}@{at}/{self.database}"


def history_errors(h: HistoryConfig) -> list[str]:
    errors = []
    if h.connect_timeout_s <= 0:
        errors.append("history.connect_timeout_s must be > 0")
    if not 1 <= h.idle_transaction_timeout_s <= 3600:
        errors.append("history.idle_transaction_timeout_s must be in 1..3600")
    if not 0 < h.port < 65536:
        errors.append("history.port must be in 1..65535")
    if h.backend is HistoryBackend.MARIADB:
        if not h.database or "`" in h.database:
            errors.append(f"history.database: {h.database!r} is not a database name")
        if not h.user:
            errors.append("history.user must be set for the mariadb backend")
    return errors


def history_source(cfg) -> "HistoryConfig | object":
    """What readers of the history open (ReadOnlyHistory): the MariaDB database, or the SQLite
    file at service.db_path."""
    return cfg.history if cfg.history.backend is HistoryBackend.MARIADB else cfg.service.db_path
