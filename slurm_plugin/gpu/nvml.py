"""GPU telemetry for the node agent: one small Protocol, real NVML (``PynvmlTelemetry``, through
pynvml) and the choice between it and the file-backed fake (``open_telemetry``); the fake and its
command line are in ``nvml_fake.py``. ``python -m slurm_plugin.gpu.nvml`` runs that command line
(job scripts on the dev cluster call it so)."""
from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from policy_service.config import AgentConfig, NvmlBackend

PROC_ROOT = Path("/proc")


class TelemetryError(RuntimeError):
    """Any failure to read GPU telemetry (NVML error, unreadable fake file, bad index)."""


@dataclass(frozen=True)
class MemoryInfo:
    total_bytes: int
    used_bytes: int


@dataclass(frozen=True)
class ProcessUsage:
    pid: int
    used_bytes: int | None  # None: the driver does not report per-process memory (MIG, WDDM)


@runtime_checkable
class GpuTelemetry(Protocol):
    """What the agent and the doctor need from a GPU driver. Indices are NVML indices."""

    source: str  # "nvml" or "fake-nvml"

    def device_count(self) -> int: ...

    def memory(self, index: int) -> MemoryInfo: ...

    def processes(self, index: int) -> list[ProcessUsage]: ...

    def utilization_pct(self, index: int) -> float | None: ...

    def name(self, index: int) -> str: ...

    def uuid(self, index: int) -> str: ...


# --------------------------------------------------------------------------- real NVML


class PynvmlTelemetry:
    """NVML through pynvml; every pynvml error surfaces as ``TelemetryError``."""

    source = "nvml"

    def __init__(self) -> None:
        import pynvml  # imported here: a missing driver must not break importing this module

        self._nvml: Any = pynvml
        self._handles: dict[int, Any] = {}
        self._call(pynvml.nvmlInit)

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            raise TelemetryError(f"NVML {getattr(fn, '__name__', fn)}: {exc}") from exc

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            self._handles[index] = self._call(self._nvml.nvmlDeviceGetHandleByIndex, index)
        return self._handles[index]

    def device_count(self) -> int:
        return int(self._call(self._nvml.nvmlDeviceGetCount))

    def memory(self, index: int) -> MemoryInfo:
        info = self._call(self._nvml.nvmlDeviceGetMemoryInfo, self._handle(index))
        return MemoryInfo(total_bytes=int(info.total), used_bytes=int(info.used))

    def processes(self, index: int) -> list[ProcessUsage]:
        procs = self._call(self._nvml.nvmlDeviceGetComputeRunningProcesses, self._handle(index))
        return [ProcessUsage(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory)) for p in procs]

    def utilization_pct(self, index: int) -> float | None:
        try:
            rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle(index))
        except self._nvml.NVMLError_NotSupported:
            return None
        except self._nvml.NVMLError as exc:
            raise TelemetryError(f"NVML nvmlDeviceGetUtilizationRates: {exc}") from exc
        return float(rates.gpu)

    def name(self, index: int) -> str:
        return _text(self._call(self._nvml.nvmlDeviceGetName, self._handle(index)))

    def uuid(self, index: int) -> str:
        return _text(self._call(self._nvml.nvmlDeviceGetUUID, self._handle(index)))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def pid_alive(pid: int, proc_root: Path = PROC_ROOT) -> bool:
    """True when ``pid`` exists and is not a zombie (a zombie's GPU memory is already freed)."""
    try:
        stat = (proc_root / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return False
    state = stat.rpartition(")")[2].split()
    return bool(state) and state[0] not in ("Z", "X")


# --------------------------------------------------------------------------- selection


def open_telemetry(cfg: AgentConfig, log: logging.Logger) -> GpuTelemetry | None:
    """The telemetry ``cfg.nvml_backend`` asks for, or None when memory cannot be sampled.

    AUTO: pynvml when NVML initialises, else None with one warning line. NVML: raises
    ``TelemetryError`` when NVML does not initialise (the operator asked for it explicitly).
    FAKE: ``FakeNvmlTelemetry(cfg.fake_nvml_dir)``. NONE: None.
    """
    backend = cfg.nvml_backend
    if backend is NvmlBackend.NONE:
        log.info("GPU telemetry disabled (agent.nvml_backend=none): memory is not sampled")
        return None
    if backend is NvmlBackend.FAKE:
        log.info("GPU telemetry: fake NVML at %s", cfg.fake_nvml_dir)
        from slurm_plugin.gpu.nvml_fake import FakeNvmlTelemetry

        return FakeNvmlTelemetry(cfg.fake_nvml_dir)
    try:
        telemetry = PynvmlTelemetry()
    except (TelemetryError, ImportError, OSError) as exc:
        if backend is NvmlBackend.NVML:
            raise TelemetryError(f"agent.nvml_backend=nvml but NVML is unavailable: {exc}") from exc
        log.warning("NVML unavailable (%s): GPU memory is not sampled on this node", str(exc).splitlines()[0])
        return None
    log.info("GPU telemetry: NVML, %d device(s)", _safe_count(telemetry))
    return telemetry


def _safe_count(telemetry: GpuTelemetry) -> int:
    try:
        return telemetry.device_count()
    except TelemetryError:
        return -1


if __name__ == "__main__":
    from slurm_plugin.gpu.nvml_fake import main

    sys.exit(main())
