"""QueueMonitor against the stateful Slurm stand-in, then the queue rule end to end over real gRPC."""
import logging
import threading
import time

import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.slurm.queue import QueueMonitor
from policy_service.slurm.slurm import PendingJob
from policy_service.serving.client import PolicyClient
from policy_service.config import Config, PolicyConfig, load_config
from policy_service.core.types import LiveShards, QueueState
from policy_service.serving.server import start_service
from tests.waiting import wait_for

from tests.adapter.serving.test_service import GIB, facts, run_job

LOGGER = "swapaware.queue"
NO_SHARDS = LiveShards({})  # the stand-in's nodes list no shards unless a test sets node_shards


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def waiting_gpu_job(job_id=70, gres="gres:gpu:1", reason="Priority"):
    return PendingJob(job_id, gres, "", "", 1, 1, reason)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def monitor(slurm_jobs, clock):
    return QueueMonitor(slurm_jobs, Config(policy=PolicyConfig(queue_poll_s=15.0)), clock)


def outage_records(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def recovery_records(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO
            and "available again" in r.getMessage()]


def test_no_snapshot_before_the_first_poll(monitor, slurm_jobs):
    assert monitor.snapshot() is None
    assert slurm_jobs.queue_reads == 0  # snapshot() never calls Slurm


def test_poll_reflects_pending_jobs_and_gpus(monitor, slurm_jobs, clock):
    slurm_jobs.pending = [waiting_gpu_job(70), waiting_gpu_job(71, "gres:shard:4"),
                          waiting_gpu_job(72, reason="JobHeldUser")]
    slurm_jobs.gpus = 6
    assert monitor.poll_once() == QueueState(1.5, 6, 0.0, live_shards=NO_SHARDS)
    assert monitor.snapshot() == QueueState(1.5, 6, 0.0, live_shards=NO_SHARDS)
    clock.t += 7.0
    assert monitor.snapshot() == QueueState(1.5, 6, 7.0, live_shards=NO_SHARDS)
    slurm_jobs.pending = []
    slurm_jobs.gpus = 4
    assert monitor.poll_once() == QueueState(0.0, 4, 0.0, live_shards=NO_SHARDS)
    assert monitor.snapshot() == QueueState(0.0, 4, 0.0, live_shards=NO_SHARDS)
    assert slurm_jobs.queue_reads == 2


def test_snapshot_carries_the_queue_ahead_of_each_qos(monitor, slurm_jobs):
    slurm_jobs.qos_table = {"normal": 0, "high": 100}
    slurm_jobs.pending = [PendingJob(1, "gres:gpu:1", "", "", 1, 1, "Priority", "normal"),
                          PendingJob(2, "gres:shard:4", "", "", 1, 1, "Resources", "high")]
    monitor.poll_once()
    snap = monitor.snapshot()
    assert snap.pending_gpus == 1.5 and dict(snap.ahead_by_qos) == {"high": 0.5, "normal": 1.5}


def test_failing_squeue_keeps_the_last_snapshot_and_logs_once_per_outage(monitor, slurm_jobs, clock, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    slurm_jobs.pending = [waiting_gpu_job()]
    monitor.poll_once()
    assert outage_records(caplog) == [] and recovery_records(caplog) == []

    slurm_jobs.pending = None  # squeue fails
    for step in range(1, 5):
        clock.t += 15.0
        assert monitor.poll_once() is None
        assert monitor.snapshot() == QueueState(1.0, 4, 15.0 * step, live_shards=NO_SHARDS)  # kept, and getting older
    assert slurm_jobs.queue_reads == 5
    (warning,) = outage_records(caplog)
    assert "Unable to contact slurm controller" in warning.getMessage()
    assert "45 s" in warning.getMessage()  # 3 x queue_poll_s
    assert recovery_records(caplog) == []

    slurm_jobs.pending = []  # back
    clock.t += 1.0
    assert monitor.poll_once() == QueueState(0.0, 4, 0.0, live_shards=NO_SHARDS)
    assert monitor.snapshot() == QueueState(0.0, 4, 0.0, live_shards=NO_SHARDS)
    monitor.poll_once()
    assert len(recovery_records(caplog)) == 1 and len(outage_records(caplog)) == 1

    slurm_jobs.pending = None  # a second outage: one more warning
    monitor.poll_once()
    monitor.poll_once()
    assert len(outage_records(caplog)) == 2 and len(recovery_records(caplog)) == 1


def test_failing_first_poll_leaves_no_snapshot(monitor, slurm_jobs, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    slurm_jobs.pending = None
    assert monitor.poll_once() is None
    assert monitor.snapshot() is None
    assert len(outage_records(caplog)) == 1


def test_thread_polls_until_stopped(slurm_jobs):
    mon = QueueMonitor(slurm_jobs, Config(policy=PolicyConfig(queue_poll_s=0.01))).start()
    try:
        wait_for(lambda: slurm_jobs.queue_reads >= 3, 5.0, "three polls")
        slurm_jobs.pending = [waiting_gpu_job()]
        wait_for(lambda: (s := mon.snapshot()) is not None and s.pending_gpus == 1.0, 5.0, "the new queue")
    finally:
        t0 = time.monotonic()
        mon.stop()
        stopped_in = time.monotonic() - t0
    assert stopped_in < 1.0
    assert not mon._thread.is_alive()


def test_stop_does_not_wait_out_a_long_poll_period(slurm_jobs):
    mon = QueueMonitor(slurm_jobs, Config(policy=PolicyConfig(queue_poll_s=300.0))).start()
    wait_for(lambda: mon.snapshot() is not None, 5.0, "the first poll")
    t0 = time.monotonic()
    mon.stop()
    assert time.monotonic() - t0 < 1.0
    assert not mon._thread.is_alive()
    assert slurm_jobs.queue_reads == 1


def test_thread_survives_a_failing_slurm(slurm_jobs, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    slurm_jobs.pending = None
    mon = QueueMonitor(slurm_jobs, Config(policy=PolicyConfig(queue_poll_s=0.01))).start()
    try:
        wait_for(lambda: slurm_jobs.queue_reads >= 5, 5.0, "polls while failing")
        assert mon._thread.is_alive() and mon.snapshot() is None
        slurm_jobs.pending = [waiting_gpu_job()]
        wait_for(lambda: mon.snapshot() is not None, 5.0, "a snapshot after recovery")
    finally:
        mon.stop()
    assert len(outage_records(caplog)) == 1 and len(recovery_records(caplog)) == 1


# ----------------------------------------------------------------------------- service wiring
def test_service_runs_no_monitor_when_the_rule_is_off(service):
    assert service.queue_monitor is None  # service_env sets share_min_queue = 0


def test_service_runs_no_monitor_without_slurm(service_env):
    env = dict(service_env, SWAPAWARE_POLICY__SHARE_MIN_QUEUE="0.05")
    svc = start_service(load_config(env=env), slurm=None, use_slurm=False)
    try:
        assert svc.queue_monitor is None and svc.handler.queue is None
    finally:
        svc.stop(0)


def test_failed_start_leaves_no_threads_behind(service_env, slurm_jobs, tmp_path):
    (tmp_path / "a-file").write_text("")  # the socket's directory cannot be created
    env = dict(service_env, SWAPAWARE_POLICY__SHARE_MIN_QUEUE="0.05",
               SWAPAWARE_SERVICE__SOCKET_PATH=str(tmp_path / "a-file" / "policy.sock"))
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(OSError):
        start_service(load_config(env=env), slurm=slurm_jobs)
    left = {t.name for t in threading.enumerate() if t.is_alive()} - before
    assert not left & {"queue-monitor", "decision-writer"}, left
    assert slurm_jobs.queue_reads == 1  # one snapshot before serving, none after the failed start


@pytest.fixture
def queue_service(service_env, slurm_jobs):
    env = dict(service_env, SWAPAWARE_POLICY__SHARE_MIN_QUEUE="0.05", SWAPAWARE_POLICY__QUEUE_POLL_S="0.05")
    svc = start_service(load_config(env=env), slurm=slurm_jobs)
    try:
        yield svc
    finally:
        svc.stop(0)


def reasons(decision):
    return {r.code: r.message for r in decision.reasons}


def test_end_to_end_share_only_while_gpu_work_waits(queue_service, slurm_jobs):
    svc = queue_service
    assert svc.queue_monitor is not None
    job = facts(name="queued")
    with PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0) as client:
        wait_for(lambda: svc.queue_monitor.snapshot() is not None, 5.0, "the monitor's first poll")

        # learn the class: one run peaking at 3 GiB would fit in one 10 GiB shard
        first, fin = run_job(client, slurm_jobs, 81, job, peak=3 * GIB)
        assert first.action == pb.ACTION_WHOLE_GPU and "no_history" in reasons(first)
        assert fin.applied and fin.decision_id == first.decision_id

        # empty queue: the job would start at once, it keeps a whole GPU
        slurm_jobs.pending = []
        d = client.admit(job).decision
        why = reasons(d)
        assert d.action == pb.ACTION_WHOLE_GPU and d.shards == 8
        assert d.rewrite.tres_per_node == "gres:shard:8" and d.rewrite.tres_per_job == ""
        assert "queue_short" in why and "queue_unknown" not in why and "fits_in_shards" not in why
        assert "0.00 of 4 GPUs" in why["queue_short"]
        assert d.estimate.peak_bytes == 3 * GIB  # the estimate is known: only the queue kept it whole
        assert "why=queue_short," in d.rewrite.admin_comment

        # one gres:gpu:1 job waits on Priority: 1 of 4 GPUs = 25 % >= 5 %
        slurm_jobs.pending = [waiting_gpu_job(90)]
        wait_for(lambda: (s := svc.queue_monitor.snapshot()) is not None and s.pending_gpus == 1.0, 5.0,
                 lambda: f"the monitor to see the waiting job (snapshot {svc.queue_monitor.snapshot()})")
        assert svc.queue_monitor.snapshot().pressure == 0.25
        d2 = client.admit(job).decision
        why2 = reasons(d2)
        assert d2.action == pb.ACTION_SHARE and d2.shards == 1
        assert d2.rewrite.tres_per_node == "gres:shard:1"
        assert "fits_in_shards" in why2 and "queue_short" not in why2 and "queue_unknown" not in why2

        # a held job asks for GPUs too but does not wait for them: the queue counts as empty again
        slurm_jobs.pending = [waiting_gpu_job(91, reason="JobHeldUser")]
        wait_for(lambda: (s := svc.queue_monitor.snapshot()) is not None and s.pending_gpus == 0.0, 5.0,
                 "the monitor to drop the waiting job")
        d3 = client.admit(job).decision
        assert d3.action == pb.ACTION_WHOLE_GPU and "queue_short" in reasons(d3)


def test_end_to_end_squeue_outage_shares_with_queue_unknown(service_env, slurm_jobs):
    # squeue fails from the start: the service never gets a snapshot, so the queue is unknown
    env = dict(service_env, SWAPAWARE_POLICY__SHARE_MIN_QUEUE="0.05", SWAPAWARE_POLICY__QUEUE_POLL_S="0.05")
    slurm_jobs.pending = None  # squeue fails from the start
    svc = start_service(load_config(env=env), slurm=slurm_jobs)
    try:
        with PolicyClient(f"127.0.0.1:{svc.grpc_port}", 5.0) as client:
            run_job(client, slurm_jobs, 82, facts(name="blind"), peak=3 * GIB)
            wait_for(lambda: slurm_jobs.queue_reads >= 2, 5.0, "polls while squeue fails")
            d = client.admit(facts(name="blind")).decision
            assert d.action == pb.ACTION_SHARE and d.shards == 1
            assert "queue_unknown" in reasons(d) and "queue_short" not in reasons(d)
    finally:
        svc.stop(0)


# ----------------------------------------------------------------------------- doctor
def test_doctor_queue_check_reports_what_the_rule_will_see(slurm_jobs):
    from policy_service.admin import queue_check

    slurm_jobs.qos_table = {"normal": 0, "high": 100}
    slurm_jobs.pending = [PendingJob(1, "gres:gpu:1", "", "", 1, 1, "Priority", "normal")]
    c = queue_check(slurm_jobs, Config())
    assert c.ok and c.detail.startswith("1.00 GPU(s) pending of 4 on nodes taking jobs (pressure 25.0%")
    assert "QoS priorities: high=100, normal=0" in c.detail
    slurm_jobs.gpus = 0
    assert not queue_check(slurm_jobs, Config()).ok
    slurm_jobs.gpus, slurm_jobs.pending = 4, None
    failed = queue_check(slurm_jobs, Config())
    assert not failed.ok and "cannot read the queue: squeue: error" in failed.detail
    assert "policy.share_min_queue = 0" in failed.fix


# ----------------------------------------------------------------------------- the controller's shards
def test_the_poll_reads_each_nodes_shards_and_a_controller_change_marks_them_unread(slurm_jobs):
    slurm_jobs.node_shards = {"n1": {"a100": 0}}
    mon = QueueMonitor(slurm_jobs, Config(policy=PolicyConfig(queue_poll_s=300.0))).start()
    try:
        wait_for(lambda: mon.snapshot() is not None, 5.0, "the first poll")
        live = mon.snapshot().live_shards
        assert live.by_node == {"n1": {"a100": 0}} and live.unread == ""
        assert live.refuses("n1", "a100")
        reads = slurm_jobs.queue_reads
        slurm_jobs.node_shards = {"n1": {"a100": 16}}
        mon.controller_changed("now writer")  # polls at once, not after 300 s
        wait_for(lambda: slurm_jobs.queue_reads > reads and mon.snapshot().live_shards.unread == "", 5.0,
                 "a poll after the change")
        assert mon.snapshot().live_shards.by_node == {"n1": {"a100": 16}}
    finally:
        mon.stop()


def test_a_snapshot_from_a_poll_begun_before_the_change_stays_unread(slurm_jobs, clock):
    mon = QueueMonitor(slurm_jobs, Config(policy=PolicyConfig(queue_poll_s=15.0)), clock)
    slurm_jobs.node_shards = {"n1": {"a100": 16}}
    real_nodes = slurm_jobs.cluster_nodes

    def change_during_the_poll():
        mon.controller_changed("role change")
        return real_nodes()

    slurm_jobs.cluster_nodes = change_during_the_poll
    mon.poll_once()
    live = mon.snapshot().live_shards
    assert live.unread.startswith("role change: ") and live.refuses("n1", "a100")
    slurm_jobs.cluster_nodes = real_nodes
    mon.poll_once()
    assert mon.snapshot().live_shards.unread == "" and not mon.snapshot().live_shards.refuses("n1", "a100")


def test_a_slurmctld_started_after_the_last_poll_began_has_its_shards_unread_until_the_next(slurm_jobs, clock):
    """The job_submit plugin's Lua state is created when slurmctld starts (or, 23.11+, is
    reconfigured): a snapshot from a poll begun before then cannot show nodes that have not
    registered with it (typed shard jobs refused there, 24.11 and 26.05). Once per Lua state."""
    wall = [1000.0]
    mon = QueueMonitor(slurm_jobs, Config(policy=PolicyConfig(queue_poll_s=15.0)), clock, wall=lambda: wall[0])
    slurm_jobs.node_shards = {"n1": {"a100": 16}}
    mon.poll_once()  # began at 1000.0
    assert not mon.slurmctld_started("1-0x1", 998.5)  # started before the poll (and its slack)
    assert mon.snapshot().live_shards.unread == ""
    assert mon.slurmctld_started("1-0x2", 999.5)  # within the slack of os.time()'s whole seconds
    live = mon.snapshot().live_shards
    assert "slurmctld started at" in live.unread and live.refuses("n1", "a100")
    assert not mon.slurmctld_started("1-0x2", 999.5)  # the same Lua state: looked at once
    wall[0] = 1002.0
    mon.poll_once()  # begun after the start: the restarted controller's view
    assert mon.snapshot().live_shards.unread == ""
    assert not mon.slurmctld_started("1-0x3", 0.0)  # an older plugin sends no start time


def test_after_a_controller_change_the_shards_stay_unread_for_the_hold(slurm_jobs, clock):
    """A 22.05 backup that took over was seen to show its nodes' shards for seconds before it
    showed them as 0: after a role change there the counts stay unread for a while, polls or not."""
    mon = QueueMonitor(slurm_jobs, Config(policy=PolicyConfig(queue_poll_s=15.0)), clock)
    slurm_jobs.node_shards = {"n1": {"a100": 16}}
    mon.controller_changed("this service became writer", hold_s=30.0)
    mon.poll_once()
    assert mon.snapshot().live_shards.unread.startswith("this service became writer")
    clock.t += 29.0
    mon.poll_once()
    assert mon.snapshot().live_shards.refuses("n1", "a100")
    clock.t += 1.5
    assert mon.snapshot().live_shards.unread == "" and not mon.snapshot().live_shards.refuses("n1", "a100")


def _read_records(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "after the role change" in r.getMessage()]


def test_the_first_read_after_each_controller_change_is_logged_once_with_its_delay(slurm_jobs, clock, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    mon = QueueMonitor(slurm_jobs, Config(policy=PolicyConfig(queue_poll_s=15.0)), clock)
    mon.poll_once()
    assert _read_records(caplog) == []                        # no change yet: nothing to say
    mon.controller_changed("this service became writer")
    clock.t += 2.5
    mon.poll_once()
    clock.t += 15
    mon.poll_once()                                           # the same change: said once
    assert _read_records(caplog) == [
        "shards of the controller in control read 2.5 s after the role change (this service became writer)"]
    mon.controller_changed("takeover", hold_s=30.0)
    mon.controller_changed("takeover again", hold_s=30.0)    # two before a poll: one line, for the last
    clock.t += 0.5
    slurm_jobs.pending = None                                 # squeue fails
    mon.poll_once()                                           # a failed poll reads nothing
    assert len(_read_records(caplog)) == 1
    slurm_jobs.pending = []
    clock.t += 1.0
    mon.poll_once()
    assert _read_records(caplog)[1:] == ["shards of the controller in control read 1.5 s after the role change "
                                         "(takeover again); used from 30.0 s on (held after the change)"]
