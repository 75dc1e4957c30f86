"""Nothing acknowledged is lost, and Admit never waits for the disk. Fault injection against a real
service process on a real SQLite file: its history write-locked by another process, its disk full
(a tiny tmpfs), a burst, each ended by ``kill -9``; the history removed or replaced under a running
service. Every decision a caller was answered with is in the history after the restart."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from policy_service.history.decision_log import backoff
from policy_service.history.journal_records import DecisionRecord, read_journal
from policy_service.history.store import HistoryStore
from policy_service.config import load_config
from policy_service.serving.server import start_service
from tests.waiting import wait_for

from tests.adapter.conftest import socket_call

ROOT = Path(__file__).resolve().parents[3]
SERVE = ("import os, threading\n"
         "from policy_service.config import load_config\n"
         "from policy_service.serving.server import start_service\n"
         "start_service(load_config(env=os.environ), use_slurm=False)\n"
         "print('ready', flush=True)\n"
         "threading.Event().wait()\n")


def admit(sock: Path, name: str, comment: str = "") -> dict:
    return socket_call(sock, {"method": "Admit", "request": {"job": {
        "user": "alice", "uid": 1000, "jobName": name, "tresPerNode": "gres:gpu:1", "comment": comment}}},
        timeout_s=30)


LOCK_WAIT_S = 10.0  # how long the history's writer waits for a lock per try (HistoryStore's busy timeout)


def admits_timed(sock: Path, n: int) -> tuple[list[str], list[float]]:
    """``n`` Admits one after another: their decision ids and the seconds each took."""
    ids, took = [], []
    for i in range(n):
        t0 = time.monotonic()
        ids.append(admit(sock, f"locked-{i}")["response"]["decision"]["decisionId"])
        took.append(time.monotonic() - t0)
    return ids, took


@contextlib.contextmanager
def service_process(env: dict[str, str]):
    p = subprocess.Popen([sys.executable, "-c", SERVE], env={**os.environ, **env}, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
        yield p
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def kill_9(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(10)


@contextlib.contextmanager
def write_locked(db: Path):
    """Another process's exclusive write transaction on the history, held for the block."""
    conn = sqlite3.connect(str(db), isolation_level=None, timeout=5)
    conn.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        conn.execute("ROLLBACK")
        conn.close()


def recorded(db: Path) -> set[str]:
    store = HistoryStore(db)
    try:
        return {d.decision_id for d in store.decisions()}
    finally:
        store.close()


@pytest.fixture
def env(short_dir, service_env):
    return {**service_env, "SWAPAWARE_SERVICE__SOCKET_PATH": str(short_dir / "p.sock")}


def test_kill_9_while_the_history_is_write_locked_loses_no_answered_decision(env, tmp_path):
    """Before: decisions waited in memory for the writer; kill -9 lost them (explain: NOT_FOUND)."""
    db, sock = Path(env["SWAPAWARE_SERVICE__DB_PATH"]), Path(env["SWAPAWARE_SERVICE__SOCKET_PATH"])
    with service_process(env) as p:
        admit(sock, "warmup")
        with write_locked(db):
            answered, took = admits_timed(sock, 20)
            kill_9(p)
    print(f"\n20 Admits with the history write-locked: {sum(took) * 1e3:.0f} ms in all, {max(took) * 1e3:.0f} ms the longest")
    # the writer waits LOCK_WAIT_S per try for the lock: an Admit that waited for it would take that long
    assert max(took) < LOCK_WAIT_S / 2
    with service_process(env):
        found = recorded(db)
    assert set(answered) <= found, set(answered) - found


