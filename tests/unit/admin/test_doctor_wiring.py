"""doctor's wiring checks (policy_service/admin/wiring.py): the Lua files beside slurm.conf that
cli_filter/lua and job_submit/lua load, and swapaware_plugin.conf against the service's config.
Each case breaks the setup in a temporary /etc/slurm, sees the failure, then mends it."""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from policy_service.admin.host import SRC_DIR, host_checks, lua_beside, shipped_lua
from policy_service.admin.perms import ANYONE, Who
from policy_service.admin.wiring import (cli_filter_entry, controller_hosts, job_submit_entry, lua_code,
                                         lua_files_check, lua_plugin_on, on_controller, plugin_conf_checks,
                                         plugin_settings, lua_requires)
from policy_service.config import AdmissionConfig, Config, ServiceConfig

from tests.unit.doctor_layout import CLI_FILES as CLI, SUBMIT_FILES as SUBMIT, install_lua as install, open_dir  # noqa: F401
from tests.unit.admin.test_doctor import GOOD_SLURM_CONF, _sub

SLURM = Who("slurm", 64030, frozenset({64030}))


def _cli(etc: Path):
    return lua_files_check(cli_filter_entry(str(etc / "slurm.conf")), str(etc), lua_beside(etc, shipped_lua()),
                           shipped_lua(), str(SRC_DIR))


def _submit(etc: Path, table_set: bool = False, reader: Who = SLURM):
    return lua_files_check(job_submit_entry(str(etc / "slurm.conf"), reader), str(etc),
                           lua_beside(etc, shipped_lua()), shipped_lua(), str(SRC_DIR), table_set=table_set)


# ------------------------------------------------------------------------------------ Lua text
def test_requires_are_read_from_code_not_comments_or_strings():
    text = ('--[[ header: require("swapaware") in a comment ]]\n'
            'local s = "-- not a comment" local m = require("swapaware_cli") -- require("nope")\n'
            "local ok, f = pcall(require, 'swapaware_facts')\nlocal x = require 'plain'\n"
            'local long = [[ require("in_a_long_string") ]] local q = "require(\'in_a_string\')"\n')
    assert lua_requires(text) == [("swapaware_cli", False), ("swapaware_facts", True), ("plain", False)]
    assert "header" not in lua_code(text) and 'local s = "" local m' in lua_code(text)


def test_the_shipped_scripts_load_what_the_guide_installs():
    shipped = shipped_lua()
    assert [m for m, _ in lua_requires(shipped["cli_filter.lua"])] == ["swapaware_cli"]  # guarded or not
    assert [m for m, _ in lua_requires(shipped["job_submit.lua"])] == ["swapaware"]
    assert {m for m, guarded in lua_requires(shipped["swapaware.lua"]) if guarded} >= {"swapaware_facts",
                                                                                      "swapaware_table"}


@pytest.mark.parametrize("value, kind, on", [
    ("lua", "cli_filter", True), ("cli_filter/lua", "cli_filter", True), ("syslog,Lua", "cli_filter", True),
    ("", "cli_filter", False), ("syslog", "cli_filter", False), ("job_submit/lua,all_partitions", "job_submit", True),
])
def test_lua_plugin_on(value, kind, on):
    assert lua_plugin_on(value, kind) is on


# ------------------------------------------------------------------------------- 1. cli_filter
def test_cli_filter_missing_fails_every_client_then_installed_passes(open_dir):
    etc = open_dir / "etc" / "slurm"
    etc.mkdir(parents=True)
    c = _cli(etc)
    assert not c.ok and f"{etc}/cli_filter.lua is missing" in c.detail
    assert "Unable to stat" in c.detail and "fatal: failed to initialize cli_filter plugin" in c.detail
    assert "cli_filter.lua" in c.fix and "swapaware_cli.lua" in c.fix
    assert "login, controller and compute nodes" in c.fix
    install(etc, ["cli_filter.lua"])  # the script alone (a configless slurmctld sends only it): no steps mended
    c = _cli(etc)
    assert not c.ok and "swapaware_cli.lua is missing: cli_filter.lua goes on without it" in c.detail
    assert "refuses a GPU step" in c.detail
    # a site's own cli_filter.lua with a bare require: it does not load at all, and every client fails
    (etc / "cli_filter.lua").write_text('local swapaware_cli = require("swapaware_cli")\n')
    c = _cli(etc)
    assert not c.ok and ("swapaware_cli.lua is missing: cli_filter.lua fails to load (module 'swapaware_cli' not "
                         "found), so Slurm fails every sbatch") in c.detail
    install(etc, ["cli_filter.lua"])
    install(etc, CLI)
    c = _cli(etc)
    assert c.ok and not c.fix and "readable by any user" in c.detail, c


