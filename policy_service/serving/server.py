"""Run the policy service: history store + Slurm access + handler, served over gRPC and
the controller-local socket until SIGTERM/SIGINT. A gRPC port held by another process does not
stop the start: the service serves its local socket and waits for the port (serving/grpc_bind.py)."""
from __future__ import annotations

import dataclasses
import gc
import logging
import pwd
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2

from policy_service.trust.access import Authorizer
from policy_service.admission.archive import TableArchive, open_archive
from policy_service.admission.catchup import attach as attach_catchup
from policy_service.admission.catchup import chain
from policy_service.admission.publish import AdmissionPublisher
from policy_service.serving.grpc_bind import GrpcListener
from policy_service.serving.grpc_server import grpc_server
from policy_service.ha.role import RoleKeeper, heartbeat_probe, holder_name, only_while_writer
from policy_service.history.store import HistoryStore, open_history
from policy_service.serving.local_socket import start_local_socket
from policy_service.slurm.partitions import SlurmConfWatch, slurm_conf_path
from policy_service.slurm.queue import QueueMonitor, reads_queue
from policy_service.slurm.reconcile import Reconciler
from policy_service.serving.redecide import PendingRedecider
from policy_service.signal_wait import SignalWait
from policy_service.slurm.slurm import ClusterRelease, SlurmAccess, cluster_release, open_slurm
from policy_service.config import Config, read_token
from policy_service.serving.handler import PolicyHandler
from policy_service.history.config import history_source
from policy_service.trust.tls import server_credentials, server_enabled

log = logging.getLogger("swapaware.service")


@dataclass
class RunningService:
    listener: GrpcListener  # the gRPC server, bound or waiting for its port
    socket_path: Path
    store: HistoryStore
    handler: PolicyHandler
    queue_monitor: QueueMonitor | None
    _health: health.HealthServicer
    _socket_server: object
    _watch_stop: threading.Event = field(default_factory=threading.Event)
    metrics_server: object = None  # the /metrics HTTP server, when service.metrics_address is set
    # [admission] table_path set: the published tables' archive and the publisher thread
    admission_archive: TableArchive | None = None
    admission_publisher: AdmissionPublisher | None = None
    role: RoleKeeper | None = None  # [ha] enabled: the writer role (ha/role.py)

    @property
    def grpc_server(self) -> grpc.Server:
        return self.listener.server

    @property
    def grpc_port(self) -> int:
        """The bound gRPC port; 0 while another process holds it (``listener.wait_bound``)."""
        return self.listener.port

    def stop(self, grace_s: float = 2.0) -> None:
        self._watch_stop.set()
        if self.admission_publisher is not None:
            self.admission_publisher.stop()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()  # type: ignore[attr-defined]
            self.metrics_server.server_close()  # type: ignore[attr-defined]
        self._health.enter_graceful_shutdown()
        self._socket_server.shutdown()  # type: ignore[attr-defined]
        self._socket_server.server_close()  # type: ignore[attr-defined]
        self.listener.stop(grace_s)  # a listener still waiting for its port stops trying
        if self.role is not None:  # a writer first records every decision it handed out
            drained_while_writer(self.handler, self.role, self.role.cfg.lease_ttl_s)
        # the writer thread ends: what a standby handed out is refused (NotWriter) and stays in its
        # journal, read back at the next start; a history that cannot be reached is given up on after
        # CLOSE_WAIT_S (DecisionLog.close). Left running, it retried for as long as the process lived.
        self.handler.close()
        if self.role is not None:
            self.role.stop()  # gives the lease back
        if self.queue_monitor is not None:
            self.queue_monitor.stop()
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass
        self.store.close()
        if self.admission_archive is not None:
            self.admission_archive.close()


