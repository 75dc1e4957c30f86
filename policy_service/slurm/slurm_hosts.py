"""The cluster's hosts and users as Slurm describes them, for access checks (``policy_service.trust.access``):
node addresses (``scontrol show nodes``), controller addresses and SlurmUser (``scontrol show
config``), a user's AdminLevel (``sacctmgr``). Pure parsers of real-shaped output, plus the
IPv4 resolution of the names found there.

Shapes: ``scontrol`` has ``--json`` since 23.02 (data_parser v0.0.39+: ``{"nodes": [{"name",
"address", "hostname", ...}]}``, 24.11 pinned to v0.0.42, 26.05 to v0.0.44, the node fields
unchanged); 22.05 prints only text (``scontrol -o show nodes``: one ``NodeName=... NodeAddr=...
NodeHostName=...`` line per node). ``scontrol show config`` prints ``Key = value`` lines on all:
``SlurmctldHost[0] = name(addr)`` or ``= name``, ``SlurmctldAddr = (null)``, ``SlurmUser =
slurm(64030)``.
"""
from __future__ import annotations

import json
import re
import socket
from dataclasses import dataclass
from typing import Any, Iterable

from policy_service.slurm.slurm_text import SlurmError

SCONTROL_JSON_SINCE = (23, 2)  # scontrol --json; 22.05 prints text only


@dataclass(frozen=True)
class SlurmNode:
    name: str
    address: str  # NodeAddr ("" when Slurm has none)
    hostname: str  # NodeHostName


def _text(value: Any) -> str:
    """A string field, however the release shapes it (a plain string, a one-item list, null)."""
    if isinstance(value, list):
        value = value[0] if value else ""
    if isinstance(value, dict):  # not seen; a future {"value": ...}-style wrapper
        value = value.get("value") or value.get("name") or ""
    return "" if value is None else str(value).strip()


def parse_nodes_json(text: str) -> list[SlurmNode]:
    """``scontrol show nodes --json[=v0.0.4X]``."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SlurmError(f"scontrol show nodes --json printed invalid JSON: {exc}") from None
    nodes = data.get("nodes") if isinstance(data, dict) else None
    if not isinstance(nodes, list):
        raise SlurmError("scontrol show nodes --json: no 'nodes' list in its output")
    out = []
    for n in nodes:
        if not isinstance(n, dict):
            continue
        name = _text(n.get("name"))
        addr = _text(n.get("address", n.get("node_addr", "")))
        host = _text(n.get("hostname", n.get("node_hostname", "")))
        if name or addr or host:
            out.append(SlurmNode(name, addr, host))
    return out


_FIELD = r"(?:^|\s){key}=(\S*)"


def parse_nodes_oneliner(text: str) -> list[SlurmNode]:
    """``scontrol -o show nodes`` (22.05 has no --json): one node per line."""
    out = []
    for line in text.splitlines():
        m = re.search(_FIELD.format(key="NodeName"), line)
        if not m:
            continue
        addr = re.search(_FIELD.format(key="NodeAddr"), line)
        host = re.search(_FIELD.format(key="NodeHostName"), line)
        out.append(SlurmNode(m.group(1), addr.group(1) if addr else "", host.group(1) if host else ""))
    return out


def parse_config(text: str) -> dict[str, str]:
    """``scontrol show config``: ``Key = value`` lines -> {key: value} (first occurrence wins)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        key = key.strip()
        if sep and key and " " not in key:
            out.setdefault(key, value.strip())
    return out


def _null(value: str) -> str:
    return "" if value in ("(null)", "N/A", "None", "") else value


def controller_hosts(config: dict[str, str]) -> list[str]:
    """Names and addresses of the controllers: every ``SlurmctldHost[i]`` (``name(addr)`` or
    ``name``) and ``SlurmctldAddr`` (and the pre-17.11 ``ControlMachine``/``ControlAddr``/
    ``BackupController``/``BackupAddr``, should a release print them)."""
    hosts: list[str] = []
    for key, value in config.items():
        if not (re.fullmatch(r"SlurmctldHost(\[\d+\])?", key) or key in ("ControlMachine", "ControlAddr",
                                                                          "BackupController", "BackupAddr",
                                                                          "SlurmctldAddr")):
            continue
        m = re.fullmatch(r"([^()\s]+)\(([^()\s]+)\)", value)
        for part in (m.groups() if m else (value,)):
            part = _null(part.strip())
            if part and part not in hosts:
                hosts.append(part)
    return hosts


def slurm_user(config: dict[str, str]) -> tuple[str, int | None]:
    """SlurmUser from ``scontrol show config``: ('slurm', 64030); ('', None) when absent."""
    value = config.get("SlurmUser", "")
    m = re.fullmatch(r"(\S+?)\((\d+)\)", value)
    if m:
        return m.group(1), int(m.group(2))
    return _null(value), None


def parse_admin_level(text: str) -> str:
    """``sacctmgr -n -P show user <name> format=adminlevel``: 'Administrator', 'Operator', 'None';
    '' when the user has no association record (no line)."""
    for line in text.splitlines():
        if line.strip():
            return line.strip().split("|")[0].strip()
    return ""


def resolve_ipv4(names: Iterable[tuple[str, str]]) -> tuple[dict[str, str], list[str]]:
    """(IPv4 address -> name, names that did not resolve) for (name, host or address) pairs."""
    out: dict[str, str] = {}
    failed: list[str] = []
    for name, host in names:
        if not host:
            continue
        try:
            infos = socket.getaddrinfo(host, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            failed.append(host)
            continue
        for info in infos:
            out.setdefault(str(info[4][0]), name or host)
    return out, failed


def node_hosts(nodes: Iterable[SlurmNode]) -> list[tuple[str, str]]:
    """(node name, host) pairs to resolve: NodeAddr, and NodeHostName where it differs."""
    pairs = []
    for n in nodes:
        for host in dict.fromkeys((n.address or n.name, n.hostname)):
            if host:
                pairs.append((n.name or host, host))
    return pairs