def test_cli_filter_unreadable_to_users_fails(open_dir):
    etc = open_dir / "etc" / "slurm"
    install(etc, CLI)
    os.chmod(etc / "swapaware_cli.lua", 0o600)
    c = _cli(etc)
    assert not c.ok and "any user has no read permission on" in c.detail and "swapaware_cli.lua (mode 0600" in c.detail
    os.chmod(etc / "swapaware_cli.lua", 0o644)
    assert _cli(etc).ok


# ------------------------------------------------------------------------------- 2. job_submit
def test_job_submit_files_missing_then_installed(open_dir):
    etc = open_dir / "etc" / "slurm"
    etc.mkdir(parents=True)
    c = _submit(etc)
    assert not c.ok and "job_submit.lua is missing" in c.detail and "does not start" in c.detail
    assert all(f"{SRC_DIR}/{f}" in c.fix for f in SUBMIT) and "restart slurmctld" in c.fix
    install(etc, ["job_submit.lua"])
    c = _submit(etc)
    assert not c.ok and "swapaware.lua is missing: job_submit.lua fails to load" in c.detail
    install(etc, ["swapaware.lua", "swapaware_table.lua"])
    c = _submit(etc)
    assert not c.ok and "swapaware_facts.lua is missing: every job passes unchanged" in c.detail
    install(etc, ["swapaware_facts.lua"])
    (etc / "swapaware_table.lua").unlink()
    c = _submit(etc)  # no table= set: the table path is lost, jobs are still decided
    assert c.ok and c.warn and "swapaware_table.lua is missing: the admission table is never used" in c.detail
    assert not _submit(etc, table_set=True).ok
    install(etc, SUBMIT)
    c = _submit(etc)
    assert c.ok and not c.warn and not c.fix, c


def test_a_sites_own_job_submit_must_load_swapaware(open_dir):
    etc = open_dir / "etc" / "slurm"
    install(etc, SUBMIT)
    (etc / "job_submit.lua").write_text("function slurm_job_submit(j, p, u) return slurm.SUCCESS end\n")
    c = _submit(etc)
    assert not c.ok and "does not load swapaware.lua" in c.detail
    own = (etc / "job_submit.lua").read_text()
    (etc / "job_submit.lua").write_text('package.path = "/etc/slurm/?.lua;" .. package.path\n'
                                        'local swapaware = require("swapaware")\n' + own)
    assert _submit(etc).ok


def test_job_submit_files_unreadable_to_slurm_user(open_dir):
    etc = open_dir / "etc" / "slurm"
    install(etc, SUBMIT)
    os.chmod(etc / "swapaware.lua", 0o600)  # root's: slurmctld running as slurm cannot load it
    c = _submit(etc)
    assert not c.ok and "slurm has no read permission on" in c.detail
    assert _submit(etc, reader=Who("root", 0, frozenset({0}))).ok  # SlurmUser=root reads anything


# ------------------------------------------------------------------ 3. swapaware_plugin.conf
def _cfg(socket_path="/run/swapaware/policy.sock", table="auto"):
    return Config(service=ServiceConfig(socket_path=Path(socket_path)), admission=AdmissionConfig(table_path=table))


def _by_name(checks):
    return {c.name: c for c in checks}


def test_plugin_settings_read_as_the_lua_reads_them():
    s = plugin_settings("# socket=/commented/out\n  socket = /a.sock  \nsocket=/b.sock\nenabled=no\nbogus line\n")
    assert s["socket"] == "/b.sock" and s["enabled"] == "no" and s["table"] == "auto"
    assert plugin_settings(None)["socket"] == "/run/swapaware/policy.sock"


def test_plugin_socket_differs_from_the_services_then_the_same():
    c = _by_name(plugin_conf_checks(None, "/etc/slurm", _cfg("/run/swapaware/other.sock")))
    assert not c["plugin_socket"].ok and "every GPU job passes unchanged" in c["plugin_socket"].detail
    assert "socket=/run/swapaware/other.sock" in c["plugin_socket"].fix and "touch /etc/slurm/job_submit.lua" in \
        c["plugin_socket"].fix
    other = "/run/swapaware/other.sock"
    c = _by_name(plugin_conf_checks(f"socket={other}\n", "/etc/slurm", _cfg(other)))
    assert c["plugin_socket"].ok and c["plugin_table"].ok  # the table beside the socket on both sides
    assert "table=/run/swapaware/admission.json" in c["plugin_table"].detail
    defaults = _by_name(plugin_conf_checks(None, "/etc/slurm", _cfg()))
    assert defaults["plugin_socket"].ok and defaults["plugin_table"].ok  # both defaults
    off = _by_name(plugin_conf_checks("table=\n", "/etc/slurm", _cfg(table="")))
    assert "plugin_table" not in off  # the table off on both sides


