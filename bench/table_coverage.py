"""How much of a real workload the admission table path (issue 21) could decide with no round trip.

The table holds the keys (every fact decide() reads, core/admission.table_key) of decisions the
service recorded: a submission is decided by the table only when a job with exactly the same
facts was decided before, long enough ago for the publisher to have published it (at most
admission.refresh_s after the decision, then up to table_check_ms until the plugin stats it).
Everything else takes the RPC path. This script measures that on real requests:

  1. the real job_desc tables of tests/golden/<release>/job_desc.jsonl (23 sbatch/srun shapes
     captured in job_submit.lua on each release): the real lua5.1 + swapaware.lua build the facts
     and key (M.facts, T.key) and tell whether the plugin asks at all (M.wants_gpu); the real
     publisher over a scratch history (each job admitted once) tells whether the table holds it;
  2. the real sacct export tests/golden/22.05/sacct_capture.json.gz (2,000 array tasks, 4 arrays
     of --gres=gpu:1 submitted in one second): each job_submit call (one per array, as Slurm calls
     it) and, as if each task had been its own sbatch, each task, through the same key logic, in
     submission order, with the table lagging the first decision of a key by 0 s (ideal), 1 s
     and refresh_s + 1 s (the default publisher and plugin), and the same workload submitted
     again within admission.horizon_s.
sacct does not keep the batch script: its fingerprint is taken as one per (user, job name), which
can only overstate coverage. The request is the one typed (swapaware's own rewrite to shards,
named in the AdminComment, is undone).
  3. a submission stream drawn from a public trace (bench/table_stream.py: alibaba-v2023's 8,152
     pods in their arrival order, each mapped to the job_desc the plugin would see; what the trace
     lacks is assumed there), read from --data (../shared/data) at run time.
For 2 and 3 (bench/table_stream.covered): the fraction of GPU submissions the table decides with
the default lag (admission.refresh_s, then table_check_ms 1 s), within admission.horizon_s, with
the class's entries dropped while an observation is learned; each miss's cause, and each key
field's share of the misses (a miss is attributed to field F when the key without F would have hit).

    .venv/bin/python bench/table_coverage.py [--sacct PATH] [--data DIR] [--refresh-s 30]
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import logging
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE_CHECK_S = 1.0  # the plugin's table_check_ms default (slurm_plugin/swapaware.lua)
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from google.protobuf import json_format  # noqa: E402

from policy_service._generated.swapaware.v1 import policy_pb2 as pb  # noqa: E402
from policy_service.admission.archive import TableArchive, archive_path  # noqa: E402
from policy_service.admission.publish import AdmissionPublisher  # noqa: E402
from policy_service.history.store import HistoryStore  # noqa: E402
from policy_service.config import load_config  # noqa: E402
from policy_service.core.admission_format import read_table  # noqa: E402
from policy_service.core.dialect import dialect_for, parse_release  # noqa: E402
from policy_service.core.policy import parse_admin_comment  # noqa: E402
from policy_service.serving.handler import PolicyHandler  # noqa: E402
from policy_service.serving.handler_error import HandlerError  # noqa: E402

from table_stream import ALIBABA_FILE, Sub, alibaba_jobs, alibaba_rows, covered, report  # noqa: E402

DRIVER = ROOT / "tests" / "adapter" / "admission_diff_driver.lua"
RELEASES = ("22.05", "24.11", "26.05")
NO_VAL = 4294967294
_GRES = re.compile(r"^(?:gres[:/])?(gpu|shard)(?::([^:=,]+))?[:=](\d+)$")


def lua_facts(jobs: list[dict]) -> list[dict]:
    """Per job_desc: the plugin's facts, key and whether it asks at all (real lua5.1 + swapaware.lua)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "jobs.jsonl"
        path.write_text("".join(json.dumps({"job": j, "uid": 1000}) + "\n" for j in jobs))
        out = subprocess.run(["lua5.1", str(DRIVER), str(ROOT / "slurm_plugin"), d, str(path), "facts"],
                             capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines()][:len(jobs)]


def shape(facts: dict) -> str:
    """The request's shape as the plugin sees it: field, GRES, typed or not, count (and tasks)."""
    parts = []
    for field in ("tresPerNode", "tresPerJob", "tresPerTask", "tresPerSocket"):
        for item in filter(None, facts.get(field, "").split(",")):
            m = _GRES.match(item)
            if m is None:
                continue  # cpu=2 and the like
            kind, typ, count = m.groups()
            parts.append(f"{field[7:].lower()}:{kind}{'(typed)' if typ else ''}x{count}")
    if not parts:
        return "no gpu"
    tasks = facts.get("numTasks", 0)
    return "+".join(parts) + (f" n{tasks}" if tasks and "task" in parts[0] else "")


