"""bench/gpu/check_gpu.py: the parts that need no GPU (PTX text, checks, CSV, budget, no-driver exit)."""
from __future__ import annotations

import datetime as dt
import importlib.util
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from policy_service.config import SwapCostConfig
from policy_service.core.calibrate import fit, read_measurements

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "bench" / "gpu" / "check_gpu.py"
_spec = importlib.util.spec_from_file_location("check_gpu", SCRIPT)
cg = importlib.util.module_from_spec(_spec)
sys.modules["check_gpu"] = cg
_spec.loader.exec_module(cg)

GIB = 1 << 30


# --------------------------------------------------------------------------- PTX


def _body(ptx: str) -> str:
    return ptx[ptx.index("{") + 1: ptx.rindex("}")]


@pytest.mark.parametrize("variant", cg.PTX_VARIANTS)
def test_ptx_header_and_entry(variant):
    ptx = cg.ptx_text(variant[0], variant[1].format(cc="90"))
    assert "{cc}" not in ptx
    lines = [ln.strip() for ln in ptx.strip().splitlines()]
    assert lines[0].startswith(".version ") and re.fullmatch(r"\.version \d+\.\d+", lines[0])
    assert re.fullmatch(r"\.target sm_\d+", lines[1])
    assert lines[2] == ".address_size 64"
    assert re.search(rf"\.visible \.entry {cg.KERNEL_NAME}\(", ptx)
    assert ptx.count("{") == ptx.count("}") == 1


def test_ptx_registers_declared_and_in_range():
    body = _body(cg.PTX)
    decls = {m.group(1): int(m.group(2)) for m in re.finditer(r"\.reg \.\w+ %(\w+?)<(\d+)>;", body)}
    used = re.findall(r"%(p|rd|r)(\d+)\b", body)
    assert used
    for prefix, idx in used:
        assert prefix in decls, prefix
        assert int(idx) < decls[prefix], f"%{prefix}{idx} beyond %{prefix}<{decls[prefix]}>"


def test_ptx_params_labels_and_statements():
    header = cg.PTX[cg.PTX.index("("): cg.PTX.index(")")]
    params = re.findall(r"\.param \.u64 (\w+)", header)
    assert params == ["p_src", "p_n", "p_out"]  # the order cuLaunchKernel passes them in
    body = _body(cg.PTX)
    assert sorted(set(re.findall(r"\[(p_\w+)\]", body))) == sorted(params)
    labels = set(re.findall(r"^\s*(\w+):", body, re.M))
    targets = set(re.findall(r"\bbra(?:\.uni)?\s+(\w+);", body))
    assert targets and targets <= labels
    for line in body.splitlines():
        line = line.strip()
        if line and not line.endswith(":"):
            assert line.endswith(";"), line
    # the loop reads 8-byte words and the result is stored: nothing for the JIT to drop
    assert "ld.global.u64" in body and "st.global.u64" in body and "shl.b64" in body


def test_expected_sum_wraps_like_the_kernel():
    word = int.from_bytes(b"\x01" * 8, "little")
    assert cg.expected_sum(3) == 3 * word
    n = (1 << 64) // word + 5
    assert cg.expected_sum(n) == (n * word) % (1 << 64) != n * word


# --------------------------------------------------------------------------- budget


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_budget_slices_and_reserve():
    clock = FakeClock()
    b = cg.Budget(480, reserve_s=15, clock=clock)
    assert b.remaining() == 465
    assert b.slice(90) == 90
    clock.t += 400
    assert b.remaining() == pytest.approx(65)
    assert b.slice(90) == pytest.approx(65)  # capped by what is left
    assert b.slice(90, min_s=70) == 0.0  # too little for the step: skipped
    b.check()
    clock.t += 66
    assert b.remaining() == 0.0
    assert b.slice(10) == 0.0
    with pytest.raises(cg.BudgetExceeded):
        b.check()


def test_budget_never_exceeds_eight_minutes():
    assert cg.DEFAULT_BUDGET_S <= 480


# --------------------------------------------------------------------------- sampler and MPS judgement


def _children():
    return [{"pid": 11, "job_id": 990000, "alloc_bytes": 1 * GIB},
            {"pid": 12, "job_id": 990001, "alloc_bytes": 2 * GIB}]


def test_judge_sampler_passes_with_overhead_and_matching_peaks():
    ovh = 500 << 20
    per_pid = {11: [GIB + ovh, GIB + ovh], 12: [2 * GIB + ovh]}
    out = cg.judge_sampler(_children(), per_pid, {11: 990000, 12: 990001},
                           {990000: GIB + ovh, 990001: 2 * GIB + ovh})
    assert out["ok"]
    assert out["context_overhead_bytes"] == ovh
    assert [r["samples"] for r in out["children"]] == [2, 1]


