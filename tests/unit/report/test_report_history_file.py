"""``swapaware report``, the history file: read without changing it (while the service holds it open
and after), and a missing or foreign file leaves an accounting-only report.

The small world comes from test_report.py."""
from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from policy_service import report as R
from policy_service.history.store import HistoryStore
from tests.unit.report.test_report import T0, scenario, world  # noqa: F401  (the fixture)


# ----------------------------------------------------------------------------- the history file
def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(db: Path) -> dict[str, str]:
    return {p.name: _digest(p) for p in sorted(db.parent.iterdir()) if p.name.startswith(db.name)}


def test_history_is_read_read_only(world):
    scenario(world)
    world.flush()
    # while the service holds it open (WAL): database and log unchanged by the reader
    before = _files(world.db)
    snap = R.read_history(world.db, [101, 102, 999], ["nope"])
    assert set(snap.run_decisions) == {101, 102} and set(snap.observations) == {101, 102}
    assert set(snap.decisions) == {world.decisions[101].decision_id, world.decisions[102].decision_id}
    after = _files(world.db)
    assert after[world.db.name] == before[world.db.name]
    assert after[world.db.name + "-wal"] == before[world.db.name + "-wal"]
    # service stopped (log checkpointed away): SQLite may recreate an empty -wal/-shm, nothing else
    world.store.close()
    before = _files(world.db)
    R.read_history(world.db, [101])
    after = _files(world.db)
    assert after[world.db.name] == before[world.db.name]
    empty = hashlib.sha256(b"").hexdigest()
    assert all(v == empty for k, v in after.items() if k.endswith("-wal") and k not in before)
    world.store = HistoryStore(world.db)  # the fixture closes it


def test_missing_or_foreign_history_leaves_an_accounting_only_report(world, tmp_path):
    scenario(world)
    rep = R.load_report(world.slurm.accounting_jobs(), tmp_path / "nowhere.sqlite3", by="user", shards_per_gpu=8,
                        now=float(T0 + 90000))
    assert "no history database" in rep.history_error and rep.total.jobs == 7
    assert rep.total.predicted_jobs == 0 and rep.total.observed_jobs == 0
    # 108's removed comment cannot be told from a job that never had one without the history
    assert rep.total.no_record == 2 and rep.total.shared_jobs == 2
    foreign = tmp_path / "foreign.sqlite3"
    with sqlite3.connect(foreign) as c:
        c.execute("CREATE TABLE t (x)")
    with pytest.raises(R.HistoryUnavailable, match="not a swapaware history"):
        R.read_history(foreign, [1])
    with sqlite3.connect(foreign) as c:
        assert [r[0] for r in c.execute("SELECT name FROM sqlite_master")] == ["t"]  # nothing created
