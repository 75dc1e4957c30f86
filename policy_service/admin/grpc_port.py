"""``swapaware doctor``'s ``grpc_port`` check: can another process take the service's gRPC port?

Any user of a host can bind a port at or above ``net.ipv4.ip_unprivileged_port_start`` (1024 by
default) while nothing listens there, e.g. while the service restarts. The service then waits for
its port (serving/grpc_bind.py): the nodes' hooks cannot reach it meanwhile, and without TLS
their events and token go to that process (issue 32). The check:

  FAIL  the port is held by a process that is not the service, where doctor can tell: the service
        of this host says so in its metrics (``swapaware_grpc_bound 0``), or a socket listening on
        the port belongs to another user than the service's (the owner of ``service.socket_path``;
        /proc/net/tcp names each socket's uid, to every user);
  WARN  the port is unprivileged and the address is not loopback (fix: a port below 1024, e.g.
        455, and CAP_NET_BIND_SERVICE: contrib/systemd/swapaware.service). Socket activation is
        no way out: gRPC Python cannot serve on a listening socket handed over by systemd;
  OK    otherwise.

``grpc_port_check`` is pure over what ``look_at_port`` saw.
"""
from __future__ import annotations

import os
import stat
import urllib.request
from dataclasses import dataclass

from policy_service.admin.check import Check
from policy_service.trust.auth_config import is_loopback
from policy_service.config import Config, split_host_port

UNPRIVILEGED_START = "/proc/sys/net/ipv4/ip_unprivileged_port_start"
PROC_TCP = ("/proc/net/tcp", "/proc/net/tcp6")
TCP_LISTEN = "0A"
SUGGESTED_PORT = 455  # the default: below 1024, and below the 512-1023 that RPC clients take as source ports


@dataclass(frozen=True)
class PortSeen:
    """What doctor saw of ``service.grpc_address`` on this host (None: not known)."""

    unprivileged_start: int = 1024  # net.ipv4.ip_unprivileged_port_start: lower ports need the capability
    listener_uids: tuple[int, ...] = ()  # owners of the sockets listening on the port here
    service_uid: int | None = None  # the service's user: the owner of service.socket_path (no socket: no service)
    service_bound: bool | None = None  # the service's own metrics: swapaware_grpc_bound


def listening_uids(proc_net_tcp: str, port: int) -> tuple[int, ...]:
    """Owners (uid) of the sockets listening on ``port`` in /proc/net/tcp or /proc/net/tcp6 text."""
    uids = []
    for line in proc_net_tcp.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8 or fields[3] != TCP_LISTEN:
            continue
        try:
            local_port, uid = int(fields[1].rpartition(":")[2], 16), int(fields[7])
        except ValueError:
            continue
        if local_port == port:
            uids.append(uid)
    return tuple(sorted(set(uids)))


def grpc_port_check(address: str, seen: PortSeen) -> Check:
    """The ``grpc_port`` check of ``service.grpc_address`` (see the module)."""
    try:
        host, port = split_host_port(address)
    except ValueError:
        return Check("grpc_port", True, f"service.grpc_address {address}: not host:port (no TCP port to take)")
    where = f"service.grpc_address {address}"
    see = f"ss -ltnp 'sport = :{port}' shows which process"
    move = (f"move the service to a port below 1024 (e.g. {SUGGESTED_PORT}) on every host (service.grpc_address, "
            "hooks.service_address, ha.controllers) and give it CAP_NET_BIND_SERVICE (contrib/systemd/"
            "swapaware.service: AmbientCapabilities=CAP_NET_BIND_SERVICE), so no user can take it")
    others = [u for u in seen.listener_uids if seen.service_uid is not None and u != seen.service_uid]
    if seen.service_bound is False:
        by = f" (listening as uid {', '.join(map(str, seen.listener_uids))})" if seen.listener_uids else ""
        return Check("grpc_port", False, f"{where}: the service on this host waits for its port: another process "
                     f"holds it{by}; the nodes' hooks cannot reach the service", f"{see}; stop it (the service "
                     f"binds the port within 5 s of its release); {move}")
    if others:
        return Check("grpc_port", False, f"{where}: port {port} is listened on by uid {', '.join(map(str, others))}, "
                     f"not by the service's user (uid {seen.service_uid}, the owner of service.socket_path)",
                     f"{see}; stop it (the service binds the port within 5 s of its release); {move}")
    if port == 0:
        return Check("grpc_port", True, f"{where}: a free port picked at each start")
    privileged = port < seen.unprivileged_start
    if privileged:
        return Check("grpc_port", True, f"{where}: port {port} is privileged (< {seen.unprivileged_start}): only root "
                     "or CAP_NET_BIND_SERVICE can bind it")
    why = (f"port {port} is unprivileged (>= {seen.unprivileged_start}, net.ipv4.ip_unprivileged_port_start)"
           if port < 1024 else f"port {port} is unprivileged (>= 1024)")
    if is_loopback(f"{host}:{port}"):
        return Check("grpc_port", True, f"{where}: {why}, on loopback: only a user of this host could take it")
    fix = move if port >= 1024 else (f"raise net.ipv4.ip_unprivileged_port_start above {port} (sysctl), or {move}")
    return Check("grpc_port", True, f"{where}: {why}: any user of this host can bind it while the service does "
                 "not listen (a restart); the service then waits for it, the nodes' events are spooled and, without "
                 "TLS, go to that process", fix, warn=True)


def look_at_port(cfg: Config, ask_service: bool, timeout_s: float = 2.0) -> PortSeen:
    """What this host shows of ``service.grpc_address`` (``ask_service``: also read the service's
    metrics, at ``service.metrics_address``)."""
    try:
        _, port = split_host_port(cfg.service.grpc_address)
    except ValueError:
        return PortSeen()
    start = 1024
    try:
        with open(UNPRIVILEGED_START) as f:
            start = int(f.read().strip())
    except (OSError, ValueError):
        pass
    uids: set[int] = set()
    for path in PROC_TCP:
        try:
            with open(path) as f:
                uids.update(listening_uids(f.read(), port))
        except OSError:
            pass
    try:
        st = os.stat(cfg.service.socket_path)
        service_uid = st.st_uid if stat.S_ISSOCK(st.st_mode) else None
    except OSError:
        service_uid = None
    bound = service_bound(cfg.service.metrics_address, timeout_s) if ask_service else None
    return PortSeen(unprivileged_start=start, listener_uids=tuple(sorted(uids)), service_uid=service_uid,
                    service_bound=bound)


def service_bound(metrics_address: str, timeout_s: float) -> bool | None:
    """``swapaware_grpc_bound`` from this host's service's metrics; None where they cannot be read
    (not served, another host's address, no service here, a service without the series)."""
    if not metrics_address:
        return None
    try:
        host, port = split_host_port(metrics_address)
    except ValueError:
        return None
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    if not is_loopback(f"{host}:{port}"):
        return None  # another address of this host, or another host: not looked up (a resolver can lie)
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/metrics"
    try:
        text = urllib.request.urlopen(url, timeout=timeout_s).read(1 << 20).decode(errors="replace")
    except (OSError, ValueError):
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "swapaware_grpc_bound":
            try:
                return float(value) >= 1
            except ValueError:
                return None
    return None


__all__ = ["PortSeen", "grpc_port_check", "listening_uids", "look_at_port", "service_bound"]
