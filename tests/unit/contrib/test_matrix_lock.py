"""contrib/matrix: one run per release at a time (release_lock in releases.sh), run as bash."""
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
RELEASES_SH = REPO / "contrib" / "matrix" / "releases.sh"


def _bash(script: str, state: Path, **kw) -> subprocess.Popen:
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "SWAPAWARE_MATRIX_STATE": str(state)}
    return subprocess.Popen(["bash", "-c", f"source {RELEASES_SH}; {script}"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _wait_for_file_text(path: Path, text: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.02)
    raise AssertionError(f"{path} never held {text!r}")


def test_a_second_run_of_a_release_refuses_while_the_first_holds_it_and_runs_after(tmp_path):
    gate = tmp_path / "gate"
    first = _bash(f'release_lock 24.11 "first run"; while [[ ! -e {gate} ]]; do sleep 0.05; done; echo done',
                  tmp_path)
    try:
        _wait_for_file_text(tmp_path / "swa-2411.lock", "first run")
        second = _bash('release_lock 24.11 "second run"; echo got-it', tmp_path)
        out, err = second.communicate(timeout=10)
        assert second.returncode == 1 and "got-it" not in out, (out, err)
        assert "another run of this release is in progress" in err and "first run" in err, err
        other = _bash('release_lock 26.05 "other release"; echo got-it', tmp_path)  # per release
        assert other.communicate(timeout=10)[0].strip() == "got-it"
    finally:
        gate.touch()
        first.communicate(timeout=10)
    third = _bash('release_lock 24.11 "third run"; echo got-it', tmp_path)
    assert third.communicate(timeout=10)[0].strip() == "got-it"


def test_a_process_the_run_leaves_behind_without_the_descriptor_does_not_hold_the_lock(tmp_path):
    left = tmp_path / "left.pid"
    run = _bash(f'release_lock 22.05 "run"; (sleep 30 9>&- >/dev/null 2>&1 & echo $! >{left}); echo started', tmp_path)
    assert run.communicate(timeout=10)[0].strip() == "started"
    try:
        again = _bash('release_lock 22.05 "again"; echo got-it', tmp_path)
        assert again.communicate(timeout=10)[0].strip() == "got-it"
    finally:
        subprocess.run(["kill", left.read_text().strip()], check=False)
