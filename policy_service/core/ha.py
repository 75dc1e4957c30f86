"""Two controllers, one history (docs/ha.md): which service may write, decided from signals.

Pure: no clock, no files, no store. The adapter (ha/role.py) reads the signals, asks the
store for the writer lease and acts on what these functions say.

A service is the writer iff it holds the store's writer lease. It tries to take the lease only
while its own slurmctld is in control; the evidence (``Signals``):
  * the role file that ``swapaware ha primary-on`` / ``primary-off`` write (slurmctld runs them as
    SlurmctldPrimaryOnProg / SlurmctldPrimaryOffProg when it becomes primary / backup);
  * the controller's own answer: the ``heartbeat`` file slurmctld keeps in StateSaveLocation names
    the SlurmctldHost line of the controller in control (measured on 22.05: 16 bytes, the time
    and that index as big-endian uint64s); ``scontrol ping`` does not tell;
  * an Admit arriving on the controller-local socket: only the slurmctld in control runs
    job_submit.
The newest explicit evidence wins; a service never takes an unexpired lease of another holder
(the store refuses it), so two services both told "primary" still have one writer.
"""
from __future__ import annotations

import enum
import re
import shlex
import stat
import struct
from dataclasses import dataclass

ROLE_FILE_MODE = 0o644


class Role(enum.Enum):
    PRIMARY = "primary"  # this host's slurmctld is in control
    BACKUP = "backup"  # it is not


class LeaseAction(enum.Enum):
    CLAIM = "claim"  # take the lease (free or expired), or renew ours
    RELEASE = "release"  # let it go now: our slurmctld is no longer in control
    STANDBY = "standby"  # nothing to do: not in control and not the holder


@dataclass(frozen=True)
class Signals:
    """What the adapter saw, all times on one wall clock (seconds)."""

    now: float
    role_file: Role | None = None  # None: no (usable) role file
    role_file_at: float | None = None  # its mtime
    controller: Role | None = None  # the controller's own answer; None: not known
    controller_why: str = ""  # where that answer came from
    local_admit_at: float | None = None  # the last Admit that arrived on the local socket


@dataclass(frozen=True)
class Control:
    in_control: bool
    why: str


@dataclass(frozen=True)
class LeaseView:
    """The store's writer lease as last read (store.writer() / claim_writer())."""

    holder: str
    epoch: int
    expires_at: float  # the store's clock
    now: float  # the store's clock when it was read

    def held_by(self, holder: str) -> bool:
        return self.holder == holder and self.expires_at > self.now


@dataclass(frozen=True)
class Step:
    action: LeaseAction
    why: str


def control(s: Signals, admit_fresh_s: float) -> Control:
    """Whether this host's slurmctld is in control, and why. The controller's own answer, when
    known, is the state now; else the newest of the role file and a local Admit (an Admit within
    ``admit_fresh_s`` counts, one older than the role file does not override it)."""
    if s.controller is not None:
        return Control(s.controller is Role.PRIMARY, s.controller_why or f"slurmctld says it is {s.controller.value}")
    admit_fresh = s.local_admit_at is not None and s.now - s.local_admit_at <= admit_fresh_s
    if s.role_file is not None:
        newer_admit = admit_fresh and (s.role_file_at is None or s.local_admit_at > s.role_file_at)
        if s.role_file is Role.BACKUP and newer_admit:
            return Control(True, f"an Admit arrived on the local socket {s.now - s.local_admit_at:.1f} s ago, "
                                 "after the role file said backup (only the slurmctld in control runs job_submit)")
        return Control(s.role_file is Role.PRIMARY, f"the role file says {s.role_file.value}")
    if admit_fresh:
        return Control(True, f"an Admit arrived on the local socket {s.now - s.local_admit_at:.1f} s ago")
    return Control(False, "no role file and no recent Admit on the local socket")


def lease_step(in_control: Control, lease: LeaseView | None, holder: str) -> Step:
    """What to do with the lease this round."""
    ours = lease is not None and lease.held_by(holder)
    if in_control.in_control:
        if ours:
            return Step(LeaseAction.CLAIM, f"renew ({in_control.why})")
        if lease is not None and lease.expires_at > lease.now:
            # claim_writer refuses it anyway; trying keeps the lease taken at the first moment it frees
            return Step(LeaseAction.CLAIM, f"{in_control.why}; writer is {lease.holder} until its lease ends "
                                           f"in {lease.expires_at - lease.now:.1f} s")
        return Step(LeaseAction.CLAIM, f"take the free lease ({in_control.why})")
    if ours:
        return Step(LeaseAction.RELEASE, f"release ({in_control.why})")
    return Step(LeaseAction.STANDBY, in_control.why)


def writer_until(claim_started: float, ttl_s: float, margin_s: float) -> float:
    """Until when (this host's monotonic clock) a lease taken by a claim that started at
    ``claim_started`` may be counted as ours: the store's expiry is at least ``ttl_s`` after the
    claim's transaction, which started after ``claim_started``; ``margin_s`` more for clock rates."""
    return claim_started + max(0.0, ttl_s - margin_s)


def service_addresses(cfg) -> tuple[str, ...]:
    """Where clients find the service (``cfg``: policy_service.config.Config): every controller's in
    ``ha.controllers``, else ``hooks.service_address`` alone."""
    return tuple(cfg.ha.controllers) or (cfg.hooks.service_address,)


