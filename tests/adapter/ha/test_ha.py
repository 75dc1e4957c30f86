"""Two controllers, one history (docs/ha.md): two real services on loopback sharing one store
(a SQLite file here), each told its role by its role file; real gRPC, real local sockets.

A standby refuses events (UNAVAILABLE, 'standby: writer is <h>') and the hooks move on to the
writer; spooled events drain to the writer once; two services both told they are primary have one
writer, the other's decisions wait in its journal and reach the history once it writes."""
from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.ha.role import write_role
from policy_service.history.store import HistoryStore
from policy_service.serving.client import FailoverClient, PolicyClient, attempt_order
from policy_service.config import HaConfig, HookConfig, load_config
from policy_service.core.admission_format import read_table
from policy_service.core.ha import Role
from policy_service.serving.server import start_service
from slurm_plugin.hooks import spool
from slurm_plugin.hooks.run import LAST_SERVICE_FILE, deliver, hook_client
from tests.waiting import wait_for

from tests.adapter.conftest import SlurmJobs, socket_call


def dead_address() -> str:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def started(job_id: int, event_id: str) -> pb.JobStartedRequest:
    return pb.JobStartedRequest(job_id=job_id, node="n1", gpu_indices=[0], started_at=1000.0 + job_id,
                                event_id=event_id)


# ---------------------------------------------------------------- clients alone (no [ha] on the service)
def test_attempt_order_puts_the_last_good_first():
    assert attempt_order(["a:1", "b:2", "c:3"], "b:2") == ["b:2", "a:1", "c:3"]
    assert attempt_order(["a:1", "b:2"], "gone:9") == ["a:1", "b:2"]
    assert attempt_order(["a:1", "a:1", "b:2"], None) == ["a:1", "b:2"]


def test_the_hook_moves_on_from_a_dead_controller_and_remembers_who_answered(service, service_env, tmp_path):
    live = f"127.0.0.1:{service.grpc_port}"
    hooks = load_config(env=service_env).hooks
    ha = HaConfig(controllers=(dead_address(), live))
    assert deliver(hooks, "JobStarted", started(7, "s-7"), ha=ha)
    assert service.store.run(7) is not None
    assert (Path(hooks.spool_dir) / LAST_SERVICE_FILE).read_text().strip() == live
    with hook_client(hooks, ha=ha) as client:  # the next hook run starts with the one that answered
        assert isinstance(client, FailoverClient) and client.last_good == live
    assert not spool.pending(hooks.spool_dir)


def test_every_controller_down_spools_within_the_deadline(service_env, tmp_path):
    hooks = load_config(env=service_env).hooks
    ha = HaConfig(controllers=(dead_address(), dead_address()))
    t0 = time.monotonic()
    assert not deliver(hooks, "JobStarted", started(8, "s-8"), ha=ha)
    assert time.monotonic() - t0 < hooks.deadline_s + 1.0
    assert len(spool.pending(hooks.spool_dir)) == 1


# ---------------------------------------------------------------- two services, one store
def ha_env(base: Path, name: str, db: Path | None, role: Role | None, extra: dict | None = None) -> dict[str, str]:
    """One controller host's service: its own socket, journal (beside service.db_path: a symlink to
    the shared SQLite file ``db``, or no file at all beside a MariaDB history) and role file; the
    history itself shared."""
    home = base / name
    home.mkdir(mode=0o755, exist_ok=True)
    link = home / "history.sqlite3"
    if db is not None:
        link.symlink_to(db)
    role_file = home / "run" / "role"
    if role is not None:
        write_role(role_file, role, time.time())
    env = {
        "SWAPAWARE_SERVICE__DB_PATH": str(link),
        "SWAPAWARE_SERVICE__SOCKET_PATH": str(home / "policy.sock"),
        "SWAPAWARE_SERVICE__GRPC_ADDRESS": "127.0.0.1:0",
        "SWAPAWARE_SERVICE__SLURM_CONF": str(home / "slurm.conf"),
        "SWAPAWARE_SERVICE__SLURM_RELEASE": "22.05",
        "SWAPAWARE_HOOKS__SPOOL_DIR": str(home / "spool"),
        "SWAPAWARE_HOOKS__AGENT_SOCKET": str(home / "no-agent.sock"),
        "SWAPAWARE_POLICY__SHARE_MIN_QUEUE": "0",
        "SWAPAWARE_POLICY__OVERCOMMIT_COMPUTE_MIN_QUEUE": "0",
        "SWAPAWARE_POLICY__REDECIDE_PENDING": "false",
        "SWAPAWARE_ESTIMATOR__MIN_SAMPLES": "1",
        "SWAPAWARE_AUTH__MUNGE": "off",
        "SWAPAWARE_HA__ENABLED": "true",
        "SWAPAWARE_HA__HOLDER": name,
        "SWAPAWARE_HA__LEASE_TTL_S": "1.0",
        "SWAPAWARE_HA__RENEW_S": "0.2",
        "SWAPAWARE_HA__ROLE_FILE": str(role_file),
    }
    env.update(extra or {})
    return env


