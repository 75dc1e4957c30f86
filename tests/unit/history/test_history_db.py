"""The SQL spelling MariaDB gets for the store's statements (the real server runs them in
tests/adapter/history/test_history_backends.py; this pins the rewrite where no server is installed)."""
from __future__ import annotations

import pytest

from policy_service.history.db import HistoryUnavailable, mariadb_sql, retryable
from policy_service.config import ConfigError, load_config
from policy_service.history.config import HistoryBackend


@pytest.mark.parametrize("sqlite,mariadb", [
    ("INSERT OR REPLACE INTO t VALUES (?,?)", "REPLACE INTO t VALUES (%s,%s)"),
    ("INSERT OR IGNORE INTO events VALUES (?,?,?)", "INSERT IGNORE INTO events VALUES (%s,%s,%s)"),
    ("SELECT level, key, stats_json FROM class_stats WHERE (level=? AND key=?)",
     "SELECT level, `key`, stats_json FROM class_stats WHERE (level=%s AND `key`=%s)"),
    ("INSERT INTO runs (a, submit_time) VALUES (?,?) ON CONFLICT(instance, node) DO UPDATE SET "
     "a=excluded.a, submit_time=MAX(runs.submit_time, excluded.submit_time)",
     "INSERT INTO runs (a, submit_time) VALUES (%s,%s) ON DUPLICATE KEY UPDATE "
     "a=VALUES(a), submit_time=GREATEST(runs.submit_time, VALUES(submit_time))"),
    ("SELECT x FROM runs WHERE instance NOT LIKE ? AND keys_json != '' AND name='50%'",
     "SELECT x FROM runs WHERE instance NOT LIKE %s AND keys_json != '' AND name='50%%'"),
    ("INSERT INTO decisions (user, partition) VALUES (?,?)", "INSERT INTO decisions (user, `partition`) VALUES (%s,%s)"),
])
def test_statements_are_spelled_for_mariadb(sqlite, mariadb):
    assert mariadb_sql(sqlite) == mariadb


def test_what_is_worth_retrying():
    assert retryable(HistoryUnavailable("gone"))
    assert not retryable(ValueError("bad"))
    assert not retryable(RuntimeError(1045, "Access denied"))  # a wrong password is not retried silently


def test_history_section(tmp_path):
    cfg = load_config(env={"SWAPAWARE_HISTORY__BACKEND": "mariadb", "SWAPAWARE_HISTORY__HOST": "db"})
    assert cfg.history.backend is HistoryBackend.MARIADB and str(cfg.history) == "mariadb swapaware@db:3306/swapaware"
    assert load_config(env={}).history.backend is HistoryBackend.SQLITE
    with pytest.raises(ConfigError, match="history.database"):
        load_config(env={"SWAPAWARE_HISTORY__BACKEND": "mariadb", "SWAPAWARE_HISTORY__DATABASE": "a`b"})
    with pytest.raises(ConfigError, match="not one of"):
        load_config(env={"SWAPAWARE_HISTORY__BACKEND": "postgres"})
