"""slurmctld's heartbeat file (StateSaveLocation/heartbeat) as the service reads it for its role
(ha/role.py heartbeat_probe): it tells the role before the role file, and two slurmctlds writing it
in turn (one hung leaving control: docs/ha.md) are said in the log, once per episode."""
from __future__ import annotations

import logging
import struct
import time

from policy_service.config import HaConfig
from policy_service.core.ha import HEARTBEAT_TURNS, Role
from policy_service.ha.role import RoleKeeper, heartbeat_probe, write_role
from policy_service.history.store import HistoryStore


def controllers_conf(short_dir, timeout_s: int = 5):
    state = short_dir / "state"
    state.mkdir()
    conf = short_dir / "slurm.conf"
    conf.write_text(f"SlurmctldHost=ctl1\nSlurmctldHost=ctl2(10.0.0.3)\nStateSaveLocation={state}\n"
                    f"SlurmctldTimeout={timeout_s}\n")
    return conf, state


def test_slurmctlds_heartbeat_tells_the_role_before_the_role_file(short_dir):
    """The heartbeat as measured on 22.05 (docs/ha.md): 16 bytes, time and SlurmctldHost index."""
    conf, state = controllers_conf(short_dir)

    def beat(index: int, age_s: float = 0.0) -> None:
        (state / "heartbeat").write_bytes(struct.pack(">QQ", int(time.time() - age_s), index))

    write_role(short_dir / "run" / "role", Role.BACKUP, time.time())  # stale: the heartbeat is newer evidence
    store = HistoryStore(short_dir / "history.sqlite3", fence="ctl2")
    try:
        probe = heartbeat_probe(conf, ("ctl2",))
        role = RoleKeeper(store, HaConfig(enabled=True, holder="ctl2", role_file=short_dir / "run" / "role"),
                          probe=probe)
        beat(1)
        assert role.step() and "heartbeat names SlurmctldHost #1 (this host)" in role.status()["why"]
        beat(0)  # the other controller took control
        assert not role.step() and store.writer().expires_at <= store.writer().now  # released
        beat(1, age_s=60)  # nobody writes it any more: the role file tells
        assert not role.step() and role.status()["why"] == "the role file says backup"
        assert heartbeat_probe(conf, ("n1",)) is None  # not a controller host: no probe
    finally:
        store.close()


def test_two_slurmctlds_writing_the_heartbeat_in_turn_are_said_once(short_dir, caplog):
    """A takeover and a hand-back (one change each) say nothing; the writer changing at every read
    (a hung slurmctld's heartbeat thread beside the one in control) is warned of once, with what to
    do, and the end of it (one writer for 2 x SlurmctldTimeout) is said too."""
    conf, state = controllers_conf(short_dir, timeout_s=10)
    clock = [1_000_000.0]
    probe = heartbeat_probe(conf, ("ctl2",), wall=lambda: clock[0])

    def read(index: int, after_s: float = 1.0) -> Role | None:
        clock[0] += after_s
        (state / "heartbeat").write_bytes(struct.pack(">QQ", int(clock[0]), index))
        return probe()[0]

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "heartbeat" in r.getMessage()]

    caplog.set_level(logging.INFO, logger="swapaware.ha")
    assert read(0) is Role.BACKUP and read(1) is Role.PRIMARY and read(1) is Role.PRIMARY  # a takeover
    assert read(0, after_s=5) is Role.BACKUP  # and a hand-back within the window: 2 changes
    assert not warned()
    assert [read(i % 2) for i in range(1, 8)]  # the writer changes at every read from here
    assert len(warned()) == 1, warned()
    assert f"changed writer {HEARTBEAT_TURNS} times in 20 s" in warned()[0] and "kill -9" in warned()[0]
    assert read(1, after_s=21) is Role.PRIMARY and read(1) is Role.PRIMARY  # the hung one killed: one writer
    assert any("has one writer again" in r.getMessage() for r in caplog.records)
    assert len(warned()) == 1
