"""The admission table publisher, the gate file and the service's start and stop: the gate follows
each queue poll at once, sends jobs to the RPC path while the controller refuses shards, is not
rewritten by a stopped publisher; events wait until the table and its catch-up are attached, and the
table is built only once the service serves.

The fixtures and helpers (env, queued...) are test_admission_publish.py's."""
import json
import time
from pathlib import Path

import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.config import load_config
from policy_service.serving.server import start_service
from tests.waiting import wait_for

from tests.adapter.admission.test_admission_publish import env, queued  # noqa: F401  (env: the fixture)


def test_events_wait_until_the_table_and_its_catch_up_are_attached(env, slurm_jobs, tmp_path, monkeypatch):
    """The gRPC port serves before the catch-up is attached: an event taken then could miss its
    table-made decision or leave its class in the table. It is refused as a standby refuses one
    (the hooks spool it), and taken once the service has started."""
    import grpc

    from policy_service.serving import server
    from policy_service.serving.handler import Method
    from policy_service.serving.handler_error import HandlerError

    seen = []
    attach = server.attach_catchup

    def attach_after_an_event(handler, *args, **kwargs):
        fin = pb.JobFinishedRequest(job_id=77, node="n1", gpu_indices=[0], finished_at=1100.0, exit_code=0,
                                    event_id="f77", telemetry_source="none")
        try:
            Method.JOB_FINISHED.call(handler, fin)
        except HandlerError as exc:
            seen.append((exc.code, exc.message))
        return attach(handler, *args, **kwargs)

    monkeypatch.setattr(server, "attach_catchup", attach_after_an_event)
    (tmp_path / "run").mkdir()
    s = start_service(load_config(env=env), slurm=slurm_jobs)
    try:
        assert seen and seen[0][0] is grpc.StatusCode.UNAVAILABLE and "starting" in seen[0][1]
        assert s.handler.standby is None  # started: events are taken
    finally:
        s.stop(0)


def test_the_gate_file_follows_each_queue_poll_at_once(env, slurm_jobs, tmp_path):
    (tmp_path / "run").mkdir()
    # the monitor's own polls 300 s apart: only the test's poll moves the snapshot
    s = start_service(load_config(env=dict(env, SWAPAWARE_POLICY__QUEUE_POLL_S="300")), slurm=slurm_jobs)
    try:
        p = s.admission_publisher
        wait_for(lambda: p.gate.exists(), 30.0, "first gate file")
        first = json.loads(p.gate.read_text())
        assert first["other"] == "short"  # the first snapshot: nothing waits
        slurm_jobs.pending = queued(2)
        s.queue_monitor.poll_once()  # returns once the gate file is written (on_poll)
        gate = json.loads(p.gate.read_text())
        assert gate["other"] == "normal" and gate["valid_until"] > first["valid_until"]
        assert gate["valid_until"] == pytest.approx(time.time() + 900.0, abs=2.0)
    finally:
        s.stop(0)


def test_the_gate_sends_jobs_to_the_rpc_path_while_the_controller_refuses_shards(env, slurm_jobs, tmp_path):
    """The table's decisions assume every GPU of the fleet takes shard jobs; while the controller in
    control refuses them somewhere (a 22.05 backup after scontrol takeover), the gate says so and
    the plugin asks the service, which reads the live counts."""
    (tmp_path / "run").mkdir()
    conf = Path(env["SWAPAWARE_SERVICE__SLURM_CONF"])
    conf.write_text("NodeName=n1 CPUs=8 Gres=gpu:a100:2,shard:16\nPartitionName=gpu Nodes=n1 Default=YES\n")
    (conf.parent / "gres.conf").write_text("Name=gpu Type=a100 File=/dev/nvidia[0-1]\n"
                                           "Name=shard Count=8 File=/dev/nvidia0\nName=shard Count=8 File=/dev/nvidia1\n")
    slurm_jobs.node_shards = {"n1": {"a100": 16}}
    s = start_service(load_config(env=dict(env, SWAPAWARE_POLICY__QUEUE_POLL_S="300")), slurm=slurm_jobs)
    try:
        p = s.admission_publisher
        wait_for(lambda: p.gate.exists(), 30.0, "first gate file")
        # a gate written while the service was starting may send jobs the round trip: a starting
        # service counts as standby, and on 22.05's dialect a standby has not read the shards of the
        # controller in control (so the table built meanwhile is not used); the first poll once
        # serving writes the gate as serving
        s.queue_monitor.poll_once()
        assert "rpc_only" not in json.loads(p.gate.read_text())
        assert "controller" not in json.loads(p.gate.read_text())  # [ha] off: one controller
        slurm_jobs.node_shards = {"n1": {"a100": 0}}
        s.queue_monitor.poll_once()  # returns once the gate file is written (on_poll)
        gate = json.loads(p.gate.read_text())
        assert gate["rpc_only"] == ("the controller refuses shards on 1 node(s): n1: the controller in control "
                                    "reports 0 a100 shards"), gate
        slurm_jobs.node_shards = {"n1": {"a100": 16}}
        s.queue_monitor.poll_once()
        assert "rpc_only" not in json.loads(p.gate.read_text())
        # after a slurmctld restart or reconfigure (24.11+): typed counts shown, State=UNKNOWN
        slurm_jobs.node_unregistered = {"n1"}
        s.queue_monitor.poll_once()
        assert "n1: the node has not registered with the controller" in json.loads(p.gate.read_text())["rpc_only"]
        slurm_jobs.node_unregistered = set()
        s.queue_monitor.poll_once()
        assert "rpc_only" not in json.loads(p.gate.read_text())
    finally:
        s.stop(0)


