"""`swapaware history migrate`: a real SQLite history, written by the store, copied into a real
MariaDB; what the service and the reports read afterwards is the same."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from policy_service.history.store import HistoryStore, ObservationRow, ReadOnlyHistory
from policy_service.history.migrate import TABLES
from policy_service.cli import main
from policy_service.core.types import ClassStats, KeyLevel
from tests.mariadb_server import Backend, _names


@pytest.fixture
def target(mariadb_server):
    name = f"swapaware_g{next(_names)}"
    yield Backend("mariadb", mariadb_server.database(name))
    mariadb_server.drop(name)


def fill(store: HistoryStore, n: int) -> None:
    for i in range(n):
        store.record_decision(decision_id=f"d{i}", decided_at=1000.0 + i, job_class=f"c{i % 3}", user="alice",
                              account="proj", partition="gpu", job_name="train", action="share", shards=2,
                              model_version="m", keys={KeyLevel.CLASS: f"c{i % 3}"}, facts_pb=bytes([i % 256, 0]),
                              decision_pb=b"\x01%\x00")
        store.record_start(event_id=f"s{i}", job_id=i, decision_id=f"d{i}", node="n1", gpus=[0],
                           started_at=2000.0 + i, received_at=2000.0 + i, instance=f"c/{i}/1", submit_time=1)
        obs = ObservationRow(f"f{i}", i, f"d{i}", "n1", (0,), 2000.0 + i, 2100.0 + i, 100.0, 0, 1 << 30, False, 0,
                             True, "fake-nvml", 2100.0 + i, f"c/{i}/1", 1)
        store.record_finish(obs, {KeyLevel.CLASS: f"c{i % 3}"}, lambda level, s: ClassStats(samples=s.samples + 1))
    store.settle_decisions(["d0", "d1"], [], 3000.0)


def test_migrate_copies_every_table_verifies_counts_and_refuses_a_second_copy(tmp_path, target, monkeypatch):
    src = tmp_path / "history.sqlite3"
    store = HistoryStore(src)
    fill(store, 40)
    store.close()
    for key, value in target.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SWAPAWARE_SERVICE__DB_PATH", str(src))  # the single-host service's own history
    run = CliRunner().invoke(main, ["history", "migrate", "--from", str(src), "--batch", "7"])
    assert run.exit_code == 0, run.output
    assert "rows/s; counts verified" in run.output and "decisions" in run.output
    sqlite, maria = HistoryStore(src), target.open(src)
    try:
        for table in TABLES:
            assert sqlite._read(f"SELECT COUNT(*) FROM {table}") == maria._read(f"SELECT COUNT(*) FROM {table}")
        assert list(sqlite.decisions()) == list(maria.decisions())
        keys = {KeyLevel.CLASS: "c1"}
        assert maria.stats(keys) == sqlite.stats(keys) and maria.stats(keys)[KeyLevel.CLASS].samples == 13
        assert maria.observations(job_id=5) == sqlite.observations(job_id=5)
        assert maria.run_of("c/5/1", "n1") == sqlite.run_of("c/5/1", "n1")
        assert maria.decision_status("d1") == "held"
    finally:
        sqlite.close()
        maria.close()
    again = CliRunner().invoke(main, ["history", "migrate", "--from", str(src)])
    assert again.exit_code != 0 and "already holds rows" in again.output and "--resume" in again.output
    resumed = CliRunner().invoke(main, ["history", "migrate", "--from", str(src), "--resume"])
    assert resumed.exit_code == 0 and "counts verified" in resumed.output


def test_reports_read_a_mariadb_history(tmp_path, target):
    store = target.open(tmp_path / "history.sqlite3")
    fill(store, 5)
    store.close()
    with ReadOnlyHistory(target.history) as h:
        assert h.run_decisions([1, 2, 99]) == {1: "d1", 2: "d2"}
        assert sorted(h.decisions_by_id(["d3", "nope"])) == ["d3"]
        assert [o.event_id for o in h.observations_of([4])] == ["f4"]


def test_migrate_refuses_a_sqlite_target_config(tmp_path, monkeypatch):
    src = tmp_path / "history.sqlite3"
    HistoryStore(src).close()
    monkeypatch.delenv("SWAPAWARE_HISTORY__BACKEND", raising=False)
    run = CliRunner().invoke(main, ["history", "migrate", "--from", str(src)])
    assert run.exit_code != 0 and 'backend = "mariadb"' in run.output