def standby_message(writer: str | None) -> str:
    """What a standby service answers to writes (clients move on to the next address)."""
    return f"standby: writer is {writer or 'nobody (no service holds the lease)'}"


def parse_role(text: str) -> Role | None:
    """The role file's content ('primary' / 'backup', first word), None when it is neither."""
    word = text.strip().split()[0].lower() if text.strip() else ""
    try:
        return Role(word)
    except ValueError:
        return None


def unsafe_owner(what: str, st_uid: int, st_mode: int, trusted_uids: tuple[int, ...]) -> str | None:
    """Why a role file or its directory may not be trusted (None: it may): owned by another user
    than ``trusted_uids`` (root, the service's), or writable by group or others."""
    if st_uid not in trusted_uids:
        return f"{what} is owned by uid {st_uid}, not by {' or '.join(map(str, trusted_uids))}"
    if st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by group or others (mode {stat.S_IMODE(st_mode):04o})"
    return None


HEARTBEAT_BYTES = 16
SLURMCTLD_TIMEOUT_DEFAULT_S = 120.0  # slurm.conf's default SlurmctldTimeout
# Changes of the heartbeat's writer within two SlurmctldTimeouts that mean two slurmctlds write it
# (a takeover and a hand-back are one change each): one of them gave up control and hangs, still
# writing (Slurm 22.05.8 and 24.11.5, docs/ha.md "A controller that hangs leaving control").
HEARTBEAT_TURNS = 4


@dataclass(frozen=True)
class Controllers:
    """What slurm.conf says of the controllers: SlurmctldHost names in order (the first is the
    primary), StateSaveLocation, SlurmctldTimeout."""

    hosts: tuple[str, ...]
    state_dir: str
    timeout_s: float

    def index_of(self, names: tuple[str, ...]) -> int | None:
        """The position of this host (any of ``names``) among the SlurmctldHost lines."""
        for i, h in enumerate(self.hosts):
            if h in names:
                return i
        return None


def controllers_of(slurm_conf: str) -> Controllers:
    """SlurmctldHost lines in order (ControlMachine / BackupController on old configs),
    StateSaveLocation and SlurmctldTimeout from slurm.conf's text."""
    hosts: list[str] = []
    legacy: dict[str, str] = {}
    params: dict[str, str] = {}
    for raw in slurm_conf.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            parts = shlex.split(line)
        except ValueError:
            parts = line.split()
        for part in parts:
            key, _, value = part.partition("=")
            key = key.lower()
            if key == "slurmctldhost":
                hosts.append(re.sub(r"\(.*\)$", "", value).strip())
            elif key in ("controlmachine", "backupcontroller"):
                legacy[key] = value.split(",")[0].strip()
            else:
                params[key] = value
    if not hosts:
        hosts = [legacy[k] for k in ("controlmachine", "backupcontroller") if legacy.get(k)]
    try:
        timeout = float(params.get("slurmctldtimeout", "") or SLURMCTLD_TIMEOUT_DEFAULT_S)
    except ValueError:
        timeout = SLURMCTLD_TIMEOUT_DEFAULT_S
    return Controllers(tuple(h for h in hosts if h), params.get("statesavelocation", ""), timeout)


def heartbeat_role(data: bytes, mine: int, controllers: int, now: float, timeout_s: float) -> tuple[Role | None, str]:
    """This controller's role from StateSaveLocation's ``heartbeat`` (``mine``: its SlurmctldHost
    index), and why; None when the file does not tell: not the measured format, a writer index
    no SlurmctldHost has, or older than SlurmctldTimeout (no controller in control writes it)."""
    if len(data) != HEARTBEAT_BYTES:
        return None, f"heartbeat is {len(data)} bytes, not {HEARTBEAT_BYTES}"
    at, index = struct.unpack(">QQ", data)
    if abs(now - at) > 86400:
        return None, f"heartbeat time {at} is not a time near now"
    if index >= controllers:
        return None, f"heartbeat names SlurmctldHost #{index}, slurm.conf has {controllers}"
    if now - at > timeout_s:
        return None, f"heartbeat {now - at:.0f} s old (SlurmctldTimeout {timeout_s:.0f} s)"
    role = Role.PRIMARY if index == mine else Role.BACKUP
    return role, f"slurmctld's heartbeat names SlurmctldHost #{index}" + (" (this host)" if role is Role.PRIMARY else "")


def heartbeat_turns(turns: tuple[float, ...], last: int | None, data: bytes, now: float,
                    timeout_s: float) -> tuple[tuple[float, ...], int | None]:
    """(the times the heartbeat's writer changed within 2 x SlurmctldTimeout of ``now``, the index
    it names now) after reading ``data``, from the same of the last read (``turns``, ``last``).
    A file not in the measured format changes nothing. Two slurmctlds writing it when
    ``len(turns) >= HEARTBEAT_TURNS``."""
    recent = tuple(t for t in turns if now - t <= 2 * timeout_s)
    if len(data) != HEARTBEAT_BYTES:
        return recent, last
    index = struct.unpack(">QQ", data)[1]
    if last is not None and index != last:
        recent += (now,)
    return recent, index
