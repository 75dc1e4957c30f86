"""Generated job_desc tables for the admission table's differential test
(tests/adapter/admission/test_admission_differential.py): seeded, covering every request shape, QoS, class
state and option the table may hold, spelled as each Slurm release hands them to job_submit.lua
(tests/golden/<release>/job_desc.jsonl).

A *spec* is one distinct job (one table key); the jobs of a run are drawn from a pool of specs,
so most keys are submitted several times, as a real sweep submits the same job again and again.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

NO_VAL = 4294967294  # what job_desc holds for a number the user did not give
NO_VAL16 = 65534
SCRIPT = "#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py --epochs 3\n"
OTHER_SCRIPT = "#!/bin/bash\npython eval.py\n"

SHAPES = ("gres_untyped", "gres_typed", "gpus", "gpus_per_node", "gpus_per_task_n1", "gpus_per_socket",
          "multi_gpu", "multi_gpu_tasks", "shards", "no_gpu")


def shape_fields(shape: str, release: str) -> dict:
    """The job_desc fields of a request shape as ``release`` stores them (22.05: "gres:gpu:1";
    24.11 and 26.05: "gres/gpu:1", --gpus-per-task as "gres/gpu=1" with its implied --gpu-bind).
    --gpus-per-node is stored in tres_per_node as --gres is: it differs only where -N is given."""
    g = "gres:" if release == "22.05" else "gres/"

    def per_task(n: int) -> dict:
        if release == "22.05":
            return {"tres_per_task": "gres:gpu:1", "num_tasks": n}
        return {"tres_per_task": "gres/gpu=1", "num_tasks": n, "tres_bind": "gres/gpu:per_task:1"}
    return {
        "gres_untyped": {"tres_per_node": f"{g}gpu:1"},
        "gres_typed": {"tres_per_node": f"{g}gpu:a100:1"},
        "gpus": {"tres_per_job": f"{g}gpu:1"},
        "gpus_per_node": {"tres_per_node": f"{g}gpu:1", "min_nodes": 1},
        "gpus_per_task_n1": per_task(1),
        "gpus_per_socket": {"tres_per_socket": f"{g}gpu:1"},
        "multi_gpu": {"tres_per_node": f"{g}gpu:2"},
        "multi_gpu_tasks": per_task(2),
        "shards": {"tres_per_node": f"{g}shard:2"},
        "no_gpu": {},
    }[shape]


# the common shapes the table is meant for (issue 21 item 1)
COMMON_SHAPES = ("gres_untyped", "gres_typed", "gpus", "gpus_per_node", "gpus_per_task_n1")

# class state -> the users whose history holds that state (test_admission_differential trains them)
CLASS_STATES = ("unknown", "few", "enough", "oom", "util")
USERS_PER_STATE = 3
PROTECTED_QOS = "protected"  # in policy.whole_gpu_qos
# QoS -> priority (what sacctmgr shows); "" (none given) and "debug" are not in the table
QOS_PRIORITIES = {"low": 10, "normal": 50, PROTECTED_QOS: 80, "high": 100}
QOSES = ("", "normal", "high", "low", PROTECTED_QOS, "debug")

VARIANTS = ("plain", "comment_hint", "env_hint", "per_gpu", "exclusive", "het", "interactive",
            "other_script", "long_comment")
VARIANT_WEIGHTS = (10, 1, 1, 1, 1, 1, 1, 1, 1)


# the users of these class states have accounts and partitions of their own, so no wider key (the
# account's, the partition's) lends them an estimate: "unknown" has no history at any level, "few"
# only its own runs
OWN_ACCOUNT = {"unknown": ("newproj", "fresh"), "few": ("fewproj", "small")}


def class_user(state: str, n: int) -> str:
    return f"{state}{n}"


@dataclass(frozen=True)
class Spec:
    """One distinct job: its facts are all in ``job``; ``held``: its key is recorded in the
    history before the table is published (the table then holds it)."""

    shape: str
    class_state: str
    qos: str
    variant: str
    held: bool
    job: dict = field(hash=False, compare=False)


def job_desc(shape: str, user: str, qos: str, variant: str, name: str = "train", release: str = "22.05") -> dict:
    """A job_desc as job_submit.lua sees it (fields a user did not give: absent or NO_VAL)."""
    account, partition = OWN_ACCOUNT.get(user.rstrip("0123456789"), ("proj", "gpu"))
    job = {"user_name": user, "account": account, "partition": partition, "name": name, "time_limit": 60,
           "min_nodes": NO_VAL, "num_tasks": NO_VAL, "script": SCRIPT, "work_dir": f"/home/{user}",
           "comment": "", "shared": NO_VAL16, "ntasks_per_tres": NO_VAL16}
    job.update(shape_fields(shape, release))
    g = "gres:" if release == "22.05" else "gres/"
    if qos:
        job["qos"] = qos
    if variant == "comment_hint":
        job["comment"] = "swapaware:mem=3G"
    elif variant == "env_hint":
        job["environment"] = {"SWAPAWARE_GPU_MEM": "6G", "HOME": f"/home/{user}"}
    elif variant == "per_gpu":
        job.update(cpus_per_tres=f"{g}gpu:4", mem_per_tres=f"{g}gpu:16000",
                   tres_bind="gpu:closest" if release == "22.05" else "gres/gpu:closest", tres_freq="gpu:high",
                   ntasks_per_tres=1)
    elif variant == "exclusive":
        job["shared"] = 0
    elif variant == "het":
        job["het_job_offset"] = 0
    elif variant == "interactive":
        del job["script"]
    elif variant == "other_script":
        job["script"] = OTHER_SCRIPT
    elif variant == "long_comment":  # a plain comment, not a hint
        job["comment"] = "sweep lr=3e-4 " + "x" * 200
    return job


def spec_pool(seed: int, size: int, release: str = "22.05", held_frac: float = 0.8) -> list[Spec]:
    """``size`` distinct specs (duplicates drawn again), every shape, QoS, class state and
    variant among them (each combination of shape x class state x QoS first, then at random)."""
    rng = random.Random(seed)
    seen: set[tuple] = set()
    out: list[Spec] = []

    def add(shape: str, state: str, qos: str, variant: str, user_n: int, name: str) -> None:
        ident = (shape, state, qos, variant, user_n, name)
        if ident in seen:
            return
        seen.add(ident)
        user = class_user(state, user_n)
        out.append(Spec(shape, state, qos, variant, rng.random() < held_frac,
                        job_desc(shape, user, qos, variant, name, release)))

    for shape in SHAPES:
        for state in CLASS_STATES:
            for qos in QOSES:
                add(shape, state, qos, "plain", 0, "train")
    for variant in VARIANTS:
        for shape in SHAPES:
            add(shape, rng.choice(CLASS_STATES), rng.choice(QOSES), variant, 0, "train")
    while len(out) < size:
        add(rng.choice(SHAPES), rng.choice(CLASS_STATES), rng.choice(QOSES),
            rng.choices(VARIANTS, VARIANT_WEIGHTS)[0], rng.randrange(USERS_PER_STATE),
            rng.choice(("train", "train", "train", "eval")))
    return out


def draw_jobs(pool: list[Spec], n: int, seed: int) -> list[int]:
    """``n`` submissions as indices into ``pool``: every spec at least once, the rest at random
    (skewed: a few specs are submitted often, as a sweep's are)."""
    rng = random.Random(seed)
    picks = list(range(len(pool)))
    weights = [1.0 / (1 + i % 37) for i in range(len(pool))]
    picks += rng.choices(range(len(pool)), weights, k=max(0, n - len(pool)))
    rng.shuffle(picks)
    return picks
