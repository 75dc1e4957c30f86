"""bench/mixed_fleet.py's arithmetic on hand-computed cases."""
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "mixed_fleet.py"
_spec = importlib.util.spec_from_file_location("mixed_fleet", SCRIPT)
mf = importlib.util.module_from_spec(_spec)
sys.modules["mixed_fleet"] = mf
_spec.loader.exec_module(mf)

G = 1 << 30
SMALLEST = mf.Scheme("slots:smallest", slots=8, ref_bytes=40 * G)
LARGEST = mf.Scheme("slots:largest", slots=8, ref_bytes=80 * G)
UNIT10 = mf.Scheme("unit:10GiB", unit_bytes=10 * G)


@pytest.mark.parametrize("scheme,gpu,charge,fits,jobs,got", [
    (SMALLEST, 40, 12, True, 2, 15),  # 5 GiB shards: 3 of them, 2 jobs on 8 shards
    (SMALLEST, 80, 12, True, 2, 30),  # the same 3 shards are 30 GiB on an 80 GiB GPU
    (LARGEST, 80, 12, True, 4, 20),  # 10 GiB shards: 2 of them
    (LARGEST, 40, 12, True, 4, 10),  # 2 shards of a 40 GiB GPU: 10 GiB, less than the charge
    (UNIT10, 40, 12, True, 2, 20),  # 4 shards on 40 GiB, 2 charged
    (UNIT10, 48, 12, True, 2, 20),  # floor(48 / 10) = 4 shards
    (UNIT10, 80, 12, True, 4, 20),
    (UNIT10, 40, 45, False, 0, 0),  # 5 shards do not fit a 4-shard GPU
    (UNIT10, 80, 45, True, 1, 50),
    (UNIT10, 80, 0.5, True, 8, 10),  # at least one shard
])
def test_placement(scheme, gpu, charge, fits, jobs, got):
    pl = mf.place(scheme, gpu * G, int(charge * G))
    assert (pl.fits, pl.jobs_per_gpu, pl.got_bytes) == (fits, jobs, got * G)


def test_evaluate_counts_over_runs_and_waste():
    runs = [(12 * G, 11 * G), (45 * G, 44 * G)]  # (charge, peak)
    small = mf.evaluate(LARGEST, 40 * G, runs)  # 12 -> 2 shards = 10 GiB < 11; 45 -> 5 shards = 25 GiB < 44
    assert (small.fit, small.over, small.jobs_per_gpu) == (2, 2, (4 + 1) / 2)
    unit = mf.evaluate(UNIT10, 40 * G, runs)  # only the first fits, 20 GiB for an 11 GiB peak
    assert (unit.fit, unit.over, unit.jobs_per_gpu) == (1, 0, (2 + 0) / 2)
    assert unit.got_per_peak == pytest.approx(20 / 11)
