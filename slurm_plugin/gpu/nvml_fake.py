"""The honest fake of NVML (slurm_plugin/gpu/nvml.py's GpuTelemetry) and its command line.

``FakeNvmlTelemetry`` reads a directory tree that behaves like a device driver, for tests and for
the dev cluster without GPUs::

    <root>/gpu<N>/total_bytes     device capacity (decimal bytes)
    <root>/gpu<N>/procs/<pid>     bytes that process holds on the device
    <root>/gpu<N>/busy/<pid>      percent of the device that process keeps busy (optional)
    <root>/gpu<N>/util_pct        utilisation in percent when no process says (optional)
    <root>/gpu<N>/name, uuid      optional identity

The fake is stateful and honest: ``fake_alloc`` refuses (``FakeOutOfMemory``, nothing written)
when the device's used + requested bytes exceed its capacity, as ``cudaMalloc`` does; memory of
dead processes (no ``/proc/<pid>``, or a zombie) does not count and is not listed, as the driver
releases it when a process exits. Stale files of dead pids are removed by the next alloc.
Utilisation is device-wide, as NVML reports it: the sum of the live processes' busy percentages,
capped at 100 (``util_pct`` when no live process declared one; None when neither exists).
Not modelled: the driver's reserved memory, CUDA contexts, pid reuse between two allocs.

CLI for job scripts (``python -m slurm_plugin.gpu.nvml``, or ``-m slurm_plugin.gpu.nvml_fake``)::

    fake-create --root R --count 4 --total-bytes 85899345920
    fake-alloc  --root R --gpu N --bytes B [--pid P] [--hold-seconds S] [--busy-pct U] [--honour-limit]
    fake-free   --root R --gpu N [--pid P] [--bytes B]

``fake-alloc`` exits 2 with "CUDA out of memory (fake)" on stderr when refused. Without
``--hold-seconds`` it allocates for ``--pid`` (default: its parent, i.e. the calling shell, so
the bytes stay held while the job script runs); with it, it holds the bytes under its own pid
for S seconds (or until SIGTERM/SIGINT) and then frees them.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from slurm_plugin.gpu.nvml import PROC_ROOT, MemoryInfo, ProcessUsage, TelemetryError, pid_alive

_GPU_DIR = re.compile(r"^gpu(\d+)$")


class FakeOutOfMemory(TelemetryError):
    """The fake device cannot satisfy an allocation (the fake's cudaErrorMemoryAllocation)."""


def _gpu_dir(root: Path, gpu: int) -> Path:
    return root / f"gpu{gpu}"


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError) as exc:
        raise TelemetryError(f"fake NVML: cannot read {path}: {exc}") from exc


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _live_procs(gpu_dir: Path, proc_root: Path) -> list[ProcessUsage]:
    procs_dir = gpu_dir / "procs"
    if not gpu_dir.is_dir():
        raise TelemetryError(f"fake NVML: no device {gpu_dir}")
    out = []
    for entry in sorted(procs_dir.iterdir()) if procs_dir.is_dir() else []:
        if not entry.name.isdigit() or not pid_alive(int(entry.name), proc_root):
            continue
        with contextlib.suppress(TelemetryError):  # freed between listing and reading
            out.append(ProcessUsage(int(entry.name), _read_int(entry)))
    return out