def drained_while_writer(handler: PolicyHandler, role: RoleKeeper, within_s: float) -> bool:
    """Whether every decision handed out reached the history, waiting up to ``within_s`` while this
    service writes: a standby's stay journaled, and a writer that loses its lease while stopping
    does not wait for ever (DecisionLog.flush has no bound)."""
    end = time.monotonic() + within_s
    while handler.decisions.pending() and role.is_writer() and time.monotonic() < end:
        time.sleep(0.05)
    return not handler.decisions.pending()


GIL_SWITCH_INTERVAL_S = 0.0002  # see serve_forever
HISTORY_HEALTH = "swapaware.history"  # health entry: NOT_SERVING while the history cannot be kept
WRITER_HEALTH = "swapaware.writer"  # [ha] enabled: SERVING while this service is the writer (docs/ha.md)


def watch_history(svc: "RunningService", every_s: float) -> threading.Thread:
    """Check every ``every_s`` that the history file is still the one the service writes
    (HistoryStore.check_file restores a removed or replaced one); health entry HISTORY_HEALTH
    turns NOT_SERVING when it cannot be restored, SERVING again once it is."""
    def loop() -> None:
        ok = True
        while not svc._watch_stop.wait(every_s):
            try:
                svc.store.check_file()
                now_ok = True
            except Exception as exc:
                now_ok = False
                if ok:
                    log.error("history %s is gone and cannot be restored: %s; decisions are kept in the journal",
                              svc.store.path, exc)
            if now_ok != ok:
                svc._health.set(HISTORY_HEALTH, health_pb2.HealthCheckResponse.SERVING if now_ok
                                else health_pb2.HealthCheckResponse.NOT_SERVING)
                ok = now_ok

    svc._health.set(HISTORY_HEALTH, health_pb2.HealthCheckResponse.SERVING)
    t = threading.Thread(target=loop, name="history-watch", daemon=True)
    t.start()
    return t


def log_release(release: ClusterRelease) -> None:
    """The dialect the service speaks, logged once at start."""
    if release.version is None:
        log.warning("slurm dialect: %s (%s: the newest release known; set service.slurm_release to the cluster's)",
                    release.dialect.describe(), release.source)
    else:
        log.info("slurm dialect: %s, from %s", release.dialect.describe(), release.source)


def slurmctld_gid(authorizer) -> int | None:
    """SlurmUser's primary group: the admission table's group, so that slurmctld, and no other
    local user, reads it (None: unknown, the files keep the service's group)."""
    try:
        return pwd.getpwuid(authorizer.trust.slurm_uid).pw_gid
    except KeyError:
        log.warning("admission table: SlurmUser (uid %d) has no passwd entry: the table keeps the service's "
                    "group, which slurmctld may not read", authorizer.trust.slurm_uid)
        return None