def test_kill_9_while_the_mariadb_history_is_locked_loses_no_answered_decision(env, mariadb_backend, mariadb_server):
    """The same on a MariaDB history: another session holds the decisions table (LOCK TABLES
    ... WRITE); Admits answer at once from the journal; after kill -9 and a restart every answered
    decision is in MariaDB."""
    import pymysql
    env = {**env, **mariadb_backend.env}
    h, sock = mariadb_backend.history, Path(env["SWAPAWARE_SERVICE__SOCKET_PATH"])
    mariadb_server.sql(f"GRANT LOCK TABLES ON `{h.database}`.* TO '{h.user}'@'localhost'")  # (the service needs none)
    with service_process(env) as p:
        admit(sock, "warmup")
        other = pymysql.connect(unix_socket=h.unix_socket, user=h.user, database=h.database,
                                password=Path(h.password_file).read_text().strip())
        try:
            with other.cursor() as cur:
                cur.execute("LOCK TABLES decisions WRITE")
            answered, took = admits_timed(sock, 20)
            kill_9(p)
        finally:
            other.close()  # its lock goes with it
    assert max(took) < LOCK_WAIT_S / 2
    store = mariadb_backend.open(env["SWAPAWARE_SERVICE__DB_PATH"])
    try:
        assert not set(answered) & store.known_decisions(answered)  # none reached MariaDB before kill -9
    finally:
        store.close()
    with service_process(env):  # the journal is committed at start
        store = mariadb_backend.open(env["SWAPAWARE_SERVICE__DB_PATH"])
        try:
            assert store.known_decisions(answered) == set(answered)
        finally:
            store.close()


def test_a_burst_killed_midway_keeps_every_answered_decision(env):
    db, sock = Path(env["SWAPAWARE_SERVICE__DB_PATH"]), Path(env["SWAPAWARE_SERVICE__SOCKET_PATH"])
    answered: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def submitter(k: int) -> None:
        for i in range(200):
            if stop.is_set():
                return
            try:
                reply = admit(sock, f"burst-{k}-{i}")
            except (OSError, ValueError):
                return  # the service is gone (refused, or the connection closed without a reply)
            with lock:
                answered.append(reply["response"]["decision"]["decisionId"])

    with service_process(env) as p:
        with write_locked(db), ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(submitter, k) for k in range(8)]
            wait_for(lambda: len(answered) >= 300, 60, "300 answered Admits", 0.01)
            kill_9(p)
            stop.set()
            for f in futures:
                f.result(30)
    with service_process(env):
        found = recorded(db)
    print(f"\nburst: {len(answered)} answered before kill -9, {len(set(answered) & found)} in the history after")
    assert set(answered) <= found


def test_a_full_disk_refuses_the_decision_instead_of_losing_it(env, tmp_path):
    """The history and its journal on a 2 MiB tmpfs, filled up: Admits that could not be journaled
    answer UNAVAILABLE (the job passes unchanged); every one that was answered survives kill -9."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "swapaware-test", str(small)], check=True)
    try:
        env = {**env, "SWAPAWARE_SERVICE__DB_PATH": str(small / "history.sqlite3")}
        db, sock = small / "history.sqlite3", Path(env["SWAPAWARE_SERVICE__SOCKET_PATH"])
        answered, refused = [], []
        with service_process(env) as p:
            with write_locked(db):  # nothing leaves the journal: it fills the disk
                filler = small / "filler"
                with open(filler, "wb", buffering=0) as f:  # unbuffered: nothing left to flush at close
                    with contextlib.suppress(OSError):
                        while True:
                            f.write(b"\0" * 65536)
                os.truncate(filler, max(0, filler.stat().st_size - 96 * 1024))  # room for a few decisions
                for i in range(200):
                    reply = admit(sock, f"full-{i}", comment="x" * 3000)
                    if "response" in reply:
                        answered.append(reply["response"]["decision"]["decisionId"])
                    else:
                        refused.append(reply["error"])
                kill_9(p)
            filler.unlink()
        assert answered and refused, (len(answered), refused[:1])
        assert {e["code"] for e in refused} == {"UNAVAILABLE"}
        assert all("No space left" in e["message"] or "disk is full" in e["message"] for e in refused), refused[:2]
        with service_process(env):
            found = recorded(db)
        print(f"\ndisk full: {len(answered)} answered, {len(refused)} refused UNAVAILABLE, "
              f"{len(set(answered) & found)} answered in the history after kill -9")
        assert set(answered) <= found
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_admit_reads_beside_a_writer_that_waits_for_the_file_lock(service_env):
    """Before: the writer held the store's one lock while SQLite waited for another process's file
    lock, and Admit's read of the class statistics waited behind it."""
    cfg = load_config(env=service_env)
    svc = start_service(cfg, use_slurm=False)
    try:
        sock = cfg.service.socket_path
        admit(sock, "first")
        svc.handler.flush()
        with write_locked(Path(cfg.service.db_path)):
            admit(sock, "queued")  # the writer now waits for the lock, holding the write connection
            wait_for(lambda: svc.handler.decisions.pending() >= 1, 5, "a decision waiting for the writer")
            times = []
            for i in range(50):
                t0 = time.monotonic()
                assert "response" in admit(sock, f"while-locked-{i}")
                times.append(time.monotonic() - t0)
            svc.store.stats({})  # reads do not wait either
        times.sort()
        print(f"\nAdmit with the history write-locked: p50 {times[25] * 1e3:.1f} ms, max {times[-1] * 1e3:.1f} ms")
        assert times[-1] < 2.0  # the lock is held for the whole loop; a blocked Admit would wait 10 s
        svc.handler.flush()
        assert len(list(svc.store.decisions())) == 52
    finally:
        svc.stop(0)


