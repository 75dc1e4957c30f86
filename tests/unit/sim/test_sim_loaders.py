"""Loaders of the public workload data: real files in ../shared/data, and files with wrong headers."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from policy_service.sim import alibaba, gavel
from policy_service.sim import loaders as L

DATA = Path(__file__).parents[3].parent / "shared" / "data"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"shared workload data not found at {DATA}")

POD_HEADER = ",".join(alibaba.ALIBABA_V2023_POD_COLUMNS)


@needs_data
@pytest.mark.parametrize("variant", alibaba.ALIBABA_V2023_VARIANTS)
def test_alibaba_v2023_real_files_load(variant):
    t = alibaba.load_alibaba_v2023(DATA, variant)
    rows = t.source["files"][0]["rows"]
    assert rows == 8152
    assert len(t.jobs) + sum(t.skipped.values()) == rows
    assert set(t.skipped) <= {"no GPU requested", "never scheduled (Pending)"}
    assert len(t.jobs) > 5000
    for j in t.jobs:
        assert j.num_gpu >= 1 and 0 < j.gpu_milli <= 1000 and j.duration_s >= 0
        assert j.num_gpu == 1 or j.gpu_milli == 1000
    assert [j.submit_s for j in t.jobs] == sorted(j.submit_s for j in t.jobs)
    assert any(j.gpu_milli < 1000 for j in t.jobs)  # shared-GPU requests are there
    assert len(t.source["files"][0]["sha256"]) == 64 and "ATC'23" in t.source["citation"]


@needs_data
def test_alibaba_v2023_limit_and_nodes():
    assert len(alibaba.load_alibaba_v2023(DATA, limit=100).jobs) == 100
    nodes = alibaba.load_alibaba_v2023_nodes(DATA)
    assert len(nodes) == 1213 and sum(n.gpus for n in nodes) == 6212
    assert {"P100", "T4", "V100M16", "V100M32"} <= {n.model for n in nodes}


@pytest.mark.parametrize("header, expect", [
    ("name,cpu_milli,memory_mib,num_gpu,gpu_share,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time",
     ["missing: gpu_milli", "unexpected: gpu_share"]),
    ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time",
     ["missing: scheduled_time"]),
    ("cpu_milli,name,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time",
     ["different order"]),
    ("sn,cpu_milli,memory_mib,gpu,model", ["missing: name", "unexpected: sn"]),
])
def test_alibaba_v2023_wrong_header_is_a_clear_error(tmp_path, header, expect):
    (tmp_path / "openb_pod_list_default.csv").write_text(header + "\npod-0,1000,1024,1,500,,LS,Running,0,10,0\n")
    with pytest.raises(L.SchemaError) as err:
        alibaba.load_alibaba_v2023(tmp_path)
    msg = str(err.value)
    assert "openb_pod_list_default.csv" in msg and "expected:" in msg and "found:" in msg
    for part in expect:
        assert part in msg


@pytest.mark.parametrize("row, problem", [
    ("pod-0,1000,1024,one,500,,LS,Running,0,10,0", "num_gpu"),
    ("pod-0,1000,1024,1,500,,LS,Running,0,10", "fields"),
])
def test_alibaba_v2023_bad_rows(tmp_path, row, problem):
    (tmp_path / "openb_pod_list_default.csv").write_text(POD_HEADER + "\n" + row + "\n")
    with pytest.raises(L.SchemaError, match=problem):
        alibaba.load_alibaba_v2023(tmp_path)


def test_alibaba_v2023_rows_become_jobs(tmp_path):
    (tmp_path / "openb_pod_list_default.csv").write_text("\n".join([
        POD_HEADER,
        "p0,1000,1024,1,470,,LS,Running,5,105,10",  # shared GPU, 95 s
        "p1,1000,1024,0,0,,BE,Running,0,10,0",  # CPU only
        "p2,1000,1024,8,1000,,BE,Failed,1,500,2",  # 8 GPUs
        "p3,1000,1024,1,1000,,LS,Pending,3,50,",  # never scheduled
    ]) + "\n")
    t = alibaba.load_alibaba_v2023(tmp_path)
    assert [(j.job_id, j.num_gpu, j.gpu_milli, j.duration_s, j.qos) for j in t.jobs] == [
        ("p2", 8, 1000, 498.0, "BE"), ("p0", 1, 470, 95.0, "LS")]
    assert t.skipped == {"no GPU requested": 1, "never scheduled (Pending)": 1}


def test_missing_trace_file_says_where_to_get_it(tmp_path):
    with pytest.raises(L.DataNotFound, match="cluster-trace-gpu-v2023"):
        alibaba.load_alibaba_v2023(tmp_path)


# ---------------------------------------------------------------- PAI 2020

@needs_data
def test_pai_2020_real_headers_match_the_schema():
    checked = alibaba.check_pai_headers(DATA)
    assert set(checked) == set(alibaba.PAI_2020_COLUMNS)


@needs_data
def test_pai_2020_machine_spec_real_file():
    gpus = alibaba.load_pai_machine_spec(DATA)
    assert gpus["CPU"] == 0 and sum(gpus.values()) > 6000


@needs_data
def test_pai_2020_without_tables_explains_what_is_missing():
    with pytest.raises(L.DataNotFound, match="ships only the .header files"):
        alibaba.load_pai_2020(DATA)


def _pai_dir(tmp_path: Path) -> Path:
    d = tmp_path / "pai"
    d.mkdir()
    for table, cols in alibaba.PAI_2020_COLUMNS.items():
        (d / f"{table}.header").write_text(",".join(cols) + "\n")
    return d


def test_pai_2020_wrong_header_file(tmp_path):
    d = _pai_dir(tmp_path)
    (d / "pai_task_table.header").write_text("job_name,task_name,inst_num,status,start_time,end_time,plan_cpu,"
                                             "plan_mem,plan_gpus,gpu_type\n")
    with pytest.raises(L.SchemaError, match=r"pai_task_table.header.*missing: plan_gpu; unexpected: plan_gpus"):
        alibaba.check_pai_headers(d)


def test_pai_2020_full_tables_become_jobs(tmp_path):
    d = _pai_dir(tmp_path)
    (d / "pai_job_table.csv").write_text("j1,i1,u1,Terminated,100,400\nj2,i2,u2,Terminated,50,900\n"
                                         "j3,i3,u1,Failed,60,70\n")
    (d / "pai_task_table.csv").write_text(
        "j1,worker,1.0,Terminated,110,400,600.0,29.3,50.0,T4\n"  # half a GPU
        "j2,worker,2.0,Terminated,60,900,600.0,29.3,100.0,V100\n"  # 2 instances x 1 GPU
        "j2,ps,1.0,Terminated,60,900,600.0,29.3,0.0,\n"  # no GPU
        "j3,worker,1.0,Running,65,,600.0,29.3,100.0,V100\n")  # still running
    (d / "pai_group_tag_table.csv").write_text("i1,u1,,g-abc,bert\n")
    (d / "pai_sensor_table.csv").write_text(
        "j1,worker,w1,i1,m1,/dev/nvidia0,140.0,16.0,1.4,2.3,1.2,2.5,1.0,1.0,1.0,1.0\n"
        "j1,worker,w2,i1,m1,/dev/nvidia1,140.0,16.0,1.4,2.3,1.2,3.5,1.0,1.0,1.0,1.0\n")
    t = alibaba.load_pai_2020(d)
    by_id = {j.job_id: j for j in t.jobs}
    assert set(by_id) == {"j1/worker", "j2/worker"}
    j1, j2 = by_id["j1/worker"], by_id["j2/worker"]
    assert (j1.num_gpu, j1.gpu_milli, j1.submit_s, j1.duration_s) == (1, 500, 100.0, 290.0)
    assert j1.class_key == "g-abc" and j1.measured_peak_bytes == int(3.5 * alibaba.GB)
    assert (j2.num_gpu, j2.gpu_milli, j2.class_key, j2.measured_peak_bytes) == (2, 1000, "user:u2", None)
    assert t.skipped == {"no GPU requested": 1, "status Running": 1}
    assert t.source["measured_memory_jobs"] == 1 and "NSDI'22" in t.source["citation"]


def test_pai_2020_row_with_wrong_field_count(tmp_path):
    d = _pai_dir(tmp_path)
    (d / "pai_job_table.csv").write_text("j1,i1,u1,Terminated,100\n")
    (d / "pai_task_table.csv").write_text("")
    with pytest.raises(L.SchemaError, match="5 fields, expected 6"):
        alibaba.load_pai_2020(d)


# ---------------------------------------------------------------- Gavel

@needs_data
def test_gavel_calibration_real_file():
    cal = gavel.calibrate_interference(DATA / "gavel", "v100")
    assert cal.pairs > 500 and cal.pairs_failed > 0
    assert 0.2 < cal.per_corunner < 1.0
    assert cal.quantiles["p25"] <= cal.per_corunner <= cal.quantiles["p75"]
    with pytest.raises(L.SchemaError, match="no worker type 'h100'"):
        gavel.calibrate_interference(DATA / "gavel", "h100")


@pytest.mark.parametrize("payload, problem", [
    ([1, 2], "expected an object"),
    ({"v100": {"('A', 1)": {"x": 1.0}}}, "'null'"),
    ({"v100": {"('A', 1)": {"null": 2.0, "('B', 1)": [1.0]}}}, r"\[self, other\]"),
])
def test_gavel_wrong_structure(tmp_path, payload, problem):
    p = tmp_path / "simulation_throughputs.json"
    p.write_text(json.dumps(payload))
    with pytest.raises(L.SchemaError, match=problem):
        gavel.load_gavel_throughputs(p)


def test_gavel_calibration_small_file(tmp_path):
    p = tmp_path / "simulation_throughputs.json"
    p.write_text(json.dumps({"v100": {
        "('A', 1)": {"null": 2.0, "('B', 1)": [1.0, 1.0], "('C', 1)": [0.0, 0.0], "('A', 2)": [0.5, 0.5]},
        "('B', 1)": {"null": 1.0, "('A', 1)": [0.8, 1.0]},
    }}))
    cal = gavel.calibrate_interference(p, "v100")
    # A with B: 2.0/1.0 - 1 = 1.0; B with A: 1.0/0.8 - 1 = 0.25; scale-2 entries are ignored.
    assert cal.pairs == 2 and cal.pairs_failed == 1
    assert cal.per_corunner == pytest.approx(0.625)


@needs_data
def test_loaders_accept_the_data_root_or_the_folder(tmp_path):
    shutil.copy(DATA / "alibaba-v2023" / "openb_pod_list_default.csv", tmp_path)
    assert len(alibaba.load_alibaba_v2023(tmp_path, limit=10).jobs) == 10
    assert len(alibaba.load_alibaba_v2023(DATA, limit=10).jobs) == 10
