"""The service's /metrics scraped on the real cluster during a short burst of submissions: the
decision counter counts exactly the burst's jobs, those the service answered (the socket Admit
histogram counts them) and those job_submit.lua decided from the admission table once the burst's
class is in it (counted when the service catches them up from the queue), and the series that
watch the service (queue snapshot age, history size) hold real values."""
import socket
import threading
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.waiting import wait_for

pytestmark = pytest.mark.integration
JOBS, SUBMITTERS = 150, 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value  # summed over labels
    return out


def test_metrics_scraped_during_a_burst(stack):
    port = free_port()
    tag = f"metrics-{uuid.uuid4().hex[:6]}"
    with stack.service_with(SWAPAWARE_SERVICE__METRICS_ADDRESS=f"127.0.0.1:{port}"):
        before = scrape(port)
        scrapes, stop = [], threading.Event()

        def scraper():
            while not stop.wait(0.05):
                scrapes.append(scrape(port))

        t = threading.Thread(target=scraper)
        t.start()
        try:
            with ThreadPoolExecutor(SUBMITTERS) as pool:
                results = list(pool.map(lambda i: stack.run(
                    "sbatch", "--hold", "--gres=gpu:1", f"--job-name={tag}", "--wrap=true", "--output=/dev/null",
                    check=False), range(JOBS)))
        finally:
            stop.set()
            t.join()
        assert all(r.returncode == 0 for r in results), [r.stderr for r in results if r.returncode][:3]

        def delta(name: str, now: dict) -> float:
            return now.get(name, 0.0) - before.get(name, 0.0)

        def counted() -> dict | None:  # a table-made decision counts once the queue poll catches it up
            now = scrape(port)
            return now if delta("swapaware_decisions_total", now) >= JOBS else None

        try:  # (the jobs still pending meanwhile)
            after = wait_for(counted, 90, lambda: f"{JOBS} decisions counted: {scrape(port)}", 0.5)
        finally:
            stack.run("scancel", "-n", tag, check=False)
    assert scrapes, "the endpoint answered during the burst"
    admits = delta("swapaware_admit_seconds_count", after)
    caught = delta("swapaware_decisions_caught_up_total", after)
    assert delta("swapaware_decisions_total", after) == JOBS and admits + caught == JOBS, (admits, caught)
    assert 0 <= after["swapaware_queue_snapshot_age_seconds"] < 120  # the service polls squeue
    assert after["swapaware_history_bytes"] > 0
    assert after.get("swapaware_plugin_fail_open_total", 0) == before.get("swapaware_plugin_fail_open_total", 0)
    counts = [s.get("swapaware_decisions_total", 0) for s in scrapes]
    assert counts == sorted(counts)  # a counter never goes back