def published(release: str, facts: list[pb.JobFacts]) -> list[bool]:
    """Whether the real publisher puts each job's key in the table once Admit decided it."""
    from policy_service.core import admission
    with tempfile.TemporaryDirectory() as d:
        db = Path(d) / "history.sqlite3"
        cfg = load_config(env={"SWAPAWARE_SERVICE__DB_PATH": str(db), "SWAPAWARE_SERVICE__SLURM_RELEASE": release,
                               "SWAPAWARE_ADMISSION__TABLE_PATH": str(Path(d) / "admission.json"),
                               "SWAPAWARE_AUTH__MUNGE": "off"})
        store = HistoryStore(db, accept_empty=True)
        handler = PolicyHandler(cfg, store, None, dialect=dialect_for(parse_release(release)))
        try:
            for f in facts:
                try:
                    handler.admit(pb.AdmitRequest(job=f))
                except HandlerError:
                    pass
            publisher = AdmissionPublisher(handler, cfg, TableArchive(archive_path(str(db))))
            publisher.publish("table_coverage")
            entries = read_table(publisher.table.read_bytes())["entries"]
        finally:
            handler.close()
        return [admission.table_key(f) in entries for f in facts]


def golden_shapes() -> None:
    print("1. real job_desc shapes (tests/golden/<release>/job_desc.jsonl): asked = the plugin asks "
          "(M.wants_gpu), held = the published table holds the key once decided")
    for release in RELEASES:
        jobs = [json.loads(line) for line in (ROOT / "tests" / "golden" / release / "job_desc.jsonl").open()]
        for j in jobs:  # the capture keeps no user name nor script text: a user and a script stand in
            j.setdefault("user_name", "alice")
            if j.pop("batch", False):
                j.setdefault("script", "#!/bin/bash\nsrun true\n")
        outs = lua_facts(jobs)
        facts = [json_format.ParseDict(o["facts"], pb.JobFacts()) for o in outs]
        held = published(release, [f for f, o in zip(facts, outs) if o["wants_gpu"]])
        held_iter = iter(held)
        print(f"  Slurm {release}: {len(jobs)} job_descs")
        asked = n_held = 0
        for j, o in zip(jobs, outs):
            h = next(held_iter) if o["wants_gpu"] else False
            asked += o["wants_gpu"]
            n_held += h
            print(f"    {j.get('name', ''):20} {shape(o['facts']):32} asked={'yes' if o['wants_gpu'] else 'no ':3} "
                  f"held={'yes' if h else 'no'}")
        print(f"    asked {asked}/{len(jobs)}, held once decided {n_held}/{asked}")


