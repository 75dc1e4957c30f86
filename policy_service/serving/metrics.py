"""Prometheus metrics of the policy service (``service.metrics_address``; empty: not served).

Every series has bounded labels (actions, reason codes, modes and transports are enums):

  swapaware_decisions_total{action,reason,mode}   decisions recorded, by the first reason code
  swapaware_admit_seconds{transport}              Admit latency inside the service (socket, grpc)
  swapaware_plugin_fail_open_total{why}           jobs the job_submit plugin let through unchanged, as
                                                  it reports them with its next Admit (breaker open,
                                                  service unreachable or too slow)
  swapaware_peak_error_ratio                      (predicted - observed) / observed peak, per finished run
  swapaware_charge_overruns_total                 shared runs whose observed peak exceeded their charge
  swapaware_ooms_total{shared}                    runs judged out of GPU memory
  swapaware_events_refused_total{why}             hook events refused, never applied: a value out of
                                                  range (policy_service/trust/event_bounds.py) or a field
                                                  missing or too large
  swapaware_credentials_refused_total{why}        MUNGE credentials refused on gRPC: a payload that does
                                                  not bind it to its request (empty_payload,
                                                  foreign_payload, other_method, other_request), a TTL
                                                  over auth.max_ttl_s (over_ttl), or munged's verdict
                                                  (cred_replayed, cred_expired, cred_invalid, ...)
  swapaware_queue_snapshot_age_seconds            age of the pending-queue snapshot (-1: none yet)
  swapaware_history_bytes                         size of the history (database + WAL + journal; MariaDB: the journal)
  swapaware_decisions_waiting                     decisions journaled, not yet in the history
  swapaware_decisions_caught_up_total{source,archived}
                                                  decisions the job_submit plugin made from the published
                                                  table, learned from Slurm (squeue, sacct, event) and
                                                  recorded; archived=false: from the AdminComment alone
  swapaware_catchup_lag_seconds{source}           from such a job's submission to its record
  swapaware_grpc_bound                            1 while the service listens on service.grpc_address, 0 while
                                                  another process holds that port and the service waits
                                                  for it (serving/grpc_bind.py; the local socket serves)
  swapaware_grpc_bind_failures_total              tries to bind service.grpc_address that found it held
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from policy_service.config import split_host_port
from policy_service.core.interference_learn import Source

log = logging.getLogger("swapaware.metrics")

ADMIT_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0)
LAG_BUCKETS = (1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 86400.0)
ERROR_BUCKETS = (-0.5, -0.25, -0.1, -0.05, -0.02, 0.0, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
FAIL_OPEN_WHY = ("breaker_open", "service_error")


class ServiceMetrics:
    """The service's series in their own registry (one per service: tests run several)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter("swapaware_decisions", "Decisions recorded, by action, first reason code and mode",
                                 ("action", "reason", "mode"), registry=r)
        self.admit = Histogram("swapaware_admit_seconds", "Admit latency inside the service, by transport",
                               ("transport",), buckets=ADMIT_BUCKETS, registry=r)
        # each transport's series, looked up once (labels() on every Admit was 2 % of its CPU)
        self.admit_by = {t: self.admit.labels(transport=t) for t in ("socket", "grpc")}
        self.fail_open = Counter("swapaware_plugin_fail_open", "Jobs the job_submit plugin let through unchanged, "
                                 "as it reported them", ("why",), registry=r)
        self.peak_error = Histogram("swapaware_peak_error_ratio", "(predicted - observed) / observed peak GPU "
                                    "memory of finished runs with both", buckets=ERROR_BUCKETS, registry=r)
        self.overruns = Counter("swapaware_charge_overruns", "Shared runs whose observed peak exceeded their "
                                "charged shards", registry=r)
        self.ooms = Counter("swapaware_ooms", "Runs judged out of GPU memory", ("shared",), registry=r)
        self.events_refused = Counter("swapaware_events_refused", "Hook events refused (never applied), by what "
                                      "was wrong with them", ("why",), registry=r)
        self.credentials_refused = Counter("swapaware_credentials_refused", "MUNGE credentials refused on "
                                           "gRPC, by why", ("why",), registry=r)
        self.queue_age = Gauge("swapaware_queue_snapshot_age_seconds", "Age of the pending-queue snapshot "
                               "(-1: none)", registry=r)
        self.history_bytes = Gauge("swapaware_history_bytes", "Size of the history: database, WAL and journal",
                                   registry=r)
        self.caught_up = Counter("swapaware_decisions_caught_up", "Decisions the job_submit plugin made from the "
                                 "published table, learned from Slurm and recorded, by source and whether its "
                                 "table was archived", ("source", "archived"), registry=r)
        self.catchup_lag = Histogram("swapaware_catchup_lag_seconds", "Seconds from a table-made decision (its job's "
                                     "submission) to its record, by source", ("source",), buckets=LAG_BUCKETS,
                                     registry=r)
        self.waiting = Gauge("swapaware_decisions_waiting", "Decisions journaled and not yet in the history",
                             registry=r)
        self.grpc_bound = Gauge("swapaware_grpc_bound", "1 while the service listens on service.grpc_address, 0 "
                                "while another process holds the port", registry=r)
        self.grpc_bind_failures = Counter("swapaware_grpc_bind_failures", "Tries to bind service.grpc_address "
                                          "that found the port held by another process", registry=r)
        self.interference = Gauge("swapaware_interference_model", "The site's interference model per GPU type "
                                  "(gpu_type * : every type's runs together): its parameters a and b (slowdown "
                                  "1 + a v + b max(0, u + v - 1)), its shared runs, and learned (1) or the prior (0)",
                                  ("gpu_type", "what"), registry=r)
        self.interference_untaught = Gauge("swapaware_interference_untaught_runs", "Shared runs that taught the "
                                           "interference model nothing since the service started, by why",
                                           ("why",), registry=r)
        # The plugin's counters, by the slurmctld that sent them (its pid): a restart starts them at 0.
        self._plugin_last: dict[tuple[object, str], int] = {}
        self._lock = threading.Lock()

    def watch(self, *, queue_age: Callable[[], float | None], history: Path, waiting: Callable[[], int]) -> None:
        self.queue_age.set_function(lambda: _or(queue_age(), -1.0))
        paths = [history, Path(f"{history}-wal"), Path(f"{history}.journal")]
        self.history_bytes.set_function(lambda: float(sum(_size(p) for p in paths)))
        self.waiting.set_function(lambda: float(waiting()))

    def interference_view(self, view, untaught: Mapping[str, int]) -> None:
        """After each fit (interference/learner.py ``on_refit``): the models and the untaught runs."""
        for gpu_type, m in (("*", view.pooled), *view.by_type):
            for what, value in (("a", m.params.base), ("b", m.params.slope), ("runs", m.runs),
                                ("learned", float(m.source is Source.LEARNED))):
                self.interference.labels(gpu_type=gpu_type, what=what).set(value)
        for why, n in untaught.items():
            self.interference_untaught.labels(why=why).set(n)

    def plugin_report(self, source: object, why: str, total: int) -> None:
        """The plugin's running count of fail-opens for ``why`` (since its slurmctld started)."""
        if why not in FAIL_OPEN_WHY or total < 0:
            return
        with self._lock:
            last = self._plugin_last.get((source, why), 0)
            self._plugin_last[(source, why)] = total
        delta = total - last if total >= last else total  # lower: that slurmctld restarted
        if delta > 0:
            self.fail_open.labels(why=why).inc(delta)

    def serve(self, address: str):
        """Start the HTTP endpoint; None (and an error in the log) when it cannot bind."""
        try:
            host, port = split_host_port(address)
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except (OSError, ValueError) as exc:
            log.error("metrics not served on %s: %s", address, exc)
            return None
        log.info("metrics on http://%s:%d/metrics", host, server.server_port)
        return server


def _or(value: float | None, default: float) -> float:
    return default if value is None else float(value)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
