"""Loaders of the Alibaba GPU cluster traces, as ``loaders.TraceJob`` lists. No paths are built
in: every loader takes the folder it reads.

* Alibaba GPU trace v2023 (``cluster-trace-gpu-v2023``, FGD, USENIX ATC'23): ``openb_pod_list_*.csv``
  (one header row) and ``openb_node_list_*.csv``.
* Alibaba PAI trace v2020 (``cluster-trace-gpu-v2020``, NSDI'22 "MLaaS in the Wild"): the tables
  have no header row; their column names are in ``<table>.header`` files. The public repository
  ships only the headers (and ``pai_machine_spec.csv``); a user with the full trace points the
  loader at the folder holding ``<table>.csv`` beside the ``.header`` files.
"""
from __future__ import annotations

import csv
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from policy_service.sim.loaders import (
    DataNotFound,
    LoadedTrace,
    SchemaError,
    TraceJob,
    _float,
    _int,
    check_columns,
    sha256_file,
)

GB = 1024**3  # PAI reports GPU memory in GB; taken as GiB (the trace does not say which)

ALIBABA_V2023_POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "qos",
                             "pod_phase", "creation_time", "deletion_time", "scheduled_time")
ALIBABA_V2023_NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
ALIBABA_V2023_VARIANTS = ("default", "gpushare40", "gpushare100")

PAI_2020_COLUMNS: dict[str, tuple[str, ...]] = {
    "pai_job_table": ("job_name", "inst_id", "user", "status", "start_time", "end_time"),
    "pai_task_table": ("job_name", "task_name", "inst_num", "status", "start_time", "end_time", "plan_cpu",
                       "plan_mem", "plan_gpu", "gpu_type"),
    "pai_instance_table": ("job_name", "task_name", "inst_name", "worker_name", "inst_id", "status", "start_time",
                           "end_time", "machine"),
    "pai_sensor_table": ("job_name", "task_name", "worker_name", "inst_id", "machine", "gpu_name", "cpu_usage",
                         "gpu_wrk_util", "avg_mem", "max_mem", "avg_gpu_wrk_mem", "max_gpu_wrk_mem", "read", "write",
                         "read_count", "write_count"),
    "pai_group_tag_table": ("inst_id", "user", "gpu_type_spec", "group", "workload"),
    "pai_machine_spec": ("machine", "gpu_type", "cap_cpu", "cap_mem", "cap_gpu"),
    "pai_machine_metric": ("worker_name", "machine", "start_time", "end_time", "machine_cpu_iowait",
                           "machine_cpu_kernel", "machine_cpu_usr", "machine_gpu", "machine_load_1",
                           "machine_net_receive", "machine_num_worker", "machine_cpu"),
}


# ---------------------------------------------------------------- Alibaba v2023 (openb)

def alibaba_v2023_pod_file(data_dir: Path, variant: str = "default") -> Path:
    if variant not in ALIBABA_V2023_VARIANTS:
        raise ValueError(f"unknown openb variant {variant!r}; one of: {', '.join(ALIBABA_V2023_VARIANTS)}")
    base = Path(data_dir)
    for candidate in (base / f"openb_pod_list_{variant}.csv", base / "alibaba-v2023" / f"openb_pod_list_{variant}.csv"):
        if candidate.is_file():
            return candidate
    raise DataNotFound(f"openb_pod_list_{variant}.csv not found in {base} (nor in {base / 'alibaba-v2023'}); "
                       "get it from github.com/alibaba/clusterdata, cluster-trace-gpu-v2023/csv/")


