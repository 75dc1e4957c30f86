"""Bounded polling for tests: no bare sleeps, a clear message on timeout."""
from __future__ import annotations

import time


def wait_for(predicate, timeout_s: float = 15.0, what: str = "condition"):
    """Return predicate()'s first truthy value, polling every 10 ms up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
