"""The writer lease in the history (docs/ha.md, docs/history-backends.md): which of the services
that share one history may write it. One row of ``writer_lease``: holder, epoch, expiry on the
database's own clock (MariaDB's ``NOW(6)``, never a host's clock, so that two hosts whose clocks
differ still agree on when it expired).

* ``claim``: takes the lease when it is free, expired or already the holder's (renewed); the epoch
  grows by one whenever the holder changes. An unexpired lease of another holder is never taken.
* ``release``: expires it now, if it is the holder's.
* ``check_fence``: inside a write transaction, locks the row (``SELECT ... FOR UPDATE``; SQLite's
  BEGIN IMMEDIATE has locked the whole database already) and raises ``NotWriter`` unless this
  holder holds an unexpired lease of the epoch it last claimed: the transaction is then rolled
  back and nothing is written. A lease lost between two of a service's writes stops the second.

Each function runs on the connection of a transaction the caller opened (``HistoryStore._tx``).
``FencedWrites``: what ``HistoryStore`` does with the lease: its write transactions (fenced where
the store has a holder name), and the claim, release and read of the lease. Claims and releases
run on the store's lease connection (``_lconn`` under ``_llock``; MariaDB: a session of its own
with short timeouts, db.py), never behind a data write: a write stuck on a dead connection holds
``_lock`` up to its 120 s timeout, and the renewal or the claim of a service back on the network
must not wait for it (SQLite: the write connection and lock, its one writer).
"""
from __future__ import annotations

from dataclasses import dataclass

from policy_service.history.db import Engine, HistoryUnavailable, MyConn

LEASE_NAME = "history"


@dataclass(frozen=True)
class WriterLease:
    """The lease as the database holds it, and the database's clock when it was read."""

    holder: str
    epoch: int
    expires_at: float
    now: float

    @property
    def valid(self) -> bool:
        return self.expires_at > self.now


class NotWriter(HistoryUnavailable):
    """This service does not hold the writer lease: nothing was written (retry once it does)."""

    def __init__(self, holder_now: str | None, why: str = ""):
        self.holder_now = holder_now
        who = f"the writer is {holder_now}" if holder_now else "no service holds the writer lease"
        super().__init__(f"not the writer: {who}" + (f" ({why})" if why else ""))


def _row(c, engine: Engine, lock: bool) -> tuple[tuple | None, float]:
    """(holder, epoch, expires_at) or None, and the database's clock."""
    row = c.execute(f"SELECT holder, epoch, expires_at, {engine.now_sql} FROM writer_lease WHERE name=?"
                    + (engine.lock_row if lock else ""), (LEASE_NAME,)).fetchone()  # one round trip
    if row is None:
        return None, float(c.execute(f"SELECT {engine.now_sql}").fetchone()[0])
    return (str(row[0]), int(row[1]), float(row[2])), float(row[3])


def read(c, engine: Engine) -> WriterLease | None:
    row, now = _row(c, engine, lock=False)
    return None if row is None else WriterLease(row[0], row[1], row[2], now)


def claim(c, engine: Engine, holder: str, ttl_s: float) -> WriterLease | None:
    if not holder:
        raise ValueError("a writer lease needs a holder name")
    row, now = _row(c, engine, lock=True)
    if row is None:
        c.execute("INSERT INTO writer_lease (name, holder, epoch, expires_at) VALUES (?,?,?,?)",
                  (LEASE_NAME, holder, 1, now + ttl_s))
        return WriterLease(holder, 1, now + ttl_s, now)
    current, epoch, expires_at = row
    if current != holder and expires_at > now:
        return None  # another holder's, unexpired: never taken
    if current != holder:
        epoch += 1
    c.execute("UPDATE writer_lease SET holder=?, epoch=?, expires_at=? WHERE name=?",
              (holder, epoch, now + ttl_s, LEASE_NAME))
    return WriterLease(holder, epoch, now + ttl_s, now)


