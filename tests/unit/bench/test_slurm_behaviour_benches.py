"""What bench/restart_gres_leak.py and bench/reconfigure_race.py read of Slurm's output, on the
lines 22.05.8 printed while they ran (docs/slurm-releases.md)."""
from __future__ import annotations

import pytest

from tests.unit.bench_loader import load_bench

leak = load_bench("restart_gres_leak")
race = load_bench("reconfigure_race")


@pytest.mark.parametrize("used,held", [
    ("gpu:a100:0(IDX:N/A),gpu:h100:0(IDX:N/A),shard:a100:0(IDX:N/A),shard:h100:0(IDX:N/A)", False),
    ("gpu:a100:1(IDX:0),gpu:h100:0(IDX:N/A),shard:a100:0(IDX:N/A),shard:h100:0(IDX:N/A)", True),   # plugin off
    ("gpu:a100:0(IDX:N/A),gpu:h100:0(IDX:N/A),shard:a100:1(IDX:0),shard:h100:0(IDX:N/A)", True),   # plugin on
    ("gpu:a100:2(IDX:0-1),gpu:h100:2(IDX:2-3)", True),       # the CI's picture
    ("gpu:a100:0,gpu:h100:0,shard:(null):2(IDX:0-1)", True),  # before the node registered again
    ("gpu:0,shard:0", False),
    ("?", False),                                             # no GresUsed read
])
def test_gres_held_counts_gpus_and_shards(used, held):
    assert leak.gres_held(used) is held


@pytest.mark.parametrize("line,lost,unread", [
    ("[2026-12-07T07:05:01.123] error: slurm_msg_sendto: address:port=127.0.0.1:41234 msg_type=4004: "
     "Socket timed out on send/recv operation", True, False),
    ("[2026-12-07T07:05:01.123] error: slurm_receive_msg [127.0.0.1:41236]: Socket timed out on send/recv "
     "operation", False, True),
    ("[2026-12-07T07:05:01.123] error: slurm_receive_msg [127.0.0.1:41238]: Unspecified error", False, True),
    ("[2026-12-07T07:05:01.124] _slurm_rpc_submit_batch_job: JobId=9 InitPrio=1 usec=309", False, False),
])
def test_reconfigure_race_tells_a_lost_answer_from_an_unread_request(line, lost, unread):
    assert bool(race.LOST_ANSWER.search(line)) is lost
    assert bool(race.UNREAD.search(line)) is unread
