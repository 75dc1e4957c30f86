import dataclasses
from pathlib import Path

import pytest

from policy_service.config import Config, ConfigError, LinkKind, WholeGpuAsShards, load_config

EXAMPLE = Path(__file__).resolve().parents[3] / "contrib" / "swapaware.toml.example"


def test_example_config_lists_every_default():
    cfg = load_config(EXAMPLE, env={})
    assert dataclasses.replace(cfg, source="defaults") == Config()
    text = EXAMPLE.read_text()
    for section in dataclasses.fields(Config):
        if section.name == "source":
            continue
        for key in dataclasses.fields(getattr(Config(), section.name)):
            assert f"\n{key.name} = " in text, f"[{section.name}] {key.name} missing from the example"


def test_environment_overrides_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[gpu]\nshards_per_gpu = 4\nlink = "pcie_gen4"\n')
    cfg = load_config(f, env={"SWAPAWARE_GPU__SHARDS_PER_GPU": "16"})
    assert cfg.gpu.shards_per_gpu == 16 and cfg.gpu.link is LinkKind.PCIE_GEN4
    assert "environment" in cfg.source


@pytest.mark.parametrize("text,env,match", [
    ("[gpu]\nshards = 4\n", {}, "unknown key"),
    ("[gpus]\n", {}, "unknown section"),
    ('[gpu]\nlink = "usb"\n', {}, "not one of"),
    ("[gpu]\nshards_per_gpu = 0\n", {}, "shards_per_gpu"),
    ("[gpu\n", {}, "not valid TOML"),
    ("", {"SWAPAWARE_NOPE__X": "1"}, "unknown section"),
    ("", {"SWAPAWARE_POLICY__ENABLE_SHARING": "maybe"}, "not a boolean"),
    ('[policy]\nwhole_gpu_as_shards = "sometimes"\n', {}, "whole_gpu_as_shards: 'sometimes' is not one of: auto, "
                                                        "true, false$"),
    ("", {"SWAPAWARE_POLICY__WHOLE_GPU_AS_SHARDS": "2"}, "whole_gpu_as_shards"),
    ('[service]\nslurm_release = "latest"\n', {}, "service.slurm_release: 'latest' is not a Slurm release"),
])
def test_bad_config_says_which_key(tmp_path, text, env, match):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(f, env=env)


def test_missing_explicit_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env={})


@pytest.mark.parametrize("text,env,expected", [
    ("", {}, WholeGpuAsShards.AUTO),
    ('[policy]\nwhole_gpu_as_shards = "auto"\n', {}, WholeGpuAsShards.AUTO),
    ("[policy]\nwhole_gpu_as_shards = true\n", {}, WholeGpuAsShards.ON),
    ("[policy]\nwhole_gpu_as_shards = false\n", {}, WholeGpuAsShards.OFF),
    ('[policy]\nwhole_gpu_as_shards = "AUTO"\n', {}, WholeGpuAsShards.AUTO),
    ("", {"SWAPAWARE_POLICY__WHOLE_GPU_AS_SHARDS": "yes"}, WholeGpuAsShards.ON),
    ("", {"SWAPAWARE_POLICY__WHOLE_GPU_AS_SHARDS": "0"}, WholeGpuAsShards.OFF),
    ("", {"SWAPAWARE_POLICY__WHOLE_GPU_AS_SHARDS": "off"}, WholeGpuAsShards.OFF),
    ("", {"SWAPAWARE_POLICY__WHOLE_GPU_AS_SHARDS": "auto"}, WholeGpuAsShards.AUTO),
])
def test_whole_gpu_as_shards_is_auto_true_or_false(tmp_path, text, env, expected):
    f = tmp_path / "c.toml"
    f.write_text(text)
    assert load_config(f, env=env).policy.whole_gpu_as_shards is expected


@pytest.mark.parametrize("value", ["", "24.11", "26.05", "22.05.8"])
def test_slurm_release_accepts_a_release_or_nothing(value):
    assert load_config(env={"SWAPAWARE_SERVICE__SLURM_RELEASE": value}).service.slurm_release == value
