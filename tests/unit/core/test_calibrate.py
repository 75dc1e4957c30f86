import io
import random

import pytest
from click.testing import CliRunner

from policy_service.cli import main
from policy_service.config import AccessClass, SwapCostConfig
from policy_service.core import swapcost
from policy_service.core.calibrate import FIELDS, CalibrationError, fit, read_measurements
from policy_service.core.swapcost import SwapMode
from policy_service.core.types import CoJob

GB = 10**9
TRUE = SwapCostConfig(pcie_gen5_bytes_per_s=41e9, fault_latency_s=22e-6)


def synthetic_csv(noise: float = 0.0, modes=(SwapMode.VICTIM, SwapMode.NAIVE), seed: int = 3) -> str:
    rng = random.Random(seed)
    lines = [",".join(FIELDS)]
    for mode in modes:
        for access in AccessClass:
            for ratio in (1.1, 1.25, 1.5, 2.0):
                fp = 40 * GB
                off = int(fp * (1 - 1 / ratio))
                job = CoJob("j", fp, int(0.8 * fp), access, 0.0, sweeps_per_s=swapcost.sweeps_for(access, TRUE))
                extra = swapcost.offload_penalty(job, off, TRUE.pcie_gen5_bytes_per_s, TRUE, mode)
                solo = 100.0
                measured = solo * (1 + extra) * (1 + rng.uniform(-noise, noise))
                lines.append(f"{mode.value},{access.value},{fp},{job.working_set_bytes},{off},{job.sweeps_per_s},"
                             f"{solo},{measured}")
    return "\n".join(lines) + "\n"


def test_fit_recovers_known_parameters():
    f = fit(read_measurements(io.StringIO(synthetic_csv())), SwapCostConfig())
    assert f.link_bytes_per_s == pytest.approx(41e9, rel=1e-6)
    assert f.fault_latency_s == pytest.approx(22e-6, rel=1e-6)
    assert f.rms_error < 1e-9


def test_fit_with_noise_stays_close():
    f = fit(read_measurements(io.StringIO(synthetic_csv(noise=0.03))), SwapCostConfig())
    assert f.link_bytes_per_s == pytest.approx(41e9, rel=0.1)
    assert f.fault_latency_s == pytest.approx(22e-6, rel=0.15)


def test_victim_only_fits_bandwidth_and_keeps_latency():
    cfg = SwapCostConfig()
    f = fit(read_measurements(io.StringIO(synthetic_csv(modes=(SwapMode.VICTIM,)))), cfg)
    assert f.link_bytes_per_s == pytest.approx(41e9, rel=1e-6) and f.fault_latency_s == cfg.fault_latency_s


@pytest.mark.parametrize("text,match", [
    ("mode,access\nvictim,random\n", "lacks column"),
    (",".join(FIELDS) + "\nvictim,sideways,1,1,1,1,1,1\n", "line 2"),
    (",".join(FIELDS) + "\nvictim,random,1,1,0,1,1,1\n", "nothing to fit"),
    (",".join(FIELDS) + "\nvictim,random,100,80,50,1,10,5\n", "non-physical"),
])
def test_bad_measurements_say_why(text, match):
    with pytest.raises(CalibrationError, match=match):
        fit(read_measurements(io.StringIO(text)), SwapCostConfig())


def test_cli_prints_config_lines(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text(synthetic_csv())
    r = CliRunner().invoke(main, ["calibrate", str(path), "--link", "pcie_gen5"], env={"SWAPAWARE_CONFIG": ""})
    assert r.exit_code == 0, r.output
    assert "pcie_gen5_bytes_per_s = 4.1e+10" in r.output and "fault_latency_s = 2.2e-05" in r.output