def release(c, engine: Engine, holder: str) -> None:
    now = float(c.execute(f"SELECT {engine.now_sql}").fetchone()[0])
    c.execute("UPDATE writer_lease SET expires_at=? WHERE name=? AND holder=? AND expires_at > ?",
              (now, LEASE_NAME, holder, now))


def check_fence(c, engine: Engine, holder: str, epoch: int | None) -> None:
    """Raises NotWriter unless ``holder`` holds an unexpired lease of ``epoch`` (locks the row)."""
    row, now = _row(c, engine, lock=True)
    if row is None:
        raise NotWriter(None, "never claimed")
    current, current_epoch, expires_at = row
    if current != holder:
        raise NotWriter(current if expires_at > now else None, f"epoch {current_epoch}")
    if expires_at <= now:
        raise NotWriter(None, f"this service's lease expired {now - expires_at:.1f} s ago")
    if epoch is None or current_epoch != epoch:
        raise NotWriter(current, f"epoch {current_epoch}, this service claimed {epoch}")


class FencedWrites:
    """The writer lease and the write transactions of ``HistoryStore`` (its engine, fence,
    _fence_epoch, _conn, _lock, _lconn, _llock, _rconn, _rlock)."""

    def _tx(self, fenced: bool = True) -> "_Tx":
        """A write transaction; ``fenced``: checked against the writer lease when ``fence`` is set."""
        return _Tx(self, fenced and self.fence is not None)

    def _lease_tx(self) -> "_Tx":
        """A transaction on the lease connection (never fenced: it is what moves the lease)."""
        return _Tx(self, False, lease=True)

    def claim_writer(self, holder: str, ttl_s: float) -> WriterLease | None:
        """Take or renew the writer lease for ``ttl_s`` seconds; None while another holds it."""
        with self._lease_tx() as c:
            got = claim(c, self.engine, holder, ttl_s)
        if got is not None and holder == self.fence:
            self._fence_epoch = got.epoch
        return got

    def release_writer(self, holder: str) -> None:
        """Expire the lease now, if ``holder`` holds it."""
        with self._lease_tx() as c:
            release(c, self.engine, holder)
        if holder == self.fence:
            self._fence_epoch = None

    def writer(self) -> WriterLease | None:
        """The lease as it stands (None: never claimed), with the database's clock."""
        with self._rlock:
            return read(self._rconn, self.engine)


def unfenced_tx(owner) -> "_Tx":
    """A write transaction on ``owner._conn`` (SQLite or ``MyConn``; ``owner.engine``) under
    ``owner._lock``, never checked against the writer lease: what ``HistoryStore._tx(fenced=False)``
    is, for other tables in the same database (the admission archive)."""
    return _Tx(owner, False)


class _Tx:
    """The store's write lock + a write transaction (SQLite: BEGIN IMMEDIATE), COMMIT, or ROLLBACK
    on error; ``fenced``: the writer lease checked first, inside it (NotWriter: rolled back);
    ``lease``: on the lease connection and its lock instead of the write connection's."""

    def __init__(self, store: FencedWrites, fenced: bool, lease: bool = False):
        self.store, self.fenced = store, fenced
        self.conn, self.lock = (store._lconn, store._llock) if lease else (store._conn, store._lock)

    def _end(self, commit: bool) -> None:
        conn = self.conn
        if isinstance(conn, MyConn):
            conn.end(commit)
        else:
            conn.execute("COMMIT" if commit else "ROLLBACK")

    def __enter__(self):
        store, conn = self.store, self.conn
        self.lock.acquire()
        begun = False
        try:
            if isinstance(conn, MyConn):
                conn.begin()
            else:
                conn.execute("BEGIN IMMEDIATE")
            begun = True
            if self.fenced:
                check_fence(conn, store.engine, store.fence, store._fence_epoch)
        except BaseException:
            try:
                if begun:
                    self._end(False)
            finally:
                self.lock.release()
            raise
        return conn

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self._end(exc_type is None)
        finally:
            self.lock.release()