def test_a_stopped_publisher_writes_no_gate_after_the_queue_polls(env, slurm_jobs, tmp_path):
    """The queue monitor outlives the publisher while a service stops: its polls must not rewrite
    the gate file of a publisher that stopped (the plugin then ages it out by valid_until)."""
    (tmp_path / "run").mkdir()
    s = start_service(load_config(env=dict(env, SWAPAWARE_POLICY__QUEUE_POLL_S="300")), slurm=slurm_jobs)
    try:
        p = s.admission_publisher
        wait_for(lambda: p.gate.exists(), 30.0, "first gate file")
        p.stop()
        before = p.gate.read_bytes()
        slurm_jobs.pending = queued(2)
        s.queue_monitor.poll_once()  # a new snapshot (normal, no longer short): no gate file for it
        assert s.queue_monitor.snapshot().pending_gpus == 2.0
        assert p.gate.read_bytes() == before
    finally:
        s.stop(0)


def test_the_table_is_built_only_once_the_service_serves(env, slurm_jobs, tmp_path, monkeypatch):
    """A starting service counts as standby (events wait until the catch-up is attached), and on
    22.05's dialect a standby has not read the controller's shards: a table built then holds every
    shard refused (whole_gpu, shards_refused), which the plugin would use once the gate lets it. So
    the publisher starts building once the service serves. (A fresh-clone run whose first build fell
    in the starting window failed test_queue_rule: every job of a learned class kept whole.)"""
    from policy_service.admission.publish import AdmissionPublisher

    (tmp_path / "run").mkdir()
    seen: list = []
    started = AdmissionPublisher.start

    def start(self):
        seen.append(self.handler.standby() if self.handler.standby is not None else None)
        return started(self)
    monkeypatch.setattr(AdmissionPublisher, "start", start)
    s = start_service(load_config(env=env), slurm=slurm_jobs)
    try:
        assert s.handler.dialect.takeover_zero_shards  # (the tests' release: 22.05)
        assert seen == [None]  # serving, not "the service is starting ..."
        wait_for(lambda: s.admission_publisher.table.exists(), 30.0, "the first table")
    finally:
        s.stop(0)


def test_the_publisher_keeps_its_history_reader_and_follows_a_restored_file(env, slurm_jobs, tmp_path):
    """The publisher's reader of the history is opened once, not at every tick (each opening read
    the schema again, more than the tick's query cost); when the history file was removed while
    the service ran and the store restored it (history/file.py check_file), the publisher reads
    the file the store writes, and sees the decisions recorded since."""
    from tests.adapter.serving.test_service import facts
    from policy_service.serving.client import PolicyClient

    (tmp_path / "run").mkdir()
    s = start_service(load_config(env=env), slurm=slurm_jobs)
    try:
        pub, store = s.admission_publisher, s.store
        opened = []
        open_reader = store.open_reader
        store.open_reader = lambda: opened.append(1) or open_reader()
        with PolicyClient(f"127.0.0.1:{s.grpc_port}", 5.0) as client:
            client.admit(facts(name="before"))
            s.handler.flush()
            for _ in range(5):
                pub.tick()
            before = len(pub._facts)
            assert before >= 1 and len(opened) <= 1  # (the first tick may have run before the wrap)
            Path(store.path).unlink()
            assert "restored" in store.check_file()
            client.admit(facts(name="after"))
            s.handler.flush()
            pub.tick()
        assert len(pub._facts) == before + 1  # the decision recorded in the restored file
        assert len(opened) <= 2
    finally:
        s.stop(0)
    assert pub._db is None  # closed with the publisher
