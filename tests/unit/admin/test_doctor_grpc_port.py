"""doctor's grpc_port check (policy_service/admin/grpc_port.py): warns on a port any user can take,
fails where another process holds it; on real-shaped /proc/net/tcp text, and through the command."""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from policy_service.admin import doctor_checks, doctor_command
from policy_service.admin.grpc_port import PortSeen, grpc_port_check, listening_uids
from policy_service.config import Config, load_config
from slurm_plugin.gpu.nvml_fake import create_fake_gpus

from tests.unit.doctor_layout import CLI_FILES, install_lua, open_dir  # noqa: F401  (open_dir: a fixture)
from tests.unit.admin.test_doctor import CFG, GIB, GOOD_GRES_CONF, GOOD_SLURM_CONF, _write_config

SLURM = 64030  # the service's user (owner of service.socket_path)
USER = 1000  # anyone else

# (address, what was seen, ok, warn, words in detail + fix)
CASES = [
    ("0.0.0.0:50551", PortSeen(), True, True, ["port 50551 is unprivileged", "455", "CAP_NET_BIND_SERVICE"]),
    ("10.0.0.1:50551", PortSeen(), True, True, ["without TLS, go to that process", "hooks.service_address"]),
    ("[::]:50551", PortSeen(), True, True, ["unprivileged"]),
    (":50551", PortSeen(), True, True, ["unprivileged"]),  # every address
    ("ctl01:50551", PortSeen(), True, True, ["unprivileged"]),  # a name is not taken for loopback
    ("127.0.0.1:50551", PortSeen(), True, False, ["on loopback"]),
    ("localhost:50551", PortSeen(), True, False, ["on loopback"]),
    ("0.0.0.0:455", PortSeen(), True, False, ["port 455 is privileged (< 1024)"]),
    ("0.0.0.0:455", PortSeen(unprivileged_start=0), True, True,
     ["unprivileged (>= 0, net.ipv4.ip_unprivileged_port_start)", "raise net.ipv4.ip_unprivileged_port_start above 455"]),
    ("0.0.0.0:455", PortSeen(unprivileged_start=456), True, False, ["privileged (< 456)"]),
    ("127.0.0.1:0", PortSeen(), True, False, ["a free port picked at each start"]),
    ("unix:/run/swapaware/grpc.sock", PortSeen(), True, False, ["not host:port"]),
    # held by the service itself (its user), or seen on a host without the service: no finding
    ("0.0.0.0:455", PortSeen(listener_uids=(SLURM,), service_uid=SLURM), True, False, ["privileged"]),
    ("0.0.0.0:455", PortSeen(listener_uids=(USER,)), True, False, ["privileged"]),
    ("0.0.0.0:455", PortSeen(listener_uids=(SLURM,), service_uid=SLURM, service_bound=True), True, False, ["privileged"]),
    # held by another process, where doctor can tell
    ("0.0.0.0:50551", PortSeen(listener_uids=(USER,), service_uid=SLURM), False, False,
     [f"listened on by uid {USER}, not by the service's user (uid {SLURM}", "ss -ltnp 'sport = :50551'",
      "e.g. 455"]),
    ("0.0.0.0:50551", PortSeen(listener_uids=(SLURM, USER), service_uid=SLURM), False, False, [f"by uid {USER},"]),
    ("127.0.0.1:50551", PortSeen(listener_uids=(USER,), service_bound=False), False, False,
     ["the service on this host waits for its port", f"listening as uid {USER}", "within 5 s of its release"]),
    ("127.0.0.1:50551", PortSeen(service_bound=False), False, False, ["another process holds it;"]),
]


@pytest.mark.parametrize("address, seen, ok, warn, words", CASES)
def test_grpc_port_check(address, seen, ok, warn, words):
    check = grpc_port_check(address, seen)
    assert (check.name, check.ok, check.warn) == ("grpc_port", ok, warn), check
    assert address in check.detail
    assert bool(check.fix) == (warn or not ok)
    for word in words:
        assert word in check.detail + " " + check.fix, (word, check)


