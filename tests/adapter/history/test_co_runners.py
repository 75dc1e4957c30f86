"""Co-runners from the history (``HistoryStore.co_runners``, read once per JobFinished and per run
in the report), on both backends (real SQLite, a real private MariaDB): exactly the other runs on
the node's same GPUs whose time overlaps, open runs only while they may still run, ordered by
start; and on SQLite the read takes two ranges of the index (node, finished_at, started_at), not
the node's whole past (bench/co_runners.py: 15.4 ms per read at 100,000 runs on the node before,
56 us after)."""
from __future__ import annotations

from policy_service.history.schema import RUN_COLS
from policy_service.history.store import HistoryStore, ObservationRow

OPEN_MAX = 1000.0
START, END = 10_000.0, 10_500.0  # the finishing run's time on node n1, GPU 0


def start(store, name: str, node: str, gpus: tuple[int, ...], at: float) -> None:
    assert store.record_start(event_id=f"s-{name}", job_id=hash(name) % 10**6, decision_id="", node=node,
                              gpus=gpus, started_at=at, received_at=at, instance=f"i/{name}")


def finish(store, name: str, node: str, gpus: tuple[int, ...], at: float, until: float) -> None:
    start(store, name, node, gpus, at)
    assert store.record_finish(ObservationRow(f"f-{name}", hash(name) % 10**6, "", node, gpus, at, until,
                                              until - at, 0, None, False, 0, False, "none", until, f"i/{name}"),
                               {}, lambda level, s: s)


def test_co_runners_are_the_overlapping_runs_on_the_same_gpus(history_backend, tmp_path):
    store = history_backend.open(tmp_path / "history.sqlite3")
    try:
        for i in range(300):  # the node's past: long over before START
            finish(store, f"old{i}", "n1", (i % 8,), 1000.0 + i * 20, 1000.0 + i * 20 + 15)
        finish(store, "before", "n1", (0,), 9000.0, 9999.0)           # ended before START
        finish(store, "long", "n1", (0, 1), 2000.0, 10_100.0)         # started long before, ended inside
        finish(store, "inside", "n1", (0,), 10_200.0, 10_300.0)
        finish(store, "later", "n1", (0,), 10_400.0, 12_000.0)        # started inside, ended after END
        finish(store, "after", "n1", (0,), 10_500.0, 11_000.0)        # started at END: not overlapping
        finish(store, "other_gpu", "n1", (1,), 10_000.0, 10_500.0)
        finish(store, "other_node", "n2", (0,), 10_000.0, 10_500.0)
        start(store, "open_recent", "n1", (0,), 9500.0)               # no finish, within OPEN_MAX of START
        start(store, "open_stale", "n1", (0,), 8000.0)                # no finish, older than START - OPEN_MAX
        start(store, "open_later", "n1", (0,), 10_600.0)              # no finish, after END
        start(store, "self", "n1", (0,), START)
        got = [r.instance for r in store.co_runners("n1", [0], START, END, "i/self", OPEN_MAX)]
        assert got == ["i/long", "i/open_recent", "i/inside", "i/later"]
    finally:
        store.close()


def test_the_read_takes_ranges_of_the_finish_index_not_the_nodes_past(tmp_path):
    """SQLite (MariaDB chooses by its own statistics): both parts of the read search the index
    (node, finished_at, started_at) by node and finish."""
    store = HistoryStore(tmp_path / "history.sqlite3", accept_empty=True)
    captured: list[str] = []
    try:
        store._rconn.set_trace_callback(captured.append)
        store.overlapping_runs("n1", [0], START, END, "i/self", open_since=START - OPEN_MAX)
        sql = next(q for q in captured if f"SELECT {RUN_COLS} FROM runs" in q)
        args = (0,) * sql.count("?")
        plan = [row[3] for row in store._rconn.execute("EXPLAIN QUERY PLAN " + sql, args)]
    finally:
        store.close()
    searches = [p for p in plan if p.startswith("SEARCH runs")]
    assert len(searches) == 2, plan
    assert all("USING INDEX runs_node_finish (node=? AND finished_at" in p for p in searches), plan