def load_alibaba_v2023(data_dir: Path, variant: str = "default", limit: int | None = None) -> LoadedTrace:
    """GPU pods of the openb trace as jobs.

    Duration = deletion_time - scheduled_time (pods still running at the end of the trace are
    censored there); pods never scheduled (Pending) and CPU-only pods are skipped and counted.
    ``limit`` keeps the first N GPU jobs in file order.
    """
    path = alibaba_v2023_pod_file(data_dir, variant)
    jobs: list[TraceJob] = []
    skipped: Counter = Counter()
    rows = 0
    with open(path, newline="") as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise SchemaError(f"{path}: empty file, expected header {','.join(ALIBABA_V2023_POD_COLUMNS)}") from None
        check_columns(path, header, ALIBABA_V2023_POD_COLUMNS, "Alibaba v2023 openb pod list")
        for line, row in enumerate(reader, start=2):
            if not row:
                continue
            rows += 1
            if len(row) != len(ALIBABA_V2023_POD_COLUMNS):
                raise SchemaError(f"{path}:{line}: {len(row)} fields, expected {len(ALIBABA_V2023_POD_COLUMNS)}")
            r = dict(zip(ALIBABA_V2023_POD_COLUMNS, row))
            num_gpu = _int(path, line, "num_gpu", r["num_gpu"])
            gpu_milli = _int(path, line, "gpu_milli", r["gpu_milli"] or "0")
            if num_gpu <= 0 or gpu_milli <= 0:
                skipped["no GPU requested"] += 1
                continue
            if not r["scheduled_time"].strip():
                skipped["never scheduled (Pending)"] += 1
                continue
            sched = _float(path, line, "scheduled_time", r["scheduled_time"])
            deletion = _float(path, line, "deletion_time", r["deletion_time"])
            created = _float(path, line, "creation_time", r["creation_time"])
            cpu = _int(path, line, "cpu_milli", r["cpu_milli"])
            mem = _int(path, line, "memory_mib", r["memory_mib"])
            milli = 1000 if num_gpu > 1 else min(1000, gpu_milli)
            jobs.append(TraceJob(
                job_id=r["name"], submit_s=created, duration_s=max(0.0, deletion - sched), num_gpu=num_gpu,
                gpu_milli=milli, qos=r["qos"], signature=f"cpu{cpu}-mem{mem}-gpu{num_gpu}x{milli}"))
            if limit is not None and len(jobs) >= limit:
                break
    jobs.sort(key=lambda j: (j.submit_s, j.job_id))
    source = {
        "name": "alibaba-v2023", "variant": variant,
        "files": [{"path": str(path), "sha256": sha256_file(path), "rows": rows}],
        "citation": "Weng et al., Beware of Fragmentation: Scheduling GPU-Sharing Workloads with Fragmentation "
                    "Gradient Descent, USENIX ATC'23 (github.com/alibaba/clusterdata, cluster-trace-gpu-v2023)",
    }
    return LoadedTrace(jobs=jobs, source=source, skipped=skipped)


@dataclass(frozen=True)
class NodeSpec:
    name: str
    gpus: int
    model: str


def load_alibaba_v2023_nodes(data_dir: Path, which: str = "gpu_node") -> list[NodeSpec]:
    base = Path(data_dir)
    name = f"openb_node_list_{which}.csv"
    path = next((p for p in (base / name, base / "alibaba-v2023" / name) if p.is_file()), None)
    if path is None:
        raise DataNotFound(f"{name} not found in {base}")
    out = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        check_columns(path, next(reader, []), ALIBABA_V2023_NODE_COLUMNS, "Alibaba v2023 openb node list")
        for line, row in enumerate(reader, start=2):
            if not row:
                continue
            r = dict(zip(ALIBABA_V2023_NODE_COLUMNS, row))
            out.append(NodeSpec(name=r["sn"], gpus=_int(path, line, "gpu", r["gpu"]), model=r["model"]))
    return out


# ---------------------------------------------------------------- Alibaba PAI v2020

def _pai_dir(data_dir: Path) -> Path:
    base = Path(data_dir)
    if (base / "pai_job_table.header").is_file() or (base / "pai_task_table.csv").is_file():
        return base
    if (base / "alibaba-v2020").is_dir():
        return base / "alibaba-v2020"
    return base


def check_pai_headers(data_dir: Path) -> dict[str, Path]:
    """Check every ``<table>.header`` present against the known schema; return the checked files."""
    base = _pai_dir(data_dir)
    checked = {}
    for table, cols in PAI_2020_COLUMNS.items():
        hp = base / f"{table}.header"
        if not hp.is_file():
            continue
        with open(hp, newline="") as f:
            header = next(csv.reader(f), [])
        check_columns(hp, header, cols, f"PAI 2020 {table}")
        checked[table] = hp
    if not checked:
        raise DataNotFound(f"no PAI 2020 .header files in {base} (expected e.g. pai_job_table.header)")
    return checked


def _pai_rows(base: Path, table: str, required: bool) -> Iterator[tuple[int, dict[str, str]]]:
    cols = PAI_2020_COLUMNS[table]
    path = base / f"{table}.csv"
    if not path.is_file():
        if required:
            raise DataNotFound(
                f"{path} not found. The public repository ships only the .header files of the PAI 2020 tables; "
                f"download the tables (cluster-trace-gpu-v2020/data/README.md in github.com/alibaba/clusterdata), "
                f"extract them beside the headers and point --data-dir at that folder")
        return
    hp = base / f"{table}.header"
    if hp.is_file():
        with open(hp, newline="") as f:
            check_columns(hp, next(csv.reader(f), []), cols, f"PAI 2020 {table}")
    with open(path, newline="") as f:
        for line, row in enumerate(csv.reader(f), start=1):
            if not row:
                continue
            if line == 1 and [c.strip().lstrip("\ufeff") for c in row] == list(cols):
                continue  # a header row someone added
            if len(row) != len(cols):
                raise SchemaError(f"{path}:{line}: {len(row)} fields, expected {len(cols)} ({','.join(cols)})")
            yield line, dict(zip(cols, row))