PROC_NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:C5E7 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 41273 1 00000000edc6b00b 100 0 0 10 0
   1: 0100007F:01C7 00000000:0000 0A 00000000:00000000 00:00000000 00000000 64030        0 41274 1 00000000edc6b00c 100 0 0 10 0
   2: 0100007F:C5E7 0100007F:A024 01 00000000:00000000 00:00000000 00000000     0        0 41275 1 00000000b72a03dd 20 4 30 10 -1
   3: 00000000:1A85 00000000:0000 0A 00000000:00000000 00:00000000 00000000   998        0 41276 1 00000000117643c5 100 0 0 10 0
"""
PROC_NET_TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:C5E7 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1001        0 51273 1 0000000011111111 100 0 0 10 0
"""


@pytest.mark.parametrize("text, port, uids", [
    (PROC_NET_TCP, 50663, (1000,)),  # 0xC5E7; the connected socket on that port (st 01) is no listener
    (PROC_NET_TCP, 455, (SLURM,)),  # 0x01C7
    (PROC_NET_TCP, 6789, (998,)),
    (PROC_NET_TCP, 50551, ()),
    (PROC_NET_TCP6, 50663, (1001,)),
    ("", 455, ()),
    ("header\n   0: garbage\n", 455, ()),
])
def test_listening_uids_from_proc_net_tcp(text, port, uids):
    assert listening_uids(text, port) == uids


def test_doctor_checks_include_grpc_port_when_looked_at():
    names = [c.name for c in doctor_checks(GOOD_SLURM_CONF, GOOD_GRES_CONF, CFG, None, None)]
    assert "grpc_port" not in names
    checks = doctor_checks(GOOD_SLURM_CONF, GOOD_GRES_CONF, CFG, None, None, grpc_port=PortSeen())
    assert [c for c in checks if c.name == "grpc_port"][0].ok


def test_the_default_is_a_privileged_port_the_hooks_also_use():
    cfg = Config()  # the code's defaults
    assert cfg.service.grpc_address.rpartition(":")[2] == cfg.hooks.service_address.rpartition(":")[2] == "455"
    example = load_config(Path(__file__).resolve().parents[3] / "contrib" / "swapaware.toml.example", env={})
    assert example.service.grpc_address == cfg.service.grpc_address
    assert example.hooks.service_address == cfg.hooks.service_address
    assert not grpc_port_check(example.service.grpc_address.replace("127.0.0.1", "0.0.0.0"), PortSeen()).warn


@pytest.mark.parametrize("address, line", [
    ("0.0.0.0:50551", "[WARN] grpc_port: service.grpc_address 0.0.0.0:50551: port 50551 is unprivileged"),
    ("0.0.0.0:455", "[ OK ] grpc_port: service.grpc_address 0.0.0.0:455: port 455 is privileged"),
])
def test_doctor_prints_the_warning_with_its_fix_and_still_exits_0(tmp_path: Path, open_dir: Path, address, line):
    create_fake_gpus(tmp_path / "gpus", 4, 80 * GIB)
    config = _write_config(tmp_path, tmp_path / "gpus")
    config.write_text(config.read_text() + f'[service]\ngrpc_address = "{address}"\n'
                      f'socket_path = "{tmp_path / "no-service.sock"}"\n')
    install_lua(open_dir, CLI_FILES)  # CliFilterPlugins=lua: cli_filter.lua beside slurm.conf
    (open_dir / "slurm.conf").write_text(GOOD_SLURM_CONF)
    (open_dir / "gres.conf").write_text(GOOD_GRES_CONF)
    env = {"SLURM_CONF": str(open_dir / "slurm.conf"), "SWAPAWARE_CONFIG": ""}
    out = CliRunner().invoke(doctor_command, ["--config", str(config), "--no-probes"], env=env)
    assert out.exit_code == 0, out.output
    assert line in out.output, out.output
    fix = "fix: move the service to a port below 1024 (e.g. 455)"
    assert (fix in out.output) == line.startswith("[WARN]")
