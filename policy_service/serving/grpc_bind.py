"""The service's gRPC port: bound at start, or, where another process holds it, as soon as it is free.

Any local user can bind an unprivileged port (>= 1024) while the service restarts (issue 32). A
service that exited then stayed down, and with it the job_submit plugin's answers (it fails
open: GPU jobs passed unchanged) and, with [ha] enabled, the writer lease. ``GrpcListener`` tries
the port once at start; where another process holds it (EADDRINUSE) the service starts anyway:
slurmctld is served on the controller-local socket, the writer role and the background work go
on, and a thread tries again every RETRY_MIN_S, doubling up to RETRY_MAX_S, until the port is
free, then starts the gRPC server there. While it waits it says so:

  log      one ERROR line naming the address and the fix, then one every LOG_EVERY_S, and one
           WARNING when the port is bound (never a line per try);
  metrics  swapaware_grpc_bound 0 (1 once bound), swapaware_grpc_bind_failures_total per try;
  health   the overall status and the PolicyService entry are NOT_SERVING until the port is
           bound (the health service is served by that gRPC server: nothing can ask it before).

Any other bind failure (a privileged port without CAP_NET_BIND_SERVICE, an address not on this
host) stops the start as before: waiting would not help. ``stop()`` ends the retries at once.
"""
from __future__ import annotations

import errno
import logging
import threading
import time
from typing import Callable

import grpc
from grpc_health.v1 import health

from policy_service.serving.grpc_server import add_port, held_message, port_holder, serving

log = logging.getLogger("swapaware.service")

RETRY_MIN_S = 1.0  # the first retry after the port was found held; the wait doubles ...
RETRY_MAX_S = 5.0  # ... up to this
LOG_EVERY_S = 60.0  # while it waits, a line this often


class GrpcListener:
    """``server``: built by grpc_server.grpc_server (servicers added, no port, not started);
    ``metrics``: the handler's ServiceMetrics."""

    def __init__(self, server: grpc.Server, health_servicer: health.HealthServicer, address: str,
                 credentials: grpc.ServerCredentials | None, metrics, *, retry_min_s: float = RETRY_MIN_S,
                 retry_max_s: float = RETRY_MAX_S, log_every_s: float = LOG_EVERY_S,
                 mono: Callable[[], float] = time.monotonic):
        self.server, self.health, self.address, self.credentials = server, health_servicer, address, credentials
        self.metrics, self.mono = metrics, mono
        self.retry_min_s, self.retry_max_s, self.log_every_s = retry_min_s, retry_max_s, log_every_s
        self.port = 0  # once bound
        self.bound = threading.Event()
        self.tries = 0  # tries that found the port held
        self.waiting_since: float | None = None  # monotonic: when the port was first found held
        self._said_at = float("-inf")
        self._problem = ""
        self._stop = threading.Event()
        self._lock = threading.Lock()  # a bind and a stop do not cross
        self._thread: threading.Thread | None = None
        metrics.grpc_bound.set(0)

    def bind(self) -> bool:
        """Bind the port and start serving if it is free: True. False where another process holds
        it (counted, logged as said above) or the listener is stopped; OSError for any other failure."""
        held = port_holder(self.address)  # a plain probe first: a failed gRPC bind logs an error line of its own
        if held is not None and held.errno == errno.EADDRINUSE:
            return self._held()
        with self._lock:
            if self._stop.is_set():
                return False
            try:
                port = add_port(self.server, self.address, self.credentials)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                return self._held()  # taken between the probe and the bind
            self.server.start()
            self.port = port
            serving(self.health)
            self.metrics.grpc_bound.set(1)
            self.bound.set()
        if self.waiting_since is not None:
            log.warning("gRPC address %s bound after %.1f s (%d tries found it held): serving gRPC on port %d",
                        self.address, self.mono() - self.waiting_since, self.tries, port)
        return True

    def _held(self) -> bool:
        self.tries += 1
        self.metrics.grpc_bind_failures.inc()
        now = self.mono()
        if self.waiting_since is None:
            self.waiting_since = self._said_at = now
            log.error("%s. The service waits for it: it tries again every %.0f-%.0f s; slurmctld is served on the "
                      "local socket meanwhile, the nodes' hooks and clients are not (events stay spooled)",
                      held_message(self.address), self.retry_min_s, self.retry_max_s)
        elif now - self._said_at >= self.log_every_s:
            self._said_at = now
            log.error("gRPC address %s still in use by another process after %.0f s (%d tries); still waiting for it",
                      self.address, now - self.waiting_since, self.tries)
        return False

    def retry(self) -> "GrpcListener":
        """Try again in a thread until the port is bound or ``stop()``."""
        def loop() -> None:
            wait = self.retry_min_s
            while not self._stop.wait(wait):
                try:
                    if self.bind():
                        return
                except OSError as exc:  # e.g. the address left this host meanwhile: said once, still tried
                    if str(exc) != self._problem:
                        log.error("gRPC address %s: %s; trying again", self.address, exc)
                    self._problem = str(exc)
                except Exception:  # noqa: BLE001 - the thread must outlive anything
                    log.exception("gRPC address %s: bind failed; trying again", self.address)
                wait = min(wait * 2, self.retry_max_s)

        self._thread = threading.Thread(target=loop, name="grpc-bind", daemon=True)
        self._thread.start()
        return self

    def wait_bound(self, timeout_s: float | None = None) -> bool:
        return self.bound.wait(timeout_s)

    def stop(self, grace_s: float) -> None:
        """No further tries; the gRPC server stopped (within ``grace_s`` for the calls in flight)."""
        with self._lock:
            self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self.server.stop(grace_s).wait(grace_s + 1)
