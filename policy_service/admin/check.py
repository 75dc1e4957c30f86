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


def _check(name: str, ok: bool, detail: str, fix: str) -> Check:
    return Check(name, ok, detail, "" if ok else fix)


def _list_values(raw: str) -> list[str]:
    """A comma-separated slurm.conf value, lower case, blanks dropped."""
    return [v.strip().lower() for v in raw.split(",") if v.strip()]