def start_service(cfg: Config, slurm: SlurmAccess | None = None, use_slurm: bool = True,
                  accept_empty_history: bool = False) -> RunningService:
    """``accept_empty_history``: start on a new, empty history even where files show that one
    existed (``swapaware serve --accept-empty-history``; history/guard.py)."""
    token = read_token(cfg.service.token_file)
    tls = server_credentials(cfg.tls) if server_enabled(cfg.tls) else None  # files checked before anything starts
    release = cluster_release(cfg.service.slurm_release, cfg.service.slurm_timeout_s)
    log_release(release)
    store = open_store(cfg, accept_empty_history)
    if slurm is None and use_slurm:
        slurm = open_slurm(cfg.service.slurm_backend, cfg.service.slurm_timeout_s, release)
    monitor = QueueMonitor(slurm, cfg) if slurm is not None and reads_queue(cfg) else None
    try:
        authorizer = Authorizer.from_config(cfg.auth, slurm, token)
    except BaseException:
        store.close()
        raise
    partitions = SlurmConfWatch(slurm_conf_path(cfg.service.slurm_conf))
    handler = PolicyHandler(cfg, store, slurm, queue_monitor=monitor, dialect=release.dialect, authorizer=authorizer,
                            partitions=partitions.current)
    if monitor is not None:  # writer or standby: each snapshot's refusals worked out before Admits read it
        monitor.prepare = lambda state: partitions.current().warm_live(state.live_shards)
    if monitor is not None and cfg.policy.redecide_pending:
        monitor.on_poll = PendingRedecider(handler, slurm, cfg)
    role = follow_role(cfg, store, handler, authorizer) if cfg.ha.enabled else None
    serving_standby = handler.standby  # the role's (HA), or None
    if cfg.table_path:
        # Until the catch-up and the table's drop are attached (below, once serving), an event could
        # be applied without its table-made decision or leave its class in the table: refused as a
        # standby refuses them (the hooks spool it; a later hook run or the agent replays it).
        handler.standby = lambda: "the service is starting (its admission table is not attached yet)"
    server, health_servicer = grpc_server(handler, cfg.service.max_workers, token, authorizer)
    listener = GrpcListener(server, health_servicer, cfg.service.grpc_address, tls, handler.metrics)
    try:
        if monitor is not None:  # the first Admit must see the queue, not "unknown": poll before serving
            monitor.start().wait_first_poll()
        bind_or_say(listener)  # False: another process holds the port; tried again once the local socket serves
        sock_server, _ = start_local_socket(handler, cfg.service.socket_path)
    except BaseException:
        listener.stop(0)
        if monitor is not None:
            monitor.stop()
        handler.close()
        store.close()
        raise
    log.info("%s gRPC on %s (%s, %s), local socket %s, history %s",
             "serving" if listener.bound.is_set() else "waiting for its port to serve", cfg.service.grpc_address,
             f"port {listener.port}" if listener.bound.is_set() else "held by another process",
             "TLS" + (" with client certificates" if cfg.tls.client_ca else "") if tls is not None else "plaintext",
             cfg.service.socket_path, history_source(cfg))
    if not listener.bound.is_set():
        listener.retry()
    svc = RunningService(listener, cfg.service.socket_path, store, handler, monitor, health_servicer, sock_server,
                         role=role)
    watch_history(svc, cfg.service.history_check_s)
    if cfg.service.metrics_address:
        def queue_age() -> float | None:
            snap = monitor.snapshot() if monitor is not None else None
            return None if snap is None else snap.age_s
        handler.metrics.watch(queue_age=queue_age, history=Path(cfg.service.db_path),
                              waiting=handler.decisions.pending)
        svc.metrics_server = handler.metrics.serve(cfg.service.metrics_address)
    if cfg.table_path:
        svc.admission_archive = open_archive(cfg)  # beside the history: its file, or its MariaDB database
        svc.admission_publisher = AdmissionPublisher(handler, cfg, svc.admission_archive,
                                                     reader_gid=slurmctld_gid(authorizer))
        if role is not None:  # the standby publishes nothing: the writer's table is the one
            svc.admission_publisher.tick = only_while_writer(svc.admission_publisher.tick, role)
            role.on_change.append(svc.admission_publisher.became_writer)
        # a recorded observation never leaves its class decided from before it (always safe:
        # dropping entries only sends jobs the round trip, so a standby does it too)
        handler.events.learning = svc.admission_publisher.learning
        if monitor is not None:  # the gate file follows each queue snapshot, first
            monitor.on_poll = chain(svc.admission_publisher.on_queue_poll, monitor.on_poll)
        log.info("admission table: published at %s (gate %s.gate), rebuilt at most every %.0f s",
                 cfg.table_path, cfg.table_path, cfg.admission.refresh_s)
    catchup = None
    if cfg.table_path and slurm is not None:  # the plugin's table-made decisions, learned from Slurm
        catchup = attach_catchup(handler, slurm, monitor, svc.admission_archive, svc._watch_stop,
                                 poll_s=cfg.policy.queue_poll_s, window_s=cfg.service.reconcile_window_s,
                                 gate=None if role is None else lambda call: only_while_writer(call, role, 0))
    if monitor is not None and role is not None:  # re-decisions, requeues, the gate file, catch-up
        # The catch-up is gated twice on a standby, on purpose: catchup.learn by the gate given to
        # attach_catchup above (needed: it covers the hook-event and reconcile paths too), and here the
        # whole poll, which also spares a standby catch-up's squeue (from_live) that learn would discard.
        monitor.on_poll = only_while_writer(monitor.on_poll, role) if monitor.on_poll is not None else None
    if slurm is not None:
        reconciler = Reconciler(store, slurm, cfg.service.reconcile_window_s, cfg.service.reconcile_settle_s,
                                time.time, catchup)
        if role is not None:
            reconciler.run_once = only_while_writer(reconciler.run_once, role)
            # a new writer checks at once what the last one left (off the role thread: it renews the lease)
            role.on_change.append(lambda writer: writer and threading.Thread(
                target=reconciler.run_once, name="reconcile-now", daemon=True).start())
        reconciler.start(cfg.service.reconcile_s, svc._watch_stop)
    if role is not None:
        def writer_health(writer: bool) -> None:
            health_servicer.set(WRITER_HEALTH, health_pb2.HealthCheckResponse.SERVING if writer
                                else health_pb2.HealthCheckResponse.NOT_SERVING)

        writer_health(role.is_writer())
        role.on_change.insert(0, writer_health)
        role.on_change.append(lambda writer: writer and handler.decisions.retry_now())  # the journal drains now
        if monitor is not None:  # the controller in control may have changed: read its nodes' shards now
            hold_s = TAKEOVER_HOLD_S if handler.dialect.takeover_zero_shards else 0.0
            role.on_change.append(lambda writer: monitor.controller_changed(
                f"this service became {'writer' if writer else 'standby'}", hold_s))
        role.start()
    # the interference learner reads the shared runs back (off the start: a MariaDB history may take
    # a while; decisions use the prior until then), and again when this service becomes the writer
    # (the events of the last writer's runs went there)
    start_interference(handler, role)
    handler.standby = serving_standby  # events are taken from now on
    if svc.admission_publisher is not None:
        # built from here on: a table built while starting would hold decisions made as a standby
        # (on 22.05's dialect, every shard refused: the shards of the controller unread)
        svc.admission_publisher.start()
    return svc


