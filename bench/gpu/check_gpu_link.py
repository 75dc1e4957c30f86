"""The GPU check's steps on the host link: pinned copy and mapped-read bandwidth, and the
swap-cost calibration (a streaming kernel fully resident vs with part of its working set in mapped
host memory, the victim placement; ``swapaware calibrate`` run on the rows)."""
from __future__ import annotations

import ctypes
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from check_gpu_cuda import ATTR_MULTIPROCESSOR_COUNT, FILL_BYTE, Cuda, expected_sum
from check_gpu_judge import GIB, MIB, Budget, Sweep, calibration_csv

REPO = Path(__file__).resolve().parents[2]


def free_host_bytes() -> int:
    try:
        text = Path("/proc/meminfo").read_text()
        return int(re.search(r"MemAvailable:\s+(\d+) kB", text).group(1)) * 1024
    except (OSError, AttributeError):
        return 4 * GIB



class Bench:
    """Device buffers, pinned/mapped host buffers and the kernel, for steps 4 and 5."""

    def __init__(self, cuda: Cuda) -> None:
        self.cuda = cuda
        self.sms = cuda.attr(ATTR_MULTIPROCESSOR_COUNT)
        self.grid, self.block = self.sms * 8, 256
        self.out = cuda.alloc(self.grid * self.block * 8)
        self.ptx = cuda.load_kernel()

    def read(self, ptr: int, nbytes: int) -> None:
        self.cuda.sum64(ptr, nbytes // 8, self.out, self.grid, self.block)

    def checksum(self) -> int:
        buf = (ctypes.c_uint64 * (self.grid * self.block))()
        self.cuda.sync()
        self.cuda.dtoh(ctypes.addressof(buf), self.out, ctypes.sizeof(buf))
        return sum(buf) % (1 << 64)

    def timed(self, fn: Callable[[], None], repeats: int) -> float:
        """Median seconds of ``fn`` (synchronised) over ``repeats`` runs after one warm-up."""
        fn()
        self.cuda.sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            self.cuda.sync()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]


def bench_sizes(free_dev: int, free_host: int) -> tuple[int, int]:
    """(copy/mapped-read buffer bytes, calibration working-set bytes), bounded by free memory."""
    buf = max(64 * MIB, min(1 * GIB, free_host // 8, free_dev // 8)) // MIB * MIB
    ws = max(64 * MIB, min(2 * GIB, free_host // 8, free_dev // 8)) // MIB * MIB
    return buf, ws


def step_bandwidth(cuda: Cuda, bench: Bench, budget: Budget, nbytes: int) -> dict[str, Any]:
    if not budget.slice(60, min_s=10):
        return {"status": "skipped", "reason": "time budget"}
    dev = cuda.alloc(nbytes)
    pinned, _ = cuda.host_alloc(nbytes, mapped=False)
    mapped, mapped_dev = cuda.host_alloc(nbytes, mapped=True)
    try:
        ctypes.memset(pinned, FILL_BYTE, nbytes)
        ctypes.memset(mapped, FILL_BYTE, nbytes)
        copy_s = bench.timed(lambda: cuda.htod(dev, pinned, nbytes), 5)
        bench.read(dev, nbytes)  # the copy landed: the device-resident sum must match too
        dev_ok = bench.checksum() == expected_sum(nbytes // 8)
        resident_s = bench.timed(lambda: bench.read(dev, nbytes), 5)
        mapped_s = bench.timed(lambda: bench.read(mapped_dev, nbytes), 3)
        mapped_ok = bench.checksum() == expected_sum(nbytes // 8)
    finally:
        cuda.free(dev)
        cuda.free_host(pinned)
        cuda.free_host(mapped)
    out = {"bytes": nbytes, "pinned_htod_bytes_per_s": nbytes / copy_s, "mapped_read_bytes_per_s": nbytes / mapped_s,
           "device_read_bytes_per_s": nbytes / resident_s, "kernel_checksum_ok": dev_ok and mapped_ok,
           "grid": bench.grid, "block": bench.block, "kernel": bench.ptx}
    out["status"] = "ok" if out["kernel_checksum_ok"] else "failed"
    out["summary"] = (f"pinned HtoD {out['pinned_htod_bytes_per_s'] / 1e9:.1f} GB/s, mapped read "
                      f"{out['mapped_read_bytes_per_s'] / 1e9:.1f} GB/s, device read "
                      f"{out['device_read_bytes_per_s'] / 1e9:.0f} GB/s")
    return out


def step_calibrate(cuda: Cuda, bench: Bench, budget: Budget, ws: int, link: str, csv_path: Path,
                   fractions: Sequence[float] = (0.05, 0.1, 0.25, 0.5)) -> dict[str, Any]:
    if not budget.slice(120, min_s=20):
        return {"status": "skipped", "reason": "time budget"}
    dev = cuda.alloc(ws)
    host, host_dev = cuda.host_alloc(ws, mapped=True)
    sweeps: list[Sweep] = []
    try:
        cuda.memset(dev, FILL_BYTE, ws)
        ctypes.memset(host, FILL_BYTE, ws)
        resident = bench.timed(lambda: bench.read(dev, ws), 7)
        for frac in fractions:
            budget.check()
            off = int(ws * frac) // 8 * 8
            res = ws - off

            def split(res: int = res, off: int = off) -> None:  # the victim placement: off bytes over the link
                bench.read(dev, res)
                bench.read(host_dev, off)

            t = bench.timed(split, 5)
            sweeps.append(Sweep(ws, off, resident, t, sweeps=100))
    finally:
        cuda.free(dev)
        cuda.free_host(host)
    text = calibration_csv(sweeps)
    csv_path.write_text(text)
    cli = run_calibrate(csv_path, link)
    return {"status": "ok" if cli["rc"] == 0 else "failed", "csv": str(csv_path.relative_to(REPO))
            if csv_path.is_relative_to(REPO) else str(csv_path), "rows": [s.row() for s in sweeps],
            "per_row_link_bytes_per_s": [s.link_bytes_per_s() for s in sweeps], "link": link, "calibrate": cli,
            "summary": (cli["stdout"].splitlines() or [cli["stderr"].strip()])[0][:160]}


def run_calibrate(csv_path: Path, link: str) -> dict[str, Any]:
    """``swapaware calibrate CSV --link LINK`` through the project's CLI; its output kept verbatim."""
    cmd = [sys.executable, "-c", "import sys; from policy_service.cli import main; sys.exit(main())",
           "calibrate", str(csv_path), "--link", link]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=str(REPO))
    return {"command": f"swapaware calibrate {csv_path.name} --link {link}", "rc": p.returncode,
            "stdout": p.stdout, "stderr": p.stderr[-2000:]}
