"""The node agent's /metrics, read from its status at each scrape."""
from __future__ import annotations

import urllib.request

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from slurm_plugin.agent import metrics as agent_metrics


def samples(text: str) -> dict[str, float]:
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_each_scrape_reads_the_agents_status_now():
    status = {"ok": True, "jobs": [{"job_id": 1}], "spool_depth": 3, "replay_delivered": 10, "replay_rejected": 1,
              "replay_failures": 2}
    reg = agent_metrics.registry_for(lambda: status)
    got = samples(generate_latest(reg).decode())
    assert got["swapaware_agent_jobs"] == 1 and got["swapaware_agent_spool_events"] == 3
    assert got["swapaware_agent_replay_delivered_total"] == 10 and got["swapaware_agent_replay_rejected_total"] == 1
    assert got["swapaware_agent_replay_failures"] == 2
    status.update(spool_depth=0, replay_delivered=13, replay_failures=0, jobs=[])
    got = samples(generate_latest(reg).decode())
    assert (got["swapaware_agent_spool_events"], got["swapaware_agent_replay_delivered_total"],
            got["swapaware_agent_jobs"]) == (0, 13, 0)


def test_without_replay_there_is_no_spool_series_and_the_endpoint_serves():
    server = agent_metrics.serve("127.0.0.1:0", lambda: {"ok": True, "jobs": []})
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
        server.server_close()
    got = samples(text)
    assert got["swapaware_agent_jobs"] == 0 and "swapaware_agent_spool_events" not in got
    assert agent_metrics.serve("not-an-address", lambda: {}) is None
