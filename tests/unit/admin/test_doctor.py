"""doctor checks on real-shaped slurm.conf / gres.conf (good and each broken variant), gres-conf output.

This module holds the good files and helpers the other doctor tests import (GOOD_SLURM_CONF,
GOOD_GRES_CONF, CFG, _sub, _checks_by_name, _write_config). The billing of shared jobs
(TRESBillingWeights, AccountingStorageTRES) is test_doctor_billing.py's."""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from policy_service.admin import (
    doctor_checks,
    doctor_command,
    expand_list,
    gres_conf_command,
    gres_conf_lines,
    parse_gres_conf,
    parse_gres_spec,
    parse_slurm_conf,
)
from policy_service.admin.check import Check
from policy_service.config import GIB, Config, GpuConfig
from slurm_plugin.gpu.nvml_fake import FakeNvmlTelemetry, create_fake_gpus

from tests.unit.doctor_layout import CLI_FILES, install_lua, open_dir  # noqa: F401  (open_dir: a fixture)

GOOD_SLURM_CONF = """\
# slurm.conf for the swapaware dev cluster
ClusterName=swapaware
SlurmctldHost=ctl01
AuthType=auth/munge
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup,task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu,shard
JobSubmitPlugins=lua
CliFilterPlugins=lua
Prolog=/usr/local/sbin/swapaware-prolog
Epilog=/usr/local/sbin/swapaware-epilog
TaskProlog=/usr/local/sbin/swapaware-task-prolog
PriorityType=priority/multifactor
PriorityWeightAge=2000   # waiting time must be able to beat the contention bonus
PriorityWeightFairshare=1000
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageTRES=gres/gpu,gres/shard
NodeName=DEFAULT CPUs=64 RealMemory=512000 State=UNKNOWN
NodeName=gpu[01-02] Gres=gpu:4,shard:32
NodeName=cpu[01-04] CPUs=32
PartitionName=gpu Nodes=gpu[01-02] Default=YES MaxTime=INFINITE State=UP
"""

GOOD_GRES_CONF = """\
AutoDetect=off
Name=gpu File=/dev/nvidia[0-3]
Name=shard Count=8 File=/dev/nvidia0
Name=shard Count=8 File=/dev/nvidia1
Name=shard Count=8 File=/dev/nvidia2
Name=shard Count=8 File=/dev/nvidia3
"""

CFG = Config(gpu=GpuConfig(memory_bytes=80 * GIB, shards_per_gpu=8))


