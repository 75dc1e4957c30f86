#!/usr/bin/env python3
"""One-shot GPU check for swapaware: NVML sampler, MPS cap, host-link bandwidth, swap-cost calibration.

Run on a node with one NVIDIA GPU and its driver (no CUDA toolkit or PyTorch needed: the CUDA
driver API is called through ctypes on libcuda.so.1 and the one kernel is hand-written PTX that
the driver JIT-compiles):

    .venv/bin/python bench/gpu/check_gpu.py            # results in bench/gpu/results/

Steps, each bounded, all within ``--budget-s`` (default 480 s):
1. device info (CUDA driver + NVML);
2. sampler: child processes allocate known amounts and hold them; the node agent's own code path
   (``Agent`` over ``PynvmlTelemetry``, pids attributed to jobs by ``SLURM_JOB_ID``) samples them;
   per-pid bytes, attribution and per-job peak are compared with what was allocated;
3. MPS: with ``nvidia-cuda-mps-control`` present, a private daemon (own pipe/log directories), a
   client with ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``: below the cap must succeed, above must fail;
4. bandwidth: pinned HtoD copy, and a kernel reading pinned *mapped* host memory (the victim
   placement the swap-cost model describes);
5. calibration: a streaming kernel fully resident vs with a fraction of its working set in mapped
   host memory gives ``victim`` rows; ``swapaware calibrate`` is run on them.
No managed memory is allocated, so nothing can ask for more than the card has free.

Exit codes: 0 all checks passed, 1 a check failed or a step errored, 3 no NVIDIA driver / GPU.
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import datetime as _dt
import io
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

EXIT_OK, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 3
NO_GPU_MESSAGE = "no NVIDIA driver / no GPU: nothing measured"
GIB = 1 << 30
MIB = 1 << 20
DEFAULT_BUDGET_S = 480.0
RESERVE_S = 15.0  # kept back for writing results
CSV_FIELDS = ("mode", "access", "footprint_bytes", "working_set_bytes", "offloaded_bytes", "sweeps_per_s",
              "solo_s", "measured_s")
JOB_ID_BASE = 990_000  # synthetic Slurm job ids for the sampler's children
MAX_CONTEXT_OVERHEAD = 2 * GIB  # per-pid NVML bytes above the allocation beyond this: attribution is wrong

# --------------------------------------------------------------------------- PTX

KERNEL_NAME = "sum64"
# sum64(src, n_words, out): a grid-stride loop; thread t adds src[t], src[t + stride], ... (u64,
# wrapping) and stores its sum at out[t]. The host adds out[] to check the kernel read everything.
PTX_HEADER = """
.version {version}
.target {target}
.address_size 64
"""
PTX_BODY = r"""
.visible .entry sum64(
    .param .u64 p_src,
    .param .u64 p_n,
    .param .u64 p_out
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<5>;
    .reg .b64 %rd<16>;

    ld.param.u64 %rd1, [p_src];
    ld.param.u64 %rd2, [p_n];
    ld.param.u64 %rd3, [p_out];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd3, %rd3;
    mov.u32 %r1, %ntid.x;
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    cvt.u64.u32 %rd4, %r1;
    cvt.u64.u32 %rd5, %r2;
    cvt.u64.u32 %rd6, %r3;
    cvt.u64.u32 %rd7, %r4;
    mul.lo.u64 %rd8, %rd4, %rd5;
    add.u64 %rd8, %rd8, %rd6;
    mul.lo.u64 %rd9, %rd4, %rd7;
    mov.u64 %rd10, 0;
    mov.u64 %rd11, %rd8;
LOOP:
    setp.ge.u64 %p1, %rd11, %rd2;
    @%p1 bra DONE;
    shl.b64 %rd12, %rd11, 3;
    add.u64 %rd13, %rd1, %rd12;
    ld.global.u64 %rd14, [%rd13];
    add.u64 %rd10, %rd10, %rd14;
    add.u64 %rd11, %rd11, %rd9;
    bra LOOP;
DONE:
    shl.b64 %rd12, %rd8, 3;
    add.u64 %rd13, %rd3, %rd12;
    st.global.u64 [%rd13], %rd10;
    ret;
}
"""


def ptx_text(version: str = "6.0", target: str = "sm_50") -> str:
    return PTX_HEADER.format(version=version, target=target) + PTX_BODY


PTX = ptx_text()
# Tried in order: the oldest ISA any driver JITs, then the device's own architecture (a driver
# that no longer takes sm_50 PTX still takes PTX written for the GPU it drives).
PTX_VARIANTS = (("6.0", "sm_50"), ("7.8", "sm_{cc}"), ("8.6", "sm_{cc}"))

FILL_BYTE = 0x01
FILL_WORD = int.from_bytes(bytes([FILL_BYTE]) * 8, "little")


def expected_sum(n_words: int) -> int:
    """What sum64 over ``n_words`` words of FILL_BYTE adds up to (mod 2**64)."""
    return (FILL_WORD * n_words) % (1 << 64)


# --------------------------------------------------------------------------- time budget


class BudgetExceeded(RuntimeError):
    pass


class Budget:
    """Overall deadline with a reserve kept for writing results; each step asks for a slice."""

    def __init__(self, total_s: float, reserve_s: float = RESERVE_S, clock: Callable[[], float] = time.monotonic):
        self.total_s, self.reserve_s, self._clock = total_s, reserve_s, clock
        self._start = clock()

    def elapsed(self) -> float:
        return self._clock() - self._start

    def remaining(self) -> float:
        """Seconds left for steps (the reserve excluded), never negative."""
        return max(0.0, self.total_s - self.reserve_s - self.elapsed())

    def slice(self, want_s: float, min_s: float = 0.0) -> float:
        """Seconds a step may take: ``want_s`` capped by what is left; 0 when under ``min_s``."""
        got = min(want_s, self.remaining())
        return got if got >= min_s and got > 0 else 0.0

    def check(self) -> None:
        if self.remaining() <= 0:
            raise BudgetExceeded(f"time budget of {self.total_s:.0f} s spent")


# --------------------------------------------------------------------------- CUDA driver API


class CudaError(RuntimeError):
    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call, self.code, self.name = call, code, name


CUDA_ERROR_OUT_OF_MEMORY = 2
CU_MEMHOSTALLOC_PORTABLE = 0x01
CU_MEMHOSTALLOC_DEVICEMAP = 0x02
ATTR_MULTIPROCESSOR_COUNT = 16
ATTR_CAN_MAP_HOST_MEMORY = 19
ATTR_PCI_BUS_ID = 33
ATTR_CC_MAJOR = 75
ATTR_CC_MINOR = 76


def libcuda_path() -> str:
    return os.environ.get("SWAPAWARE_LIBCUDA", "libcuda.so.1")


class Cuda:
    """Thin ctypes wrapper over the driver API calls this script uses."""

    def __init__(self, path: str | None = None) -> None:
        self.lib = ctypes.CDLL(path or libcuda_path())  # OSError when there is no driver
        u64, c = ctypes.c_uint64, ctypes
        sig = {
            "cuInit": [c.c_uint], "cuDriverGetVersion": [c.POINTER(c.c_int)],
            "cuDeviceGetCount": [c.POINTER(c.c_int)], "cuDeviceGet": [c.POINTER(c.c_int), c.c_int],
            "cuDeviceGetName": [c.c_char_p, c.c_int, c.c_int],
            "cuDeviceTotalMem_v2": [c.POINTER(c.c_size_t), c.c_int],
            "cuDeviceGetAttribute": [c.POINTER(c.c_int), c.c_int, c.c_int],
            "cuDevicePrimaryCtxRetain": [c.POINTER(c.c_void_p), c.c_int],
            "cuDevicePrimaryCtxRelease_v2": [c.c_int],
            "cuCtxSetCurrent": [c.c_void_p], "cuCtxSynchronize": [],
            "cuMemGetInfo_v2": [c.POINTER(c.c_size_t), c.POINTER(c.c_size_t)],
            "cuMemAlloc_v2": [c.POINTER(u64), c.c_size_t], "cuMemFree_v2": [u64],
            "cuMemsetD8_v2": [u64, c.c_ubyte, c.c_size_t],
            "cuMemHostAlloc": [c.POINTER(c.c_void_p), c.c_size_t, c.c_uint], "cuMemFreeHost": [c.c_void_p],
            "cuMemHostGetDevicePointer_v2": [c.POINTER(u64), c.c_void_p, c.c_uint],
            "cuMemcpyHtoD_v2": [u64, c.c_void_p, c.c_size_t], "cuMemcpyDtoH_v2": [c.c_void_p, u64, c.c_size_t],
            "cuModuleLoadData": [c.POINTER(c.c_void_p), c.c_char_p],
            "cuModuleGetFunction": [c.POINTER(c.c_void_p), c.c_void_p, c.c_char_p],
            "cuLaunchKernel": [c.c_void_p, c.c_uint, c.c_uint, c.c_uint, c.c_uint, c.c_uint, c.c_uint, c.c_uint,
                               c.c_void_p, c.POINTER(c.c_void_p), c.POINTER(c.c_void_p)],
            "cuGetErrorName": [c.c_int, c.POINTER(c.c_char_p)],
        }
        for name, args in sig.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, c.c_int

    def call(self, name: str, *args: Any) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(text))
            raise CudaError(name, rc, (text.value or b"?").decode())

    def init(self, ordinal: int = 0) -> int:
        self.call("cuInit", 0)
        count = ctypes.c_int()
        self.call("cuDeviceGetCount", ctypes.byref(count))
        if count.value < 1:
            raise CudaError("cuDeviceGetCount", 100, "CUDA_ERROR_NO_DEVICE")
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), ordinal)
        self.dev = dev.value
        return count.value

    def attr(self, attr: int) -> int:
        v = ctypes.c_int()
        self.call("cuDeviceGetAttribute", ctypes.byref(v), attr, self.dev)
        return v.value

    def info(self) -> dict[str, Any]:
        name = ctypes.create_string_buffer(256)
        self.call("cuDeviceGetName", name, 256, self.dev)
        total, ver = ctypes.c_size_t(), ctypes.c_int()
        self.call("cuDeviceTotalMem_v2", ctypes.byref(total), self.dev)
        self.call("cuDriverGetVersion", ctypes.byref(ver))
        return {"name": name.value.decode(), "total_bytes": total.value, "cuda_driver_version": ver.value,
                "compute_capability": f"{self.attr(ATTR_CC_MAJOR)}.{self.attr(ATTR_CC_MINOR)}",
                "multiprocessors": self.attr(ATTR_MULTIPROCESSOR_COUNT),
                "can_map_host_memory": bool(self.attr(ATTR_CAN_MAP_HOST_MEMORY))}

    def context(self) -> None:
        ctx = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), self.dev)
        self.call("cuCtxSetCurrent", ctx)

    def mem_info(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self.call("cuMemAlloc_v2", ctypes.byref(ptr), nbytes)
        return ptr.value

    def free(self, ptr: int) -> None:
        self.call("cuMemFree_v2", ptr)

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        self.call("cuMemsetD8_v2", ptr, value, nbytes)

    def host_alloc(self, nbytes: int, mapped: bool) -> tuple[int, int | None]:
        """Pinned host memory; with ``mapped`` also its device pointer (for kernels reading over the link)."""
        host = ctypes.c_void_p()
        flags = CU_MEMHOSTALLOC_PORTABLE | (CU_MEMHOSTALLOC_DEVICEMAP if mapped else 0)
        self.call("cuMemHostAlloc", ctypes.byref(host), nbytes, flags)
        dptr = None
        if mapped:
            d = ctypes.c_uint64()
            self.call("cuMemHostGetDevicePointer_v2", ctypes.byref(d), host, 0)
            dptr = d.value
        return int(host.value), dptr

    def free_host(self, host: int) -> None:
        self.call("cuMemFreeHost", ctypes.c_void_p(host))

    def htod(self, dst: int, src: int, nbytes: int) -> None:
        self.call("cuMemcpyHtoD_v2", dst, ctypes.c_void_p(src), nbytes)

    def dtoh(self, dst: int, src: int, nbytes: int) -> None:
        self.call("cuMemcpyDtoH_v2", ctypes.c_void_p(dst), src, nbytes)

    def sync(self) -> None:
        self.call("cuCtxSynchronize")

    def load_kernel(self) -> str:
        """JIT the PTX (first variant the driver takes); returns which one loaded."""
        cc = f"{self.attr(ATTR_CC_MAJOR)}{self.attr(ATTR_CC_MINOR)}"
        errors = []
        for version, target in PTX_VARIANTS:
            target = target.format(cc=cc)
            mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
            try:
                self.call("cuModuleLoadData", ctypes.byref(mod), ptx_text(version, target).encode() + b"\0")
                self.call("cuModuleGetFunction", ctypes.byref(fn), mod, KERNEL_NAME.encode())
            except CudaError as exc:
                errors.append(f"{version}/{target}: {exc.name}")
                continue
            self.kernel = fn
            return f"PTX {version} {target}"
        raise CudaError("cuModuleLoadData", -1, "; ".join(errors))

    def sum64(self, src: int, n_words: int, out: int, grid: int, block: int) -> None:
        args = [ctypes.c_uint64(src), ctypes.c_uint64(n_words), ctypes.c_uint64(out)]
        params = (ctypes.c_void_p * 3)(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        self.call("cuLaunchKernel", self.kernel, grid, 1, 1, block, 1, 1, 0, None, params, None)


def open_cuda() -> tuple[Cuda, int] | None:
    """The driver and the device count, or None when there is no driver or no device."""
    try:
        cuda = Cuda()
        return cuda, cuda.init(0)
    except (OSError, AttributeError, CudaError):
        return None


# --------------------------------------------------------------------------- child processes


def child_main(argv: Sequence[str]) -> int:
    """``--child hold N``: allocate N bytes, say ready, hold until stdin closes.
    ``--child try N``: try to allocate N bytes, print the outcome as JSON."""
    action, nbytes = argv[0], int(argv[1])
    cuda = Cuda()
    cuda.init(0)
    cuda.context()
    try:
        ptr = cuda.alloc(nbytes)
        cuda.memset(ptr, 0x5A, nbytes)  # touch it: committed, not just reserved
        cuda.sync()
    except CudaError as exc:
        print(json.dumps({"ok": False, "pid": os.getpid(), "error": exc.name, "code": exc.code}), flush=True)
        return 0 if action == "try" else 1
    print(json.dumps({"ok": True, "pid": os.getpid()}), flush=True)
    if action == "hold":
        sys.stdin.read()
    cuda.free(ptr)
    return 0


def _spawn_child(action: str, nbytes: int, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", action, str(nbytes)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def _read_ready(proc: subprocess.Popen, timeout_s: float) -> dict[str, Any] | None:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout_s):
            return None
        line = proc.stdout.readline()
    finally:
        sel.close()
    try:
        return json.loads(line)
    except ValueError:
        return None


def _stop(procs: Iterable[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.stdin.close()
                p.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                p.kill()
                p.wait()


# --------------------------------------------------------------------------- pure checks


def sampler_sizes(free_bytes: int, wanted: Sequence[int] = (1 * GIB, 2 * GIB, 4 * GIB)) -> list[int]:
    """Allocation sizes for the sampler's children: the wanted ones that fit in half the free memory."""
    out, used = [], 0
    for size in wanted:
        if used + size + 1 * GIB > free_bytes // 2:  # ~1 GiB per context for the driver
            break
        out.append(size)
        used += size + 1 * GIB
    return out


