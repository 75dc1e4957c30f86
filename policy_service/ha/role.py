"""The writer role of a service on one of two controller hosts (docs/ha.md; decisions in core/ha.py).

``RoleKeeper`` reads the signals (the role file that ``swapaware ha primary-on|primary-off``
write, the controller's own answer where a probe is given, Admits arriving on the local socket),
and every ``ha.renew_s`` claims, renews or releases the store's writer lease. ``is_writer()`` is
what the service's writing threads ask; the store's fence (``HistoryStore(..., fence=holder)``)
refuses any write of a holder whose lease is gone, whatever this thread believes. Every change
of role is logged with why.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from policy_service.atomic_file import write_atomically
from policy_service.config import HaConfig
from policy_service.core.ha import (HEARTBEAT_TURNS, ROLE_FILE_MODE, Control, LeaseAction, LeaseView, Role,
                                    Signals, control, controllers_of, heartbeat_role, heartbeat_turns, lease_step,
                                    parse_role, standby_message, unsafe_owner, writer_until)

Probe = Callable[[], "tuple[Role | None, str]"]  # the controller's own answer, and where it came from

log = logging.getLogger("swapaware.ha")
ROLE_FILE_POLL_S = 0.1  # how often the thread looks whether `swapaware ha primary-on|off` rewrote the role file


def holder_name(cfg: HaConfig) -> str:
    """This service's name in the lease: ``ha.holder``, else the short host name."""
    return cfg.holder or socket.gethostname().split(".")[0]


def trusted_uids(*more: int | None) -> tuple[int, ...]:
    """Who may write the role file: root, this process's user, and ``more`` (SlurmUser: slurmctld
    runs SlurmctldPrimaryOnProg / OffProg as SlurmUser)."""
    return tuple(sorted({0, os.geteuid(), *(u for u in more if u is not None)}))


def read_role_file(path: Path, trusted: tuple[int, ...] | None = None) -> tuple[Role | None, float | None, str]:
    """(role, mtime, why it is not used or ""). A file or directory that another user than
    ``trusted`` (default: root and this user) could have written is not used."""
    trusted = trusted or trusted_uids()
    try:
        for what, st in ((f"{path.parent}", os.stat(path.parent)), (f"{path}", os.stat(path))):
            bad = unsafe_owner(what, st.st_uid, st.st_mode, trusted)
            if bad:
                return None, None, bad
        role = parse_role(path.read_text(errors="replace")[:200])
    except FileNotFoundError:
        return None, None, ""
    except OSError as exc:
        return None, None, f"{path}: {exc.strerror or exc}"
    return role, st.st_mtime, "" if role is not None else f"{path} says neither primary nor backup"


def heartbeat_probe(slurm_conf: Path, names: tuple[str, ...],
                    wall: Callable[[], float] = time.time) -> Probe | None:
    """slurmctld's own answer from the ``heartbeat`` file in StateSaveLocation (core/ha.py), where
    slurm.conf names two or more SlurmctldHost lines, this host (any of ``names``) among them, and a
    StateSaveLocation; None (said in the log) where it does not."""
    try:
        conf = controllers_of(slurm_conf.read_text(errors="replace"))
    except OSError as exc:
        log.info("ha: slurm.conf %s not read (%s): the role file and local Admits tell the role", slurm_conf, exc)
        return None
    mine = conf.index_of(names)
    if len(conf.hosts) < 2 or mine is None or not conf.state_dir:
        log.info("ha: slurmctld's heartbeat not used (SlurmctldHost %s, this host %s, StateSaveLocation %r)",
                 ", ".join(conf.hosts) or "none", "/".join(names), conf.state_dir)
        return None
    path = Path(conf.state_dir) / "heartbeat"
    seen: dict = {"turns": (), "last": None, "said": False}  # the writer's changes (heartbeat_turns)

    def probe() -> tuple[Role | None, str]:
        try:
            data = path.read_bytes()[:64]
        except OSError as exc:
            return None, f"{path}: {exc.strerror or exc}"
        now = wall()
        seen["turns"], seen["last"] = heartbeat_turns(seen["turns"], seen["last"], data, now, conf.timeout_s)
        contested = len(seen["turns"]) >= HEARTBEAT_TURNS
        if contested != seen["said"]:
            seen["said"] = contested
            if contested:
                log.warning("ha: slurmctld's heartbeat %s changed writer %d times in %.0f s: two slurmctlds "
                            "write it, and the role it tells follows whichever wrote last. One of them "
                            "gave up control and hangs (Slurm 22.05.8 and 24.11.5; docs/ha.md, 'A "
                            "controller that hangs leaving control'): kill -9 the slurmctld whose log "
                            "ended at its shutdown", path, len(seen["turns"]), 2 * conf.timeout_s)
            else:
                log.info("ha: slurmctld's heartbeat %s has one writer again", path)
        return heartbeat_role(data, mine, len(conf.hosts), now, conf.timeout_s)

    log.info("ha: slurmctld's heartbeat %s tells the role (this host is SlurmctldHost #%d of %d)", path, mine,
             len(conf.hosts))
    return probe