def start_interference(handler, role) -> None:
    """``InterferenceLearner.load`` in a thread now, and whenever ``role`` makes this service the writer."""
    def load() -> None:
        try:
            handler.interference.load(handler.store)
        except Exception:  # noqa: BLE001 - the prior decides meanwhile; the next finished shared run teaches
            if handler.store.closed:  # the service stopped while they were read: nothing is wrong
                log.info("interference learner: the service stopped before the history's shared runs were read")
                return
            log.exception("interference learner: the history's shared runs could not be read")

    threading.Thread(target=load, name="interference-load", daemon=True).start()
    if role is not None:
        role.on_change.append(lambda writer: writer and threading.Thread(
            target=load, name="interference-load", daemon=True).start())


def bind_or_say(listener: GrpcListener) -> bool:
    """The first try at the gRPC port; a failure that waiting would not mend is logged and raised."""
    try:
        return listener.bind()
    except OSError as exc:
        log.error("%s", exc.strerror or exc)
        raise


# After a role change on a release whose backup may refuse shards after a takeover (dialect
# takeover_zero_shards), the shards count as unread this long: a 22.05 backup that took over showed
# its nodes' shards from its first answer in 3 takeovers, and once for about 10 s before it showed
# them as 0 (tests/multinode_ha/test_ha_shards.py); a job given shards then waits for the primary.
TAKEOVER_HOLD_S = 30.0


def open_store(cfg: Config, accept_empty: bool) -> HistoryStore:
    """The history; with [ha] enabled every write is fenced by this service's writer lease."""
    return open_history(cfg, accept_empty=accept_empty, fence=holder_name(cfg.ha) if cfg.ha.enabled else None)


