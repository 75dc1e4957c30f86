"""The job_submit plugin's admission table path in the real Lua 5.1 (lua-cjson, lua-posix): the
time of one table hit (swapaware.submit() of a GPU job whose class the table holds: facts, key,
lookup, gate state, id, apply) and the time to stat, read, index and check a table of N entries
(what slurmctld spends under its Lua mutex each time the table changed).

    .venv/bin/python bench/lua_table.py [--hits 10000] [--entries 10000,100000] [--rounds 5]
        [--baseline DIR] [--queue 200]

The tables are written in the format the tree's publisher writes (core/admission_format.py; a tree
from before it: the JSON table), so the same bench measures a tree before and after. --baseline
runs the plugin of another tree beside this one's, round by round in alternating order, on the same
tables (DIR: its slurm_plugin/ or a directory holding it, e.g. `git archive REV slurm_plugin | tar -x
-C DIR`), and prints the median of the rounds for each.

"as inside slurmctld": the job_desc as slurmctld gives it (every read and write a call, environment a
new table behind a lookup function at each read; the calls counted per hit), slurm.jobs made again
with --queue entries before each job as slurmctld does at each submission (its garbage paces Lua's
collector as there), each job timed alone and split into bench/lua_phases.py's phases.

Runs the same Lua state driver as tests/unit/plugin/test_lua_table.py (tests/unit/lua_table_driver.lua).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.unit.plugin.test_lua_table import Plugin, decision, gpu_job, write_atomic  # noqa: E402

PLUGIN = ROOT / "slurm_plugin"
SHORT_SCRIPT = "#!/bin/bash\n#SBATCH --gres=gpu:1\nsource env/bin/activate\npython train.py --epochs 3\n"
# what sbatch sends of a login shell's environment (slurmctld looks SWAPAWARE_GPU_MEM up in it)
ENVIRONMENT = {**{f"VAR_{k}": f"value {k}" for k in range(24)}, "PATH": "/usr/local/bin:/usr/bin:/bin",
               "HOME": "/home/alice", "SHELL": "/bin/bash", "USER": "alice", "LANG": "C.UTF-8"}
LONG_SCRIPT = SHORT_SCRIPT + "# padding\n" * 1000   # over the fingerprint's 4096-byte read limit


def synthetic_key(i: int) -> str:
    """A key of the published shape (23 fields), distinct per i."""
    fields = [f"user{i % 997}", "proj", "gpu", f"job{i}", "gres:gpu:1", "", "", "", "60", f"{i:016x}", "", "",
              "0", "0", "1", "0", "normal", "", "", "0", "", "", ""]
    return "\x1f".join(fields)


def table(entries: dict, valid_s: float = 3600) -> str:
    now = time.time()
    doc = {"format": "swapaware-admission/1", "version": "0123456789abcdef", "generated_at": now,
           "valid_until": now + valid_s, "dialect": "24.11", "mode": "enforce", "per_qos": False, "entries": entries}
    try:
        from policy_service.core.admission_format import render_table
    except ImportError:  # a tree from before the compact file
        return json.dumps(doc)
    from policy_service.core.admission import TABLE_FORMAT
    return render_table(dict(doc, format=TABLE_FORMAT)).decode()


def load_seconds(path: Path, dialect: str = "24.11", rounds: int = 3) -> tuple[float, float]:
    """(best seconds to stat, read, index and check ``path`` in the plugin, Lua heap MiB after)."""
    with tempfile.TemporaryDirectory() as tmp:
        p = plugin(Path(tmp), path, dialect)
        try:
            out = p.req("bench_load", n=rounds)
        finally:
            p.close()
    return out["seconds"], out["memory_kib"] / 1024


def entries(n: int, distinct: bool = False) -> dict:
    """n entries, as the publisher writes them: most held as "*", every fourth by state; the
    decisions alike across entries, or (``distinct``) each entry's its own (a site factor per entry:
    the compact file's worst case, one decision line per entry and state)."""
    out = {}
    for i in range(n):
        sf = {"site_factor": i} if distinct else {}
        if i % 4:
            out[synthetic_key(i)] = {"i": i, "*": decision(i, "a", **sf)}
        else:
            out[synthetic_key(i)] = {"i": i, "short": decision(i, "s", shards=8, **sf),
                                     "normal": decision(i, "n", **sf), "long": decision(i, "l", shards=1, **sf),
                                     "unknown": decision(i, "u", shards=8, **sf)}
    return out