def _sub(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


def _checks_by_name(slurm: str, gres: str, cfg: Config = CFG) -> dict[str, Check]:
    return {c.name: c for c in doctor_checks(slurm, gres, cfg, None, None)}


@pytest.fixture
def fake4(tmp_path: Path) -> FakeNvmlTelemetry:
    create_fake_gpus(tmp_path / "gpus", 4, 80 * GIB)
    return FakeNvmlTelemetry(tmp_path / "gpus")


def _failing(slurm: str = GOOD_SLURM_CONF, gres: str = GOOD_GRES_CONF, cfg: Config = CFG, telemetry="fake4",
             service: bool | None = True, fake4: FakeNvmlTelemetry | None = None) -> set[str]:
    tel = fake4 if telemetry == "fake4" else telemetry
    checks = doctor_checks(slurm, gres, cfg, tel, service, agent_reachable=True, hostname="gpu01")
    assert all(c.fix for c in checks if not c.ok) and all(not c.fix for c in checks if c.ok)
    return {c.name for c in checks if not c.ok}


def test_good_setup_passes_every_check(fake4: FakeNvmlTelemetry) -> None:
    checks = doctor_checks(GOOD_SLURM_CONF, GOOD_GRES_CONF, CFG, fake4, True, agent_reachable=True, hostname="gpu01")
    assert [c for c in checks if not c.ok] == []
    names = {c.name for c in checks}
    assert {"gres_types", "select_type", "job_submit_lua", "prolog", "epilog", "task_prolog", "priority_type",
            "priority_weight_age", "proctrack_cgroup", "node_gres[gpu[01-02]]", "gres_conf[gpu01]", "nvml",
            "gres_conf_gpu_count", "shard_memory", "service", "agent", "billing[gpu]", "accounting_tres"} <= names


SLURM_VARIANTS = [
    ("mps in GresTypes", ("GresTypes=gpu,shard", "GresTypes=gpu,shard,mps"), {"gres_types"}),
    ("no shard in GresTypes", ("GresTypes=gpu,shard", "GresTypes=gpu"), {"gres_types"}),
    ("cons_res", ("SelectType=select/cons_tres", "SelectType=select/cons_res"), {"select_type"}),
    ("no job_submit", ("JobSubmitPlugins=lua\n", ""), {"job_submit_lua"}),
    ("no cli_filter", ("CliFilterPlugins=lua\n", ""), {"cli_filter_lua"}),
    ("cli_filter path form", ("CliFilterPlugins=lua", "CliFilterPlugins=cli_filter/lua"), set()),
    ("shards spanning GPUs", ("SelectTypeParameters=CR_Core_Memory", "SelectTypeParameters=CR_Core_Memory,"
                              "MULTIPLE_SHARING_GRES_PJ"), {"one_gpu_per_shard_job"}),
    ("least-loaded GPU is fine", ("SelectTypeParameters=CR_Core_Memory", "SelectTypeParameters=CR_Core_Memory,"
                                  "LL_SHARED_GRES"), set()),
    ("job_submit plugin path form", ("JobSubmitPlugins=lua", "JobSubmitPlugins=job_submit/require_timelimit,"
                                                             "job_submit/lua"), set()),
    ("no prolog", ("Prolog=/usr/local/sbin/swapaware-prolog\n", ""), {"prolog"}),
    ("no epilog", ("Epilog=/usr/local/sbin/swapaware-epilog\n", ""), {"epilog"}),
    ("no task prolog", ("TaskProlog=/usr/local/sbin/swapaware-task-prolog\n", ""), {"task_prolog"}),
    ("basic priority", ("PriorityType=priority/multifactor", "PriorityType=priority/basic"), {"priority_type"}),
    ("age weight too small", ("PriorityWeightAge=2000", "PriorityWeightAge=999"), {"priority_weight_age"}),
    ("age weight unset", ("PriorityWeightAge=2000", "#PriorityWeightAge=2000"), {"priority_weight_age"}),
    ("linuxproc", ("ProctrackType=proctrack/cgroup", "ProctrackType=proctrack/linuxproc"), {"proctrack_cgroup"}),
    ("keys are case-insensitive", ("SelectType=select/cons_tres", "selecttype=select/cons_tres"), set()),
    ("node shards inconsistent", ("Gres=gpu:4,shard:32", "Gres=gpu:4,shard:16"), {"gres_conf[gpu01]"}),
    ("node without shards", ("Gres=gpu:4,shard:32", "Gres=gpu:4"), {"node_gres[gpu[01-02]]", "gres_conf[gpu01]"}),
    ("typed gpus fine", ("Gres=gpu:4,shard:32", "Gres=gpu:h200:4,shard:32"), set()),
    ("no gpu nodes", ("NodeName=gpu[01-02] Gres=gpu:4,shard:32\n", ""), {"node_gres"}),
    # cpu nodes inherit the DEFAULT gres (gpu nodes override it): 2 GPUs there, 4 in gres.conf
    ("gres from NodeName=DEFAULT", ("NodeName=DEFAULT CPUs=64", "NodeName=DEFAULT Gres=gpu:2,shard:16 CPUs=64"),
     {"gres_conf[cpu01]"}),
]


@pytest.mark.parametrize("change, expected", [v[1:] for v in SLURM_VARIANTS], ids=[v[0] for v in SLURM_VARIANTS])
def test_slurm_conf_variants(fake4: FakeNvmlTelemetry, change: tuple[str, str], expected: set[str]) -> None:
    assert _failing(slurm=_sub(GOOD_SLURM_CONF, *change), fake4=fake4) == expected


GRES_VARIANTS = [
    ("one gpu short of 8 shards", ("Name=shard Count=8 File=/dev/nvidia2", "Name=shard Count=4 File=/dev/nvidia2"),
     {"gres_conf[gpu01]"}),
    ("shard line without file", ("Name=shard Count=8 File=/dev/nvidia3", "Name=shard Count=8"), {"gres_conf[gpu01]"}),
    ("a gpu missing", ("File=/dev/nvidia[0-3]", "File=/dev/nvidia[0-2]"), {"gres_conf[gpu01]", "gres_conf_gpu_count"}),
    ("one line for all shards", ("Name=shard Count=8 File=/dev/nvidia0\nName=shard Count=8 File=/dev/nvidia1\n"
                                 "Name=shard Count=8 File=/dev/nvidia2\nName=shard Count=8 File=/dev/nvidia3\n",
                                 "Name=shard Count=32 File=/dev/nvidia[0-3]\n"), set()),
    ("lines for another node only", ("Name=gpu File", "NodeName=gpu02 Name=gpu File"),
     {"gres_conf[gpu01]", "gres_conf_gpu_count"}),
]


@pytest.mark.parametrize("change, expected", [v[1:] for v in GRES_VARIANTS], ids=[v[0] for v in GRES_VARIANTS])
def test_gres_conf_variants(fake4: FakeNvmlTelemetry, change: tuple[str, str], expected: set[str]) -> None:
    assert _failing(gres=_sub(GOOD_GRES_CONF, *change), fake4=fake4) == expected


def test_environment_variants(tmp_path: Path, fake4: FakeNvmlTelemetry) -> None:
    assert _failing(telemetry=None) == {"nvml"}
    create_fake_gpus(tmp_path / "two", 2, 80 * GIB)
    assert _failing(telemetry=FakeNvmlTelemetry(tmp_path / "two")) == {"gres_conf_gpu_count"}
    # shards of 20 GiB: gres.conf's 8 per 80 GiB GPU promise 160 GiB
    assert _failing(cfg=Config(gpu=GpuConfig(memory_bytes=80 * GIB, shards_per_gpu=4)), fake4=fake4) == {"shard_memory"}
    # shards of 5 GiB: 8 per GPU use half of it, which the check says but does not fail
    half = doctor_checks(GOOD_SLURM_CONF, GOOD_GRES_CONF, Config(gpu=GpuConfig(memory_bytes=80 * GIB,
                                                                              shards_per_gpu=16)), fake4, True)
    (memory,) = [c for c in half if c.name == "shard_memory"]
    assert memory.ok and "GPU 0 80.0 GiB: 8 of 16" in memory.detail and "could hold 16" in memory.detail
    assert _failing(service=False, fake4=fake4) == {"service"}
    no_probe = doctor_checks(GOOD_SLURM_CONF, GOOD_GRES_CONF, CFG, fake4, None)
    assert not {"service", "agent"} & {c.name for c in no_probe}


@pytest.mark.parametrize("expr, names", [
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("a,b[1-2]", ["a", "b1", "b2"]),
    ("/dev/nvidia[0-1]", ["/dev/nvidia0", "/dev/nvidia1"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("single", ["single"]),
])
def test_expand_list(expr: str, names: list[str]) -> None:
    assert expand_list(expr) == names


@pytest.mark.parametrize("spec, counts", [
    ("gpu:4,shard:32", {"gpu": 4, "shard": 32}),
    ("gpu:a100:2,gpu:v100:2,shard:32", {"gpu": 4, "shard": 32}),
    ("gpu:h200:4(S:0-1),shard:1K", {"gpu": 4, "shard": 1024}),
    ("gpu", {"gpu": 1}),
    ("gpu:a100", {"gpu": 1}),
    ("shard:0", {"shard": 0}),
    ("", {}),
])
def test_parse_gres_spec(spec: str, counts: dict[str, int]) -> None:
    assert parse_gres_spec(spec) == counts


def test_parsers_keep_what_checks_need() -> None:
    conf = parse_slurm_conf('Prolog="/opt/sa prolog"\nNodeName=n1 Gres=gpu:1,shard:8\nPartitionName=p Nodes=n1\n')
    assert conf.get("prolog") == "/opt/sa prolog" and conf.nodes[0].names == ("n1",)
    assert "nodes" not in conf.params
    gres = parse_gres_conf("AutoDetect=off\nNodeName=n[1-2] Name=shard Count=8 File=/dev/nvidia0\n")
    assert gres.params == {"autodetect": "off"}
    assert gres.for_node("n2")[0].files == ("/dev/nvidia0",) and gres.for_node("n3") == []


def test_gres_conf_lines_golden_and_round_trip(tmp_path: Path) -> None:
    create_fake_gpus(tmp_path / "g", 2, 80 * GIB)
    lines = gres_conf_lines(FakeNvmlTelemetry(tmp_path / "g"), 10 * GIB, "/tmp/fakedev/nvidia")
    assert lines == [
        f"# generated by swapaware gres-conf from fake-nvml: 2 GPU(s), a shard is {10 * GIB} bytes (10.0 GiB) on "
        "every GPU",
        "# slurm.conf node line: Gres=gpu:2,shard:16",
        "# adding Type= to a gpu line: give its shard line the same Type= and list the shards by type in Gres=",
        "# (gpu:<type>:<n>,shard:<type>:<n>), or a 24.11 slurmctld taking control drains the node (swapaware doctor)",
        "AutoDetect=off",
        f"# GPU 0: Fake GPU GPU-fake-0000 {80 * GIB} bytes: 8 shard(s)",
        "Name=gpu File=/tmp/fakedev/nvidia0",
        "Name=shard Count=8 File=/tmp/fakedev/nvidia0",
        f"# GPU 1: Fake GPU GPU-fake-0001 {80 * GIB} bytes: 8 shard(s)",
        "Name=gpu File=/tmp/fakedev/nvidia1",
        "Name=shard Count=8 File=/tmp/fakedev/nvidia1",
    ]
    slurm = _sub(GOOD_SLURM_CONF, "Gres=gpu:4,shard:32", "Gres=gpu:2,shard:16")
    assert _failing(slurm=slurm, gres="\n".join(lines), telemetry=FakeNvmlTelemetry(tmp_path / "g")) == set()
    create_fake_gpus(tmp_path / "none", 0, 1)
    with pytest.raises(ValueError, match="no GPUs"):
        gres_conf_lines(FakeNvmlTelemetry(tmp_path / "none"), 10 * GIB)


def test_a_mixed_fleet_gets_a_count_per_gpu_and_the_doctor_holds_each_gpu_to_its_memory(tmp_path: Path) -> None:
    """40, 48 and 80 GiB GPUs with 10 GiB shards: 4, 4 and 8; a GPU smaller than a shard gets none."""
    create_fake_gpus(tmp_path / "mixed", 5, [40 * GIB, 48 * GIB, 80 * GIB, 80 * GIB, 8 * GIB])
    fleet = FakeNvmlTelemetry(tmp_path / "mixed")
    lines = gres_conf_lines(fleet, 10 * GIB)
    assert [ln for ln in lines if ln.startswith("Name=shard")] == [
        "Name=shard Count=4 File=/dev/nvidia0", "Name=shard Count=4 File=/dev/nvidia1",
        "Name=shard Count=8 File=/dev/nvidia2", "Name=shard Count=8 File=/dev/nvidia3"]
    assert "# slurm.conf node line: Gres=gpu:5,shard:24" in lines
    slurm = _sub(GOOD_SLURM_CONF, "Gres=gpu:4,shard:32", "Gres=gpu:5,shard:24")
    gres = "\n".join(ln for ln in lines if not ln.startswith("#"))
    assert _failing(slurm=slurm, gres=gres, telemetry=fleet) - {"billing[gpu]"} == set()
    # the same fleet cut into 8 shards per GPU: the 40 and 48 GiB GPUs promise 80 GiB each
    uniform = gres.replace("Count=4 ", "Count=8 ")
    slurm32 = _sub(GOOD_SLURM_CONF, "Gres=gpu:4,shard:32", "Gres=gpu:5,shard:32")
    checks = {c.name: c for c in doctor_checks(slurm32, uniform, CFG, fleet, True, hostname="gpu01")}
    assert not checks["shard_memory"].ok
    assert "GPU 0 has 8 shards x 10.0 GiB = 80.0 GiB, more than its 40.0 GiB" in checks["shard_memory"].detail


def _write_config(tmp_path: Path, gpus: Path) -> Path:
    config = tmp_path / "swapaware.toml"
    config.write_text(f'[gpu]\nmemory_bytes = {80 * GIB}\n[agent]\nnvml_backend = "fake"\nfake_nvml_dir = "{gpus}"\n')
    return config


def test_click_commands(tmp_path: Path, open_dir: Path) -> None:
    create_fake_gpus(tmp_path / "gpus", 4, 80 * GIB)
    config = _write_config(tmp_path, tmp_path / "gpus")
    etc = open_dir  # slurm.conf where every user may read it, cli_filter.lua beside it (CliFilterPlugins=lua)
    install_lua(etc, CLI_FILES)
    (etc / "slurm.conf").write_text(GOOD_SLURM_CONF)
    (etc / "gres.conf").write_text(GOOD_GRES_CONF)
    runner = CliRunner()
    env = {"SLURM_CONF": str(etc / "slurm.conf"), "SWAPAWARE_CONFIG": ""}
    out = runner.invoke(gres_conf_command, ["--config", str(config)], env=env)
    assert out.exit_code == 0, out.output
    assert "Name=shard Count=8 File=/dev/nvidia3" in out.output
    good = runner.invoke(doctor_command, ["--config", str(config), "--no-probes"], env=env)
    assert good.exit_code == 0, good.output
    assert "[FAIL]" not in good.output and "[ OK ] gres_types" in good.output
    (etc / "slurm.conf").write_text(_sub(GOOD_SLURM_CONF, "GresTypes=gpu,shard", "GresTypes=gpu,shard,mps"))
    bad = runner.invoke(doctor_command, ["--config", str(config), "--no-probes"], env=env)
    assert bad.exit_code == 1 and "[FAIL] gres_types" in bad.output and "fix: set GresTypes=gpu,shard" in bad.output
    missing = runner.invoke(doctor_command, ["--config", str(config), "--no-probes", "--slurm-conf",
                                             str(tmp_path / "nope.conf")], env=env)
    assert missing.exit_code == 1 and "not readable" in missing.output


def test_22_05_with_different_shard_counts_on_a_node_fails() -> None:
    """Measured on 22.05 with 4/4/8/8 shards: an idle node kept every GPU allocated to no job."""
    from policy_service.core.dialect import DIALECTS, SLURM_22_05

    gres = GOOD_GRES_CONF.replace("Name=shard Count=8 File=/dev/nvidia0", "Name=shard Count=4 File=/dev/nvidia0")
    slurm = _sub(GOOD_SLURM_CONF, "Gres=gpu:4,shard:32", "Gres=gpu:4,shard:28")
    on_22 = {c.name: c for c in doctor_checks(slurm, gres, CFG, None, None, hostname="gpu01", dialect=SLURM_22_05)}
    assert not on_22["shard_counts"].ok and "gpu[01-02]" in on_22["shard_counts"].detail
    assert on_22["shard_counts"].fix.startswith("on Slurm 22.05 give every GPU of a node the same count")
    same = {c.name: c for c in doctor_checks(GOOD_SLURM_CONF, GOOD_GRES_CONF, CFG, None, None, dialect=SLURM_22_05)}
    assert same["shard_counts"].ok
    newer = doctor_checks(slurm, gres, CFG, None, None, hostname="gpu01", dialect=DIALECTS[(24, 11)])
    assert "shard_counts" not in {c.name for c in newer}