def judge_sampler(children: Sequence[dict[str, Any]], per_pid: dict[int, list[int | None]],
                  attribution: dict[int, int | None], job_peaks: dict[int, int]) -> dict[str, Any]:
    """Compare what NVML/the agent saw with what each child allocated.

    ``children``: {pid, job_id, alloc_bytes}; ``per_pid``: bytes per sample (None: not reported);
    ``attribution``: pid -> job id as the agent resolved it; ``job_peaks``: job id -> the agent's
    peak_bytes at stop. Overhead = NVML bytes - allocated (the driver's per-context reservation)."""
    rows, ok = [], True
    for c in children:
        seen = [b for b in per_pid.get(c["pid"], []) if b is not None]
        peak_seen = max(seen) if seen else None
        overhead = None if peak_seen is None else peak_seen - c["alloc_bytes"]
        attributed = attribution.get(c["pid"]) == c["job_id"]
        job_peak = job_peaks.get(c["job_id"])
        checks = {
            "reported": peak_seen is not None,
            "covers_allocation": overhead is not None and 0 <= overhead <= MAX_CONTEXT_OVERHEAD,
            "attributed_to_job": attributed,
            "agent_peak_matches": job_peak is not None and peak_seen is not None and job_peak == peak_seen,
        }
        ok = ok and all(checks.values())
        rows.append({**c, "samples": len(seen), "nvml_peak_bytes": peak_seen, "overhead_bytes": overhead,
                     "agent_job_id": attribution.get(c["pid"]), "agent_peak_bytes": job_peak, "checks": checks})
    overheads = [r["overhead_bytes"] for r in rows if r["overhead_bytes"] is not None]
    return {"ok": ok and bool(rows), "children": rows,
            "context_overhead_bytes": sorted(overheads)[len(overheads) // 2] if overheads else None}


def judge_mps(below: dict[str, Any] | None, above: dict[str, Any] | None, enforced: bool = True) -> dict[str, Any]:
    """The cap holds when the backend set it, an allocation below it succeeds and one above fails."""
    checks = {"backend_sets_limit": bool(enforced), "below_cap_succeeds": bool(below and below.get("ok")),
              "above_cap_fails": bool(above) and not above.get("ok")}
    return {"ok": all(checks.values()), "checks": checks, "below": below, "above": above}


@dataclass(frozen=True)
class Sweep:
    """One calibration point: a streaming kernel over ``working_set_bytes``, with ``offloaded_bytes``
    of it in mapped host memory; seconds per sweep fully resident and with the offload."""

    working_set_bytes: int
    offloaded_bytes: int
    resident_s_per_sweep: float
    offloaded_s_per_sweep: float
    sweeps: int

    def row(self) -> dict[str, Any]:
        return {"mode": "victim", "access": "streaming", "footprint_bytes": self.working_set_bytes,
                "working_set_bytes": self.working_set_bytes, "offloaded_bytes": self.offloaded_bytes,
                "sweeps_per_s": f"{1.0 / self.resident_s_per_sweep:.9g}",
                "solo_s": f"{self.resident_s_per_sweep * self.sweeps:.9g}",
                "measured_s": f"{self.offloaded_s_per_sweep * self.sweeps:.9g}"}

    def link_bytes_per_s(self) -> float | None:
        """The bandwidth this point alone implies: offloaded bytes / extra seconds per sweep."""
        extra = self.offloaded_s_per_sweep - self.resident_s_per_sweep
        return self.offloaded_bytes / extra if extra > 0 else None


def calibration_csv(sweeps: Sequence[Sweep]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for s in sweeps:
        w.writerow(s.row())
    return buf.getvalue()


def link_kind(pcie_gen: int | None, override: str | None) -> str:
    if override:
        return override
    return "pcie_gen5" if (pcie_gen or 0) >= 5 else "pcie_gen4"


def assemble(steps: dict[str, dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The result document: every step's outcome and an overall status.

    A step is ``{"status": "ok"|"failed"|"error"|"skipped"|"not available", ...}``; the run passes
    when no step failed or errored (skipped and not-available steps are reported, not failures)."""
    bad = sorted(k for k, v in steps.items() if v.get("status") in ("failed", "error"))
    return {**meta, "status": "failed" if bad else "ok", "failed_steps": bad, "steps": steps}


def result_path(out_dir: Path, host: str, now: _dt.datetime) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", host) or "host"
    return out_dir / f"{safe}-{now.strftime('%Y%m%dT%H%M%SZ')}.json"


def summary_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"swapaware GPU check on {result.get('host')}: {result['status']}"]
    for name, step in result["steps"].items():
        detail = step.get("summary") or step.get("reason") or step.get("error") or ""
        lines.append(f"  {name:<12} {step.get('status', '?'):<14} {detail}")
    return lines


# --------------------------------------------------------------------------- steps (need a GPU)


def _free_host_bytes() -> int:
    try:
        text = Path("/proc/meminfo").read_text()
        return int(re.search(r"MemAvailable:\s+(\d+) kB", text).group(1)) * 1024
    except (OSError, AttributeError):
        return 4 * GIB


def step_device(cuda: Cuda, count: int) -> dict[str, Any]:
    out: dict[str, Any] = {"status": "ok", "cuda_devices": count, **cuda.info()}
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        out["nvml_driver_version"] = _s(pynvml.nvmlSystemGetDriverVersion())
        out["nvml_name"] = _s(pynvml.nvmlDeviceGetName(h))
        out["nvml_total_bytes"] = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
        for key, fn in (("pcie_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration"),
                        ("pcie_gen_current", "nvmlDeviceGetCurrPcieLinkGeneration"),
                        ("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth")):
            try:
                out[key] = int(getattr(pynvml, fn)(h))
            except Exception:  # noqa: BLE001 - optional facts
                out[key] = None
        pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001
        out["nvml_error"] = str(exc)
    out["summary"] = f"{out['name']}, {out['total_bytes'] / GIB:.1f} GiB, cc {out['compute_capability']}"
    return out


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def step_sampler(budget: Budget, free_bytes: int, telemetry: Any = None,
                 spawn: Callable[[str, int, dict[str, str]], subprocess.Popen] = None) -> dict[str, Any]:
    """Children hold known allocations under synthetic job ids; the agent samples them.
    ``telemetry``/``spawn`` default to real NVML and CUDA children (tests pass fakes)."""
    from policy_service.config import AgentConfig
    from slurm_plugin.agent import Agent
    from slurm_plugin.attribution import charged_job
    from slurm_plugin.nvml import PynvmlTelemetry

    limit = budget.slice(90, min_s=20)
    if not limit:
        return {"status": "skipped", "reason": "time budget"}
    deadline = time.monotonic() + limit
    sizes = sampler_sizes(free_bytes)
    if not sizes:
        return {"status": "skipped", "reason": f"only {free_bytes / GIB:.1f} GiB free on the device"}
    telemetry = telemetry if telemetry is not None else PynvmlTelemetry()
    spawn = spawn or _spawn_child
    agent = Agent(AgentConfig(sample_period_s=0.2), telemetry, kernel_log=None)
    procs: list[subprocess.Popen] = []
    children: list[dict[str, Any]] = []
    try:
        baseline = telemetry.memory(0).used_bytes
        for i, size in enumerate(sizes):
            job_id = JOB_ID_BASE + i
            env = {**os.environ, "SLURM_JOB_ID": str(job_id), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
            env.pop("SLURM_JOBID", None)
            agent.start(job_id, [0], os.getuid())  # the children run as this user, on GPU 0
            p = spawn("hold", size, env)
            procs.append(p)
            ready = _read_ready(p, max(1.0, deadline - time.monotonic()))
            if not ready or not ready.get("ok"):
                return {"status": "error", "error": f"child allocating {size} bytes did not get ready: {ready}",
                        "stderr": (p.stderr.read() if p.poll() is not None else "")[-2000:]}
            children.append({"pid": ready["pid"], "job_id": job_id, "alloc_bytes": size})
        per_pid: dict[int, list[int | None]] = {c["pid"]: [] for c in children}
        raw_pids: set[int] = set()
        device_used_peak = 0
        for _ in range(10):
            if time.monotonic() > deadline:
                break
            agent.sample_once()
            procs_now = telemetry.processes(0)
            raw_pids.update(p.pid for p in procs_now)
            for p in procs_now:
                if p.pid in per_pid:
                    per_pid[p.pid].append(p.used_bytes)
            device_used_peak = max(device_used_peak, telemetry.memory(0).used_bytes)
            time.sleep(0.2)
        facts = agent._pid_cache.resolve(raw_pids)  # the agent's own pid -> job rule, on GPU 0
        attribution = {pid: charged_job(f, 0, agent._jobs) for pid, f in facts.items()}
        job_peaks = {c["job_id"]: int(agent.stop(c["job_id"]).get("peak_bytes", 0)) for c in children}
    finally:
        _stop(procs)
        telemetry.close()
    judged = judge_sampler(children, per_pid, attribution, job_peaks)
    note = ""
    if not (raw_pids & set(per_pid)):
        note = ("NVML reported none of the children's pids (container with its own pid namespace?): "
                f"NVML pids {sorted(raw_pids)[:10]}")
    other = sorted({r["agent_job_id"] for r in judged["children"]
                    if r["agent_job_id"] is not None and r["agent_job_id"] != r["job_id"]})
    if other:
        note = (f"children attributed to job(s) {other}: run outside a Slurm job, whose cgroup "
                "(job_<id>) takes precedence over SLURM_JOB_ID")
    ovh = judged["context_overhead_bytes"]
    return {"status": "ok" if judged["ok"] else "failed", **judged, "nvml_pids": sorted(raw_pids),
            "device_used_baseline_bytes": baseline, "device_used_peak_bytes": device_used_peak, "note": note,
            "summary": f"{len(children)} children; context overhead ~{(ovh or 0) / MIB:.0f} MiB" + (
                f"; {note}" if note else "")}


def mps_client_env(pipe_dir: Path, cap_bytes: int, device_bytes: int) -> Any:
    """The environment the node's MPS enforcement backend gives a job's processes (what the
    TaskProlog exports), so the check exercises the project's own limit string."""
    from slurm_plugin.enforce import JobCap
    from slurm_plugin.enforce.mps import MpsBackend

    return MpsBackend(pipe_dir).apply(JobCap(job_id=JOB_ID_BASE, cap_bytes=cap_bytes, device_bytes=device_bytes,
                                             visible_gpus=1))


def step_mps(budget: Budget, device_bytes: int, cap_bytes: int = 2 * GIB) -> dict[str, Any]:
    control = shutil.which("nvidia-cuda-mps-control")
    if not control:
        return {"status": "not available", "reason": "nvidia-cuda-mps-control not found"}
    limit = budget.slice(60, min_s=20)
    if not limit:
        return {"status": "skipped", "reason": "time budget"}
    tmp = Path(tempfile.mkdtemp(prefix="swapaware-mps-"))
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(tmp / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(tmp / "log")}
    (tmp / "pipe").mkdir()
    (tmp / "log").mkdir()
    started = subprocess.run([control, "-d"], env=env, capture_output=True, text=True, timeout=20)
    if started.returncode != 0:
        return {"status": "error", "error": f"mps control -d: rc {started.returncode} {started.stderr[-500:]}"}
    results: dict[str, Any] = {}
    try:
        for _ in range(50):  # the daemon forks; its control pipe appears shortly after
            if (tmp / "pipe" / "control").exists():
                break
            time.sleep(0.1)
        applied = mps_client_env(tmp / "pipe", cap_bytes, device_bytes)
        client_env = {**env, **applied.env}
        results["backend_enforced"] = applied.enforced
        results["limit_env"] = applied.env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
        for key, nbytes in (("below", cap_bytes // 2), ("above", cap_bytes + cap_bytes // 2)):
            p = _spawn_child("try", nbytes, client_env)
            try:
                out, err = p.communicate(timeout=max(5.0, limit / 3))
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
            try:
                results[key] = {**json.loads(out.strip().splitlines()[-1]), "bytes": nbytes}
            except (ValueError, IndexError):
                results[key] = {"ok": False, "bytes": nbytes, "error": f"no result; stderr: {err[-500:]}"}
    finally:
        subprocess.run([control], input="quit\n", env=env, capture_output=True, text=True, timeout=20)
        log = tmp / "log" / "control.log"
        tail = log.read_text()[-2000:] if log.exists() else ""
        shutil.rmtree(tmp, ignore_errors=True)
    judged = judge_mps(results.get("below"), results.get("above"), bool(results.get("backend_enforced")))
    return {"status": "ok" if judged["ok"] else "failed", "cap_bytes": cap_bytes, **judged,
            "limit_env": results.get("limit_env"), "backend_enforced": results.get("backend_enforced"),
            "control_log": tail,
            "summary": ", ".join(f"{k}={v}" for k, v in judged["checks"].items())}


class _Bench:
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


def step_bandwidth(cuda: Cuda, bench: _Bench, budget: Budget, nbytes: int) -> dict[str, Any]:
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


def step_calibrate(cuda: Cuda, bench: _Bench, budget: Budget, ws: int, link: str, csv_path: Path,
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


# --------------------------------------------------------------------------- main


def _run_step(steps: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    t0 = time.monotonic()
    try:
        steps[name] = fn()
    except BudgetExceeded as exc:
        steps[name] = {"status": "skipped", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - one step's failure must not lose the others
        steps[name] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
    steps[name]["seconds"] = round(time.monotonic() - t0, 2)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return child_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S)
    ap.add_argument("--link", choices=("pcie_gen4", "pcie_gen5", "nvlink_c2c"),
                    help="host link to calibrate (default: from the PCIe generation NVML reports)")
    args = ap.parse_args(argv)

    opened = open_cuda()
    if opened is None:
        print(f"{NO_GPU_MESSAGE} (tried {libcuda_path()})", file=sys.stderr)
        return EXIT_NO_GPU
    cuda, count = opened
    budget = Budget(min(args.budget_s, DEFAULT_BUDGET_S))

    def _alarm(_sig: int, _frame: Any) -> None:
        raise BudgetExceeded("hard time limit reached")

    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(int(budget.total_s - budget.reserve_s / 2))
    now = _dt.datetime.now(_dt.timezone.utc)
    host = socket.gethostname()
    args.out.mkdir(parents=True, exist_ok=True)
    path = result_path(args.out, host, now)
    steps: dict[str, Any] = {}
    try:
        _run_steps(steps, cuda, count, budget, args.link, path)
    except Exception as exc:  # noqa: BLE001 - between steps (budget, driver): what ran is still written
        steps["between_steps"] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
    signal.alarm(0)
    meta = {"host": host, "date": now.isoformat(), "platform": platform.platform(), "budget_s": budget.total_s,
            "elapsed_s": round(budget.elapsed(), 1), "script": "bench/gpu/check_gpu.py",
            "in_slurm_job": os.environ.get("SLURM_JOB_ID")}
    result = assemble(steps, meta)
    path.write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
    for line in summary_lines(result):
        print(line)
    print(f"results: {path}")
    return EXIT_OK if result["status"] == "ok" else EXIT_FAILED


def _run_steps(steps: dict[str, Any], cuda: Cuda, count: int, budget: Budget, link_override: str | None,
               path: Path) -> None:
    _run_step(steps, "device", lambda: step_device(cuda, count))
    free_dev = steps["device"].get("total_bytes", 0)
    try:
        cuda.context()  # the script's own context; it shows up in NVML, not as a sampled job
        free_dev = cuda.mem_info()[0]
    except CudaError as exc:
        steps["device"]["context_error"] = str(exc)
    _run_step(steps, "sampler", lambda: step_sampler(budget, free_dev))
    _run_step(steps, "mps", lambda: step_mps(budget, int(steps["device"].get("total_bytes") or 0)))
    free_dev = cuda.mem_info()[0]
    buf, ws = bench_sizes(free_dev, _free_host_bytes())
    bench_holder: dict[str, _Bench] = {}

    def _bw() -> dict[str, Any]:
        bench_holder["b"] = _Bench(cuda)
        return step_bandwidth(cuda, bench_holder["b"], budget, buf)

    _run_step(steps, "bandwidth", _bw)
    link = link_kind(steps["device"].get("pcie_gen_max"), link_override)
    csv_path = path.with_suffix(".csv")
    if "b" in bench_holder:
        _run_step(steps, "calibrate", lambda: step_calibrate(cuda, bench_holder["b"], budget, ws, link, csv_path))
    else:
        steps["calibrate"] = {"status": "skipped", "reason": "bandwidth step could not set up the kernel"}


if __name__ == "__main__":
    sys.exit(main())
