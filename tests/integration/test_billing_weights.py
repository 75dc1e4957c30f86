"""A GPU job bills what it bills without swapaware under each way a site weighs GPUs: where no
shard weight bills the fraction of a GPU a shared job holds (GPUs weighed by GRES/gpu alone, or by
type with GRES/gpu:<type>, which no shard TRES can carry), the job keeps its request (reason
shards_unbilled) and sacct's billing is the same with the plugin on and off. (The dev cluster's own
weights, CPU=1,GRES/gpu=8,GRES/shard=1, under which jobs share and bill their shards: see
test_user_options.) Each weight set is written into slurm.conf's gpu partition, as an admin would,
then every job runs once with the plugin on and once off."""
from __future__ import annotations

import re
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from typing import Iterator

import pytest

from tests.slurm_stack import Stack
from tests.waiting import wait_for

from .conftest import decision_of, job_field
from .side_by_side import Run, collect, submit, switch_plugin

pytestmark = pytest.mark.integration

HINT = "--comment=swapaware:mem=2G"  # a class that would share on its first run
SCRIPT = "#!/bin/bash\nsrun bash -c 'echo gpu=${CUDA_VISIBLE_DEVICES:+set}'\n"
TYPED_TRES = "gres/gpu,gres/shard,gres/gpu:a100,gres/gpu:h100"  # typed weights bill tracked TRES only


@dataclass(frozen=True)
class WeightSet:
    name: str
    weights: str  # the gpu partition's TRESBillingWeights
    tres: str = ""  # AccountingStorageTRES, where the set needs more tracked than the dev cluster's

    def price(self) -> dict[str, Fraction]:
        """TRES name (as sacct writes it, lower case) -> weight."""
        return {k.strip().lower(): Fraction(v) for k, v in (kv.split("=") for kv in self.weights.split(","))}


SETS = (
    WeightSet("gpu_only", "CPU=1.0,GRES/gpu=10"),
    WeightSet("typed", "CPU=1.0,GRES/gpu:a100=12,GRES/gpu:h100=16", TYPED_TRES),
)
REQUESTS = {"plain": ("--gres=gpu:1",), "typed": ("--gres=gpu:h100:1",), "typed_gpus": ("--gpus=a100:1",)}


def _billed(alloc: dict[str, str], price: dict[str, Fraction]) -> Fraction:
    """What Slurm bills for ``alloc`` (sum of weight x count; memory and nodes weigh nothing here)."""
    return sum((w * int(alloc[k]) for k, w in price.items() if k in alloc), Fraction(0))


@contextmanager
def _weights(stack: Stack, ws: WeightSet) -> Iterator[None]:
    """slurm.conf with ``ws`` for the gpu partition (taking effect at the next slurmctld restart),
    restored afterwards."""
    conf = stack.state / "etc" / "slurm.conf"
    before = conf.read_text()
    text, n = re.subn(r'^(PartitionName=gpu .*TRESBillingWeights=)"[^"]*"', rf'\g<1>"{ws.weights}"', before,
                      flags=re.M)
    assert n == 1, "the dev cluster's gpu partition line"
    if ws.tres:
        text = re.sub(r"^AccountingStorageTRES=.*$", f"AccountingStorageTRES={ws.tres}", text, flags=re.M)
    conf.write_text(text)
    try:
        yield
    finally:
        conf.write_text(before)


def _unbilled(stack: Stack) -> None:
    """The service read the new weights: a class that would share keeps its request, shards_unbilled."""
    def kept() -> dict | None:
        probe = stack.held("#!/bin/sh\ntrue\n", "--gres=gpu:1", HINT, f"--job-name=probe-{uuid.uuid4().hex[:8]}")
        d = decision_of(job_field(probe, "AdminComment"))
        return d if "shards_unbilled" in d.get("why", "").split(",") else None

    wait_for(kept, 60, "a shareable probe job to keep its request, shards_unbilled", 1.0)


@pytest.fixture(scope="module")
def runs(stack) -> dict[tuple[str, str, str], Run]:
    """(weight set, request, "on"/"off") -> the run; the dev cluster's weights and the plugin on
    again afterwards."""
    tag = uuid.uuid4().hex[:6]
    out: dict[tuple[str, str, str], Run] = {}
    try:
        for ws in SETS:
            with _weights(stack, ws):
                for mode in ("on", "off"):
                    switch_plugin(stack, mode, ready=lambda: _unbilled(stack))
                    jobs = {r: submit(stack, SCRIPT, (*args, HINT), f"bill-{r}", f"bill-{ws.name}-{r}-{tag}-{mode}")
                            for r, args in REQUESTS.items()}
                    for r, job in jobs.items():
                        out[ws.name, r, mode] = collect(stack, job, f"bill-{ws.name}-{r}-{tag}-{mode}")
    finally:
        switch_plugin(stack, "on")
    return out


@pytest.mark.parametrize("ws", SETS, ids=lambda w: w.name)
@pytest.mark.parametrize("request_name", list(REQUESTS))
def test_a_job_bills_what_it_bills_without_swapaware(runs, ws, request_name):
    on, off = runs[ws.name, request_name, "on"], runs[ws.name, request_name, "off"]
    price = ws.price()
    assert off.state == on.state == "COMPLETED", (on, off)
    assert off.stdout == on.stdout == "gpu=set\n", (on.stdout, off.stdout)
    # the GPU's weight is in the bill without swapaware (the weights took effect), and with it
    assert _billed(off.alloc, price) > int(off.alloc["cpu"]), off.alloc
    for run in (off, on):
        assert Fraction(run.alloc["billing"]) == _billed(run.alloc, price), (ws, run.alloc)
    assert "gres/shard" not in on.alloc and on.alloc.get("gres/gpu") == "1", on.alloc
    if request_name != "plain":  # the same type, so the same TRES and the same bill
        assert on.alloc == off.alloc, (on.alloc, off.alloc)
    d = decision_of(on.admin_comment)
    assert d["action"] == "whole_gpu" and "shards_unbilled" in d["why"].split(","), d
    assert on.tres_per_node == off.tres_per_node, (on, off)