@pytest.mark.parametrize("case", ["misattributed", "under_allocation", "unreported", "peak_mismatch", "no_children"])
def test_judge_sampler_flags_each_failure(case):
    ovh = 300 << 20
    children = _children()
    per_pid = {11: [GIB + ovh], 12: [2 * GIB + ovh]}
    attribution = {11: 990000, 12: 990001}
    peaks = {990000: GIB + ovh, 990001: 2 * GIB + ovh}
    if case == "misattributed":
        attribution[12] = 990000
    elif case == "under_allocation":
        per_pid[12] = [GIB]
        peaks[990001] = GIB
    elif case == "unreported":
        per_pid[12] = [None, None]
    elif case == "peak_mismatch":
        peaks[990001] = 2 * GIB
    elif case == "no_children":
        children = []
    assert not cg.judge_sampler(children, per_pid, attribution, peaks)["ok"]


_FAKE_CHILD = """
import json, os, sys
from pathlib import Path
from slurm_plugin.gpu.nvml_fake import fake_alloc, fake_free
root, nbytes = Path(sys.argv[1]), int(sys.argv[2])
fake_alloc(root, 0, os.getpid(), nbytes + int(sys.argv[3]))  # the allocation plus a context's overhead
print(json.dumps({"ok": True, "pid": os.getpid()}), flush=True)
sys.stdin.read()
fake_free(root, 0, os.getpid())
"""


def test_step_sampler_through_the_agent_with_fake_nvml(tmp_path):
    from slurm_plugin.gpu.nvml_fake import FakeNvmlTelemetry, create_fake_gpus

    create_fake_gpus(tmp_path, 1, 141 * GIB)
    ovh = 512 << 20

    def spawn(action, nbytes, env):
        assert action == "hold" and env["SLURM_JOB_ID"].startswith("99")
        return subprocess.Popen([sys.executable, "-c", _FAKE_CHILD, str(tmp_path), str(nbytes), str(ovh)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**env, "PYTHONPATH": str(REPO)}, cwd=str(REPO))

    out = cg.step_sampler(cg.Budget(120), 140 * GIB, telemetry=FakeNvmlTelemetry(tmp_path), spawn=spawn)
    assert out["status"] == "ok", out
    assert [c["alloc_bytes"] for c in out["children"]] == [GIB, 2 * GIB, 4 * GIB]
    assert out["context_overhead_bytes"] == ovh
    for c in out["children"]:
        assert c["agent_job_id"] == c["job_id"] and c["agent_peak_bytes"] == c["alloc_bytes"] + ovh
    assert not list((tmp_path / "gpu0" / "procs").iterdir())  # children freed on the way out


def test_sampler_sizes_fit_in_half_the_free_memory():
    assert cg.sampler_sizes(140 * GIB) == [GIB, 2 * GIB, 4 * GIB]
    assert cg.sampler_sizes(8 * GIB) == [GIB]
    assert cg.sampler_sizes(2 * GIB) == []


def test_judge_mps():
    assert cg.judge_mps({"ok": True}, {"ok": False, "error": "CUDA_ERROR_OUT_OF_MEMORY"})["ok"]
    assert not cg.judge_mps({"ok": True}, {"ok": True})["ok"]  # cap not enforced
    assert not cg.judge_mps({"ok": False}, {"ok": False})["ok"]  # nothing works
    assert not cg.judge_mps(None, None)["ok"]
    assert not cg.judge_mps({"ok": True}, {"ok": False}, enforced=False)["ok"]


def test_mps_client_env_is_the_backends_limit(tmp_path):
    (tmp_path / "control").touch()  # the daemon's control pipe, as MpsBackend detects it
    applied = cg.mps_client_env(tmp_path, 2 * GIB, 141 * GIB)
    assert applied.enforced
    assert applied.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
    assert applied.env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path)


# --------------------------------------------------------------------------- calibration CSV


def _sweeps(link_bytes_per_s: float, ws: int = 2 * GIB, t0: float = 0.0005):
    out = []
    for frac in (0.05, 0.1, 0.25, 0.5):
        off = int(ws * frac) // 8 * 8
        out.append(cg.Sweep(ws, off, t0, t0 + off / link_bytes_per_s, sweeps=100))
    return out


