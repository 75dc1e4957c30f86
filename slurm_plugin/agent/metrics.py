"""Prometheus metrics of the node agent (``agent.metrics_address``; empty: not served), read from
its status at each scrape (Prometheus labels each node by its target):

  swapaware_agent_spool_events            hook events waiting in this node's spool
  swapaware_agent_jobs                    jobs the agent samples now
  swapaware_agent_replay_delivered_total  spooled events the agent delivered to the service
  swapaware_agent_replay_rejected_total   spooled events the service refused (kept aside)
  swapaware_agent_replay_failures         consecutive failed deliveries (0 while the service takes them)
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from policy_service.config import split_host_port

log = logging.getLogger("swapaware.agent")


class AgentCollector:
    """The agent's figures, from ``status()`` (the same dict ``swapaware-agent`` answers with)."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        s = self.status()
        yield GaugeMetricFamily("swapaware_agent_jobs", "Jobs the agent samples now", value=len(s.get("jobs", ())))
        if "spool_depth" in s:  # the agent delivers the spool (agent.replay)
            yield GaugeMetricFamily("swapaware_agent_spool_events", "Hook events waiting in the spool",
                                    value=s["spool_depth"])
            yield CounterMetricFamily("swapaware_agent_replay_delivered", "Spooled events delivered",
                                      value=s.get("replay_delivered", 0))
            yield CounterMetricFamily("swapaware_agent_replay_rejected", "Spooled events the service refused",
                                      value=s.get("replay_rejected", 0))
            yield GaugeMetricFamily("swapaware_agent_replay_failures", "Consecutive failed deliveries",
                                    value=s.get("replay_failures", 0))


def registry_for(status: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    r = CollectorRegistry()
    r.register(AgentCollector(status))
    return r


def serve(address: str, status: Callable[[], dict[str, Any]]):
    """Start /metrics; None (and an error in the log) when it cannot bind."""
    try:
        host, port = split_host_port(address)
        server, _thread = start_http_server(port, addr=host, registry=registry_for(status))
    except (OSError, ValueError) as exc:
        log.error("metrics not served on %s: %s", address, exc)
        return None
    log.info("metrics on http://%s:%d/metrics", host, server.server_port)
    return server
