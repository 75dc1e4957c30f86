"""Run by test_history_backends.py inside a network namespace of its own (``unshare -n``): a history
session over TCP (127.0.0.1, through tests/socket_relay.py to the test's private mariadbd) whose
link goes down (``ip link set lo down``) while a fenced write waits for its answer. The relay has
taken the write's statement (so TCP has nothing unacknowledged) and holds it: only keepalive can
tell that the server's host is gone. Prints one JSON line: how the write ended and how long
after the link went down.

    unshare -n python -m tests.adapter.history.dead_link_driver '{"socket": ..., "database": ...,
        "user": ..., "password_file": ..., "db_path": ...}'
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from policy_service.history.config import HistoryConfig
from policy_service.history.store import HistoryStore
from tests.adapter.history.held_write import held_write
from tests.socket_relay import Relay


def main() -> None:
    args = json.loads(sys.argv[1])
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    relay = Relay(("127.0.0.1", 0), args["socket"])
    cfg = HistoryConfig(backend="mariadb", host="127.0.0.1", port=relay.port, database=args["database"],
                        user=args["user"], password_file=args["password_file"], connect_timeout_s=2.0)
    store = HistoryStore(args["db_path"], fence="a", mariadb=cfg)
    store.claim_writer("a", 300.0)
    store.settle_decisions(["x"], [], 1.0)
    writer, ended = held_write(store, relay)
    subprocess.run(["ip", "link", "set", "lo", "down"], check=True)
    cut_at = time.monotonic()
    writer.join(float(args.get("wait_s", 150)))
    outcome = ended.get("outcome", "still waiting")
    print(json.dumps({"outcome": outcome if isinstance(outcome, str) else type(outcome).__name__,
                      "message": "" if isinstance(outcome, str) else str(outcome),
                      "after_cut_s": round(ended.get("at", time.monotonic()) - cut_at, 1)}), flush=True)
    os._exit(0)  # (the store's sessions are on a dead link: nothing to close)


if __name__ == "__main__":
    main()