def sacct_jobs(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["jobs"]


def typed_request(job: dict) -> str:
    """The GRES request as typed: sacct's requested TRES, with swapaware's own rewrite of one GPU to
    shards (action=whole_gpu|share with shards>0 in the AdminComment) undone."""
    gres = [t for t in (job.get("tres") or {}).get("requested", []) if t.get("type") == "gres"]
    ac = parse_admin_comment(((job.get("comment") or {}).get("administrator")) or "")
    out = []
    for t in gres:
        kind, _, typ = (t.get("name") or "").partition(":")
        if kind == "shard" and ac.get("action") in ("whole_gpu", "share") and int(ac.get("shards", "0")) > 0:
            kind, count = "gpu", 1
        else:
            count = t.get("count") or 0
        out.append(f"gres:{kind}:{typ + ':' if typ else ''}{count}")
    return ",".join(out)


def submissions(jobs: list[dict]) -> list[tuple[float, int, dict, int, list[float]]]:
    """(submit time, job id, job_desc, tasks, the tasks' ends) per job_submit call: one per array, one
    per het component."""
    calls: dict[tuple, list] = {}
    for j in jobs:
        array = (j.get("array") or {}).get("job_id") or j["job_id"]
        het = (j.get("het") or {}).get("job_offset")
        key = (array, het)
        if key not in calls:
            limit = (j.get("time") or {}).get("limit")
            desc = {"user_name": j.get("user"), "account": j.get("account"), "partition": j.get("partition"),
                    "name": j.get("name"), "tres_per_node": typed_request(j),
                    "time_limit": limit if isinstance(limit, int) else NO_VAL, "min_nodes": NO_VAL,
                    "num_tasks": NO_VAL, "script": f"#!/bin/sh\n# {j.get('user')}/{j.get('name')}\n"}
            if het is not None:
                desc["het_job_offset"] = het
            calls[key] = [j["time"]["submission"], j["job_id"], desc, 0, []]
        calls[key][3] += 1
        if j["time"].get("end"):
            calls[key][4].append(float(j["time"]["end"]))
    return sorted((tuple(c) for c in calls.values()), key=lambda c: (c[0], c[1]))


def coverage(events: list[tuple[float, str]], lag_s: float) -> int:
    """Submissions (time, key) the table decides: its key first decided at least lag_s before."""
    first: dict[str, float] = {}
    hits = 0
    for t, key in events:
        if key in first and first[key] + lag_s <= t:
            hits += 1
        first.setdefault(key, t)
    return hits


def key_names() -> tuple[str, ...]:
    from policy_service.core.admission import KEY_FIELDS
    return tuple(name for name, _ in KEY_FIELDS)


def stream_coverage(jobs: list[tuple[float, tuple[float, ...], dict]], lag_s: float, horizon_s: float):
    """The table's coverage (table_stream.Coverage) of the GPU submissions among ``jobs`` (submission
    time, observation times, job_desc), keyed by the real plugin (lua_facts); also the number asked."""
    outs = lua_facts([j[2] for j in jobs])
    subs = [Sub(t, o["key"], tuple(ends)) for (t, ends, _), o in zip(jobs, outs) if o["wants_gpu"]]
    return covered(subs, key_names(), lag_s, horizon_s)


def sacct_coverage(path: Path, refresh_s: float) -> None:
    jobs = sacct_jobs(path)
    calls = submissions(jobs)
    outs = lua_facts([c[2] for c in calls])
    asked = [o for o in outs if o["wants_gpu"]]
    print(f"\n2. real sacct export {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: "
          f"{len(jobs)} jobs, {len(calls)} job_submit calls (arrays count once), {len(asked)} ask the service")
    shapes = collections.Counter()
    for c, o in zip(calls, outs):
        shapes[shape(o["facts"])] += c[3]
    print("   shapes (tasks):", dict(shapes))
    keys = {o["key"] for o in asked}
    print(f"   distinct keys: {len(keys)}")
    per_call = [(c[0], o["key"]) for c, o in zip(calls, outs) if o["wants_gpu"]]
    per_task = [(c[0], o["key"]) for c, o in zip(calls, outs) if o["wants_gpu"] for _ in range(c[3])]
    lags = (0.0, 1.0, refresh_s + 1.0)
    for label, events in (("as submitted (one call per array)", per_call),
                          ("each task its own sbatch", per_task)):
        figures = ", ".join(f"lag {lag:g} s: {coverage(events, lag)}/{len(events)} "
                            f"({100 * coverage(events, lag) / max(1, len(events)):.1f} %)" for lag in lags)
        print(f"   {label}: {figures}")
    again = sum(1 for _, k in per_task if k in keys)
    print(f"   the same workload again within horizon_s: {again}/{len(per_task)} tasks' keys held "
          f"({100 * again / max(1, len(per_task)):.1f} %), {len(per_call)} job_submit calls")
    lag, horizon = refresh_s + TABLE_CHECK_S, load_config(env={}).admission.horizon_s
    names = key_names()
    print(f"   with the default lag ({lag:g} s), horizon_s and observation drops:")
    report("as submitted (one call per array)",
           covered([Sub(c[0], o["key"], tuple(c[4])) for c, o in zip(calls, outs) if o["wants_gpu"]],
                   names, lag, horizon), indent="     ")
    report("each task its own sbatch",
           covered([Sub(c[0], o["key"], (end,)) for c, o in zip(calls, outs) if o["wants_gpu"] for end in c[4]],
                   names, lag, horizon), indent="     ")


def trace_coverage(data: Path, refresh_s: float, limit: int | None = None) -> None:
    lag, horizon = refresh_s + TABLE_CHECK_S, load_config(env={}).admission.horizon_s
    try:
        rows = alibaba_rows(data, limit)
    except FileNotFoundError as e:
        print(f"\n3. public trace: not found ({e}); skipped")
        return
    print(f"\n3. public trace alibaba-v2023 ({data / ALIBABA_FILE}): {len(rows)} pods, "
          f"{sum(1 for r in rows if r['num_gpu'] not in ('', '0'))} with a GPU; default lag {lag:g} s")
    for mode, label in (("none", "no --time (partition default)"), ("runtime", "--time = each run's length, rounded up "
                                                                             "to an hour")):
        jobs = [(t, (end,) if end is not None else (), d) for t, end, d in alibaba_jobs(rows, mode)]
        report(label, stream_coverage(jobs, lag, horizon))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sacct", type=Path, default=ROOT / "tests" / "golden" / "22.05" / "sacct_capture.json.gz")
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data",
                    help="the public traces (../shared/data/README.md)")
    ap.add_argument("--refresh-s", type=float, default=load_config(env={}).admission.refresh_s)
    args = ap.parse_args()
    logging.getLogger("swapaware").setLevel(logging.ERROR)  # the scratch histories' "new, empty history"
    golden_shapes()
    sacct_coverage(args.sacct.resolve(), args.refresh_s)
    trace_coverage(args.data.resolve(), args.refresh_s)


if __name__ == "__main__":
    main()
