"""What a report is made of: the records read from the history and accounting, a job's
judgement and the per-group summary (frozen dataclasses), and the report's errors."""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Mapping

from policy_service.core.types import Action, GresKind

GIB = 1024**3
HOUR_S = 3600.0
SHARED_ACTIONS = frozenset({Action.SHARE.value, Action.SHARE_OVERSUBSCRIBED.value})
GROUP_KEYS = ("user", "account", "partition")
# An observation that finished this long before accounting says the job started belongs to an
# earlier job with the same id (ids restart when a cluster's state is reset).
STALE_OBSERVATION_S = 600.0
# Unfinished jobs whose AdminComment is read live from slurmctld (one scontrol call each).
LIVE_LOOKUP_MAX = 200


class ReportError(RuntimeError):
    pass


class HistoryUnavailable(ReportError):
    pass


# ============================================================================ values
@dataclass(frozen=True)
class TresCounts:
    """GPU resources of a TRES string: whole GPUs and shards (totals over all nodes)."""

    gpus: int = 0
    shards: int = 0

    @property
    def any_gpu(self) -> bool:
        return self.gpus > 0 or self.shards > 0


class RecordStatus(enum.Enum):
    AS_DECIDED = "as_decided"  # the allocation matches the swapaware decision
    OVERRIDDEN = "overridden"  # see OverrideReason
    NO_RECORD = "no_record"  # a GPU job with no swapaware decision (failed open, plugin off, bypassed)
    NOT_JUDGED = "not_judged"  # never started (nothing allocated) or nothing to compare with


class OverrideReason(enum.Enum):
    RAN_WHOLE_GPU_NOT_SHARDS = "ran_whole_gpu_not_shards"
    RAN_OTHER_SHARD_COUNT = "ran_other_shard_count"
    RAN_SHARDS_NOT_WHOLE_GPU = "ran_shards_not_whole_gpu"
    RAN_WITHOUT_GPU = "ran_without_gpu"
    COMMENT_EDITED = "comment_edited"  # AdminComment's action/shards differ from the history's decision
    COMMENT_REPLACED = "comment_replaced"  # AdminComment names another decision than the job's recorded run
    COMMENT_REMOVED = "comment_removed"  # the history linked the job to a decision, AdminComment no longer does


@dataclass(frozen=True)
class HistoryDecision:
    """What the report needs of one ``decisions`` row."""

    decision_id: str
    action: str  # Action value: "share", "whole_gpu", ...
    shards: int
    peak_bytes: int  # predicted peak; 0 = no prediction (no history at decision time)
    margin_bytes: int
    asked_kind: GresKind | None  # what the job asked for at submit (from the recorded facts)
    asked_gpus: int  # whole GPUs the request adds up to (per node x nodes, per task x tasks); 0 if none
    whole_because: str = ""  # for a whole-GPU decision: the reason code that kept it whole
    mode: str = ""  # policy.mode it was made under: "shadow", else enforce ("" in older records)


@dataclass(frozen=True)
class HistoryObservation:
    job_id: int
    decision_id: str
    finished_at: float
    peak_bytes: int | None
    oom: bool
    telemetry_source: str
    submit_time: int = 0  # of the job instance it belongs to; 0: not known (legacy or unresolved)


@dataclass(frozen=True)
class HistorySnapshot:
    decisions: Mapping[str, HistoryDecision] = dataclasses.field(default_factory=dict)
    observations: Mapping[int, tuple[HistoryObservation, ...]] = dataclasses.field(default_factory=dict)
    run_decisions: Mapping[int, str] = dataclasses.field(default_factory=dict)  # job id -> decision id (runs)
    # job id -> {submit time -> decision id}: the runs whose job instance is known (ids repeat after a
    # Slurm state reset; a requeue gives a new submit time). Where an id has any, they alone count.
    run_instances: Mapping[int, Mapping[int, str]] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class JobReport:
    """One accounting job joined with its decision and observation."""

    job_id: int
    user: str
    account: str
    partition: str
    job_name: str
    state: str
    started: bool
    elapsed_s: float
    wait_s: float | None
    gpus: int
    shards: int
    shared: bool
    whole_gpu: bool
    decision_id: str
    action: str
    decided_shards: int | None
    whole_because: str  # the reason code of a whole-GPU decision ("" otherwise or unknown)
    in_history: bool
    status: RecordStatus
    override_reason: OverrideReason | None
    gpu_hours_used: float
    gpu_hours_saved: float
    predicted_peak_bytes: int | None
    margin_bytes: int | None
    observed_peak_bytes: int | None
    oom: bool | None  # None: no observation
    abs_pct_error: float | None
    under_predicted: bool | None
    # Shadow decisions (policy.mode = shadow: the job ran as submitted). What they would have done:
    shadow: bool = False
    shadow_would_share: bool = False  # a single whole-GPU request the decision would have put on shards
    shadow_gpu_hours_freed: float = 0.0  # elapsed x (1 - k / shards_per_gpu) of those
    shadow_would_oom: bool | None = None  # its observed peak above its k shards; None: not observed


