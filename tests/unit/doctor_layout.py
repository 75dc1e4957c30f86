"""A slurm.conf directory for doctor's tests: under /tmp and open to every user (pytest's tmp_path
lies below /tmp/pytest-of-<user>, mode 0700, which doctor rightly reports as closed to SlurmUser
and to the users who run srun), with the Lua files installed as the admin guide installs them."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

import pytest

import slurm_plugin

SRC_DIR = Path(slurm_plugin.__file__).resolve().parent  # the package's Lua files

CLI_FILES = ("cli_filter.lua", "swapaware_cli.lua")
SUBMIT_FILES = ("job_submit.lua", "swapaware.lua", "swapaware_facts.lua", "swapaware_table.lua")


def install_lua(etc: Path, names: Iterable[str] = CLI_FILES + SUBMIT_FILES) -> None:
    """``install -m 644 <package>/<name> <etc>/`` for each name."""
    etc.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy(SRC_DIR / name, etc / name)
        os.chmod(etc / name, 0o644)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """An empty directory every user may pass through (0755, as /etc/slurm and /run/swapaware)."""
    with tempfile.TemporaryDirectory(prefix="sa-doctor-", dir="/tmp") as d:
        os.chmod(d, 0o755)
        yield Path(d)
