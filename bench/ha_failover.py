"""Two controllers' services on one history (docs/ha.md), timed side by side in one run:

* handover: `ha primary-off` on the writer and `ha primary-on` on the standby (what slurmctld's
  SlurmctldPrimaryOff/OnProg do at a takeover) until the standby writes;
* the writer stops dead (SIGKILL has no lease release: its thread is stopped and the lease left to
  expire) until the standby, told primary, writes: lease_ttl_s + up to renew_s;
* a hook's JobStarted with ha.controllers: the writer first (the usual case: it answered last),
  the standby first (one refusal, then the writer), a dead address first (connection refused).

Real services on loopback (gRPC, local sockets), the history a SQLite file both reach.

    .venv/bin/python bench/ha_failover.py [--ttl 10 --renew 2] [--events 50]
"""
from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy_service._generated.swapaware.v1 import policy_pb2 as pb  # noqa: E402
from policy_service.ha.role import write_role  # noqa: E402
from policy_service.history.store import HistoryStore  # noqa: E402
from policy_service.config import HaConfig, HookConfig, load_config  # noqa: E402
from policy_service.core.ha import Role  # noqa: E402
from policy_service.serving.server import start_service  # noqa: E402
from slurm_plugin.hooks.run import deliver  # noqa: E402
from tests.adapter.conftest import SlurmJobs  # noqa: E402


def service(base: Path, name: str, db: Path, role: Role, ttl: float, renew: float):
    home = base / name
    home.mkdir(mode=0o755)
    (home / "history.sqlite3").symlink_to(db)
    write_role(home / "run" / "role", role, time.time())
    env = {"SWAPAWARE_SERVICE__DB_PATH": str(home / "history.sqlite3"),
           "SWAPAWARE_SERVICE__SOCKET_PATH": str(home / "policy.sock"),
           "SWAPAWARE_SERVICE__GRPC_ADDRESS": "127.0.0.1:0", "SWAPAWARE_SERVICE__SLURM_CONF": str(home / "slurm.conf"),
           "SWAPAWARE_SERVICE__SLURM_RELEASE": "22.05", "SWAPAWARE_POLICY__REDECIDE_PENDING": "false",
           "SWAPAWARE_AUTH__MUNGE": "off", "SWAPAWARE_HA__ENABLED": "true", "SWAPAWARE_HA__HOLDER": name,
           "SWAPAWARE_HA__LEASE_TTL_S": str(ttl), "SWAPAWARE_HA__RENEW_S": str(renew),
           "SWAPAWARE_HA__ROLE_FILE": str(home / "run" / "role")}
    return start_service(load_config(env=env), slurm=SlurmJobs())


def until(predicate, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise SystemExit(f"not within {timeout_s} s")
        time.sleep(0.005)
    return time.monotonic() - t0


def dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def hook_ms(spool: Path, first: str, writer: str, n: int, start: int) -> list[float]:
    out = []
    for j in range(start, start + n):
        (spool / ".last-service").unlink(missing_ok=True)
        hooks = HookConfig(spool_dir=spool, deadline_s=5.0)
        t0 = time.perf_counter()
        ok = deliver(hooks, "JobStarted", pb.JobStartedRequest(job_id=j, node="n1", gpu_indices=[0],
                                                               started_at=1000.0 + j, event_id=f"s-{j}"),
                     ha=HaConfig(controllers=(first, writer)))
        out.append((time.perf_counter() - t0) * 1e3)
        if not ok:
            raise SystemExit(f"event {j} spooled")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ttl", type=float, default=10.0)
    ap.add_argument("--renew", type=float, default=2.0)
    ap.add_argument("--events", type=int, default=50)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ha-", dir="/tmp") as d:
        base = Path(d)
        db = base / "history.sqlite3"
        HistoryStore(db).close()
        a = service(base, "a", db, Role.PRIMARY, args.ttl, args.renew)
        until(a.role.is_writer, 30)
        b = service(base, "b", db, Role.BACKUP, args.ttl, args.renew)
        try:
            write_role(base / "b" / "run" / "role", Role.PRIMARY, time.time())  # b's claim is refused first
            write_role(base / "a" / "run" / "role", Role.BACKUP, time.time())
            handover = until(b.role.is_writer, 60)
            print(f"handover (primary-on on b, then primary-off on a) until b writes: {handover:.2f} s "
                  f"(ttl {args.ttl:g} s, renew {args.renew:g} s)")
            spool = base / "spool"
            addr = {n: f"127.0.0.1:{s.grpc_port}" for n, s in (("a", a), ("b", b))}
            for what, first, start in (("writer first", addr["b"], 1), ("standby first", addr["a"], 10_001),
                                       ("dead address first", dead_address(), 20_001)):
                ms = hook_ms(spool, first, addr["b"], args.events, start)
                print(f"hook JobStarted, {what}: median {statistics.median(ms):.1f} ms, "
                      f"max {max(ms):.1f} ms ({args.events} events)")
            # b dies without giving its lease back: its role thread stopped, nothing released
            b.role._stop.set()  # noqa: SLF001 - a dead process renews nothing and releases nothing
            b.role._wake.set()  # noqa: SLF001
            b.role._thread.join()  # noqa: SLF001
            write_role(base / "a" / "run" / "role", Role.PRIMARY, time.time())
            t0 = time.monotonic()
            until(a.role.is_writer, 120)
            print(f"writer dead (lease not released), a told primary, until a writes: {time.monotonic() - t0:.2f} s")
        finally:
            b.role.release = lambda: None  # a dead writer gives nothing back
            for s in (a, b):
                s.stop(0)


if __name__ == "__main__":
    main()
