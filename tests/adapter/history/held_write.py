"""A fenced write of a history store that a relay (tests/socket_relay.py) holds the way a network
cut does: its fence has locked the lease row, its statement is taken by the relay and goes no
further, and its thread waits for the answer holding the store's write lock."""
from __future__ import annotations

import threading
import time

from tests.waiting import wait_for


def held_write(store, relay) -> tuple[threading.Thread, dict]:
    """Start the write (decision "x" settled as never held) and return once the relay holds it: its
    thread, and what it ended with (``outcome``: "written" or the exception; ``at``: monotonic)."""
    ended: dict = {}
    relay.hold(b"decision_status")  # the write's statement, after its fence locked the lease row

    def write() -> None:
        try:
            store.settle_decisions([], ["x"], 2.0)
            ended["outcome"] = "written"
        except Exception as exc:  # noqa: BLE001 - the caller looks at it
            ended["outcome"] = exc
        ended["at"] = time.monotonic()

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    wait_for(lambda: relay.held and store._lock.locked(), 10, "the write held by the relay, holding the write lock")
    return writer, ended
