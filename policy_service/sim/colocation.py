"""Schema-checked loaders of measured co-located GPU job pairs, as ``interference_fit.PairObs``.

* Lucid (Hu et al., "Lucid: A Non-intrusive, Scalable and Interpretable Scheduler for Deep
  Learning Training Jobs", ASPLOS'23; github.com/S-Lab-System-Group/Lucid at commit
  63685a3ab7d15d8e940bb47ef98b6d5cca472b13): ``simulation/data/colocate_info.csv`` (1,388 pairs of
  single-GPU training jobs on one GPU: each job's co-located speed normalised to its speed alone)
  and ``simulation/analyzer/single_data.csv`` (each job configuration alone: its mean GPU
  utilisation in percent). Licence: S-Lab License 1.0 (redistribution for non-commercial
  purposes only), so the files are not shipped: the user passes the folder that holds them.
* Gavel (``gavel.gavel_pair_slowdowns``): pairs without utilisations.

No paths are built in: every loader takes the folder (or file) it reads.
"""
from __future__ import annotations

import csv
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policy_service.sim.gavel import gavel_pair_slowdowns
from policy_service.sim.interference_fit import PairObs
from policy_service.sim.loaders import (
    DataNotFound,
    SchemaError,
    _float,
    _int,
    check_columns,
    sha256_file,
)

LUCID_PAIR_COLUMNS = ("", "model1", "dataset1", "gpu_num1", "batchsize1", "amp1", "speed1", "model2", "dataset2",
                      "gpu_num2", "batchsize2", "amp2", "speed2", "gpu_util", "gmem_util", "gmem")
LUCID_SOLO_COLUMNS = ("model", "dataset", "batchsize", "amp", "speed", "gpu_util", "gmem_util", "gmem", "label")
# The files as published at the commit above (sha256): a loader run reports whether its files match.
LUCID_PUBLISHED_SHA256 = {
    "colocate_info.csv": "eb17384138b035112e7118b9fd33ae2ab9040fb4688942c74af59a700425ed0d",
    "single_data.csv": "6bce9f9410b9d1529c7bcfca50aa7c7bc9684dff49da8e13414013325f99ed23",
}
LUCID_CITATION = ("Hu et al., Lucid: A Non-intrusive, Scalable and Interpretable Scheduler for Deep Learning "
                  "Training Jobs, ASPLOS'23 (github.com/S-Lab-System-Group/Lucid, S-Lab License 1.0)")
GAVEL_CITATION = ("Narayanan et al., Heterogeneity-Aware Cluster Scheduling Policies for Deep Learning Workloads "
                  "(Gavel), USENIX OSDI'20 (github.com/stanford-futuredata/gavel, MIT)")


@dataclass(frozen=True)
class PairSource:
    """Measured pairs of one source. ``pairs``: one entry per measured job of a pair (a pair
    gives two), with utilisations; empty where the source records none, and then
    ``slowdowns`` holds the measured slowdowns alone."""

    name: str
    pairs: tuple[PairObs, ...]
    slowdowns: tuple[float, ...]
    source: dict[str, Any]
    skipped: dict[str, int] = field(default_factory=dict)


def _find(base: Path, name: str, subdirs: tuple[str, ...]) -> Path:
    for candidate in (base / name, *(base / d / name for d in subdirs)):
        if candidate.is_file():
            return candidate
    raise DataNotFound(f"{base}: {name} not found (looked in {', '.join(['.', *subdirs])}); it is in "
                       "github.com/S-Lab-System-Group/Lucid (simulation/data/colocate_info.csv, "
                       "simulation/analyzer/single_data.csv)")


def _rows(path: Path, expected: tuple[str, ...], what: str):
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise SchemaError(f"{path}: empty file (expected the {what} header)")
        check_columns(path, header, expected, what)
        for line, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != len(expected):
                raise SchemaError(f"{path}:{line}: {len(row)} fields, expected {len(expected)}")
            yield line, dict(zip(expected, (c.strip() for c in row)))


def load_lucid_pairs(path: Path) -> PairSource:
    """Lucid's measured pairs with each job's measured solo utilisation (see the module doc).
    ``path``: a folder holding colocate_info.csv and single_data.csv, or Lucid's repository root.
    A job's slowdown is 1 / its normalised co-located speed."""
    base = Path(path)
    pairs_path = _find(base, "colocate_info.csv", ("simulation/data", "lucid"))
    solo_path = _find(base, "single_data.csv", ("simulation/analyzer", "lucid"))
    solo: dict[tuple[str, str, str, str], float] = {}
    for line, r in _rows(solo_path, LUCID_SOLO_COLUMNS, "Lucid single_data.csv"):
        util = _float(solo_path, line, "gpu_util", r["gpu_util"])
        if not 0 <= util <= 100:
            raise SchemaError(f"{solo_path}:{line}: gpu_util {util} is not a percentage")
        solo[(r["model"], r["dataset"], str(_int(solo_path, line, "batchsize", r["batchsize"])),
              str(_int(solo_path, line, "amp", r["amp"])))] = util / 100.0
    out: list[PairObs] = []
    skipped: Counter = Counter()
    rows = 0
    for line, r in _rows(pairs_path, LUCID_PAIR_COLUMNS, "Lucid colocate_info.csv"):
        rows += 1
        if _int(pairs_path, line, "gpu_num1", r["gpu_num1"]) != 1 or _int(pairs_path, line, "gpu_num2",
                                                                          r["gpu_num2"]) != 1:
            skipped["not single-GPU"] += 1
            continue
        keys = [(r[f"model{i}"], r[f"dataset{i}"], str(_int(pairs_path, line, f"batchsize{i}", r[f"batchsize{i}"])),
                 str(_int(pairs_path, line, f"amp{i}", r[f"amp{i}"]))) for i in (1, 2)]
        if any(k not in solo for k in keys):
            skipped["no solo profile"] += 1
            continue
        for me, other in ((0, 1), (1, 0)):
            speed = _float(pairs_path, line, f"speed{me + 1}", r[f"speed{me + 1}"])
            if speed <= 0:
                skipped["speed <= 0"] += 1
                continue
            out.append(PairObs(u_self=solo[keys[me]], u_other=solo[keys[other]], slowdown=1.0 / speed))
    if not out:
        raise SchemaError(f"{pairs_path}: no usable pairs")
    files = []
    for p, rows_n in ((pairs_path, rows), (solo_path, len(solo))):
        digest = sha256_file(p)
        files.append({"path": str(p), "sha256": digest, "rows": rows_n,
                      "matches_published": digest == LUCID_PUBLISHED_SHA256.get(p.name)})
    return PairSource(name="lucid", pairs=tuple(out), slowdowns=tuple(p.slowdown for p in out),
                      source={"files": files, "citation": LUCID_CITATION,
                              "utilisation": "measured: single_data.csv gpu_util (mean over the run alone)"},
                      skipped=dict(skipped))


def load_gavel_pairs(path: Path, worker: str = "v100") -> PairSource:
    """Gavel's measured single-GPU pairs on one worker type: slowdowns only (no utilisations)."""
    slow = tuple(1.0 + s for s in gavel_pair_slowdowns(path, worker))
    real = Path(path)
    if real.is_dir():
        real = next(p for p in (real / "simulation_throughputs.json", real / "gavel" / "simulation_throughputs.json")
                    if p.is_file())
    return PairSource(name=f"gavel-{worker}", pairs=(), slowdowns=slow,
                      source={"files": [{"path": str(real), "sha256": sha256_file(real), "rows": len(slow)}],
                              "citation": GAVEL_CITATION, "utilisation": "not recorded"})
