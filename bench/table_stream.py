"""Submission streams for bench/table_coverage.py, and the table's coverage of a stream with each
miss attributed to the key fields that kept it out (issue 33, item 5).

A stream is a list of ``Sub`` (submission time, the plugin's key of the job, its history class,
when its observation reached the service). ``covered`` replays it against the table's rules:

* a submission is decided by the table when a job with the same key was decided in
  [t - admission.horizon_s, t - lag] (lag: the publisher's admission.refresh_s, then the plugin's
  table_check_ms), and no job of its class (user, job name, script fingerprint, GRES: the history
  keys core/request.py names its class by) had its observation learned in (t - lag, t] (the
  entry is dropped before the observation is recorded and comes back with the next build, at most
  refresh_s later; the keys a decision with no usable history also reads, the account's and
  partition's, are not modelled: a bound from above);
* every miss gets a cause: ``dropped`` (the key was held, an observation of its class dropped it),
  ``lag`` (its key was decided within the lag only), ``horizon`` (only longer than horizon_s ago),
  ``new`` (its key was never decided before);
* attribution: a miss is attributed to key field F when the same replay with F left out of every
  key (the key with F's value replaced by a wildcard) would have decided it by the key rule above
  (the drop rule left aside); a miss may be attributed to several fields, or to none (a class
  first seen, or one differing in two fields or more). Shares are of all misses.

The alibaba-v2023 stream (``alibaba_jobs``): alibaba/clusterdata cluster-trace-gpu-v2023
(``openb_pod_list_default.csv``, 8,152 pods over 149 days, their real arrival order and times,
GPU counts and fractions, QoS and run ends). Chosen because it is the only trace in ../shared/data
with records: alibaba-v2020 there holds the PAI tables' headers alone (no job or task rows), gavel
holds the throughputs of 83 job types and no submissions. What the trace lacks, assumed:

* names, users, accounts: the pod names are unique ids (openb-pod-NNNN), so each distinct request
  (cpu_milli, memory_mib, num_gpu, gpu_milli, qos) stands for one user's one job, resubmitted:
  user u<i>, account a<i>, job name job<i>, one batch script per job (an upper bound on repetition:
  two users with one shape merge, one user's sweep of names would split);
* partition "gpu"; QoS the trace's own, lower case (ls, be, burstable, guaranteed);
* GRES: num_gpu GPUs as ``--gres=gpu:N``, a fraction (gpu_milli < 1000) also as gpu:1, as a
  swapaware site's users type it (the service sizes the share); gpu_spec is empty throughout;
* time limit: none given (``--time`` absent, the partition's default), or with ``limit=runtime``
  each run's own length rounded up to a whole hour (a user who sets -t per run: a bound from below);
* no comment, no environment hint, no arrays (each pod its own submission), batch;
* the observation reaches the service at deletion_time for a pod that was scheduled and ended
  (not for one Pending or still Running at the trace's end).
"""
from __future__ import annotations

import bisect
import collections
import csv
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

NO_VAL = 4294967294
SEP = "\x1f"
ALIBABA_FILE = "alibaba-v2023/openb_pod_list_default.csv"
ALIBABA_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "qos", "pod_phase",
                   "creation_time", "deletion_time", "scheduled_time")
# the history class of a key (core/request.py: user, job name, script fingerprint, GRES)
CLASS_FIELDS = ("user", "job_name", "script_fingerprint", "tres_per_node", "tres_per_job", "tres_per_task",
                "tres_per_socket")


@dataclass(frozen=True)
class Sub:
    t: float
    key: str
    ends: tuple[float, ...] = ()  # when its observations were learned (an array's tasks: one each)


@dataclass
class Coverage:
    n: int = 0
    hits: int = 0
    causes: collections.Counter = field(default_factory=collections.Counter)
    fields: collections.Counter = field(default_factory=collections.Counter)  # misses attributed per field

    @property
    def misses(self) -> int:
        return self.n - self.hits


def _class_of(key: str, names: tuple[str, ...]) -> str:
    parts = key.split(SEP)
    return SEP.join(parts[names.index(f)] for f in CLASS_FIELDS) if len(parts) == len(names) else key


def _held(times: list[float], t: float, lag_s: float, horizon_s: float) -> bool:
    """Whether a decision at one of ``times`` (sorted, all before this submission) is in the table."""
    i = bisect.bisect_right(times, t - lag_s)
    return i > 0 and times[i - 1] >= t - horizon_s


