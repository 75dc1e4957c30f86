"""The file-backed fake NVML: capacity, process death, CLI, and telemetry selection."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from policy_service.config import AgentConfig, NvmlBackend
from slurm_plugin.gpu.nvml import (GpuTelemetry, MemoryInfo, ProcessUsage, PynvmlTelemetry, TelemetryError, open_telemetry,
                               pid_alive)
from slurm_plugin.gpu.nvml_fake import FakeNvmlTelemetry, FakeOutOfMemory, create_fake_gpus, fake_alloc, fake_free
from slurm_plugin.gpu.nvml_fake import main as nvml_main
from tests.waiting import wait_for

TOTAL_BYTES = 1_000_000


def _nvml_works() -> bool:
    try:
        PynvmlTelemetry().close()
        return True
    except TelemetryError:
        return False




def _cli(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "slurm_plugin.gpu.nvml", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    create_fake_gpus(tmp_path / "gpus", count=2, total_bytes=TOTAL_BYTES)
    return tmp_path / "gpus"


def test_create_gives_empty_devices_of_the_requested_size(root: Path) -> None:
    fake = FakeNvmlTelemetry(root)
    assert isinstance(fake, GpuTelemetry)
    assert fake.device_count() == 2
    assert fake.memory(1) == MemoryInfo(total_bytes=TOTAL_BYTES, used_bytes=0)
    assert fake.processes(0) == []
    assert fake.utilization_pct(0) is None
    assert fake.uuid(1) == "GPU-fake-0001" and fake.name(0) == "Fake GPU"


def test_a_mixed_fleet_has_devices_of_different_sizes_each_enforcing_its_own(tmp_path: Path) -> None:
    create_fake_gpus(tmp_path / "mixed", 3, [400, 480, 800])
    fake, me = FakeNvmlTelemetry(tmp_path / "mixed"), os.getpid()
    assert [fake.memory(i).total_bytes for i in range(3)] == [400, 480, 800]
    with pytest.raises(FakeOutOfMemory):
        fake_alloc(tmp_path / "mixed", 0, me, 401)
    assert fake_alloc(tmp_path / "mixed", 2, me, 800) == 800
    with pytest.raises(ValueError, match="one size"):
        create_fake_gpus(tmp_path / "bad", 2, [400])
    made = _cli("fake-create", "--root", str(tmp_path / "cli"), "--count", "2", "--total-bytes", "40,80")
    made.communicate(timeout=30)
    assert made.returncode == 0 and FakeNvmlTelemetry(tmp_path / "cli").memory(1).total_bytes == 80


def test_alloc_within_capacity_is_counted_per_process(root: Path) -> None:
    me = os.getpid()
    assert fake_alloc(root, 0, me, 400_000) == 400_000
    assert fake_alloc(root, 0, me, 100_000) == 500_000
    fake = FakeNvmlTelemetry(root)
    assert fake.processes(0) == [ProcessUsage(me, 500_000)]
    assert fake.memory(0).used_bytes == 500_000
    assert fake.memory(1).used_bytes == 0


def test_alloc_beyond_capacity_is_refused_and_writes_nothing(root: Path) -> None:
    me = os.getpid()
    fake_alloc(root, 0, me, 900_000)
    before = sorted(p.name for p in (root / "gpu0" / "procs").iterdir())
    with pytest.raises(FakeOutOfMemory, match="CUDA out of memory"):
        fake_alloc(root, 0, me, 100_001)
    assert sorted(p.name for p in (root / "gpu0" / "procs").iterdir()) == before
    assert FakeNvmlTelemetry(root).memory(0).used_bytes == 900_000
    assert fake_alloc(root, 0, me, 100_000) == TOTAL_BYTES  # exactly full is allowed


def test_free_releases_part_or_all(root: Path) -> None:
    me = os.getpid()
    fake_alloc(root, 1, me, 600_000)
    assert fake_free(root, 1, me, 200_000) == 400_000
    assert FakeNvmlTelemetry(root).memory(1).used_bytes == 400_000
    assert fake_free(root, 1, me) == 0
    assert FakeNvmlTelemetry(root).processes(1) == []


def test_missing_device_and_dead_pid_raise(root: Path) -> None:
    with pytest.raises(TelemetryError):
        FakeNvmlTelemetry(root).memory(7)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with pytest.raises(TelemetryError, match="not running"):
        fake_alloc(root, 0, int(dead.stdout), 10)


def test_cli_holder_memory_is_released_when_the_process_is_killed(root: Path) -> None:
    holder = _cli("fake-alloc", "--root", str(root), "--gpu", "0", "--bytes", "700000", "--hold-seconds", "60")
    fake = FakeNvmlTelemetry(root)
    try:
        wait_for(lambda: fake.processes(0) == [ProcessUsage(holder.pid, 700_000)], what="holder allocation")
        assert fake.memory(0).used_bytes == 700_000
        refused = _cli("fake-alloc", "--root", str(root), "--gpu", "0", "--bytes", "300001", "--pid", str(os.getpid()))
        _, err = refused.communicate(timeout=30)
        assert refused.returncode == 2 and "CUDA out of memory (fake)" in err
        holder.send_signal(signal.SIGKILL)
        # Before and after reaping (zombie, then gone) the driver has released the memory.
        wait_for(lambda: fake.memory(0).used_bytes == 0, what="release after SIGKILL")
        holder.wait(timeout=10)
        assert fake.processes(0) == []
        assert fake_alloc(root, 0, os.getpid(), TOTAL_BYTES) == TOTAL_BYTES
        assert not (root / "gpu0" / "procs" / str(holder.pid)).exists()  # collected by the alloc
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_cli_holder_frees_on_sigterm_and_on_timeout(root: Path) -> None:
    holder = _cli("fake-alloc", "--root", str(root), "--gpu", "1", "--bytes", "5", "--hold-seconds", "60")
    fake = FakeNvmlTelemetry(root)
    wait_for(lambda: fake.memory(1).used_bytes == 5, what="holder allocation")
    holder.send_signal(signal.SIGTERM)
    holder.wait(timeout=10)
    assert not (root / "gpu1" / "procs" / str(holder.pid)).exists()
    short = _cli("fake-alloc", "--root", str(root), "--gpu", "1", "--bytes", "5", "--hold-seconds", "0.05")
    short.communicate(timeout=30)
    assert short.returncode == 0 and not (root / "gpu1" / "procs" / str(short.pid)).exists()


def test_cli_without_hold_allocates_for_the_calling_shell(root: Path) -> None:
    script = f"{sys.executable} -m slurm_plugin.gpu.nvml fake-alloc --root {root} --gpu 0 --bytes 42 >/dev/null && echo $$ && exec sleep 30"
    shell = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(shell.stdout.readline())
        assert pid == shell.pid
        assert FakeNvmlTelemetry(root).processes(0) == [ProcessUsage(shell.pid, 42)]
    finally:
        shell.kill()
        shell.wait(timeout=10)
    wait_for(lambda: FakeNvmlTelemetry(root).memory(0).used_bytes == 0, what="release")


def test_cli_create_and_free(tmp_path: Path) -> None:
    made = _cli("fake-create", "--root", str(tmp_path / "r"), "--count", "3", "--total-bytes", "64")
    made.communicate(timeout=30)
    assert made.returncode == 0 and FakeNvmlTelemetry(tmp_path / "r").device_count() == 3
    fake_alloc(tmp_path / "r", 2, os.getpid(), 64)
    freed = _cli("fake-free", "--root", str(tmp_path / "r"), "--gpu", "2", "--pid", str(os.getpid()))
    freed.communicate(timeout=30)
    assert freed.returncode == 0 and FakeNvmlTelemetry(tmp_path / "r").memory(2).used_bytes == 0


def test_util_and_zombie_detection(root: Path, tmp_path: Path) -> None:
    (root / "gpu0" / "util_pct").write_text("37.5\n")
    assert FakeNvmlTelemetry(root).utilization_pct(0) == 37.5
    proc = tmp_path / "proc"
    (proc / "10").mkdir(parents=True)
    (proc / "10" / "stat").write_text("10 (a b) Z 1 1 1")
    (proc / "11").mkdir()
    (proc / "11" / "stat").write_text("11 (python) S 1 1 1")
    assert not pid_alive(10, proc) and pid_alive(11, proc) and not pid_alive(12, proc)


def test_utilisation_is_the_sum_of_live_processes_busy_shares(root: Path, tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    for pid, state in ((21, "S"), (22, "S"), (23, "S")):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(f"{pid} (python) {state} 1 1 1")
    fake = FakeNvmlTelemetry(root, proc_root=proc)
    (root / "gpu0" / "util_pct").write_text("5\n")  # used only while no process declares its share
    fake_alloc(root, 0, 21, 100_000, proc_root=proc, busy_pct=40.0)
    assert fake.utilization_pct(0) == 40.0
    fake_alloc(root, 0, 22, 100_000, proc_root=proc, busy_pct=35.5)
    assert fake.utilization_pct(0) == 75.5
    fake_alloc(root, 0, 23, 100_000, proc_root=proc, busy_pct=90.0)
    assert fake.utilization_pct(0) == 100.0  # a device is at most fully busy
    assert fake.utilization_pct(1) is None
    fake_free(root, 0, 23)
    (proc / "22" / "stat").write_text("22 (python) Z 1 1 1")  # exited: its share no longer counts
    assert fake.utilization_pct(0) == 40.0
    fake_free(root, 0, 21)
    assert fake.utilization_pct(0) == 5.0
    fake_alloc(root, 0, 21, 1, proc_root=proc)  # the next alloc collects the dead pid's files
    assert not (root / "gpu0" / "busy" / "22").exists() and not (root / "gpu0" / "procs" / "22").exists()


def test_cli_alloc_declares_its_busy_share(root: Path) -> None:
    holder = _cli("fake-alloc", "--root", str(root), "--gpu", "1", "--bytes", "1000", "--hold-seconds", "30",
                  "--busy-pct", "62")
    try:
        assert "allocated 1000 bytes" in holder.stdout.readline()
        assert FakeNvmlTelemetry(root).utilization_pct(1) == 62.0
    finally:
        holder.terminate()
        holder.wait(10)
    assert FakeNvmlTelemetry(root).utilization_pct(1) is None


def test_open_telemetry_fake_and_none(tmp_path: Path) -> None:
    log = logging.getLogger("test.nvml")
    fake = open_telemetry(AgentConfig(nvml_backend=NvmlBackend.FAKE, fake_nvml_dir=tmp_path), log)
    assert isinstance(fake, FakeNvmlTelemetry) and fake.source == "fake-nvml"
    assert open_telemetry(AgentConfig(nvml_backend=NvmlBackend.NONE), log) is None


@pytest.mark.skipif(_nvml_works(), reason="NVML initialises on this machine")
def test_auto_without_nvml_returns_none_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="test.nvml"):
        assert open_telemetry(AgentConfig(nvml_backend=NvmlBackend.AUTO), logging.getLogger("test.nvml")) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not sampled" in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()
    with pytest.raises(TelemetryError, match="nvml_backend=nvml"):
        open_telemetry(AgentConfig(nvml_backend=NvmlBackend.NVML), logging.getLogger("test.nvml"))


@pytest.mark.skipif(not _nvml_works(), reason="needs a GPU with NVML")
def test_pynvml_reads_a_real_device() -> None:
    nvml = PynvmlTelemetry()
    try:
        assert nvml.device_count() >= 1
        mem = nvml.memory(0)
        assert mem.total_bytes > 0 and 0 <= mem.used_bytes <= mem.total_bytes
        assert nvml.uuid(0).startswith(("GPU-", "MIG-")) and nvml.name(0)
        assert all(isinstance(p, ProcessUsage) for p in nvml.processes(0))
        util = nvml.utilization_pct(0)
        assert util is None or 0 <= util <= 100
        with pytest.raises(TelemetryError):
            nvml.memory(nvml.device_count() + 5)
    finally:
        nvml.close()


def test_a_process_limit_refuses_what_would_exceed_it_and_writes_nothing(tmp_path):
    me = os.getpid()
    create_fake_gpus(tmp_path, 1, 1000)
    assert fake_alloc(tmp_path, 0, me, 600, limit_bytes=700) == 600
    with pytest.raises(FakeOutOfMemory, match="over its limit of 700 bytes"):
        fake_alloc(tmp_path, 0, me, 101, limit_bytes=700)  # the device has room, the limit has not
    assert fake_alloc(tmp_path, 0, me, 100, limit_bytes=700) == 700  # up to the limit exactly
    assert fake_alloc(tmp_path, 0, me, 200) == 900  # no limit: the device's capacity alone


def test_the_cli_honours_the_handed_down_limit_only_when_asked(tmp_path, monkeypatch):
    create_fake_gpus(tmp_path, 1, 1000)
    monkeypatch.setenv("SWAPAWARE_GPU_MEM_LIMIT_BYTES", "500")
    args = ["fake-alloc", "--root", str(tmp_path), "--gpu", "0", "--bytes", "600", "--pid", str(os.getpid())]
    assert nvml_main([*args, "--honour-limit"]) == 2
    assert nvml_main(args) == 0