def plugin(d: Path, path: Path, dialect: str = "24.11", plugin_dir: Path = PLUGIN, check_ms: int = 1000) -> Plugin:
    conf = d / f"etc-{time.monotonic_ns()}"
    conf.mkdir()
    (conf / "swapaware_plugin.conf").write_text(f"socket={d}/none.sock\ntable={path}\ntable_check_ms={check_ms}\n"
                                                f"table_uids={os.getuid()}\nslurm_release={dialect}\n")
    return Plugin(conf, plugin_dir=plugin_dir)


def plugin_dir(where: str) -> Path:
    """A tree's plugin directory: ``where`` itself when it holds swapaware.lua, else its slurm_plugin/."""
    d = Path(where)
    return d if (d / "swapaware.lua").is_file() else d / "slurm_plugin"


def trees(baseline: Path | None, r: int) -> list[tuple[str, Path]]:
    """The plugins to run in round ``r``, in alternating order."""
    out = [("tree", PLUGIN)] + ([("baseline", baseline)] if baseline else [])
    return out if r % 2 == 0 else out[::-1]


def in_rounds(d: Path, path: Path, rounds: int, baseline: Path | None, checks: tuple[int, ...], check,
              request: str, **args) -> dict[str, list[dict]]:
    """The driver's answers to ``request`` (checked by ``check``) by plugin, over ``rounds`` rounds:
    each tree (this one, the baseline) and each table_check_ms of ``checks`` in turn, in alternating
    order; the names say the table_check_ms when more than one is run."""
    got: dict[str, list[dict]] = {}
    for r in range(rounds):
        for (name, where), check_ms in ((t, c) for t in trees(baseline, r) for c in checks[::(-1) ** r]):
            p = plugin(d, path, plugin_dir=where, check_ms=check_ms)
            out = p.req(request, **args)
            p.close()
            check(out)
            got.setdefault(f"{name}, table_check_ms={check_ms}" if len(checks) > 1 else name, []).append(out)
    return got


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def publish(d: Path, path: Path, jobs: list[dict]) -> None:
    """A 10,000-entry table holding ``jobs`` too (their keys as this tree's plugin makes them), a gate
    saying "normal"."""
    gate = {"format": "swapaware-gate/1", "generated_at": time.time(), "valid_until": time.time() + 3600,
            "views": {"": "normal"}, "other": "normal"}
    write_atomic(path.with_name(path.name + ".gate"), json.dumps(gate))
    p = plugin(d, path)
    es = entries(10_000)
    for n, job in enumerate(jobs):
        es[p.key(job)] = {"i": 10_000 + n, "short": decision(10_000 + n, "s", shards=8),
                          "normal": decision(10_000 + n, "n")}
    p.close()
    write_atomic(path, table(es))


def bench_hits(d: Path, hits: int, rounds: int, baseline: Path | None) -> None:
    path = d / "admission.json"
    cases = (("one 86 B script", [SHORT_SCRIPT], False),
             ("one 86 B script, job_desc behind __index as slurmctld gives it", [SHORT_SCRIPT], True),
             ("one 10 KB script (fingerprint read once)", [LONG_SCRIPT], False),
             ("two 10 KB scripts in turn", [LONG_SCRIPT, LONG_SCRIPT + "#"], False),
             ("40 10 KB scripts in turn (more than the plugin remembers: a 4 KB fingerprint each time)",
              [LONG_SCRIPT + "#" * k for k in range(40)], False))
    for label, scripts, proxy in cases:
        jobs = [gpu_job(script=script) for script in scripts]
        publish(d, path, jobs)
        def check(out: dict) -> None:
            assert out["counters"]["table_hit"] == hits + min(hits, 1000) and out["rpc_calls"] == 0, out["counters"]
            assert out["job"]["tres_per_node"] == "gres:shard:2"
        got = in_rounds(d, path, rounds, baseline, (1000,), check, "bench_hit", jobs=jobs, n=hits, proxy=proxy)
        for name, outs in got.items():
            print(f"table hit, {label}{'' if baseline is None else f' [{name}]'}: "
                  f"{med([o['seconds'] for o in outs]) / hits * 1e6:.1f} us/hit over {hits} hits, median of {rounds} "
                  f"(M.facts of the job alone {med([o['facts_seconds'] for o in outs]) / hits * 1e6:.1f} us, T.key "
                  f"alone {med([o['key_seconds'] for o in outs]) / hits * 1e6:.2f} us; "
                  f"{med([o['alloc_bytes'] for o in outs]):.0f} bytes allocated per hit)", flush=True)


