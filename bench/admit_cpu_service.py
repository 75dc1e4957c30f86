"""bench/admit_cpu.py's services: one `swapaware serve` process per source tree (this checkout or a
git revision's archive), as deployed, with one kept socket connection, and its CPU per Admit read
from /proc (the whole process, and the thread that served the connection)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from admit_cpu_work import write_files
from proc_cpu import stat_cpu_s

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- a service
def tree_of(rev: str, workdir: Path) -> Path:
    """The source of ``rev`` (git archive), with this checkout's generated protos."""
    out = workdir / f"src-{rev.replace('/', '_')}"
    out.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "policy_service"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    shutil.copytree(ROOT / "policy_service" / "_generated", out / "policy_service" / "_generated")
    return out


class Service:
    def __init__(self, name: str, src: Path, workdir: Path, history: Path, table: bool):
        self.name, self.src = name, src
        self.dir = Path(tempfile.mkdtemp(prefix="svc-", dir=workdir))  # (a socket path: at most 107 bytes)
        write_files(self.dir, table)
        shutil.copy(history, self.dir / "history.sqlite3")
        env = {**os.environ, "SWAPAWARE_CONFIG": str(self.dir / "swapaware.toml"), "PYTHONPATH": str(src),
               "PATH": f"{self.dir / 'bin'}:{os.environ.get('PATH', '')}", "PYTHONDONTWRITEBYTECODE": "1"}
        env = {k: v for k, v in env.items() if not k.startswith("SWAPAWARE_") or k == "SWAPAWARE_CONFIG"}
        self.log = open(workdir / f"{name}.log", "wb")
        entry = os.environ.get("ADMIT_CPU_ENTRY")  # (experiments: another way to start it)
        argv = [sys.executable, entry] if entry else [sys.executable, "-c", "from policy_service.cli import main; main()", "serve"]
        self.proc = subprocess.Popen(argv,
                                     env=env, cwd=src, stdout=self.log, stderr=subprocess.STDOUT)
        sock = self.dir / "swapaware.sock"
        for _ in range(300):
            if sock.exists():
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name}: the service exited ({workdir / f'{name}.log'})")
            time.sleep(0.1)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(sock))
        self.sock.settimeout(10)
        self.rfile = self.sock.makefile("rb")
        self.replies: list[bytes] = []

    def cpu_s(self) -> float:
        return stat_cpu_s(Path(f"/proc/{self.proc.pid}/stat"))

    def threads(self) -> dict[str, float]:
        """CPU seconds of each live thread of the service, by tid."""
        out = {}
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                out[task.name] = stat_cpu_s(task / "stat")
            except (FileNotFoundError, ProcessLookupError):
                pass
        return out

    def admit(self, lines: list[bytes], keep: bool = False) -> None:
        for line in lines:
            self.sock.sendall(line)
            reply = self.rfile.readline()
            if not reply.startswith(b'{"response"'):
                raise RuntimeError(f"{self.name}: {reply[:300]!r}")
            if keep:
                self.replies.append(reply)

    def pending(self) -> int:
        """Decisions journaled and not yet in the history (the journal's size, 0 once drained)."""
        try:
            return (self.dir / "history.sqlite3.journal").stat().st_size
        except FileNotFoundError:
            return 0

    def stop(self) -> None:
        self.sock.close()
        self.proc.terminate()
        self.proc.wait(20)
        self.log.close()


def measure(svc: Service, lines: list[bytes]) -> tuple[float, float]:
    """CPU microseconds of the service per Admit over ``lines``, the writer's commits included,
    and the part of it spent by the thread that served the connection (the busiest one)."""
    t0, c0 = svc.threads(), svc.cpu_s()
    svc.admit(lines)
    for _ in range(200):  # the writer commits what waits every 50 ms, then empties the journal
        if svc.pending() == 0:
            break
        time.sleep(0.02)
    time.sleep(0.1)
    t1, c1 = svc.threads(), svc.cpu_s()
    busiest = max((v - t0.get(tid, 0.0) for tid, v in t1.items()), default=0.0)
    return (c1 - c0) * 1e6 / len(lines), busiest * 1e6 / len(lines)


def idle(svc: Service, seconds: float) -> float:
    c0 = svc.cpu_s()
    time.sleep(seconds)
    return (svc.cpu_s() - c0) * 1e6 / seconds