def lease_view(lease) -> LeaseView | None:
    """core's view of the store's WriterLease (holder, epoch, expires_at, now)."""
    if lease is None:
        return None
    return LeaseView(holder=lease.holder, epoch=int(lease.epoch), expires_at=float(lease.expires_at),
                     now=float(lease.now))


class RoleKeeper:
    """``store``: a HistoryStore with claim_writer / release_writer / writer. ``probe``: the
    controller's own answer (Role or None when it cannot tell, and why), None: not asked."""

    def __init__(self, store, cfg: HaConfig, *, probe: Probe | None = None,
                 slurm_uid: int | None = None, wall: Callable[[], float] = time.time,
                 mono: Callable[[], float] = time.monotonic):
        self.store, self.cfg, self.probe, self.wall, self.mono = store, cfg, probe, wall, mono
        self.trusted = trusted_uids(slurm_uid)  # who may write the role file
        self.holder = holder_name(cfg)
        # an Admit on the local socket within this long counts as this slurmctld being in control
        self.admit_fresh_s = max(30.0, 3 * cfg.lease_ttl_s)
        self.margin_s = min(1.0, cfg.lease_ttl_s / 10)
        self._until = float("-inf")  # monotonic: counted as writer until then
        self._writer: str | None = None  # the holder last seen
        self._epoch = 0
        self._local_admit_at: float | None = None
        self._said: tuple | None = None  # the last role logged, with its reason
        self._role_file_problem = ""
        self._probe_problem = ""
        self._store_error = ""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_change: list[Callable[[bool], None]] = []  # called with is_writer() when it changes
        self.last_control: Control | None = None
        self._control_since = float("-inf")  # monotonic: when this slurmctld was last seen taking control

    # ------------------------------------------------------------------ what others ask
    def is_writer(self) -> bool:
        return self.mono() < self._until

    def writer(self) -> str | None:
        """Who writes, as last seen (this service's holder name while it is the writer)."""
        return self.holder if self.is_writer() else self._writer

    def standby_reason(self) -> str | None:
        """None while this service writes; else what a write is answered (UNAVAILABLE)."""
        return None if self.is_writer() else standby_message(self._writer)

    def local_admit(self) -> None:
        """slurmctld's Admit arrived on the local socket: this host's slurmctld runs job_submit."""
        self._local_admit_at = self.wall()
        if not self.is_writer():
            self._wake.set()

    def status(self) -> dict:
        c = self.last_control
        return {"holder": self.holder, "writer": self.writer(), "epoch": self._epoch, "is_writer": self.is_writer(),
                "in_control": None if c is None else c.in_control, "why": "" if c is None else c.why}

    # ------------------------------------------------------------------ one round
    def signals(self) -> Signals:
        role, at, problem = read_role_file(self.cfg.role_file, self.trusted)
        if problem != self._role_file_problem:
            if problem:
                log.error("ha: role file not used: %s", problem)
            self._role_file_problem = problem
        answer, why = None, ""
        if self.probe is not None:
            try:
                answer, why = self.probe()
            except Exception as exc:  # noqa: BLE001 - the other signals still count
                why = f"{type(exc).__name__}: {exc}"
            if answer is None and why != self._probe_problem:
                log.info("ha: slurmctld's own answer not known (%s): the role file and local Admits tell", why)
            self._probe_problem = why if answer is None else ""
        return Signals(now=self.wall(), role_file=role, role_file_at=at, controller=answer, controller_why=why,
                       local_admit_at=self._local_admit_at)

    def step(self) -> bool:
        """One round: read the signals, claim / renew / release the lease. Returns is_writer()."""
        with self._lock:
            was = self.is_writer()
            ctl = control(self.signals(), self.admit_fresh_s)
            if ctl.in_control and not (self.last_control and self.last_control.in_control):
                self._control_since = self.mono()
            self.last_control = ctl
            why = ctl.why
            try:
                view = lease_view(self.store.writer())
                step = lease_step(ctl, view, self.holder)
                why = step.why
                if step.action is LeaseAction.CLAIM:
                    started = self.mono()
                    got = lease_view(self.store.claim_writer(self.holder, self.cfg.lease_ttl_s))
                    if got is not None and got.holder == self.holder:
                        self._until = writer_until(started, self.cfg.lease_ttl_s, self.margin_s)
                        self._writer, self._epoch = self.holder, got.epoch
                        if view is not None and view.holder not in ("", self.holder) and view.expires_at > view.now:
                            # the holder read a moment ago released it (or let it expire) before the claim
                            why = f"take the lease {view.holder} let go ({ctl.why})"
                    else:
                        self._until = float("-inf")
                        now_view = got or lease_view(self.store.writer())
                        self._writer = now_view.holder if now_view is not None and now_view.expires_at > now_view.now \
                            else None
                elif step.action is LeaseAction.RELEASE:
                    self._until = float("-inf")  # stop writing before the lease goes
                    self.store.release_writer(self.holder)
                    self._writer = None
                else:
                    self._until = float("-inf")
                    self._writer = view.holder if view is not None and view.expires_at > view.now else None
                if self._store_error:
                    log.warning("ha: the history answers again")
                self._store_error = ""
            except Exception as exc:  # noqa: BLE001 - an unreachable store: our lease runs out by itself
                msg = f"{type(exc).__name__}: {exc}"
                if msg != self._store_error:
                    log.error("ha: cannot read or claim the writer lease (%s); %s", msg,
                              "writing until the lease runs out" if self.is_writer() else "standby")
                self._store_error = msg
                if not self.is_writer() and self._writer == self.holder:
                    self._writer = None  # our lease ran out unrenewed: who holds it now is not known
            now_writer = self.is_writer()
            self._say(now_writer, why)
        if now_writer != was:
            for call in self.on_change:
                try:
                    call(now_writer)
                except Exception:  # noqa: BLE001
                    log.exception("ha: after the role change")
        return now_writer

    def _say(self, writer: bool, why: str) -> None:
        said = (writer, self._writer)
        if said == self._said:
            return
        if writer:
            log.warning("ha: %s is now the writer (epoch %d): %s", self.holder, self._epoch, why)
        else:
            log.warning("ha: %s is standby, writer is %s: %s", self.holder, self._writer or "nobody", why)
        self._said = said

    # ------------------------------------------------------------------ the thread
    def _claiming(self) -> bool:
        """In control but not (yet) the writer, within a lease's time of taking control: the old
        writer's release or expiry is looked for every ROLE_FILE_POLL_S, not every renew_s."""
        c = self.last_control
        return (c is not None and c.in_control and not self.is_writer()
                and self.mono() - self._control_since < self.cfg.lease_ttl_s + self.cfg.renew_s)

    def _role_stamp(self) -> tuple | None:
        try:
            st = os.stat(self.cfg.role_file)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def start(self) -> "RoleKeeper":
        """A round every renew_s, and at once when the role file changes (looked at every
        ROLE_FILE_POLL_S) or slurmctld's Admit arrives while standby."""
        def loop() -> None:
            due, stamp, last = 0.0, None, float("-inf")
            while not self._stop.is_set():
                now_stamp = self._role_stamp()
                if self.mono() >= due or now_stamp != stamp:
                    stamp, last = now_stamp, self.mono()
                    try:
                        self.step()
                    except Exception:  # noqa: BLE001 - the thread must outlive anything
                        log.exception("ha: role round failed")
                    due = self.mono() + (ROLE_FILE_POLL_S if self._claiming() else self.cfg.renew_s)
                if self._wake.wait(max(0.0, min(ROLE_FILE_POLL_S, due - self.mono()))):
                    self._wake.clear()  # a burst of Admits: one round per ROLE_FILE_POLL_S at most
                    due = min(due, last + ROLE_FILE_POLL_S)

        self._thread = threading.Thread(target=loop, name="ha-role", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and give the lease back (after the service's last write)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.release()

    def release(self) -> None:
        with self._lock:
            if self.is_writer():
                self._until = float("-inf")
                try:
                    self.store.release_writer(self.holder)
                    log.warning("ha: %s gave the writer lease back (stopping)", self.holder)
                except Exception as exc:  # noqa: BLE001 - it expires by itself
                    log.error("ha: the writer lease not given back (%s); it expires in %.0f s", exc,
                              self.cfg.lease_ttl_s)


def only_while_writer(call: Callable, role: RoleKeeper, default=None) -> Callable:
    """``call`` run only while ``role`` is the writer (else ``default`` is returned)."""
    def gated(*args, **kwargs):
        if not role.is_writer():
            return default
        return call(*args, **kwargs)
    return gated


def write_role(path: Path, role: Role, now: float) -> None:
    """Write ``role`` to the role file atomically (atomic_file: a new file renamed over it, 0644), in a
    directory that only root or this user may write (created 0755 where missing). OSError, or
    PermissionError saying why the directory is not trusted."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    st = os.stat(path.parent)
    bad = unsafe_owner(str(path.parent), st.st_uid, st.st_mode, trusted_uids())
    if bad:
        raise PermissionError(f"{bad}: the service would not trust a role file there")
    write_atomically(path, f"{role.value} {now:.3f}\n".encode(), ROLE_FILE_MODE)