@pytest.fixture
def pair(short_dir, history_backend):
    """Start services by name (role file primary/backup) on one history: a SQLite file, or a MariaDB
    database; all stopped at the end."""
    db = None
    if history_backend.name == "sqlite":
        db = short_dir / "shared" / "history.sqlite3"
        HistoryStore(db).close()  # the shared history exists before either service starts
    running = {}

    def start(name: str, role: Role | None, **extra: str):
        cfg = load_config(env=ha_env(short_dir, name, db, role, {**history_backend.env, **extra}))
        running[name] = start_service(cfg, slurm=SlurmJobs())
        return running[name]

    start.running = running
    yield start
    for svc in running.values():
        svc.stop(0)


def writer_health(svc) -> str:
    """The service's health entry swapaware.writer, by name."""
    with grpc.insecure_channel(f"127.0.0.1:{svc.grpc_port}") as ch:
        got = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="swapaware.writer"), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(got.status)


def admit_locally(svc, name: str) -> str:
    reply = socket_call(svc.socket_path, {"method": "Admit", "request": {"job": {
        "user": "alice", "jobName": name, "tresPerNode": "gres:gpu:1"}}})
    return reply["response"]["decision"]["decisionId"]


def test_the_standby_refuses_events_and_the_hook_fails_over_to_the_writer(pair, short_dir):
    a = pair("a", Role.PRIMARY)
    b = pair("b", Role.BACKUP)
    wait_for(a.role.is_writer, 10, "a to write")
    assert not b.role.is_writer()
    with PolicyClient(f"127.0.0.1:{b.grpc_port}", 5.0) as to_b:
        with pytest.raises(grpc.RpcError) as refused:
            to_b.call("JobStarted", started(11, "s-11"))
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert refused.value.details() == "standby: writer is a"
        # reads work on either
        d_id = admit_locally(a, "read-me")
        a.handler.flush()
        assert to_b.explain(pb.ExplainRequest(decision_id=d_id)).decision.decision_id == d_id
    hooks = HookConfig(spool_dir=short_dir / "node-spool", deadline_s=3.0)
    ha = HaConfig(controllers=(f"127.0.0.1:{b.grpc_port}", f"127.0.0.1:{a.grpc_port}"))
    assert deliver(hooks, "JobStarted", started(11, "s-11"), ha=ha)
    assert a.store.run(11) is not None
    assert (hooks.spool_dir / LAST_SERVICE_FILE).read_text().strip() == f"127.0.0.1:{a.grpc_port}"


def test_spooled_events_drain_to_whichever_writes_once(pair, short_dir):
    a = pair("a", Role.PRIMARY)
    b = pair("b", Role.BACKUP)
    wait_for(a.role.is_writer, 10, "a to write")
    spool_dir = short_dir / "node-spool"
    for j in range(1, 21):
        spool.spool_event(spool_dir, "JobStarted", started(j, f"s-{j}"), f"s-{j}")
    # the takeover: a's slurmctld is no longer in control, b's is
    assert (writer_health(a), writer_health(b)) == ("SERVING", "NOT_SERVING")
    write_role(short_dir / "a" / "run" / "role", Role.BACKUP, time.time())
    write_role(short_dir / "b" / "run" / "role", Role.PRIMARY, time.time())
    wait_for(b.role.is_writer, 10, "b to write after the takeover")
    assert not a.role.is_writer()
    wait_for(lambda: (writer_health(a), writer_health(b)) == ("NOT_SERVING", "SERVING"), 10, "the health entries")
    addresses = (f"127.0.0.1:{a.grpc_port}", f"127.0.0.1:{b.grpc_port}")
    with hook_client(HookConfig(spool_dir=spool_dir, deadline_s=3.0), ha=HaConfig(controllers=addresses)) as c:
        result = spool.replay(spool_dir, c.call, max_events=10_000)
    assert (result.sent, result.left, result.stopped_by) == (20, 0, "")
    assert all(b.store.run(j) is not None for j in range(1, 21))
    # the same events again (an answer lost on the way): nothing twice
    for j in range(1, 21):
        spool.spool_event(spool_dir, "JobStarted", started(j, f"s-{j}"), f"s-{j}")
    with hook_client(HookConfig(spool_dir=spool_dir, deadline_s=3.0), ha=HaConfig(controllers=addresses)) as c:
        assert spool.replay(spool_dir, c.call, max_events=10_000).sent == 20
    assert len(b.store.open_runs_of(5, "n1")) == 1


