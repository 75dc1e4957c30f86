"""Loaders of measured co-located pairs (Lucid's schema on small files; Gavel's real file) and
the simulator's named interference fits."""
from __future__ import annotations

from pathlib import Path

import pytest

from policy_service.config import ConfigError
from policy_service.sim.colocation import LUCID_PAIR_COLUMNS, LUCID_SOLO_COLUMNS, load_gavel_pairs, load_lucid_pairs
from policy_service.sim.config import INTERFERENCE_FITS, SimConfig, sim_config_from_mapping, with_interference_fit
from policy_service.sim.gavel import gavel_pair_slowdowns
from policy_service.sim.interference_fit import fit_knee
from policy_service.sim.loaders import DataNotFound, SchemaError

DATA = Path(__file__).parents[3].parent / "shared" / "data"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"shared workload data not found at {DATA}")

SOLO = [",".join(LUCID_SOLO_COLUMNS),
        "ResNet18,CIFAR-10,32,0,900.1,80.0,30.0,2000,2",
        "BERT,SQuAD,32,1,119.9,50.0,74.2,16334.0,2"]
PAIRS = [",".join(LUCID_PAIR_COLUMNS),
         "0,ResNet18,CIFAR-10,1,32,0,0.8,BERT,SQuAD,1,32,1,0.5,90.0,40.0,18000",
         "1,ResNet18,CIFAR-10,1,32,0,0.9,DCGAN,LSUN,1,32,0,0.9,60.0,20.0,5000",  # DCGAN: no solo profile
         "2,ResNet18,CIFAR-10,2,32,0,0.9,BERT,SQuAD,2,32,1,0.9,60.0,20.0,5000"]  # two GPUs each


def _write(folder: Path, pairs=PAIRS, solo=SOLO) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "colocate_info.csv").write_text("\n".join(pairs) + "\n")
    (folder / "single_data.csv").write_text("\n".join(solo) + "\n")
    return folder


def test_lucid_rows_become_pairs_with_measured_utilisations(tmp_path):
    src = load_lucid_pairs(_write(tmp_path))
    # one usable row gives two observations: each job next to the other, slowdown 1 / speed
    assert [(p.u_self, p.u_other) for p in src.pairs] == [(0.8, 0.5), (0.5, 0.8)]
    assert [p.slowdown for p in src.pairs] == pytest.approx([1 / 0.8, 1 / 0.5])
    assert src.skipped == {"no solo profile": 1, "not single-GPU": 1}
    assert src.source["files"][0]["rows"] == 3 and not src.source["files"][0]["matches_published"]


def test_lucid_repository_layout_is_found(tmp_path):
    _write(tmp_path / "simulation" / "data", solo=["x"])
    _write(tmp_path / "simulation" / "analyzer")
    (tmp_path / "simulation" / "data" / "single_data.csv").unlink()
    assert len(load_lucid_pairs(tmp_path).pairs) == 2


def test_lucid_wrong_header_names_the_missing_column(tmp_path):
    bad = [PAIRS[0].replace("speed2", "speed_b")] + PAIRS[1:]
    with pytest.raises(SchemaError, match="missing: speed2"):
        load_lucid_pairs(_write(tmp_path, pairs=bad))


def test_lucid_bad_values_are_errors(tmp_path):
    with pytest.raises(SchemaError, match="not a percentage"):
        load_lucid_pairs(_write(tmp_path, solo=SOLO[:2] + ["BERT,SQuAD,32,1,119.9,150.0,74.2,16334.0,2"]))
    with pytest.raises(SchemaError, match="speed1"):
        load_lucid_pairs(_write(tmp_path / "b", pairs=[PAIRS[0], PAIRS[1].replace(",0.8,", ",fast,")]))


def test_lucid_missing_files_say_where_to_get_them(tmp_path):
    with pytest.raises(DataNotFound, match="S-Lab-System-Group/Lucid"):
        load_lucid_pairs(tmp_path)


@needs_data
def test_gavel_pairs_are_the_calibration_pairs_as_slowdowns():
    src = load_gavel_pairs(DATA / "gavel")
    extra = gavel_pair_slowdowns(DATA / "gavel")
    assert len(src.slowdowns) == len(extra) > 0 and src.pairs == ()
    assert src.slowdowns == pytest.approx([1 + s for s in extra])


@needs_data
def test_named_gavel_fit_is_the_fit_to_the_shipped_data():
    fit = fit_knee(gavel_pair_slowdowns(DATA / "gavel", "v100"))
    assert (fit.base, fit.slope) == pytest.approx(INTERFERENCE_FITS["gavel"])


def test_default_sim_config_assumes_the_gavel_fit():
    i = SimConfig().interference
    assert i.fit == "gavel" and (i.knee_base, i.knee_slope) == INTERFERENCE_FITS["gavel"]


def test_sim_config_selects_a_named_fit():
    cfg = sim_config_from_mapping({"interference": {"fit": "lucid"}})
    assert (cfg.interference.knee_base, cfg.interference.knee_slope) == INTERFERENCE_FITS["lucid"]
    assert with_interference_fit(SimConfig(), "lucid") == cfg


def test_sim_config_refuses_a_named_fit_with_other_values():
    with pytest.raises(ConfigError, match="custom"):
        sim_config_from_mapping({"interference": {"fit": "lucid", "knee_base": 0.3}})
    with pytest.raises(ConfigError, match="unknown interference fit"):
        with_interference_fit(SimConfig(), "nope")
    with pytest.raises(ConfigError, match="interference.fit"):
        sim_config_from_mapping({"interference": {"fit": "nope"}})


def test_sim_config_with_knee_values_alone_is_a_custom_fit():
    cfg = sim_config_from_mapping({"interference": {"knee_base": 0.3, "knee_slope": 1.0}})
    assert cfg.interference.fit == "custom" and cfg.interference.knee_base == 0.3