def covered(subs: list[Sub], names: tuple[str, ...], lag_s: float, horizon_s: float) -> Coverage:
    """The table's coverage of ``subs`` (module doc); ``names``: the key's fields, in key order."""
    subs = sorted(subs, key=lambda s: s.t)
    out = Coverage()
    decided: dict[str, list[float]] = collections.defaultdict(list)
    masked: list[dict[str, list[float]]] = [collections.defaultdict(list) for _ in names]
    ends: dict[str, list[float]] = collections.defaultdict(list)
    for s in subs:
        ends[_class_of(s.key, names)].extend(s.ends)
    for v in ends.values():
        v.sort()
    for s in subs:
        out.n += 1
        times = decided[s.key]
        parts = s.key.split(SEP)
        mkeys = [SEP.join(parts[:i] + ["*"] + parts[i + 1:]) for i in range(len(parts))] if len(parts) == len(names) \
            else []
        if _held(times, s.t, lag_s, horizon_s):
            e = ends.get(_class_of(s.key, names), [])
            j = bisect.bisect_right(e, s.t)
            if j > 0 and e[j - 1] > s.t - lag_s:
                out.causes["dropped"] += 1
            else:
                out.hits += 1
        else:
            out.causes["new" if not times else "lag" if times[-1] > s.t - lag_s else "horizon"] += 1
            hit_by = [names[i] for i, mk in enumerate(mkeys) if _held(masked[i][mk], s.t, lag_s, horizon_s)]
            out.fields.update(hit_by)
            if not hit_by:
                out.causes["no single field"] += 1
        times.append(s.t)
        for i, mk in enumerate(mkeys):
            masked[i][mk].append(s.t)
    return out


def report(label: str, cov: Coverage, indent: str = "   ") -> None:
    pct = 100 * cov.hits / max(1, cov.n)
    print(f"{indent}{label}: decided by the table {cov.hits}/{cov.n} ({pct:.1f} %), misses {cov.misses}")
    if cov.misses:
        causes = ", ".join(f"{k} {v} ({100 * v / cov.misses:.1f} %)" for k, v in
                           sorted(cov.causes.items(), key=lambda kv: (-kv[1], kv[0])) if k != "no single field")
        print(f"{indent}  misses by cause: {causes}")
        shares = ", ".join(f"{k} {v} ({100 * v / cov.misses:.1f} %)" for k, v in cov.fields.most_common())
        none = cov.causes.get("no single field", 0)
        print(f"{indent}  misses a key without one field would have decided: {shares or '(none)'}; "
              f"no single field: {none} ({100 * none / cov.misses:.1f} %)")


# ---------------------------------------------------------------------- alibaba-v2023
def alibaba_rows(data_dir: Path, limit: int | None = None) -> list[dict]:
    """The trace's pods (schema checked), in file order; ``limit``: the first N only."""
    path = data_dir / ALIBABA_FILE
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != ALIBABA_COLUMNS:
            raise ValueError(f"{path}: columns {reader.fieldnames}, expected {ALIBABA_COLUMNS}")
        rows = []
        for row in reader:
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    return rows


def alibaba_jobs(rows: list[dict], limit_mode: str = "none") -> list[tuple[float, float | None, dict]]:
    """(submission time, observation time or None, job_desc) per pod, as the module doc maps them."""
    shapes: dict[tuple, int] = {}
    trace_end = max((float(r["deletion_time"] or 0) for r in rows), default=0.0)
    out = []
    for r in rows:
        shape = (r["cpu_milli"], r["memory_mib"], r["num_gpu"], r["gpu_milli"], r["qos"])
        i = shapes.setdefault(shape, len(shapes))
        user, name = f"u{i}", f"job{i}"
        n_gpu = int(r["num_gpu"] or 0)
        start, end = r["scheduled_time"], r["deletion_time"]
        ended = r["pod_phase"] != "Pending" and start != "" and end != "" and float(end) < trace_end
        limit = NO_VAL
        if limit_mode == "runtime" and start and end:
            limit = 60 * max(1, math.ceil((float(end) - float(start)) / 3600))
        desc = {"user_name": user, "account": f"a{i}", "partition": "gpu", "name": name, "time_limit": limit,
                "min_nodes": NO_VAL, "num_tasks": NO_VAL, "qos": r["qos"].lower(),
                "script": f"#!/bin/sh\n# {hashlib.sha1(repr(shape).encode()).hexdigest()[:12]}\npython run.py\n"}
        if n_gpu:
            desc["tres_per_node"] = f"gres:gpu:{n_gpu}"
        out.append((float(r["creation_time"]), float(end) if ended else None, desc))
    return out
