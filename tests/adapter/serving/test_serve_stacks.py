"""`swapaware serve` answers SIGUSR1 with every thread's stack in its log (faulthandler), and goes
on serving: what docs/admin-guide.md tells admins, and what the HA suite's report reads when a
service did not take the writer's role in time (tests/multinode_ha/controllers.service_stacks,
run here on a real `swapaware serve` laid out as the HA cluster lays out its services)."""
from __future__ import annotations

import signal
from types import SimpleNamespace

from tests.adapter.serving.test_port_squatter import catches, serve_process
from tests.multinode_ha.controllers import service_stacks
from tests.waiting import wait_for


def test_sigusr1_writes_every_threads_stack_to_the_log_and_the_service_goes_on(service_env, tmp_path):
    log_path = tmp_path / "log" / "swapaware-ctl1.log"  # where the HA cluster's ctl1 service logs
    log_path.parent.mkdir()
    with serve_process(service_env, log_path) as p:
        wait_for(lambda: catches(p.pid, signal.SIGTERM) or p.poll() is not None, 60, "serve started")
        assert p.poll() is None, log_path.read_text()
        assert catches(p.pid, signal.SIGUSR1)
        run = tmp_path / "nodes" / "ctl1" / "run"
        run.mkdir(parents=True)
        (run / "swapaware.pid").write_text(f"{p.pid}\n")
        report = service_stacks(SimpleNamespace(state=tmp_path), "ctl1", log_path)
        assert report.startswith(f"-- ctl1's service (pid {p.pid}), its threads' stacks:"), report
        assert "in serve_forever" in report, report  # the main thread, waiting for its signals
        text = log_path.read_text()
        assert text.count("Thread 0x") + text.count("Current thread 0x") >= 3, text[-3000:]  # every thread's
        assert p.poll() is None  # it goes on
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=15) == 0
