"""doctor's checks of how Slurm reaches swapaware on this host: the Lua files beside slurm.conf
(cli_filter.lua and job_submit.lua, and the swapaware*.lua they load), swapaware_plugin.conf
against the service's config. Pure over file texts and stat results (``host.py`` reads them);
the access rule itself is ``perms.py``'s."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from policy_service.admin.check import Check, _list_values
from policy_service.admin.perms import ANYONE, READ, StatLike, Who, refusal
from policy_service.config import Config

# swapaware.lua's M.settings and swapaware_table.lua's T.DEFAULTS: what the plugin uses for a key
# swapaware_plugin.conf does not set (or where the file is absent).
# As swapaware.lua and swapaware_table.lua default them; table_uids "": root and slurmctld's own user.
PLUGIN_DEFAULTS = {"socket": "/run/swapaware/policy.sock", "enabled": "1", "table": "auto", "table_uids": ""}
PLUGIN_CONF = "swapaware_plugin.conf"

# What is lost when a module loaded through pcall(require, ...) is missing (swapaware.lua says the same
# in slurmctld's log); a module loaded by a bare require() stops its script from loading at all.
GUARDED_LOSS = {
    "swapaware_facts.lua": "every job passes unchanged (slurmctld logs 'swapaware_facts.lua cannot be loaded')",
    "swapaware_table.lua": "the admission table is never used: every GPU job takes the round trip to the service",
    "swapaware_cli.lua": "cli_filter.lua goes on without it, so Slurm refuses a GPU step (srun --gres=gpu:1) inside a "
                         "job rewritten to shards, and --test-only queries are recorded as decisions",
}


@dataclass(frozen=True)
class LuaFile:
    """One file beside slurm.conf: its text (None: there but unreadable to doctor) and the stat
    results from / down to it (perms.stat_chain)."""

    text: str | None
    chain: Sequence[tuple[str, StatLike]] = ()


@dataclass(frozen=True)
class Entry:
    """A Slurm Lua plugin: its script, the module that makes it swapaware's, who reads it, and
    what breaks without it."""

    check: str
    script: str
    module: str  # the swapaware module it must reach (job_submit.lua -> swapaware.lua)
    reader: Who
    hosts: str
    effect: str  # what Slurm does where the script or a module it needs cannot be loaded
    log: str  # what Slurm logs where the script is missing


# ------------------------------------------------------------------------------------- Lua text

_LONG = re.compile(r"\[(=*)\[")
_SPECIAL = re.compile(r"""["'\[]|--""")
_NAME = re.compile(r"[\w.]+")
_REQUIRE = re.compile(r"""(pcall\s*\(\s*)?\brequire\s*[(,]?\s*(["'])([\w.]+)\2""")


def _long_end(text: str, m: re.Match) -> int:
    end = text.find("]" + m.group(1) + "]", m.end())
    return len(text) if end < 0 else end + len(m.group(1)) + 2


def lua_code(text: str) -> str:
    """``text`` without its comments (``-- ...``, ``--[[ ... ]]``) and with every string emptied but
    those that could name a module (``"swapaware_cli"``): what require() calls are left are code."""
    out, i = [], 0
    while True:
        m = _SPECIAL.search(text, i)
        if m is None:
            out.append(text[i:])
            return "".join(out)
        j = m.start()
        out.append(text[i:j])
        if m.group() == "--":
            long = _LONG.match(text, j + 2)
            if long:
                i = _long_end(text, long)
            else:
                nl = text.find("\n", j)
                i = len(text) if nl < 0 else nl
        elif m.group() == "[":
            long = _LONG.match(text, j)
            i = _long_end(text, long) if long else j + 1
            out.append("[[]]" if long else "[")
        else:  # a quoted string: up to its closing quote (backslash escapes) or the line's end
            k = j + 1
            while k < len(text) and text[k] not in (m.group(), "\n"):
                k += 2 if text[k] == "\\" else 1
            i = min(k + 1, len(text))
            body = text[j + 1:k]
            out.append(m.group() + (body if _NAME.fullmatch(body) else "") + m.group())


def lua_requires(text: str) -> list[tuple[str, bool]]:
    """The modules a Lua script loads with require, each with whether it is guarded by pcall
    (a failed load is then the script's to handle, not an error that stops it)."""
    return [(m.group(3), bool(m.group(1))) for m in _REQUIRE.finditer(lua_code(text))]


