"""The GPU check's parts that need no GPU: its time budget, the sampler and MPS judgements, the
calibration rows (``swapaware calibrate`` CSV), the host link's kind, and the result document
(its status, file name and printed summary)."""
from __future__ import annotations

import csv
import datetime as _dt
import io
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

GIB = 1 << 30
MIB = 1 << 20
DEFAULT_BUDGET_S = 480.0
RESERVE_S = 15.0  # kept back for writing results
CSV_FIELDS = ("mode", "access", "footprint_bytes", "working_set_bytes", "offloaded_bytes", "sweeps_per_s",
              "solo_s", "measured_s")
MAX_CONTEXT_OVERHEAD = 2 * GIB  # per-pid NVML bytes above the allocation beyond this: attribution is wrong

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