def test_the_decision_log_line_is_written_once_the_decision_is_in_the_history(service_env, caplog):
    """Admit journals the decision; its ``decision {json}`` line comes from the writer after the
    commit (formatting it cost Admit ~40 us), so while the history is locked there is none yet."""
    cfg = load_config(env=service_env)
    svc = start_service(cfg, use_slurm=False)
    caplog.set_level("INFO", logger="swapaware")

    def lines() -> list[dict]:
        return [json.loads(r.getMessage()[len("decision "):]) for r in caplog.records
                if r.getMessage().startswith("decision {")]
    try:
        sock = cfg.service.socket_path
        with write_locked(Path(cfg.service.db_path)):
            d_id = admit(sock, "logged")["response"]["decision"]["decisionId"]
            wait_for(lambda: svc.handler.decisions.pending() >= 1, 5, "the decision waiting for the writer")
            assert lines() == []
        svc.handler.flush()
        wait_for(lambda: lines(), 5, "the decision's log line")
        (line,) = lines()
        assert line["decision_id"] == d_id and line["job_name"] == "logged" and line["mode"] == "enforce"
        assert line["action"] == "whole_gpu" and "no_history" in line["reasons"]
    finally:
        svc.stop(0)


def test_an_idle_writer_sleeps_until_a_decision_comes_and_then_commits_it_at_once(service_env):
    """The writer polls every WRITE_INTERVAL_S while decisions come in, and once an interval found
    none it sleeps until record() wakes it (an idle service no longer wakes 20 times a second): the
    decision after a quiet spell reaches the history well before IDLE_WAIT_S."""
    from policy_service.history import decision_log

    cfg = load_config(env=service_env)
    svc = start_service(cfg, use_slurm=False)
    log = svc.handler.decisions
    waits: list[float | None] = []
    real_wait = log._wake.wait

    def counted(timeout=None):
        waits.append(timeout)
        return real_wait(timeout)
    log._wake.wait = counted
    try:
        sock, db = cfg.service.socket_path, Path(cfg.service.db_path)
        first = admit(sock, "before-quiet")["response"]["decision"]["decisionId"]
        wait_for(lambda: first in recorded(db), 5, "the first decision in the history")
        wait_for(lambda: log._idle, 5, "the writer idle")
        waits.clear()
        time.sleep(1.0)  # a quiet second: at most the one idle wait (IDLE_WAIT_S), not 20 polls
        assert len(waits) <= 1 and all(w == decision_log.IDLE_WAIT_S for w in waits), waits
        t0 = time.monotonic()
        second = admit(sock, "after-quiet")["response"]["decision"]["decisionId"]
        wait_for(lambda: second in recorded(db), decision_log.IDLE_WAIT_S - 1, "the decision after the quiet spell")
        assert time.monotonic() - t0 < decision_log.IDLE_WAIT_S / 2
    finally:
        log._wake.wait = real_wait
        svc.stop(0)


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_history_removed_or_replaced_under_the_service_is_restored(service_env, how, caplog):
    env = {**service_env, "SWAPAWARE_SERVICE__HISTORY_CHECK_S": "0.1"}
    cfg = load_config(env=env)
    db = Path(cfg.service.db_path)
    svc = start_service(cfg, use_slurm=False)
    try:
        ids = [admit(cfg.service.socket_path, f"job-{i}")["response"]["decision"]["decisionId"] for i in range(30)]
        svc.handler.flush()
        if how == "removed":
            for f in db.parent.glob(db.name + "*"):
                if not f.name.endswith(".journal"):
                    f.unlink()
        else:
            other = db.with_name("other.sqlite3")
            sqlite3.connect(str(other)).execute("CREATE TABLE x (y)").connection.close()
            os.replace(other, db)
        wait_for(lambda: any("while the service ran: restored" in r.getMessage() for r in caplog.records), 10,
                 "the service to notice and restore its history")
        later = admit(cfg.service.socket_path, "after")["response"]["decision"]["decisionId"]
        svc.handler.flush()
    finally:
        svc.stop(0)
    assert set(ids) | {later} <= recorded(db)
    if how == "replaced":
        assert list(db.parent.glob(db.name + ".replaced-*"))


