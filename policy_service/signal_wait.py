"""A main loop's wait for signals (the service's SIGHUP and SIGTERM, the node agent's SIGTERM) with
no lock taken in a signal handler.

A Python signal handler runs in the main thread between two of its bytecodes, wherever that thread
is. A handler that set a ``threading.Event`` the main loop waits on took the Event's lock, which
the main thread itself holds for a moment each time it enters ``wait()`` or ``clear()``: a signal
handled in that moment waited forever for a lock its own thread held, and the main loop never ran
again (no reload, no stop on SIGTERM: a SIGHUP never applied, seen once in the test suite under
load). Here the handler does nothing: CPython's own C handler writes each signal's number to a
pipe (``signal.set_wakeup_fd``), and the main loop reads the pipe.
"""
from __future__ import annotations

import os
import select
import signal
from typing import Iterable


def _noted(_signum: int, _frame) -> None:
    """A Python handler must be installed for the C handler to write the signal to the pipe."""


class SignalWait:
    """The signals the main thread waits for; made and used in the main thread only."""

    def __init__(self, signums: Iterable[int] = ()):
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)  # a full pipe drops the byte, never blocks the C handler
        self._previous_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        self.add(signums)

    def add(self, signums: Iterable[int]) -> None:
        """Wait for these too from now on (until then their default action stands)."""
        for signum in signums:
            signal.signal(signum, _noted)

    def wait(self, timeout_s: float | None = None) -> set[int]:
        """The signals that came since the last wait (every one that came while the loop was
        busy is kept in the pipe); an empty set when ``timeout_s`` passed first."""
        ready, _, _ = select.select([self._r], [], [], timeout_s)
        return set(os.read(self._r, 512)) if ready else set()

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._r)
        os.close(self._w)
