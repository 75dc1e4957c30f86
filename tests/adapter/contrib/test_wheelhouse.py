"""The admin guide's install for hosts without PyPI: a wheelhouse built where PyPI is reachable
(swapaware's wheel and every dependency's), then a fresh venv installed from it alone in a network
namespace with no network (`unshare -n`: only a loopback that is down), as a cluster node would.
The installed commands run."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.release_files import copy_release

ROOT = Path(__file__).resolve().parents[3]


def _run(*argv: str, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare (a network namespace with no network)")
    wh = tmp_path_factory.mktemp("wheelhouse")
    src = tmp_path_factory.mktemp("src") / "swapaware"
    copy_release(src)  # the tracked sources alone, as a release tarball holds them
    r = _run(sys.executable, "-m", "pip", "wheel", "-q", "-w", str(wh), str(src), timeout=900)
    if r.returncode != 0:
        if os.environ.get("CI"):
            raise AssertionError(f"pip wheel failed (CI reaches the package registries):\n{r.stderr[-3000:]}")
        pytest.skip(f"no package registry reachable to build the wheelhouse: {r.stderr.strip().splitlines()[-1:]}")
    return wh


def test_a_node_without_network_installs_from_the_wheelhouse_alone(wheelhouse, tmp_path):
    wheels = sorted(p.name for p in wheelhouse.glob("*.whl"))
    assert any(w.startswith("swapaware-") for w in wheels), wheels
    for dep in ("grpcio-", "grpcio_health_checking-", "protobuf-", "click-", "nvidia_ml_py-"):
        assert any(w.lower().startswith(dep) for w in wheels), (dep, wheels)
    venv = tmp_path / "venv"
    assert _run(sys.executable, "-m", "venv", str(venv)).returncode == 0
    # the guide's command, where no network exists (not even loopback is up)
    r = _run("unshare", "-n", str(venv / "bin" / "pip"), "install", "-q", "--no-index", "--find-links",
             str(wheelhouse), "swapaware", env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    for cmd in ("swapaware", "swapaware-prolog", "swapaware-epilog", "swapaware-agent"):
        assert (venv / "bin" / cmd).exists(), cmd
    r = _run("unshare", "-n", str(venv / "bin" / "swapaware"), "--help", env={"PATH": os.environ["PATH"]})
    assert r.returncode == 0 and "doctor" in r.stdout, (r.stdout, r.stderr)
    # the package's Lua files come with it (the guide copies them from the installed package)
    r = _run(str(venv / "bin" / "python"), "-c", "import slurm_plugin, os; print(os.path.dirname(slurm_plugin.__file__))")
    lua = Path(r.stdout.strip())
    assert all((lua / f).is_file() for f in ("job_submit.lua", "swapaware.lua", "cli_filter.lua")), r