def _needed(entry: str, files: Mapping[str, LuaFile], shipped: Mapping[str, str]) -> list[tuple[str, bool, str]]:
    """(file, guarded, loaded by) for every shipped module ``entry`` loads, directly or through
    another: followed in the installed file where there is one, else in the shipped copy."""
    order: list[tuple[str, bool, str]] = []
    seen, todo = {entry}, [entry]
    while todo:
        name = todo.pop(0)
        text = files[name].text if name in files and files[name].text is not None else shipped.get(name, "")
        for module, guarded in lua_requires(text):
            file = module + ".lua"
            if file in shipped and file not in seen:
                seen.add(file)
                order.append((file, guarded, name))
                todo.append(file)
    return order


def lua_files_check(entry: Entry, conf_dir: str, files: Mapping[str, LuaFile], shipped: Mapping[str, str],
                    src_dir: str, table_set: bool = False) -> Check:
    """Are ``entry.script`` and every swapaware module it loads beside slurm.conf and readable by
    ``entry.reader``? ``files``: the *.lua files there; ``shipped``: the package's Lua files
    (name -> text), installed from ``src_dir``."""
    needed = _needed(entry.script, files, shipped)
    problems: list[str] = []
    fail = False
    script = files.get(entry.script)
    if script is None:
        problems.append(f"{conf_dir}/{entry.script} is missing: {entry.effect} ({entry.log})")
        fail = True
    elif script.text is not None and entry.module not in {f for f, _, _ in needed}:
        problems.append(f"{conf_dir}/{entry.script} does not load {entry.module} (no require of "
                        f"{entry.module.removesuffix('.lua')!r}): swapaware is not called from it")
        fail = True
    for file, guarded, by in needed:
        if file in files or script is None:
            continue
        if guarded:
            problems.append(f"{file} is missing: {GUARDED_LOSS.get(file, f'{by} goes on without it')}")
            fail = fail or file != "swapaware_table.lua" or table_set
        else:
            problems.append(f"{file} is missing: {by} fails to load (module '{file.removesuffix('.lua')}' not "
                            f"found), so {entry.effect}")
            fail = True
    for file in [entry.script, *(f for f, _, _ in needed)]:
        why = refusal(entry.reader, files[file].chain, READ) if file in files and files[file].chain else ""
        if why:
            problems.append(f"{why}: {entry.effect}")
            fail = True
    names = ", ".join([entry.script, *(f for f, _, _ in needed)])
    detail = "; ".join(problems) or f"{names} beside slurm.conf in {conf_dir}, readable by {entry.reader.name}"
    fix = ("install -m 644 " + " ".join(f"{src_dir}/{f}" for f in names.split(", ")) + f" {conf_dir}/ on "
           + entry.hosts + ("" if entry.reader.uid == 0 else f"; {entry.reader.name} must be able to read them"))
    return Check(entry.check, not fail, detail, fix if problems else "", warn=bool(problems) and not fail)


def cli_filter_entry(slurm_conf_path: str) -> Entry:
    return Entry("cli_filter_files", "cli_filter.lua", "swapaware_cli.lua", ANYONE,
                 "every host that has this slurm.conf (login, controller and compute nodes: Slurm's clients load "
                 "them there, as the user who runs them)",
                 "Slurm fails every sbatch, salloc and srun on this host",
                 f"'cli_filter/lua: Unable to stat {os.path.dirname(slurm_conf_path)}/cli_filter.lua', 'fatal: failed "
                 "to initialize cli_filter plugin'")


def job_submit_entry(slurm_conf_path: str, slurm_user: Who) -> Entry:
    return Entry("job_submit_files", "job_submit.lua", "swapaware.lua", slurm_user,
                 "every controller (each SlurmctldHost), then restart slurmctld",
                 "slurmctld cannot load job_submit/lua and does not start",
                 f"'job_submit/lua: Unable to stat {os.path.dirname(slurm_conf_path)}/job_submit.lua'")


def lua_plugin_on(slurm_conf_value: str, kind: str) -> bool:
    """``JobSubmitPlugins=lua`` / ``CliFilterPlugins=cli_filter/lua,...`` names the Lua plugin."""
    return "lua" in [v.removeprefix(kind + "/") for v in _list_values(slurm_conf_value)]


# ------------------------------------------------------------------------- the controller's host

_CTLD = re.compile(r"^\s*(SlurmctldHost|ControlMachine|BackupController)\s*=\s*(\S+)", re.IGNORECASE)