def test_journal_records_and_a_torn_tail():
    rec = DecisionRecord("d1", 1.5, "c", "u", "a", "p", "n", "whole_gpu", 8, "m", {"class": "k"}, b"\x00f", b"\x01d")
    data = rec.encode() + rec.encode()
    assert read_journal(data) == ([rec, rec], 0)
    assert read_journal(data[:-3]) == ([rec], len(rec.encode()) - 3)
    corrupt = bytearray(data)
    corrupt[-1] ^= 0xFF
    assert read_journal(bytes(corrupt))[0] == [rec]
    assert [backoff(a) for a in (1, 2, 3, 10, 50)] == [0.05, 0.1, 0.2, 5.0, 5.0]


def test_a_stop_while_the_history_cannot_be_reached_ends_and_the_next_start_commits(tmp_path, monkeypatch, caplog):
    """close() lets the writer try for CLOSE_WAIT_S, then stops it: what waits stays in the journal
    (committed at the next start, as after a crash), and the stop does not hang on a history that is
    gone (a MariaDB down while the service is stopped). The retries before it are spaced, not spun."""
    from policy_service.history import decision_log
    from policy_service.history.db import HistoryUnavailable
    from policy_service.history.decision_log import DecisionLog
    from tests.adapter.history.test_history_backends import record

    monkeypatch.setattr(decision_log, "CLOSE_WAIT_S", 1.0)
    tries: list[float] = []

    def unreachable(_records):
        tries.append(time.monotonic())
        raise HistoryUnavailable("connection to mariadb lost: MySQL server has gone away")

    journal = tmp_path / "history.journal"
    log = DecisionLog(journal, unreachable)
    log.record(record(0, "gone"))
    caplog.set_level("WARNING", logger="swapaware")
    t0 = time.monotonic()
    log.close()
    took = time.monotonic() - t0
    assert 1.0 <= took < 1.0 + decision_log.RETRY_MAX_S + 2.0, took
    assert not log._thread.is_alive()
    assert 2 <= len(tries) <= 20, len(tries)  # backed off, not a tight loop
    assert "1 decision(s) stay in the journal for the next start" in caplog.text
    assert [r.decision_id for r in read_journal(journal.read_bytes())[0]] == ["gone0"]
    committed: list = []
    DecisionLog(journal, committed.extend).close()  # the next start, with the history back
    assert [r.decision_id for r in committed] == ["gone0"] and journal.stat().st_size == 0
