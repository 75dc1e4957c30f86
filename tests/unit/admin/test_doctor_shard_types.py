"""swapaware doctor's shard_types check: where a node's shards have types, slurm.conf's Gres= lists
them by type and every Name=shard line names it (docs/slurm-releases.md, two controllers: untyped in
Gres=, a 24.11 controller taking control drained the nodes)."""
from __future__ import annotations

import pytest

from tests.unit.admin.test_doctor import GOOD_SLURM_CONF, _checks_by_name, _sub

TYPED_GPUS = "".join(f"Name=gpu Type={t} File=/dev/nvidia{i}\n" for i, t in enumerate(("a100", "a100", "h100", "h100")))
SHARD_LINES = "".join(f"Name=shard Count=8 File=/dev/nvidia{i}\n" for i in range(4))
TYPED_SHARD_LINES = "".join(f"Name=shard Type={t} Count=8 File=/dev/nvidia{i}\n"
                            for i, t in enumerate(("a100", "a100", "h100", "h100")))
TYPED_GRES = "Gres=gpu:a100:2,gpu:h100:2,shard:a100:16,shard:h100:16"


@pytest.mark.parametrize("node_gres, gres_lines, ok, texts", [
    # untyped everywhere (what swapaware gres-conf writes): nothing to check
    ("Gres=gpu:4,shard:32", "Name=gpu File=/dev/nvidia[0-3]\n" + SHARD_LINES, None, []),
    # shards typed by their GPU's File= but untyped in Gres=: the 24.11 drain at a takeover
    ("Gres=gpu:a100:2,gpu:h100:2,shard:32", TYPED_GPUS + SHARD_LINES, False,
     ["slurm.conf Gres= has shard:32, gres.conf shard:a100:16, shard:h100:16", "4 Name=shard line(s) without Type=",
      "shard:a100:16,shard:h100:16", "reported but not", "drains the node"]),
    # typed in Gres=, the shard lines without Type=: slurmd does not start
    (TYPED_GRES, TYPED_GPUS + SHARD_LINES, False, ["4 Name=shard line(s) without Type=", "slurmd does not start"]),
    (TYPED_GRES, TYPED_GPUS + TYPED_SHARD_LINES, True, ["shards by type: shard:a100:16, shard:h100:16"]),
    ("Gres=gpu:a100:2,gpu:h100:2,shard:a100:16,shard:h100:8", TYPED_GPUS + TYPED_SHARD_LINES, False,
     ["slurm.conf Gres= has shard:a100:16, shard:h100:8, gres.conf shard:a100:16, shard:h100:16"]),
], ids=["untyped", "untyped in Gres=", "no Type= on shard lines", "typed in both", "counts differ"])
def test_shard_types(node_gres: str, gres_lines: str, ok: bool | None, texts: list[str]) -> None:
    slurm = _sub(GOOD_SLURM_CONF, "Gres=gpu:4,shard:32", node_gres)
    checks = _checks_by_name(slurm, "AutoDetect=off\n" + gres_lines)
    check = checks.get("shard_types[gpu01]")
    assert (check.ok if check else None) is ok
    said = f"{check.detail}\nfix: {check.fix}" if check else ""
    for text in texts:
        assert text in said, said


def test_typed_gres_spec() -> None:
    from policy_service.slurm.slurm_files import parse_gres_types

    assert parse_gres_types("gpu:a100:2(S:0),gpu:h100:2,shard:24,gpu") == {
        "gpu": {"a100": 2, "h100": 2, "": 1}, "shard": {"": 24}}
    assert parse_gres_types("shard:A100:8,shard:h100:1K,gpu:tesla") == {
        "shard": {"a100": 8, "h100": 1024}, "gpu": {"tesla": 1}}