@pytest.mark.parametrize("plugin, service, ok, words", [
    ("table=/var/lib/swapaware/t\n", "", False, "the service publishes no table there"),
    ("table=\n", "/var/lib/swapaware/t", False, "what the service publishes is never used"),
    ("", "/var/lib/swapaware/t", False, "publishes no table there"),  # the plugin's default: beside the socket
    ("", "auto", True, "table=/run/swapaware/admission.json, [admission] table_path=/run/swapaware/admission.json"),
    ("table=/var/lib/swapaware/t\n", "/var/lib/swapaware/other", False, "publishes no table there"),
    ("table=/var/lib/swapaware/t\n", "/var/lib/swapaware/t", True, "table=/var/lib/swapaware/t"),
])
def test_plugin_table_against_admission_table_path(plugin, service, ok, words):
    c = _by_name(plugin_conf_checks(plugin, "/etc/slurm", _cfg(table=service)))["plugin_table"]
    assert c.ok is ok and words in c.detail and bool(c.fix) is not ok, c


def test_plugin_switched_off_warns():
    c = _by_name(plugin_conf_checks("enabled=0\n", "/etc/slurm", _cfg()))["plugin_enabled"]
    assert c.ok and c.warn and "every job passes unchanged" in c.detail and "enabled=1" in c.fix
    assert not _by_name(plugin_conf_checks("enabled=yes\n", "/etc/slurm", _cfg()))["plugin_enabled"].warn


# ---------------------------------------------------------------------- which host is which
def test_controller_hosts():
    text = "SlurmctldHost=ctl01(10.0.0.1)\nSlurmctldHost=ctl02.example.org\n#SlurmctldHost=old\n"
    assert controller_hosts(text) == ["ctl01", "ctl02"]
    assert on_controller(text, "ctl02") and not on_controller(text, "gpu01")
    assert controller_hosts("ControlMachine=head\nBackupController=head2\n") == ["head", "head2"]
    assert on_controller("ClusterName=x\n", "anything")  # none named: checked


# ----------------------------------------------------------------------- through host_checks
def test_host_checks_on_a_login_node_and_on_the_controller(open_dir):
    etc = open_dir / "etc" / "slurm"
    etc.mkdir(parents=True)
    host = "ctl01"
    cfg = _cfg(str(open_dir / "run" / "policy.sock"))
    (etc / "slurm.conf").write_text(GOOD_SLURM_CONF)
    login = _by_name(host_checks(etc / "slurm.conf", GOOD_SLURM_CONF, cfg, "login01", probes=False))
    assert not login["cli_filter_files"].ok and login["job_submit_files"].skipped
    assert set(login) == {"cli_filter_files", "job_submit_files"}
    install(etc, CLI)
    assert _by_name(host_checks(etc / "slurm.conf", GOOD_SLURM_CONF, cfg, "login01", probes=False))[
        "cli_filter_files"].ok
    ctl = _by_name(host_checks(etc / "slurm.conf", GOOD_SLURM_CONF, cfg, host, probes=False))
    assert not ctl["job_submit_files"].ok and not ctl["plugin_socket"].ok
    install(etc, SUBMIT)
    (etc / "swapaware_plugin.conf").write_text(f"socket={cfg.service.socket_path}\n")
    ctl = _by_name(host_checks(etc / "slurm.conf", GOOD_SLURM_CONF, cfg, host, probes=False))
    assert ctl["job_submit_files"].ok and ctl["plugin_socket"].ok
    assert not ctl["slurmuser_socket"].ok and "no socket at" in ctl["slurmuser_socket"].detail  # service not started
    no_cli = _sub(GOOD_SLURM_CONF, "CliFilterPlugins=lua\n", "")
    assert "cli_filter_files" not in _by_name(host_checks(etc / "slurm.conf", no_cli, cfg, host, probes=False))


def test_any_user_is_the_other_bits():
    st = SimpleNamespace(st_mode=0o100604, st_uid=0, st_gid=0)
    from policy_service.admin.perms import READ, allowed
    assert allowed(ANYONE, READ, st)
    assert not allowed(ANYONE, READ, SimpleNamespace(st_mode=0o100640, st_uid=0, st_gid=0))
