"""What doctor reads and asks on this host for the wiring checks (wiring.py, access_checks.py,
peers.py): the Lua files and swapaware_plugin.conf beside slurm.conf, stat results, SlurmUser's
groups, the uid behind the service's socket, the node agent, munged, the cluster's addresses."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import slurm_plugin
from policy_service.admin.access_checks import slurmuser_socket_check, slurmuser_table_check
from policy_service.admin.check import Check
from policy_service.admin.peers import (agent_check, munge_origin_check, peer_uid, service_user_check,
                                        unmunge_origin)
from policy_service.admin.perms import ANYONE, WRITE, Who, blocker, me, stat_chain, who
from policy_service.admin.table_decisions import table_decisions_checks
from policy_service.admin.wiring import (PLUGIN_CONF, LuaFile, cli_filter_entry, controller_hosts, job_submit_entry,
                                         lua_files_check, lua_plugin_on, on_controller, plugin_conf_checks,
                                         plugin_settings, plugin_table_path, table_uids)
from policy_service.slurm.slurm_files import parse_slurm_conf
from policy_service.config import Config
from policy_service.core.dialect import SlurmDialect

SRC_DIR = Path(slurm_plugin.__file__).resolve().parent


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def shipped_lua() -> dict[str, str]:
    """The package's Lua files (name -> text): what the guide installs beside slurm.conf."""
    return {p.name: p.read_text() for p in sorted(SRC_DIR.glob("*.lua"))}


def lua_beside(conf_dir: Path, names) -> dict[str, LuaFile]:
    """Those of ``names`` that are in ``conf_dir``: their text (None: unreadable here) and stat chain."""
    found = {}
    for name in names:
        chain, stop = stat_chain(conf_dir / name)
        if not stop:
            found[name] = LuaFile(_read(conf_dir / name), chain)
    return found


def host_checks(slurm_conf: Path, slurm_text: str, cfg: Config, hostname: str, probes: bool,
                dialect: SlurmDialect | None = None) -> list[Check]:
    """The wiring checks of this host (``probes``: also connect to the service's socket and the
    agent's, and ask munged and Slurm)."""
    conf = parse_slurm_conf(slurm_text)
    conf_dir = Path(os.path.abspath(slurm_conf)).parent
    shipped = shipped_lua()
    files = lua_beside(conf_dir, shipped)
    user_label = conf.get("SlurmUser") or "root"
    slurm_user, doctor = who(user_label), me()
    plugin_text = _read(conf_dir / PLUGIN_CONF)
    settings = plugin_settings(plugin_text)
    checks = []
    if lua_plugin_on(conf.get("CliFilterPlugins"), "cli_filter"):
        checks.append(lua_files_check(cli_filter_entry(str(conf_dir / "slurm.conf")), str(conf_dir), files, shipped,
                                      str(SRC_DIR)))
    controller = on_controller(slurm_text, hostname)
    if not controller:
        checks.append(Check("job_submit_files", True, f"{hostname} is no controller (SlurmctldHost="
                            f"{','.join(controller_hosts(slurm_text))}): job_submit.lua, swapaware_plugin.conf and "
                            "the service's socket are checked by doctor on the controller", skipped=True))
    else:
        if lua_plugin_on(conf.get("JobSubmitPlugins"), "job_submit"):
            reader = slurm_user or Who(user_label, ANYONE.uid, ANYONE.gids)
            checks.append(lua_files_check(job_submit_entry(str(conf_dir / "slurm.conf"), reader), str(conf_dir), files,
                                          shipped, str(SRC_DIR), table_set=bool(plugin_table_path(settings))))
        if plugin_text is None and (conf_dir / PLUGIN_CONF).exists():
            checks.append(Check("plugin_socket", True, f"not checked as {doctor.name}: {conf_dir / PLUGIN_CONF} is not "
                                "readable to this user; run doctor as root or as SlurmUser", skipped=True))
        else:
            checks += plugin_conf_checks(plugin_text, str(conf_dir), cfg)
        sock = settings["socket"] or str(cfg.service.socket_path)
        checks.append(slurmuser_socket_check(slurm_user, user_label, sock, *stat_chain(Path(sock)), doctor))
        table = plugin_table_path(settings) or cfg.table_path
        if table:
            tables = [(p, *stat_chain(Path(p))) for p in (table, table + ".gate")]
            uids = table_uids(settings, slurm_user.uid if slurm_user else None)
            checks.append(slurmuser_table_check(slurm_user, user_label, tables, uids, doctor))
        if probes:
            path = str(cfg.service.socket_path)
            uid, error = peer_uid(path)
            chain, _ = stat_chain(Path(path))
            checks.append(service_user_check(path, uid, error, chain, slurm_user, doctor))
            # what slurmctld did: recent jobs decided from the table (table_decisions.py)
            checks += table_decisions_checks(cfg, settings, str(conf_dir), doctor.name,
                                             slurm_user.uid if slurm_user else None, dialect)
    if probes:
        checks.append(agent_probe(cfg, conf, hostname, doctor))
        checks.append(munge_probe(cfg, hostname, dialect))
    return checks


def agent_probe(cfg: Config, conf, hostname: str, doctor: Who) -> Check:
    path = str(cfg.hooks.agent_socket)
    chain, stop = stat_chain(Path(path))
    answered = None
    if not stop and blocker(doctor, chain, WRITE) is None:
        from slurm_plugin.agent.client import status

        answered = status(cfg.hooks) is not None
    node = conf.node(hostname.split(".", 1)[0])
    return agent_check(path, chain, stop, doctor, answered, node is not None and node.gres.get("gpu", 0) > 0,
                       hostname, str(cfg.agent.socket_path))


def munge_probe(cfg: Config, hostname: str, dialect: SlurmDialect | None, slurm=None) -> Check:
    """``slurm``: what lists the cluster's addresses (default: Slurm's commands, as the service)."""
    from policy_service.serving.client import munge_socket_for

    sock = munge_socket_for(cfg.auth)
    if sock is None:
        return Check("munge_origin", True, f"this host's hooks attach no MUNGE credential (auth.munge = "
                     f"{cfg.auth.munge.value}, munged's socket {cfg.auth.munge_socket}): not checked", skipped=True)
    if not (shutil.which("munge") and shutil.which("unmunge")):
        return Check("munge_origin", True, "munge and unmunge are not installed here: the origin of this host's "
                     "credentials is not checked", skipped=True)
    origin, error = unmunge_origin(sock)
    verdict = addrs = None
    if origin is not None:
        from policy_service.trust.access import Authorizer
        from policy_service.slurm.slurm import CliSlurm
        from policy_service.trust.authz import Caller, Trust, Via, event_verdict

        # the service's own lookup of the cluster's addresses and its own rule for a hook's event
        trust = Trust(munge=True, token=False, slurm_uid=0, service_uid=os.geteuid())
        slurm = slurm or CliSlurm(cfg.service.slurm_timeout_s, dialect=dialect)
        authorizer = Authorizer(trust, cfg.auth, slurm)
        quiet = logging.getLogger("swapaware.access")  # what it would log, the check's line says
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            addrs = authorizer.addresses(origin)
        finally:
            quiet.setLevel(level)
        verdict = event_verdict("JobFinished", Caller(Via.MUNGE, 0, 0, origin), trust, addrs)
    return munge_origin_check(origin, error, verdict, addrs, hostname, bool(cfg.hooks.token_file), sock)
