"""Integration fixtures: the single-node stack of tests/slurm_stack.py for this session, started
from an empty history and accounting, stopped at the end."""
from __future__ import annotations

import pytest

from tests.slurm_stack import GIB, PORTS, STATE, Stack, decision_of, fake_alloc_script, job_field, start_stack


@pytest.fixture(scope="session")
def stack():
    s = start_stack(STATE, PORTS)
    yield s
    s.stack("down", "--purge")


__all__ = ["Stack", "job_field", "fake_alloc_script", "decision_of", "GIB"]