def test_two_services_told_primary_have_one_writer_and_the_others_journal_drains_later(pair, short_dir):
    a = pair("a", Role.PRIMARY)
    wait_for(a.role.is_writer, 10, "a to write")
    b = pair("b", Role.PRIMARY)  # both told they are primary
    for _ in range(10):  # b keeps trying every renew_s; a keeps renewing: b never writes meanwhile
        b.role.step()
        assert a.role.is_writer() and not b.role.is_writer()
    assert b.role.standby_reason() == "standby: writer is a"
    d_b = admit_locally(b, "from-b")  # b still answers Admit (its slurmctld may be the one in control)
    # b's writer is refused by the store's fence: the decision waits in b's journal
    wait_for(lambda: "NotWriter" in b.handler.decisions.failing, 10, "b's journal to be refused by the fence")
    assert b.store.decision(d_b) is None
    assert [r.decision_id for r in b.handler.decisions.records()] == [d_b]
    a.stop(0)  # gives the lease back
    del pair.running["a"]
    wait_for(b.role.is_writer, 10, "b to write once a is gone")
    wait_for(lambda: b.store.decision(d_b) is not None, 15, "b's journaled decision in the history")
    with PolicyClient(f"127.0.0.1:{b.grpc_port}", 5.0) as to_b:  # and b takes events now
        to_b.call("JobStarted", started(12, "s-12"))
    assert b.store.run(12) is not None


def test_only_the_writer_publishes_the_admission_table_and_says_why_it_writes(pair, short_dir, caplog, history_backend):
    def table_of(name):
        (short_dir / name / "table").mkdir(mode=0o755, parents=True)
        return {"SWAPAWARE_ADMISSION__TABLE_PATH": str(short_dir / name / "table" / "admission.json"),
                "SWAPAWARE_POLICY__QUEUE_POLL_S": "0.2"}

    caplog.set_level(logging.WARNING, logger="swapaware.ha")
    a = pair("a", Role.PRIMARY, **table_of("a"))
    b = pair("b", Role.BACKUP, **table_of("b"))
    wait_for(a.admission_publisher.table.exists, 15, "a's table")
    b.admission_publisher.tick()  # what its thread runs: nothing while standby
    assert b.admission_publisher.last is None and not b.admission_publisher.table.exists()
    write_role(short_dir / "a" / "run" / "role", Role.BACKUP, time.time())
    write_role(short_dir / "b" / "run" / "role", Role.PRIMARY, time.time())
    wait_for(b.admission_publisher.table.exists, 15, "b's table once b writes")
    assert b.role.is_writer() and not a.role.is_writer()
    said = [r.getMessage() for r in caplog.records]
    # a released the lease: b read it free, or read it still a's and claimed it as a let go
    assert any(m in ("ha: b is now the writer (epoch 2): take the free lease (the role file says primary)",
                     "ha: b is now the writer (epoch 2): take the lease a let go (the role file says primary)")
               for m in said), said
    assert any(m.startswith("ha: a is standby, writer is nobody: release (the role file says backup)")
               for m in said), said


def test_a_writer_back_publishes_at_once_over_the_other_writers_table(pair, short_dir, history_backend):
    """Two services on one table path (both controllers see it): a service that becomes the writer
    again publishes at its next tick, though nothing it depends on changed and refresh_s and
    valid_s / 2 are far off: the file held the other writer's version, which its archive (its
    catch-up's) does not hold."""
    (short_dir / "table").mkdir(mode=0o755)
    shared = {"SWAPAWARE_ADMISSION__TABLE_PATH": str(short_dir / "table" / "admission.json"),
              "SWAPAWARE_ADMISSION__REFRESH_S": "1000", "SWAPAWARE_ADMISSION__VALID_S": "3000",
              "SWAPAWARE_POLICY__QUEUE_POLL_S": "0.2"}
    a = pair("a", Role.PRIMARY, **shared)
    b = pair("b", Role.BACKUP, **shared)

    def in_file() -> str:
        try:
            return read_table(a.admission_publisher.table.read_bytes())["version"]
        except (FileNotFoundError, ValueError):
            return ""

    def swap(to_writer, to_standby) -> None:
        write_role(short_dir / to_standby / "run" / "role", Role.BACKUP, time.time())
        write_role(short_dir / to_writer / "run" / "role", Role.PRIMARY, time.time())

    wait_for(lambda: a.admission_publisher.last is not None and in_file() == a.admission_publisher.last.version,
             15, "a's table")
    swap("b", "a")
    wait_for(lambda: b.admission_publisher.last is not None and in_file() == b.admission_publisher.last.version,
             15, lambda: f"b's table once b writes (file {in_file()})")
    assert b.admission_publisher.last.version != a.admission_publisher.last.version
    swap("a", "b")
    wait_for(a.role.is_writer, 15, "a the writer again")
    wait_for(lambda: in_file() == a.admission_publisher.last.version, 10,
             lambda: f"a's table in the file again (file {in_file()}, a's {a.admission_publisher.last.version})")


