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

This script is the entry (options, the steps in order, the result file); the parts live beside it:
check_gpu_cuda.py (the PTX kernel, the driver API over ctypes), check_gpu_judge.py (what needs no
GPU: time budget, judgements, calibration rows, the result document), check_gpu_memory.py (steps
1-3 and the child processes), check_gpu_link.py (steps 4-5).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _path in (REPO, HERE):  # the project's packages; this check's modules beside it
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

# The check's modules, one a part; what they define is named here too (tests and callers use
# ``check_gpu.<name>``).
from check_gpu_cuda import (KERNEL_NAME, PTX, PTX_VARIANTS, Cuda, CudaError, expected_sum,  # noqa: E402
                            libcuda_path, open_cuda, ptx_text)
from check_gpu_judge import (DEFAULT_BUDGET_S, Budget, BudgetExceeded, Sweep, assemble,  # noqa: E402
                             calibration_csv, judge_mps, judge_sampler, link_kind, result_path,
                             sampler_sizes, summary_lines)
from check_gpu_link import (Bench, bench_sizes, free_host_bytes, run_calibrate,  # noqa: E402
                            step_bandwidth, step_calibrate)
from check_gpu_memory import child_main, mps_client_env, step_device, step_mps, step_sampler  # noqa: E402

__all__ = ["KERNEL_NAME", "PTX", "PTX_VARIANTS", "Cuda", "CudaError", "expected_sum", "libcuda_path", "open_cuda",
           "ptx_text", "DEFAULT_BUDGET_S", "Budget", "BudgetExceeded", "Sweep", "assemble", "calibration_csv",
           "judge_mps", "judge_sampler", "link_kind", "result_path", "sampler_sizes", "summary_lines", "Bench",
           "bench_sizes", "free_host_bytes", "run_calibrate", "step_bandwidth", "step_calibrate", "child_main",
           "mps_client_env", "step_device", "step_mps", "step_sampler", "EXIT_OK", "EXIT_FAILED", "EXIT_NO_GPU",
           "NO_GPU_MESSAGE", "main"]

EXIT_OK, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 3
NO_GPU_MESSAGE = "no NVIDIA driver / no GPU: nothing measured"

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
    buf, ws = bench_sizes(free_dev, free_host_bytes())
    bench_holder: dict[str, Bench] = {}

    def _bw() -> dict[str, Any]:
        bench_holder["b"] = Bench(cuda)
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