@contextlib.contextmanager
def _device_lock(gpu_dir: Path) -> Iterator[None]:
    with open(gpu_dir / ".lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


class FakeNvmlTelemetry:
    """File-backed fake GPUs (layout in the module docstring)."""

    source = "fake-nvml"

    def __init__(self, root: Path, proc_root: Path = PROC_ROOT) -> None:
        self.root = Path(root)
        self._proc_root = proc_root

    def device_count(self) -> int:
        if not self.root.is_dir():
            return 0
        return sum(1 for p in self.root.iterdir() if _GPU_DIR.match(p.name) and p.is_dir())

    def memory(self, index: int) -> MemoryInfo:
        gpu_dir = _gpu_dir(self.root, index)
        total_bytes = _read_int(gpu_dir / "total_bytes")
        used_bytes = sum(p.used_bytes or 0 for p in _live_procs(gpu_dir, self._proc_root))
        return MemoryInfo(total_bytes=total_bytes, used_bytes=used_bytes)

    def processes(self, index: int) -> list[ProcessUsage]:
        return _live_procs(_gpu_dir(self.root, index), self._proc_root)

    def utilization_pct(self, index: int) -> float | None:
        gpu_dir = _gpu_dir(self.root, index)
        live = {p.pid for p in _live_procs(gpu_dir, self._proc_root)}
        busy = [_read_float(gpu_dir / "busy" / str(pid)) for pid in sorted(live)]
        busy = [b for b in busy if b is not None]
        if busy:
            return min(100.0, sum(busy))
        return _read_float(gpu_dir / "util_pct")

    def name(self, index: int) -> str:
        return self._ident(index, "name", "Fake GPU")

    def uuid(self, index: int) -> str:
        return self._ident(index, "uuid", f"GPU-fake-{index:04d}")

    def _ident(self, index: int, field: str, default: str) -> str:
        gpu_dir = _gpu_dir(self.root, index)
        if not gpu_dir.is_dir():
            raise TelemetryError(f"fake NVML: no device {gpu_dir}")
        path = gpu_dir / field
        return path.read_text().strip() if path.is_file() else default

    def close(self) -> None:
        pass


def create_fake_gpus(root: Path, count: int, total_bytes: int | Sequence[int], name: str = "Fake GPU") -> None:
    """Create ``count`` empty fake devices under ``root`` of ``total_bytes`` each, or of
    ``total_bytes[i]`` for device i (a fleet of GPUs of different memory)."""
    sizes = [total_bytes] * count if isinstance(total_bytes, int) else list(total_bytes)
    if count < 0 or len(sizes) != count or any(b <= 0 for b in sizes):
        raise ValueError("count must be >= 0, with one size > 0 bytes per device")
    for gpu, size in enumerate(sizes):
        gpu_dir = _gpu_dir(Path(root), gpu)
        (gpu_dir / "procs").mkdir(parents=True, exist_ok=True)
        _write_atomic(gpu_dir / "total_bytes", f"{size}\n")
        _write_atomic(gpu_dir / "name", f"{name}\n")
        _write_atomic(gpu_dir / "uuid", f"GPU-fake-{gpu:04d}\n")


def _read_float(path: Path) -> float | None:
    try:
        return float(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def fake_alloc(root: Path, gpu: int, pid: int, nbytes: int, proc_root: Path = PROC_ROOT,
               busy_pct: float | None = None, limit_bytes: int | None = None) -> int:
    """Add ``nbytes`` to what ``pid`` holds on fake ``gpu``; returns the pid's new total.

    Raises ``FakeOutOfMemory`` (writing nothing) when used + nbytes > total, or when the pid would
    hold more than ``limit_bytes`` (a per-process cap, as a framework that honours the job's
    handed-down share or MPS's pinned-memory limit refuses), and ``TelemetryError`` for a missing
    device or a dead pid.
    """
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    gpu_dir = _gpu_dir(Path(root), gpu)
    total_bytes = _read_int(gpu_dir / "total_bytes")
    if not pid_alive(pid, proc_root):
        raise TelemetryError(f"fake NVML: pid {pid} is not running")
    with _device_lock(gpu_dir):
        _collect_dead(gpu_dir, proc_root)
        live = _live_procs(gpu_dir, proc_root)
        used_bytes = sum(p.used_bytes or 0 for p in live)
        if used_bytes + nbytes > total_bytes:
            raise FakeOutOfMemory(
                f"CUDA out of memory (fake): tried to allocate {nbytes} bytes on GPU {gpu}; "
                f"{used_bytes} of {total_bytes} bytes in use, {total_bytes - used_bytes} free"
            )
        held_bytes = next((p.used_bytes or 0 for p in live if p.pid == pid), 0) + nbytes
        if limit_bytes is not None and held_bytes > limit_bytes:
            raise FakeOutOfMemory(
                f"CUDA out of memory (fake): tried to allocate {nbytes} bytes on GPU {gpu}; the process would "
                f"hold {held_bytes} bytes, over its limit of {limit_bytes} bytes"
            )
        (gpu_dir / "procs").mkdir(exist_ok=True)
        _write_atomic(gpu_dir / "procs" / str(pid), f"{held_bytes}\n")
        if busy_pct is not None:
            (gpu_dir / "busy").mkdir(exist_ok=True)
            _write_atomic(gpu_dir / "busy" / str(pid), f"{min(100.0, max(0.0, busy_pct))}\n")
        return held_bytes


def fake_free(root: Path, gpu: int, pid: int, nbytes: int | None = None) -> int:
    """Release ``nbytes`` (default: all) that ``pid`` holds on fake ``gpu``; returns what remains."""
    gpu_dir = _gpu_dir(Path(root), gpu)
    path = gpu_dir / "procs" / str(pid)
    with _device_lock(gpu_dir):
        if not path.exists():
            return 0
        remaining_bytes = 0 if nbytes is None else max(0, _read_int(path) - nbytes)
        if remaining_bytes == 0:
            path.unlink(missing_ok=True)
            (gpu_dir / "busy" / str(pid)).unlink(missing_ok=True)
        else:
            _write_atomic(path, f"{remaining_bytes}\n")
        return remaining_bytes


def _collect_dead(gpu_dir: Path, proc_root: Path) -> None:
    for sub in ("procs", "busy"):
        d = gpu_dir / sub
        for entry in d.iterdir() if d.is_dir() else []:
            if entry.name.isdigit() and not pid_alive(int(entry.name), proc_root):
                entry.unlink(missing_ok=True)


# --------------------------------------------------------------------------- CLI


def _sizes(raw: str) -> int | list[int]:
    sizes = [int(v) for v in raw.split(",")]
    return sizes[0] if len(sizes) == 1 else sizes


# The job's share as the TaskProlog exports it (slurm_plugin/enforce/advisory.py).
LIMIT_ENV = "SWAPAWARE_GPU_MEM_LIMIT_BYTES"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m slurm_plugin.gpu.nvml", description="fake NVML tools")
    sub = parser.add_subparsers(dest="command", required=True)
    create = sub.add_parser("fake-create", help="create fake GPUs")
    create.add_argument("--root", type=Path, required=True)
    create.add_argument("--count", type=int, required=True)
    create.add_argument("--total-bytes", type=_sizes, required=True,
                        help="bytes per device: one number, or one per device separated by commas")
    alloc = sub.add_parser("fake-alloc", help="allocate fake GPU memory (refuses beyond capacity)")
    alloc.add_argument("--root", type=Path, required=True)
    alloc.add_argument("--gpu", type=int, required=True)
    alloc.add_argument("--bytes", dest="nbytes", type=int, required=True)
    alloc.add_argument("--pid", type=int, default=None)
    alloc.add_argument("--hold-seconds", type=float, default=None)
    alloc.add_argument("--busy-pct", type=float, default=None, help="percent of the GPU this process keeps busy")
    alloc.add_argument("--honour-limit", action="store_true",
                       help=f"refuse beyond ${LIMIT_ENV} (the job's share the TaskProlog hands down), as a "
                            "framework that honours it does")
    free = sub.add_parser("fake-free", help="free fake GPU memory")
    free.add_argument("--root", type=Path, required=True)
    free.add_argument("--gpu", type=int, required=True)
    free.add_argument("--pid", type=int, default=None)
    free.add_argument("--bytes", dest="nbytes", type=int, default=None)
    return parser


def _hold(root: Path, gpu: int, pid: int, nbytes: int, hold_s: float) -> None:
    def _stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        time.sleep(hold_s)
    finally:
        fake_free(root, gpu, pid, nbytes)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "fake-create":
            create_fake_gpus(args.root, args.count, args.total_bytes)
        elif args.command == "fake-alloc":
            holding = args.hold_seconds is not None
            pid = args.pid if args.pid is not None else (os.getpid() if holding else os.getppid())
            limit = os.environ.get(LIMIT_ENV, "") if args.honour_limit else ""
            fake_alloc(args.root, args.gpu, pid, args.nbytes, busy_pct=args.busy_pct,
                       limit_bytes=int(limit) if limit.isdigit() else None)
            sys.stdout.write(f"allocated {args.nbytes} bytes on fake GPU {args.gpu} for pid {pid}\n")
            sys.stdout.flush()
            if holding:
                _hold(args.root, args.gpu, pid, args.nbytes, args.hold_seconds)
        else:
            pid = args.pid if args.pid is not None else os.getppid()
            fake_free(args.root, args.gpu, pid, args.nbytes)
    except FakeOutOfMemory as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    except (TelemetryError, OSError, ValueError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