def test_slurmctlds_admit_on_the_local_socket_is_evidence_of_control(pair):
    a = pair("a", None)  # no role file: nothing says its slurmctld is in control
    assert not a.role.is_writer()
    assert "no role file" in a.role.status()["why"]
    d_id = admit_locally(a, "job-submit-ran-here")  # as root: only the slurmctld in control runs job_submit
    wait_for(a.role.is_writer, 10, "a to write after slurmctld's Admit")
    wait_for(lambda: a.store.decision(d_id) is not None, 15, "the decision in the history")


def test_ha_commands_write_the_role_and_status_tells_the_lease(short_dir, history_backend):
    from click.testing import CliRunner

    from policy_service.cli import main

    db = short_dir / "history.sqlite3"
    env = {"SWAPAWARE_SERVICE__DB_PATH": str(db), "SWAPAWARE_HA__ROLE_FILE": str(short_dir / "run" / "role"),
           "SWAPAWARE_HA__HOLDER": "ctl2", "SWAPAWARE_HA__ENABLED": "true", **history_backend.env}
    run = CliRunner().invoke
    done = run(main, ["ha", "primary-on"], env=env)
    assert done.exit_code == 0, done.output
    assert (short_dir / "run" / "role").read_text().startswith("primary ")
    assert (short_dir / "run" / "role").stat().st_mode & 0o777 == 0o644
    store = history_backend.open(db)
    try:
        store.claim_writer("ctl1", 30.0)
        done = run(main, ["ha", "status", "--json"], env=env)
        assert done.exit_code == 0, done.output
        got = json.loads(done.output)
        assert (got["holder"], got["epoch"], got["live"], got["this_host"], got["this_host_writes"],
                got["role_file_says"]) == ("ctl1", 1, True, "ctl2", False, "primary")
        assert 0 < got["expires_in_s"] <= 30.0
        assert run(main, ["ha", "primary-off"], env=env).exit_code == 0
        store.release_writer("ctl1")
        done = run(main, ["ha", "status"], env=env)
        assert "writer lease: ctl1, epoch 1, expired" in done.output
        assert "this host: ctl2, standby; role file " in done.output and done.output.rstrip().endswith("backup")
    finally:
        store.close()
    (short_dir / "run").chmod(0o777)  # a directory others may write: refused, said why
    done = run(main, ["ha", "primary-on"], env=env)
    assert done.exit_code != 0 and "writable by group or others" in done.output


def test_a_writer_cut_off_from_the_history_stops_when_its_lease_would_have_run_out(short_dir, caplog):
    from policy_service.ha.role import RoleKeeper

    caplog.set_level(logging.ERROR, logger="swapaware.ha")  # (test_fuzz quiets "swapaware" for the session)
    clock = [1000.0]
    write_role(short_dir / "run" / "role", Role.PRIMARY, time.time())
    store = HistoryStore(short_dir / "history.sqlite3", fence="a")
    role = RoleKeeper(store, HaConfig(enabled=True, holder="a", lease_ttl_s=10.0, renew_s=2.0,
                                      role_file=short_dir / "run" / "role"), mono=lambda: clock[0])
    assert role.step() and role.writer() == "a"
    store.close()  # the history is gone from under it
    clock[0] += 8.0
    assert role.step()  # still within the lease it took (ttl less the margin)
    assert "cannot read or claim the writer lease" in caplog.text
    clock[0] += 1.5
    assert not role.step() and role.standby_reason() == "standby: writer is nobody (no service holds the lease)"


def test_a_standby_stops_at_once_keeping_its_journaled_decisions(pair, short_dir):
    a = pair("a", Role.PRIMARY)
    wait_for(a.role.is_writer, 10, "a to write")
    b = pair("b", Role.PRIMARY)
    d_b = admit_locally(b, "journaled-on-b")
    t0 = time.monotonic()
    b.stop(0)  # its writer cannot take the decision (a writes): stopping does not wait for that
    del pair.running["b"]
    assert time.monotonic() - t0 < 10.0
    assert not b.handler.decisions._thread.is_alive()  # its writer thread ended, not retrying for ever
    assert a.store.decision(d_b) is None
    assert d_b.encode() in (short_dir / "b" / "history.sqlite3.journal").read_bytes()
