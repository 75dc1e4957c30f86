"""The history never silently restarts: a real service on a real SQLite file, stopped (or killed)
with its history removed or moved away, refuses to start and names the files that show a history
existed and the flag that accepts an empty start; with the flag, and on a fresh install, it
starts and logs the new history."""
from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from policy_service.history.guard import ACCEPT_FLAG, HistoryMissing, marker
from policy_service.cli import main
from policy_service.config import load_config
from policy_service.serving.server import start_service

from tests.adapter.conftest import socket_call
from tests.adapter.history.test_durability import ROOT, admit, kill_9, service_process


def decisions_in(db: Path) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return conn.execute("SELECT count(*) FROM decisions").fetchone()[0]


def created_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "a new, empty history created" in r.getMessage()]


def run_once(cfg, n: int = 3) -> None:
    svc = start_service(cfg, use_slurm=False)
    try:
        for i in range(n):
            admit(cfg.service.socket_path, f"job-{i}")
        svc.handler.flush()
    finally:
        svc.stop(0)


def test_a_fresh_install_starts_and_logs_its_new_history(service_env, caplog):
    cfg = load_config(env=service_env)
    db = Path(cfg.service.db_path)
    with caplog.at_level(logging.INFO, logger="swapaware.service"):
        run_once(cfg)
    assert len(created_lines(caplog)) == 1 and str(db) in created_lines(caplog)[0]
    assert marker(db).exists() and oct(marker(db).stat().st_mode & 0o777) == "0o600"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="swapaware.service"):
        run_once(cfg)  # the same history again: nothing new created
    assert created_lines(caplog) == [] and decisions_in(db) == 6


@pytest.mark.parametrize("how", ["moved away", "removed", "emptied"])
def test_a_history_gone_while_stopped_refuses_the_start(service_env, tmp_path, how):
    cfg = load_config(env=service_env)
    db = Path(cfg.service.db_path)
    run_once(cfg)
    if how == "moved away":
        os.replace(db, tmp_path / "elsewhere.sqlite3")
    elif how == "removed":
        db.unlink()
    else:
        db.write_bytes(b"")
    with pytest.raises(HistoryMissing) as err:
        start_service(cfg, use_slurm=False)
    text = str(err.value)
    assert str(marker(db)) in text and f"{db}.journal" in text and ACCEPT_FLAG in text
    assert not Path(cfg.service.socket_path).exists()  # nothing started
    assert not db.exists() or db.stat().st_size == 0  # and nothing created in its place


def test_a_history_replaced_by_a_foreign_database_while_stopped_refuses_the_start(service_env):
    cfg = load_config(env=service_env)
    db = Path(cfg.service.db_path)
    run_once(cfg)
    db.unlink()
    sqlite3.connect(str(db)).execute("CREATE TABLE x (y)").connection.close()
    with pytest.raises(HistoryMissing, match="holds no swapaware tables"):
        start_service(cfg, use_slurm=False)


def test_the_flag_accepts_an_empty_start_and_says_so(service_env, caplog):
    cfg = load_config(env=service_env)
    db = Path(cfg.service.db_path)
    run_once(cfg)
    db.unlink()
    with caplog.at_level(logging.INFO, logger="swapaware.service"):
        svc = start_service(cfg, use_slurm=False, accept_empty_history=True)
    try:
        reply = socket_call(cfg.service.socket_path, {"method": "Admit", "request": {"job": {
            "user": "alice", "uid": 1000, "jobName": "after", "tresPerNode": "gres:gpu:1"}}})
        assert reply["response"]["decision"]["decisionId"]
        svc.handler.flush()
    finally:
        svc.stop(0)
    messages = [r.getMessage() for r in caplog.records]
    assert any("an empty start accepted" in m and str(marker(db)) in m for m in messages), messages
    assert created_lines(caplog) and decisions_in(db) == 1
    run_once(cfg, n=1)  # from now on it is the history: the next start takes it without the flag


def test_a_history_deleted_then_the_service_killed_refuses_the_start(service_env, short_dir):
    """Deleted under a running service, which is killed before it notices (history_check_s): the
    WAL it leaves is named, and with the flag set aside, never applied to the new history (which
    takes only what the decision journal held)."""
    env = {**service_env, "SWAPAWARE_SERVICE__SOCKET_PATH": str(short_dir / "p.sock"),
           "SWAPAWARE_SERVICE__HISTORY_CHECK_S": "3600"}
    cfg = load_config(env=env)
    db = Path(cfg.service.db_path)
    with service_process(env) as p:
        for i in range(5):
            admit(cfg.service.socket_path, f"job-{i}")
        db.unlink()
        kill_9(p)
    with pytest.raises(HistoryMissing) as err:
        start_service(cfg, use_slurm=False)
    assert f"{db}-wal" in str(err.value)
    svc = start_service(cfg, use_slurm=False, accept_empty_history=True)
    svc.stop(0)
    assert list(db.parent.glob(f"{db.name}-wal.orphaned-*"))
    with sqlite3.connect(str(db)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert decisions_in(db) <= 5  # those the decision journal still held (answered decisions are kept)


def test_swapaware_serve_refuses_and_names_the_flag(service_env, tmp_path):
    cfg = load_config(env=service_env)
    run_once(cfg)
    Path(cfg.service.db_path).unlink()
    # a process of its own: a service that does not refuse serves until the timeout ends it
    p = subprocess.run([sys.executable, "-c", "from policy_service.cli import main; main()", "serve"],
                       env={**os.environ, **service_env}, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stderr
    assert "cannot start: history" in p.stderr and ACCEPT_FLAG in p.stderr
    assert ACCEPT_FLAG in CliRunner().invoke(main, ["serve", "--help"]).output
