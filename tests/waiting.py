"""Bounded polling for tests: no bare sleeps, a clear message on timeout."""
from __future__ import annotations

import time
from typing import Callable


def wait_for(predicate, timeout_s: float = 15.0, what: str | Callable[[], str] = "condition",
             interval_s: float = 0.01):
    """Return predicate()'s first truthy value, polling every ``interval_s`` up to ``timeout_s``.
    ``what`` (or what it returns, computed only on timeout) names the awaited condition."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what() if callable(what) else what}")
        time.sleep(interval_s)
