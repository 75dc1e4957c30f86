"""The release's files alone, as a release tarball unpacks them (no .venv, no build output): what
the tests that build swapaware's wheel copy first, so that setuptools never packs an earlier build's
leftovers. Used by tests/install (the guide's install) and tests/adapter/contrib/test_wheelhouse.py."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD_OUTPUTS = {".git", ".venv", "__pycache__", "_generated", "build", "dist", "results", ".pytest_cache"}


def release_names(root: Path = ROOT) -> list[str]:
    """The tracked files of a git checkout, else (contrib/matrix/run.sh's copy in a release root has
    no .git) every file but build outputs."""
    if shutil.which("git") and (root / ".git").exists():
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, text=True, check=True)
        return [n for n in out.stdout.split("\0") if n]
    return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()
            and not BUILD_OUTPUTS & set(p.relative_to(root).parts)
            and not any(part.endswith(".egg-info") for part in p.parts)]


def copy_release(dest: Path, root: Path = ROOT) -> None:
    """The release's files copied into ``dest``, with their modes and times."""
    for name in release_names(root):
        if (root / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, dest / name)