def _opt_float(text: str) -> float | None:
    if text is None or not text.strip():
        return None
    try:
        v = float(text)
    except ValueError:
        return None
    return None if math.isnan(v) else v


def load_pai_2020(data_dir: Path, limit: int | None = None) -> LoadedTrace:
    """GPU tasks of the PAI 2020 trace as jobs.

    One job per task with ``plan_gpu > 0`` and status Terminated or Failed: submit = the job's
    ``start_time`` (submission), duration = task ``end_time - start_time``; ``plan_gpu`` (percent)
    per instance times ``inst_num`` gives the GPUs (below 100 % with one instance: a shared GPU).
    Class = the instance's ``group`` tag (repeated jobs), or the user when there is none (as in the
    publishers' analysis scripts). Measured peak = largest ``max_gpu_wrk_mem`` of the job's
    instances, per GPU, when the sensor table is there.
    """
    base = _pai_dir(data_dir)
    check_pai_headers(base)
    files = []
    jobs_by_name: dict[str, tuple[str, str, float | None]] = {}
    for _, r in _pai_rows(base, "pai_job_table", required=True):
        jobs_by_name[r["job_name"]] = (r["inst_id"], r["user"], _opt_float(r["start_time"]))
    groups: dict[str, str] = {}
    for _, r in _pai_rows(base, "pai_group_tag_table", required=False):
        if r["group"]:
            groups[r["inst_id"]] = r["group"]
    peaks: dict[str, float] = {}
    for _, r in _pai_rows(base, "pai_sensor_table", required=False):
        v = _opt_float(r["max_gpu_wrk_mem"])
        if v is not None and v > 0:
            peaks[r["job_name"]] = max(peaks.get(r["job_name"], 0.0), v)
    jobs: list[TraceJob] = []
    skipped: Counter = Counter()
    rows = 0
    for line, r in _pai_rows(base, "pai_task_table", required=True):
        rows += 1
        plan_gpu = _opt_float(r["plan_gpu"]) or 0.0
        if plan_gpu <= 0:
            skipped["no GPU requested"] += 1
            continue
        if r["status"] not in ("Terminated", "Failed"):
            skipped[f"status {r['status'] or '(empty)'}"] += 1
            continue
        start, end = _opt_float(r["start_time"]), _opt_float(r["end_time"])
        if not start or not end or end < start:
            skipped["no start/end time"] += 1
            continue
        inst = max(1, int(_opt_float(r["inst_num"]) or 1))
        per_inst = plan_gpu / 100.0
        if inst == 1 and per_inst < 1.0:
            num_gpu, milli = 1, max(1, int(round(per_inst * 1000)))
        else:
            num_gpu, milli = inst * max(1, math.ceil(per_inst)), 1000
        inst_id, user, submit = jobs_by_name.get(r["job_name"], ("", "", None))
        peak = peaks.get(r["job_name"])
        jobs.append(TraceJob(
            job_id=f"{r['job_name']}/{r['task_name']}", submit_s=submit if submit else start,
            duration_s=end - start, num_gpu=num_gpu, gpu_milli=milli, qos="",
            class_key=groups.get(inst_id, "") or (f"user:{user}" if user else ""), user=user,
            signature=f"{r['task_name']}-gpu{num_gpu}x{milli}",
            measured_peak_bytes=int(peak * GB / max(1, math.ceil(per_inst))) if peak else None))
        if limit is not None and len(jobs) >= limit:
            break
    for table in ("pai_job_table", "pai_task_table", "pai_group_tag_table", "pai_sensor_table"):
        p = base / f"{table}.csv"
        if p.is_file():
            files.append({"path": str(p), "sha256": sha256_file(p)})
    jobs.sort(key=lambda j: (j.submit_s, j.job_id))
    source = {
        "name": "pai-2020", "files": files, "task_rows": rows,
        "measured_memory_jobs": sum(1 for j in jobs if j.measured_peak_bytes),
        "citation": "Weng et al., MLaaS in the Wild: Workload Analysis and Scheduling in Large-Scale "
                    "Heterogeneous GPU Clusters, USENIX NSDI'22 (github.com/alibaba/clusterdata, "
                    "cluster-trace-gpu-v2020)",
    }
    return LoadedTrace(jobs=jobs, source=source, skipped=skipped)


def load_pai_machine_spec(data_dir: Path) -> Counter:
    """GPUs per GPU type from ``pai_machine_spec.csv`` (no header row; columns from the .header)."""
    base = _pai_dir(data_dir)
    counts: Counter = Counter()
    path = base / "pai_machine_spec.csv"
    for line, r in _pai_rows(base, "pai_machine_spec", required=True):
        counts[r["gpu_type"]] += _int(path, line, "cap_gpu", r["cap_gpu"])
    return counts