@dataclass(frozen=True)
class GroupSummary:
    key: str
    jobs: int
    not_started: int
    shared_jobs: int
    whole_gpu_jobs: int
    as_decided: int
    overridden: int
    no_record: int
    not_in_history: int
    gpu_hours_used: float
    gpu_hours_shared: float
    gpu_hours_saved: float
    wait_median_s: float | None
    wait_mean_s: float | None
    wait_max_s: float | None
    observed_jobs: int
    observed_peak_max_bytes: int | None
    predicted_jobs: int
    abs_pct_error_median: float | None
    under_predicted: int
    ooms: int
    # Whole-GPU decisions by the reason that kept them whole, e.g. "no_history=3;queue_short=12"
    whole_because: str = ""
    shadow_jobs: int = 0
    shadow_would_share: int = 0
    shadow_gpu_hours_freed: float = 0.0
    shadow_would_oom: int = 0


# ============================================================================ interference
@dataclass(frozen=True)
class InterferenceRun:
    """One finished run that shared its GPU: its slowdown as observed and as predicted
    (report/interference.py)."""

    decision_id: str
    gpu_type: str  # "" where gres.conf names none for the GPU it ran on
    user: str
    job_class: str
    u_self: float  # its class's solo utilisation (as learned now)
    u_others: float  # its co-runners' classes' solo utilisations, summed
    observed: float  # its runtime / its class's solo runtime (EWMA), not clamped
    predicted_learned: float  # by the model decisions use for its GPU type (the prior until one is learned)
    predicted_prior: float  # by the configured prior (swap_cost.compute_interference_*)
    model_type: str  # the GPU type of the model that predicted it: its own, or "*" (every type's runs)


@dataclass(frozen=True)
class InterferenceSummary:
    """One GPU type's shared runs (``gpu_type`` "(all)": every run) and the model that judges it."""

    gpu_type: str
    runs: int
    users: int
    mae_learned: float | None  # mean |predicted_learned - observed|; None: no run
    mae_prior: float | None  # mean |predicted_prior - observed|
    model_type: str  # "*": the model of every type's runs together
    model_source: str  # "learned" or "prior"
    model_runs: int  # shared runs the model was fitted to
    model_users: int
    model_base: float  # a of s(u, v) = 1 + a v + b max(0, u + v - 1)
    model_slope: float  # b
    model_reason: str


@dataclass(frozen=True)
class InterferenceSection:
    """Predicted against observed slowdowns of the history's newest shared runs."""

    runs: tuple[InterferenceRun, ...] = ()
    summary: tuple[InterferenceSummary, ...] = ()
    refused: tuple[tuple[str, int], ...] = ()  # (why a shared run taught nothing, how many)
    prior: str = ""  # the prior: its name and parameters
    learn: bool = True  # interference.learn: false, the prior alone decides
    error: str = ""  # non-empty: not read, and why


@dataclass(frozen=True)
class Report:
    by: str
    start: str
    end: str
    generated_at: float
    shards_per_gpu: int
    groups: tuple[GroupSummary, ...]
    total: GroupSummary
    jobs: tuple[JobReport, ...]
    non_gpu_jobs: int
    history_path: str = ""
    history_error: str = ""  # non-empty: accounting only, history could not be read
    slurm_backend: str = ""
    interference: InterferenceSection | None = None  # None: not asked for


# ============================================================================ pure parsing
