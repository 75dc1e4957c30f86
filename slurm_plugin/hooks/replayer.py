"""The node agent delivers what the hooks spooled, on its own: no job has to run on the node again.

Every ``agent.replay_interval_s`` the agent looks at the hooks' spool; when events wait there it
replays them (``spool.replay``: batches of ReportEvents, oldest first, the spool's lock held, each
event applied once by the service whatever is sent twice). While the service cannot take them the
next try waits longer, doubling from the interval up to ``agent.replay_max_backoff_s``, with
jitter so that a cluster's agents do not all come back at the same instant. One log line when
delivery starts failing, one when it works again, one per delivered batch: no line per attempt.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from slurm_plugin.hooks import spool

log = logging.getLogger("swapaware.replay")


@dataclass(frozen=True)
class ReplayState:
    failures: int = 0  # consecutive tries the service did not take
    delivered: int = 0  # events delivered since the agent started
    rejected: int = 0
    last_error: str = ""
    last_try_at: float = 0.0  # wall clock
    last_result: spool.ReplayResult | None = None


def next_delay(failures: int, interval_s: float, max_backoff_s: float, jitter: float) -> float:
    """Seconds until the next look at the spool: the interval while all is well, else doubling per
    consecutive failure up to ``max_backoff_s``; ``jitter`` in [0, 1) takes off up to half."""
    if failures <= 0:
        return interval_s
    base = min(max_backoff_s, interval_s * (2 ** (failures - 1)))
    return max(interval_s / 2, base * (1.0 - jitter / 2))


def after(state: ReplayState, result: spool.ReplayResult, now: float) -> ReplayState:
    """The state after one replay."""
    failed = bool(result.stopped_by) and result.stopped_by != "another replay holds the spool lock"
    return replace(state, failures=state.failures + 1 if failed else 0, delivered=state.delivered + result.sent,
                   rejected=state.rejected + result.rejected, last_error=result.stopped_by if failed else "",
                   last_try_at=now, last_result=result)


class SpoolReplayer:
    def __init__(self, spool_dir, make_client: Callable[[], Any], interval_s: float, max_backoff_s: float,
                 rand: Callable[[], float] = random.random, wall: Callable[[], float] = time.time):
        self.spool_dir, self.make_client = spool_dir, make_client
        self.interval_s, self.max_backoff_s = interval_s, max_backoff_s
        self.rand, self.wall = rand, wall
        self.state = ReplayState()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def run_once(self) -> spool.ReplayResult | None:
        """Replay what waits (None: the spool is empty)."""
        if not spool.pending(self.spool_dir):
            with self._lock:
                self.state = replace(self.state, failures=0)
            return None
        with self.make_client() as client:
            result = spool.replay(self.spool_dir, client.call, max_events=10**9)
        with self._lock:
            before, self.state = self.state, after(self.state, result, self.wall())
        if result.sent:
            log.info("delivered %d spooled event(s) to the service (%d left)", result.sent, result.left)
        if self.state.failures == 1 and before.failures == 0:
            log.warning("spooled events cannot be delivered now (%s); %d wait, retrying with backoff up to %.0f s",
                        self.state.last_error, result.left, self.max_backoff_s)
        elif self.state.failures == 0 and before.failures > 0:
            log.info("the service takes spooled events again")
        return result

    def delay(self) -> float:
        return next_delay(self.state.failures, self.interval_s, self.max_backoff_s, self.rand())

    def loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.delay()):
            try:
                self.run_once()
            except Exception:  # never let the thread die: the spool keeps everything
                log.exception("replaying the spool failed")
                with self._lock:
                    self.state = replace(self.state, failures=self.state.failures + 1)

    def start(self, stop: threading.Event) -> threading.Thread:
        t = threading.Thread(target=self.loop, args=(stop,), name="spool-replay", daemon=True)
        t.start()
        self._thread = t
        return t

    def join(self, timeout_s: float) -> bool:
        """Wait for the thread (after its stop event was set); False if it is still in a replay."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    def status(self) -> dict[str, Any]:
        with self._lock:
            s = self.state
        return {"spool_depth": len(spool.pending(self.spool_dir)), "replay_failures": s.failures,
                "replay_delivered": s.delivered, "replay_rejected": s.rejected, "replay_last_error": s.last_error,
                "replay_last_try_at": s.last_try_at,
                "replay_last": None if s.last_result is None else {
                    "sent": s.last_result.sent, "rejected": s.last_result.rejected, "left": s.last_result.left,
                    "stopped_by": s.last_result.stopped_by}}
