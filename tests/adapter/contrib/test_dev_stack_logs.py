"""The dev stack's logs hold users' job names and decisions: contrib/dev-stack.sh creates each 0640
in a 0750 directory and narrows one an older stack left world-readable. Run for real: the script's
``service-start`` on a state directory with no cluster (the service it starts finds no config and
exits at once, having written its log)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("earlier_mode", [None, 0o644])
def test_service_log_is_private(tmp_path, earlier_mode):
    state = tmp_path / "dev"
    log = state / "log" / "swapaware.log"
    if earlier_mode is not None:  # what an older dev stack left behind
        log.parent.mkdir(parents=True, mode=0o755)
        log.write_text("old lines\n")
        log.chmod(earlier_mode)
    env = {**os.environ, "SWAPAWARE_DEV_DIR": str(state), "SWAPAWARE_VENV": str(Path(sys.executable).parent.parent)}
    p = subprocess.run(["bash", str(ROOT / "contrib" / "dev-stack.sh"), "service-start"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "policy service exited" in p.stderr, p.stderr
    assert "config file" in log.read_text()  # the service ran and wrote there
    assert log.stat().st_mode & 0o777 == 0o640
    assert log.parent.stat().st_mode & 0o777 == 0o750


def test_the_hook_wrappers_log_privately():
    """slurmd runs the prolog/epilog wrappers with its own umask (022): the wrapper sets its own."""
    text = (ROOT / "contrib" / "dev-stack.sh").read_text()
    wrapper = text[text.index('cat >"$STATE/bin/$hook" <<EOF'):]
    wrapper = wrapper[:wrapper.index("\nEOF\n")]
    assert wrapper.index("umask 027") < wrapper.index(">>$LOGDIR/hooks.log")