def follow_role(cfg: Config, store: HistoryStore, handler: PolicyHandler, authorizer) -> RoleKeeper:
    """[ha] enabled: the writer role, taken once before serving (a service that may write starts
    as writer), then kept by its thread; events are refused and background writes skipped while
    standby."""
    slurm_uid = getattr(getattr(authorizer, "trust", None), "slurm_uid", None)
    me = holder_name(cfg.ha)
    names = tuple(dict.fromkeys((me, socket.gethostname().split(".")[0], socket.gethostname())))
    role = RoleKeeper(store, cfg.ha, slurm_uid=slurm_uid,
                      probe=heartbeat_probe(slurm_conf_path(cfg.service.slurm_conf), names))
    handler.standby = role.standby_reason

    def local_admit(uid: int | None) -> None:
        if uid in (0, slurm_uid):
            role.local_admit()

    handler.on_local_admit = local_admit
    role.step()
    return role


def reload_mode(svc: RunningService, running: Config, reload: Callable[[], Config]) -> Config:
    """SIGHUP: re-read the config and apply its ``policy.mode``; what else changed needs a restart
    (said in the log). A config that no longer loads changes nothing. Returns the config the
    running service now stands for."""
    try:
        new = reload()
    except Exception as exc:  # a broken file must not take the service down
        log.error("SIGHUP: config not reloaded, policy.mode stays %s: %s", svc.handler.mode.value, exc)
        return running
    svc.handler.set_mode(new.policy.mode)
    applied = dataclasses.replace(running, policy=dataclasses.replace(running.policy, mode=new.policy.mode))
    if applied != new:
        log.warning("SIGHUP: only policy.mode is applied live; other changed settings take effect at the next "
                    "restart")
    return applied


def settle_gc() -> None:
    """What the service holds once started (modules, gRPC, protobuf, its config and state) is kept
    for its life: moved out of the cyclic collector's reach (gc.freeze), so that a full collection
    walks only what was made since. A full collection holds the GIL, and an Admit meanwhile waits
    with slurmctld holding its job lock. bench/gc_pause.py: after 12,000 Admits a full collection
    walked 100,000 objects, 60,000 with these frozen. Frozen objects are still freed by their
    reference counts."""
    gc.collect()
    gc.freeze()


def serve_forever(cfg: Config, reload: Callable[[], Config] | None = None, use_slurm: bool = True,
                  accept_empty_history: bool = False) -> None:
    """Serve until SIGTERM/SIGINT; SIGHUP re-reads policy.mode with ``reload``."""
    # An Admit thread that gives up the GIL (socket read, journal write, SQLite read) waits to get
    # it back for up to the switch interval whenever another thread of the service runs Python
    # (the queue poll parsing squeue, the writer committing decisions): 5 ms by default, while
    # slurmctld waits holding its job lock. bench/gil_switch.py measures it.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    # Signals are read from a pipe (signal_wait.py), never by a handler taking a lock. SIGHUP's is
    # installed first: the socket is there (and `systemctl reload` may come) before the rest has
    # started (the publisher, the monitor), and SIGHUP's default action would kill the service; one
    # that arrives meanwhile is applied once it has started. (SIGTERM meanwhile still ends it at
    # once: nothing it has answered is lost, the journal holds it.)
    signals = SignalWait((signal.SIGHUP,) if reload is not None else ())
    try:
        svc = start_service(cfg, use_slurm=use_slurm, accept_empty_history=accept_empty_history)
        settle_gc()
        signals.add((signal.SIGTERM, signal.SIGINT))
        running = cfg
        while True:
            got = signals.wait()
            stopping = got & {signal.SIGTERM, signal.SIGINT}
            if stopping:
                log.info("signal %d: shutting down", min(stopping))
                break
            if signal.SIGHUP in got and reload is not None:
                running = reload_mode(svc, running, reload)
        svc.stop()
    finally:
        signals.close()
    log.info("stopped")


__all__ = ["RunningService", "start_service", "serve_forever", "health_pb2"]