PHASES = ("gres", "key", "facts", "table")


def bench_slurm(d: Path, hits: int, rounds: int, baseline: Path | None, queue: int,
                checks: tuple[int, ...] = (1000,), cold_mb: int = 0) -> None:
    """Table hits as inside slurmctld (the driver's bench_slurm): us per hit, per phase, and the
    job_desc accessor calls per hit; the 20 job names bench/lua_phases.py submits in turn, and one;
    each table_check_ms of ``checks`` in turn within each round (0: both files stat'ed at every job);
    ``cold_mb``: that many MB read between jobs, outside the timing (the caches as slurmctld's own
    work between two submissions leaves them)."""
    path = d / "admission.json"
    burst = [gpu_job(name=f"burst-{k}", script=SHORT_SCRIPT, environment=ENVIRONMENT) for k in range(20)]
    publish(d, path, burst)
    for label, jobs in (("20 job names in turn", burst), ("one job name", burst[:1])):
        def check(out: dict) -> None:
            assert out["hits"] == hits and out["rpc_calls"] == 0, out
            assert out["job"]["tres_per_node"] == "gres:shard:2" and " tbl=" in out["job"]["admin_comment"]
        got = in_rounds(d, path, rounds, baseline, checks, check, "bench_slurm", jobs=jobs, n=hits, queue=queue,
                        cold_mb=cold_mb)
        for name, outs in got.items():
            calls = outs[0]["calls"]
            phases = {ph: med([o["phases"][ph] for o in outs]) / hits * 1e6 for ph in PHASES}
            total = med([o["seconds"] for o in outs]) / hits * 1e6
            print(f"table hit as inside slurmctld, {label} (slurm.jobs of {queue}"
                  + (f", {cold_mb} MB read between jobs" if cold_mb else "") + ")"
                  f"{'' if baseline is None and len(checks) == 1 else f' [{name}]'}: {total:.1f} us/hit, median of {rounds} x {hits} ("
                  + ", ".join(f"{ph} {v:.1f}" for ph, v in phases.items()) + f", rest {total - sum(phases.values()):.1f});"
                  f" job_desc calls per hit: {calls['read'] / hits:.0f} reads + {calls['env'] / hits:.0f} environment "
                  f"lookup + {calls['write'] / hits:.0f} writes", flush=True)


def bench_load(d: Path, sizes: list[int], rounds: int = 3) -> None:
    for n in sizes:
        for distinct in (False, True):
            path = d / f"admission-{n}.json"
            write_atomic(path, table(entries(n, distinct)))
            seconds, heap = load_seconds(path, rounds=rounds)
            print(f"table load, {n} entries, decisions {'distinct per entry' if distinct else 'alike'}: "
                  f"{path.stat().st_size / 1e6:.1f} MB, {seconds * 1e3:.1f} ms (best of {rounds}: stat, read, index, "
                  f"checks), Lua heap {heap:.0f} MiB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hits", type=int, default=10_000)
    ap.add_argument("--entries", default="10000,100000")
    ap.add_argument("--rounds", type=int, default=1, help="rounds per case (the median is printed)")
    ap.add_argument("--baseline", help="another tree's plugin, run beside this one's (see above)")
    ap.add_argument("--queue", type=int, default=200, help="slurm.jobs entries made again before each job")
    ap.add_argument("--cold", type=int, default=0, metavar="MB",
                    help="the slurmctld-like part reads MB of other memory between jobs (untimed): caches as cold as "
                         "slurmctld leaves them (8: a hit costs what it costs inside slurmctld)")
    ap.add_argument("--only", choices=("hits", "slurm", "load"), help="one part of the bench")
    ap.add_argument("--check-ms", default="1000",
                    help="table_check_ms values run in turn by the slurmctld-like part, e.g. 1000,0")
    args = ap.parse_args()
    baseline = plugin_dir(args.baseline) if args.baseline else None
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        if args.only in (None, "slurm"):
            bench_slurm(d, args.hits, args.rounds, baseline, args.queue,
                        tuple(int(x) for x in args.check_ms.split(",")), args.cold)
        if args.only in (None, "hits"):
            bench_hits(d, args.hits, args.rounds, baseline)
        if args.only in (None, "load"):
            bench_load(d, [int(x) for x in args.entries.split(",")])


if __name__ == "__main__":
    main()
