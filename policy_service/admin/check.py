"""One result of ``swapaware doctor``: what was checked, whether it holds, and how to fix it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    warn: bool = False  # ok, but worth fixing: printed [WARN] with its fix; doctor still exits 0
    skipped: bool = False  # not checked here (the detail says why and where it can be): printed [SKIP], exit 0

    @property
    def label(self) -> str:
        if not self.ok:
            return "FAIL"
        return "WARN" if self.warn else "SKIP" if self.skipped else " OK "


def _check(name: str, ok: bool, detail: str, fix: str) -> Check:
    return Check(name, ok, detail, "" if ok else fix)


def _list_values(raw: str) -> list[str]:
    """A comma-separated slurm.conf value, lower case, blanks dropped."""
    return [v.strip().lower() for v in raw.split(",") if v.strip()]