def test_calibration_csv_is_accepted_and_fits_the_bandwidth():
    true_b = 23.0e9
    text = cg.calibration_csv(_sweeps(true_b))
    rows = read_measurements(io.StringIO(text))
    assert len(rows) == 4 and all(r.mode.value == "victim" for r in rows)
    result = fit(rows, SwapCostConfig())
    assert result.link_bytes_per_s == pytest.approx(true_b, rel=1e-6)
    assert result.rms_error < 1e-6
    assert result.fault_latency_s == SwapCostConfig().fault_latency_s  # victim rows only: latency kept


def test_sweep_row_and_direct_estimate():
    s = cg.Sweep(1000, 250, 0.01, 0.02, sweeps=10)
    row = s.row()
    assert float(row["sweeps_per_s"]) == pytest.approx(100)
    assert float(row["solo_s"]) == pytest.approx(0.1) and float(row["measured_s"]) == pytest.approx(0.2)
    assert s.link_bytes_per_s() == pytest.approx(25000)
    assert cg.Sweep(1000, 250, 0.02, 0.01, sweeps=10).link_bytes_per_s() is None  # faster offloaded: no figure


def test_run_calibrate_through_the_cli(tmp_path, monkeypatch):
    monkeypatch.setenv("SWAPAWARE_CONFIG", "")
    path = tmp_path / "runs.csv"
    path.write_text(cg.calibration_csv(_sweeps(40e9)))
    out = cg.run_calibrate(path, "pcie_gen5")
    assert out["rc"] == 0, out["stderr"]
    assert "link 40.0 GB/s" in out["stdout"]
    assert "pcie_gen5_bytes_per_s = 4e+10" in out["stdout"]


def test_link_kind():
    assert cg.link_kind(5, None) == "pcie_gen5"
    assert cg.link_kind(4, None) == "pcie_gen4"
    assert cg.link_kind(None, None) == "pcie_gen4"
    assert cg.link_kind(5, "nvlink_c2c") == "nvlink_c2c"


def test_bench_sizes_bounded_by_free_memory():
    buf, ws = cg.bench_sizes(140 * GIB, 1000 * GIB)
    assert (buf, ws) == (GIB, 2 * GIB)
    buf, ws = cg.bench_sizes(140 * GIB, 4 * GIB)  # little host memory: an eighth of it
    assert buf == ws == 512 << 20


# --------------------------------------------------------------------------- result assembly


def test_assemble_status_and_summary():
    steps = {"device": {"status": "ok", "summary": "H200"}, "mps": {"status": "not available", "reason": "no"},
             "sampler": {"status": "ok"}, "bandwidth": {"status": "skipped", "reason": "time budget"}}
    res = cg.assemble(steps, {"host": "n1"})
    assert res["status"] == "ok" and res["failed_steps"] == [] and res["host"] == "n1"
    steps["calibrate"] = {"status": "failed"}
    steps["sampler"] = {"status": "error", "error": "boom"}
    res = cg.assemble(steps, {"host": "n1"})
    assert res["status"] == "failed" and res["failed_steps"] == ["calibrate", "sampler"]
    text = "\n".join(cg.summary_lines(res))
    assert "boom" in text and "not available" in text


def test_result_path_names_host_and_date(tmp_path):
    p = cg.result_path(tmp_path, "gpu/node 1", dt.datetime(2026, 12, 4, 4, 5, 6, tzinfo=dt.timezone.utc))
    assert p == tmp_path / "gpu_node_1-20261204T040506Z.json"


def test_run_step_keeps_going_after_an_error():
    steps: dict = {}
    cg._run_step(steps, "a", lambda: 1 / 0)
    cg._run_step(steps, "b", lambda: {"status": "ok"})

    def over():
        raise cg.BudgetExceeded("spent")

    cg._run_step(steps, "c", over)
    assert steps["a"]["status"] == "error" and "ZeroDivisionError" in steps["a"]["error"]
    assert steps["b"]["status"] == "ok" and "seconds" in steps["b"]
    assert steps["c"]["status"] == "skipped"


# --------------------------------------------------------------------------- no driver


def test_no_driver_exits_with_its_own_code_and_writes_nothing(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "SWAPAWARE_LIBCUDA": str(tmp_path / "libcuda.so.1")}
    p = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "results")], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == cg.EXIT_NO_GPU == 3
    assert cg.NO_GPU_MESSAGE in p.stderr
    assert not (tmp_path / "results").exists()


def test_open_cuda_returns_none_without_a_driver(monkeypatch, tmp_path):
    monkeypatch.setenv("SWAPAWARE_LIBCUDA", str(tmp_path / "missing.so"))
    assert cg.open_cuda() is None
    assert cg.main(["--out", str(tmp_path / "r")]) == cg.EXIT_NO_GPU
