"""Enforcement backends against honest fakes of their mechanisms: what each writes is what the
mechanism reads, and the mechanism then refuses an allocation beyond the cap (or evicts the
designated victim first). Backend choice is table-driven."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from policy_service.config import GIB, AgentConfig, Config, Enforcement, GpuConfig
from slurm_plugin.enforce import JobCap
from slurm_plugin.enforce.advisory import AdvisoryBackend
from slurm_plugin.enforce.choose import choose
from slurm_plugin.enforce.hami import HamiBackend
from slurm_plugin.enforce.mps import MpsBackend
from slurm_plugin.enforce.nvml_cgroup import NvmlCgroupBackend, nvml_has_memory_limits

from tests.unit.enforce_fakes import FakeDevice, FakeDmemTree, FakeHamiLibrary, FakeMpsDaemon, OutOfMemory

REGION = "drm/0000:01:00.0/vram0"
JOB = JobCap(job_id=7, cap_bytes=20 * GIB, device_bytes=80 * GIB, visible_gpus=1)


def write(files: dict[Path, str]) -> None:
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


# ------------------------------------------------------------------------------------- MPS
def test_mps_caps_each_client(tmp_path):
    dev = FakeDevice(80 * GIB)
    daemon = FakeMpsDaemon(tmp_path / "mps", dev)
    backend = MpsBackend(tmp_path / "mps")
    assert not backend.detect().available
    assert not backend.apply(JOB).enforced  # no daemon: the limit would be ignored, so it is not claimed
    daemon.start()
    cap = backend.detect()
    assert (cap.available, cap.hard_cap, cap.victim) == (True, True, False)
    applied = backend.apply(JOB)
    assert applied.enforced and "capped at 20480 MiB" in applied.message
    proc = daemon.client(100, applied.env)
    proc.malloc(19 * GIB)
    with pytest.raises(OutOfMemory):
        proc.malloc(2 * GIB)  # 21 GiB > 20 GiB
    neighbour = daemon.client(101, {})  # a process outside MPS is not capped by the variable
    neighbour.malloc(40 * GIB)


def test_mps_daemon_default_limit_bounds_a_client_that_dropped_the_variable(tmp_path):
    daemon = FakeMpsDaemon(tmp_path / "mps", FakeDevice(80 * GIB))
    daemon.start()
    daemon.control("set_default_device_pinned_mem_limit 0 10G")
    env = dict(MpsBackend(tmp_path / "mps").apply(JOB).env)
    env.pop("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
    proc = daemon.client(5, env)
    with pytest.raises(OutOfMemory):
        proc.malloc(11 * GIB)


def test_mps_needs_one_visible_gpu(tmp_path):
    FakeMpsDaemon(tmp_path / "mps", FakeDevice(80 * GIB)).start()
    applied = MpsBackend(tmp_path / "mps").apply(replace(JOB, visible_gpus=2))
    assert not applied.enforced and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in applied.env


# ------------------------------------------------------------------------------------- HAMi
def test_hami_caps_the_job_across_its_processes(tmp_path):
    lib = tmp_path / "libvgpu.so"
    backend = HamiBackend(lib, tmp_path / "cache", tmp_path / "conf")
    assert not backend.detect().available
    lib.write_bytes(b"\x7fELF")
    cap = backend.detect()
    assert (cap.available, cap.hard_cap, cap.victim) == (True, True, False)
    applied = backend.apply(JOB)
    assert applied.enforced and applied.env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "20480m"
    write(applied.files)
    assert (tmp_path / "conf" / "job_7.conf").read_text().startswith("CUDA_DEVICE_MEMORY_LIMIT_0=20480m\n")
    fake = FakeHamiLibrary(lib, FakeDevice(80 * GIB))
    a, b = fake.process(1, applied.env), fake.process(2, applied.env)
    a.malloc(12 * GIB)
    b.malloc(8 * GIB)
    with pytest.raises(OutOfMemory):
        b.malloc(1 * GIB)  # the job's two processes together hold the cap
    assert backend.release(7) and not (tmp_path / "conf" / "job_7.conf").exists()


def test_hami_keeps_the_users_preload_and_without_preload_nothing_is_capped(tmp_path):
    lib = tmp_path / "libvgpu.so"
    lib.write_bytes(b"")
    env = HamiBackend(lib, tmp_path / "c").apply(replace(JOB, user_env={"LD_PRELOAD": "/x/libfoo.so"})).env
    assert env["LD_PRELOAD"] == f"{lib}:/x/libfoo.so"
    env.pop("LD_PRELOAD")  # a job that drops the preload escapes the library (documented)
    FakeHamiLibrary(lib, FakeDevice(80 * GIB)).process(3, env).malloc(30 * GIB)


# ------------------------------------------------------------------------------------- nvml-cgroup (dmem)
def test_dmem_not_available_without_controller_or_region(tmp_path):
    FakeDmemTree(tmp_path / "cg", REGION, 80 * GIB, with_dmem=False)
    b = NvmlCgroupBackend(tmp_path / "cg", "job_{job_id}", nvml_module=object())
    cap = b.detect()
    assert not cap.available and "no dmem controller" in cap.detail and "absent" in cap.detail
    assert not b.apply(JOB).enforced


def test_dmem_hard_cap(tmp_path):
    tree = FakeDmemTree(tmp_path / "cg", REGION, 80 * GIB)
    b = NvmlCgroupBackend(tmp_path / "cg", "job_{job_id}")
    cap = b.detect()
    assert (cap.available, cap.hard_cap, cap.victim) == (True, True, True)
    applied = b.apply(JOB)
    write(applied.files)
    tree.charge("job_7", 20 * GIB)
    with pytest.raises(OutOfMemory):
        tree.charge("job_7", 1)


def test_dmem_evicts_the_designated_victim_first(tmp_path):
    tree = FakeDmemTree(tmp_path / "cg", REGION, 80 * GIB)
    b = NvmlCgroupBackend(tmp_path / "cg", "job_{job_id}")
    # victim: charged 20 GiB, predicted need 30 GiB; neighbour: 60 GiB, not oversubscribed
    victim = b.apply(replace(JOB, job_id=1, need_bytes=30 * GIB))
    neighbour = b.apply(replace(JOB, job_id=2, cap_bytes=60 * GIB))
    write(victim.files)
    write(neighbour.files)
    assert "evicted first" in victim.message
    tree.charge("job_1", 30 * GIB)  # the victim may grow past its charge while memory is free
    with pytest.raises(OutOfMemory):
        tree.charge("job_1", 1)  # but not past its need
    tree.charge("job_2", 60 * GIB)  # device full: 10 GiB of the victim's excess is evicted
    assert tree.evicted == {"job_1": 10 * GIB} and tree.usage["job_1"] == 20 * GIB
    with pytest.raises(OutOfMemory):
        tree.charge("job_3", 1)  # nobody is above their protection any more


def test_nvml_capability_is_detected_by_attribute():
    class WithLimits:
        def nvmlDeviceSetMemoryLimits(self, *a):  # noqa: N802
            pass
    assert nvml_has_memory_limits(WithLimits()) and not nvml_has_memory_limits(object())


# ------------------------------------------------------------------------------------- advisory and choice
def test_advisory_says_so_and_caps_nothing():
    applied = AdvisoryBackend().apply(JOB)
    assert not applied.enforced and "ADVISORY" in applied.message
    assert applied.env["SWAPAWARE_GPU_MEM_LIMIT_BYTES"] == str(20 * GIB)
    cap = AdvisoryBackend().detect()
    assert (cap.hard_cap, cap.victim) == (False, False)


def _cfg(tmp_path, mode):
    return Config(gpu=GpuConfig(memory_bytes=80 * GIB, shards_per_gpu=8),
                  agent=AgentConfig(enforcement=mode, mps_pipe_dir=tmp_path / "mps", hami_library=tmp_path / "lib.so",
                                    hami_cache_dir=tmp_path / "c", cgroup_root=tmp_path / "cg", job_cgroup="job_{job_id}"))


@pytest.mark.parametrize("mode, present, chosen", [
    (Enforcement.AUTO, set(), "advisory"),
    (Enforcement.AUTO, {"mps"}, "mps"),
    (Enforcement.AUTO, {"mps", "hami"}, "hami"),
    (Enforcement.AUTO, {"mps", "hami", "dmem"}, "nvml-cgroup"),
    (Enforcement.MPS, {"hami", "dmem"}, "advisory"),  # configured but absent: not claimed
    (Enforcement.HAMI, {"hami", "dmem"}, "hami"),
    (Enforcement.FRAMEWORK_ENV, {"mps", "hami", "dmem"}, "advisory"),
    (Enforcement.NONE, {"dmem"}, "none"),
])
def test_choose(tmp_path, mode, present, chosen):
    if "mps" in present:
        FakeMpsDaemon(tmp_path / "mps", FakeDevice(1)).start()
    if "hami" in present:
        (tmp_path / "lib.so").write_bytes(b"")
    FakeDmemTree(tmp_path / "cg", REGION, 80 * GIB, with_dmem="dmem" in present)
    backend, cap, seen = choose(_cfg(tmp_path, mode))
    assert cap.backend == chosen and cap.available
    assert seen[-1] == cap


def test_prolog_reports_the_capability_and_writes_the_root_files(tmp_path):
    from slurm_plugin.enforce.node import apply_root, capability_proto
    tree = FakeDmemTree(tmp_path / "cg", REGION, 80 * GIB)
    cfg = _cfg(tmp_path, Enforcement.AUTO)
    report = capability_proto(cfg)
    assert (report.backend, report.hard_cap, report.victim) == ("nvml-cgroup", True, True)
    assert apply_root({"SLURM_JOB_ID": "9"}, cfg) == []  # no shards named: nothing written
    written = apply_root({"SLURM_JOB_ID": "9", "SLURM_SHARDS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": "0"}, cfg)
    assert sorted(p.name for p in written) == ["dmem.low", "dmem.max"]
    tree.charge("job_9", 20 * GIB)
    with pytest.raises(OutOfMemory):
        tree.charge("job_9", 1)


@pytest.mark.parametrize("mode, present, ok, first", [
    (Enforcement.AUTO, set(), True, "advisory: advisory only"),
    (Enforcement.AUTO, {"dmem"}, True, "nvml-cgroup: hard cap + victim semantics"),
    (Enforcement.HAMI, set(), False, "agent.enforcement=hami: advisory"),  # configured, absent: a failed check
    (Enforcement.MPS, {"mps"}, True, "mps: hard cap, no victim semantics"),
])
def test_doctor_reports_the_backend(tmp_path, mode, present, ok, first):
    from policy_service.admin import enforcement_checks
    if "mps" in present:
        FakeMpsDaemon(tmp_path / "mps", FakeDevice(1)).start()
    FakeDmemTree(tmp_path / "cg", REGION, 80 * GIB, with_dmem="dmem" in present)
    checks = enforcement_checks(_cfg(tmp_path, mode))
    assert checks[0].ok is ok and first in checks[0].detail
    assert all(c.ok for c in checks[1:])


def test_dmem_region_of_the_jobs_gpu_on_a_two_gpu_node(tmp_path):
    root = tmp_path / "cg"
    FakeDmemTree(root, "drm/a/vram0", 80 * GIB)
    (root / "dmem.capacity").write_text(f"drm/a/vram0 {80 * GIB}\ndrm/b/vram0 {80 * GIB}\n")
    b = NvmlCgroupBackend(root, "job_{job_id}")
    files = b.apply(replace(JOB, user_env={"SLURM_JOB_GPUS": "1"})).files
    assert files[root / "job_7" / "dmem.max"].startswith("drm/b/vram0 ")
    assert not b.apply(replace(JOB, user_env={"SLURM_JOB_GPUS": "5"})).enforced  # unknown: not claimed
