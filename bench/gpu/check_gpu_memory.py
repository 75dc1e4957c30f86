"""The GPU check's steps on device memory: device info (CUDA driver + NVML), the sampler (child
processes hold known allocations under synthetic Slurm job ids; the node agent's own code samples
and attributes them) and the MPS cap (a private daemon; the project's MPS backend's limit below and
above the cap). The child processes are this check's own script run with ``--child``."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from check_gpu_cuda import Cuda, CudaError
from check_gpu_judge import GIB, MIB, Budget, judge_mps, judge_sampler, sampler_sizes

ENTRY = Path(__file__).resolve().parent / "check_gpu.py"  # what a child process runs (``--child``)
JOB_ID_BASE = 990_000  # synthetic Slurm job ids for the sampler's children

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
    return subprocess.Popen([sys.executable, str(ENTRY), "--child", action, str(nbytes)],
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


# --------------------------------------------------------------------------- steps (need a GPU)


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
    from slurm_plugin.agent.daemon import Agent
    from slurm_plugin.agent.attribution import charged_job
    from slurm_plugin.gpu.nvml import PynvmlTelemetry

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
