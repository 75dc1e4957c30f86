from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest

from policy_service.sim import memtrace as M
from policy_service.sim.loaders import DataNotFound, SchemaError

DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "alibaba-v2026-genai"


def _write(tmp_path: Path, rows: list[str], header: str = "timestamp_anon,value,container_ip") -> Path:
    (tmp_path / M.MEMORY_FILE).write_text("\n".join([header, *rows]) + "\n")
    return tmp_path


@pytest.mark.skipif(not DATA.is_dir(), reason="shared data not beside the repository")
def test_real_memory_and_duty_files_load():
    mem = M.load_memory(DATA)
    duty = M.load_duty(DATA)
    assert len(mem) == 76 and len(duty) > 0
    assert all(s.t == tuple(sorted(s.t)) for s in mem)
    runs = [r for s in mem for r in M.cut_runs(s, 1800)]
    # about 23 h of one-minute samples: up to 46 windows per container
    assert 1000 < len(runs) <= 76 * 46
    assert all(0 <= t < 1800 for r in runs for t in r.t)


def test_series_are_grouped_and_sorted(tmp_path):
    d = _write(tmp_path, ["120,30,b", "60,20,a", "0,10,a", "0,5,b"])
    got = {s.container: s for s in M.load_memory(d)}
    assert got["a"].t == (0.0, 60.0) and got["a"].v == (10.0, 20.0)
    assert got["b"].v == (5.0, 30.0)


def test_windows_cut_peaks_and_skip_idle(tmp_path):
    rows = [f"{60 * i},{v},c" for i, v in enumerate([1, 5, 3, 0, 0, 0, 7, 9])]
    (s,) = M.load_memory(_write(tmp_path, rows))
    runs = M.cut_runs(s, 180)  # windows [0,180) [180,360) [360,540)
    assert [(r.index, r.peak_bytes, r.first_bytes) for r in runs] == [(0, 5, 1), (2, 9, 7)]
    assert runs[1].start_s == 360 and runs[1].t == (0.0, 60.0)
    with pytest.raises(ValueError):
        M.cut_runs(s, 0)


@pytest.mark.parametrize("rows,problem", [(["x,1,a"], "not a number"), (["1,-5,a"], ">= 0"),
                                          (["1,nan,a"], "finite"), (["1,2"], "fields")])
def test_bad_rows_name_the_line(tmp_path, rows, problem):
    with pytest.raises(SchemaError, match=problem):
        M.load_memory(_write(tmp_path, rows))


def test_wrong_header_and_missing_file(tmp_path):
    with pytest.raises(SchemaError, match="expected"):
        M.load_memory(_write(tmp_path, ["1,2,a"], header="value,timestamp_anon,container_ip"))
    with pytest.raises(DataNotFound, match="cluster-trace-v2026-GenAI"):
        M.load_duty(tmp_path / "nowhere")


def _brute_floor(classes, over_frac):
    n = sum(len(c) for c in classes)
    best = math.inf
    for charges in itertools.product(*[sorted(set(c)) for c in classes]):
        over = sum(p > ch for c, ch in zip(classes, charges) for p in c)
        if over <= over_frac * n + 1e-9:
            best = min(best, sum(ch / p for c, ch in zip(classes, charges) for p in c) / n)
    return best


def test_hindsight_floor_matches_brute_force_over_every_per_class_charge():
    rng = random.Random(7)
    for _ in range(40):
        classes = [[rng.choice((10, 12, 15, 20, 31)) for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(1, 4))]
        for frac in (0.0, 0.1, 0.25, 0.5):
            assert M.hindsight_charge_floor(classes, frac) == pytest.approx(_brute_floor(classes, frac))


def test_hindsight_floor_values_by_hand():
    # One class 10, 10, 20: no over-run -> charge 20 -> (2 + 2 + 1) / 3; one allowed -> charge 10 -> (1 + 1 + 0.5) / 3.
    assert M.hindsight_charge_floor([[10, 10, 20]], 0.0) == pytest.approx(5 / 3)
    assert M.hindsight_charge_floor([[10, 10, 20]], 1 / 3) == pytest.approx(2.5 / 3)
    # Steady classes cost exactly 1; empty input is NaN.
    assert M.hindsight_charge_floor([[7, 7], [9]], 0.0) == 1.0
    assert math.isnan(M.hindsight_charge_floor([[], []], 0.01))
