"""core/ha.py: whether this host's slurmctld is in control, and what to do with the writer lease."""
from __future__ import annotations

import stat

import pytest

from policy_service.core.ha import (Control, LeaseAction, LeaseView, Role, Signals, control, lease_step,
                                    parse_role, standby_message, unsafe_owner, writer_until)

FRESH = 30.0


@pytest.mark.parametrize("signals,expected", [
    (Signals(now=100), False),  # nothing says so
    (Signals(now=100, role_file=Role.PRIMARY, role_file_at=50), True),
    (Signals(now=100, role_file=Role.BACKUP, role_file_at=50), False),
    (Signals(now=100, local_admit_at=90), True),  # job_submit runs only on the controller in control
    (Signals(now=100, local_admit_at=60), False),  # too old to count
    # an Admit after primary-off: slurmctld took control again (the off/on programs may not both run)
    (Signals(now=100, role_file=Role.BACKUP, role_file_at=80, local_admit_at=90), True),
    # an Admit from before primary-off does not override it
    (Signals(now=100, role_file=Role.BACKUP, role_file_at=95, local_admit_at=90), False),
    # the controller's own answer is the state now, whatever the file says
    (Signals(now=100, role_file=Role.PRIMARY, role_file_at=50, controller=Role.BACKUP), False),
    (Signals(now=100, role_file=Role.BACKUP, role_file_at=50, controller=Role.PRIMARY), True),
])
def test_control_from_signals(signals, expected):
    got = control(signals, FRESH)
    assert got.in_control is expected
    assert got.why  # every answer says why


def lease(holder, expires_at, now=100.0, epoch=3):
    return LeaseView(holder=holder, epoch=epoch, expires_at=expires_at, now=now)


IN, OUT = Control(True, "the role file says primary"), Control(False, "the role file says backup")


@pytest.mark.parametrize("ctl,view,action,says", [
    (IN, None, LeaseAction.CLAIM, "free"),
    (IN, lease("b", 90.0), LeaseAction.CLAIM, "free"),  # expired
    (IN, lease("a", 110.0), LeaseAction.CLAIM, "renew"),
    (IN, lease("b", 110.0), LeaseAction.CLAIM, "writer is b"),  # the store refuses; said why
    (OUT, lease("a", 110.0), LeaseAction.RELEASE, "release"),
    (OUT, lease("a", 90.0), LeaseAction.STANDBY, "backup"),  # ours but expired: nothing to give back
    (OUT, lease("b", 110.0), LeaseAction.STANDBY, "backup"),
    (OUT, None, LeaseAction.STANDBY, "backup"),
])
def test_lease_step(ctl, view, action, says):
    step = lease_step(ctl, view, "a")
    assert step.action is action
    assert says in step.why


def test_writer_until_counts_from_the_claims_start_less_the_margin():
    assert writer_until(1000.0, 10.0, 1.0) == 1009.0
    assert writer_until(1000.0, 0.5, 1.0) == 1000.0  # never before the claim


@pytest.mark.parametrize("text,role", [("primary\n", Role.PRIMARY), ("backup 1733350000.5\n", Role.BACKUP),
                                       ("PRIMARY", Role.PRIMARY), ("", None), ("maybe", None)])
def test_parse_role(text, role):
    assert parse_role(text) is role


def test_standby_message_names_the_writer():
    assert standby_message("ctl1") == "standby: writer is ctl1"
    assert standby_message(None).startswith("standby: writer is nobody")


@pytest.mark.parametrize("uid,mode,bad", [
    (0, stat.S_IFDIR | 0o755, None), (1000, stat.S_IFDIR | 0o755, None),
    (4242, stat.S_IFDIR | 0o755, "owned by uid 4242"), (0, stat.S_IFDIR | 0o775, "writable"),
    (0, stat.S_IFREG | 0o646, "writable"), (0, stat.S_IFREG | 0o644, None),
])
def test_unsafe_owner(uid, mode, bad):
    why = unsafe_owner("x", uid, mode, (0, 1000))
    assert (why is None) if bad is None else (bad in why)


def test_service_addresses_are_the_controllers_else_the_single_address():
    from policy_service.config import Config, HaConfig, HookConfig
    from policy_service.core.ha import service_addresses

    assert service_addresses(Config(hooks=HookConfig(service_address="ctl:1"))) == ("ctl:1",)
    assert service_addresses(Config(hooks=HookConfig(service_address="ctl:1"),
                                    ha=HaConfig(controllers=("a:1", "b:2")))) == ("a:1", "b:2")


def test_controllers_of_slurm_conf():
    from policy_service.core.ha import controllers_of

    c = controllers_of("SlurmctldHost=ctl1(10.0.0.1)\nSlurmctldHost=ctl2  # backup\n"
                       "StateSaveLocation=/shared/state\nSlurmctldTimeout=5\nNodeName=n1 Gres=gpu:1\n")
    assert (c.hosts, c.state_dir, c.timeout_s) == (("ctl1", "ctl2"), "/shared/state", 5.0)
    assert (c.index_of(("ctl2", "x")), c.index_of(("n1",))) == (1, None)
    old = controllers_of("ControlMachine=a\nBackupController=b\n")  # before SlurmctldHost
    assert (old.hosts, old.timeout_s) == (("a", "b"), 120.0)


NOW = 1_733_360_000.0


@pytest.mark.parametrize("age,index,role,says", [
    (5, 1, Role.PRIMARY, "#1 (this host)"),
    (5, 0, Role.BACKUP, "#0"),
    (100, 1, None, "old"),  # no controller writes it: not known
    (5, 2, None, "has 2"),
    (NOW - 5, 1, None, "not a time"),
])
def test_heartbeat_role(age, index, role, says):
    import struct

    from policy_service.core.ha import heartbeat_role

    got, why = heartbeat_role(struct.pack(">QQ", int(NOW - age), index), 1, 2, now=NOW, timeout_s=10.0)
    assert got is role and says in why


def test_heartbeat_of_another_size_is_not_read():
    from policy_service.core.ha import heartbeat_role

    assert heartbeat_role(b"\0" * 12, 0, 2, now=1000.0, timeout_s=10.0)[0] is None


def test_heartbeat_turns_count_the_writer_changes_within_two_timeouts():
    import struct

    from policy_service.core.ha import heartbeat_turns

    def beat(index: int) -> bytes:
        return struct.pack(">QQ", 1000, index)

    turns, last = heartbeat_turns((), None, beat(0), now=100.0, timeout_s=10.0)
    assert (turns, last) == ((), 0)  # the first read: no change yet
    turns, last = heartbeat_turns(turns, last, beat(0), now=101.0, timeout_s=10.0)
    assert (turns, last) == ((), 0)
    turns, last = heartbeat_turns(turns, last, beat(1), now=102.0, timeout_s=10.0)
    assert (turns, last) == ((102.0,), 1)
    turns, last = heartbeat_turns(turns, last, b"short", now=103.0, timeout_s=10.0)
    assert (turns, last) == ((102.0,), 1)  # not the measured format: nothing changes
    turns, last = heartbeat_turns(turns, last, beat(0), now=110.0, timeout_s=10.0)
    assert (turns, last) == ((102.0, 110.0), 0)
    turns, last = heartbeat_turns(turns, last, beat(0), now=122.5, timeout_s=10.0)
    assert (turns, last) == ((110.0,), 0)  # 102 is more than 2 x 10 s before 122.5