def controller_hosts(slurm_conf_text: str) -> list[str]:
    """Short names of the controller hosts slurm.conf names (every SlurmctldHost line, or the
    old ControlMachine / BackupController)."""
    hosts = []
    for line in slurm_conf_text.splitlines():
        m = _CTLD.match(line.split("#", 1)[0])
        if m:
            hosts.append(m.group(2).split("(", 1)[0].split(".", 1)[0])
    return hosts


def on_controller(slurm_conf_text: str, hostname: str) -> bool:
    """Is this host a controller (where slurmctld runs job_submit.lua)? True where slurm.conf names none."""
    hosts = controller_hosts(slurm_conf_text)
    return not hosts or hostname.split(".", 1)[0] in hosts


# ---------------------------------------------------------------------------- swapaware_plugin.conf

_SETTING = re.compile(r"^\s*([A-Za-z0-9_]+)\s*=\s*(.*?)\s*$")


def plugin_settings(text: str | None) -> dict[str, str]:
    """swapaware_plugin.conf as swapaware.lua's M.parse_settings reads it (key=value lines, the
    last of a key wins), over the plugin's defaults."""
    out = dict(PLUGIN_DEFAULTS)
    for line in (text or "").split("\n"):
        m = _SETTING.match(line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def plugin_enabled(settings: Mapping[str, str]) -> bool:
    return settings["enabled"] in ("1", "true", "yes")


def plugin_conf_checks(text: str | None, conf_dir: str, cfg: Config) -> list[Check]:
    """swapaware_plugin.conf (beside slurm.conf, read by job_submit.lua) against the service's
    config: the socket it connects to, the table it reads, whether it is switched on."""
    s = plugin_settings(text)
    path = f"{conf_dir}/{PLUGIN_CONF}"
    where = path if text is not None else f"{path} absent, the plugin's defaults"
    reload = f"then touch {conf_dir}/job_submit.lua (slurmctld reloads it when its time stamp changes)"
    checks = [Check("plugin_enabled", True, f"{where}: enabled={s['enabled']}", "")]
    if not plugin_enabled(s):
        checks[0] = Check("plugin_enabled", True, f"{where}: enabled={s['enabled']}: the plugin is switched off and "
                          "every job passes unchanged", f"set enabled=1 in {path}, {reload}", warn=True)
    service_socket = str(cfg.service.socket_path)
    same = os.path.normpath(s["socket"] or ".") == os.path.normpath(service_socket)
    checks.append(Check(
        "plugin_socket", same,
        f"{where}: socket={s['socket']}, service.socket_path={service_socket}" + (
            "" if same else ": job_submit.lua connects where no service listens, and every GPU job passes unchanged "
                            "('job passes unchanged (fail-open): connect ...' in slurmctld's log)"),
        "" if same else f"set socket={service_socket} in {path} (or service.socket_path to match), {reload}"))
    table, published = plugin_table_path(s), cfg.table_path
    if table or published:
        ok = bool(table) and bool(published) and os.path.normpath(table) == os.path.normpath(published)
        why = ("" if ok else ": the service publishes no table there, so the plugin never finds one and every GPU "
               "job takes the round trip" if table else ": the plugin reads no table (table= unset), so what the "
               "service publishes is never used")
        checks.append(Check(
            "plugin_table", ok, f"{where}: table={table or '(unset)'}, [admission] table_path={published or '(unset)'}"
                                + why,
            "" if ok else f"set table={published} in {path}, {reload}" if published else
            f"set [admission] table_path = \"{table}\" in the service's config and restart it, or remove table= "
            f"from {path}"))
    return checks


def plugin_table_path(settings: Mapping[str, str]) -> str:
    """The class table's path as swapaware_table.lua's T.path resolves table= ("auto": admission.json
    beside socket=); "": off."""
    table = settings["table"]
    if table == "auto":
        head = settings["socket"].rpartition("/")[0]
        return f"{head}/admission.json" if head else ""
    return table


def table_uids(settings: Mapping[str, str], slurm_uid: int | None = None) -> frozenset[int]:
    """swapaware_table.lua's table_uids: who may own the admission table's files (not set: root and
    the user slurmctld runs as, ``slurm_uid``)."""
    if not settings["table_uids"].strip():
        return frozenset({0} | ({slurm_uid} if slurm_uid is not None else set()))
    return frozenset(int(u) for u in re.findall(r"[^,\s]+", settings["table_uids"]) if u.isdigit())
