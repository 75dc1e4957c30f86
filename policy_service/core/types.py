"""Typed, immutable values of the policy core. No I/O here."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from policy_service.config import AccessClass, PolicyMode
from policy_service.config.choices import Choice


class GresKind(Choice):
    NONE = "none"
    GPU = "gpu"
    SHARD = "shard"
    OTHER = "other"  # e.g. mps, or a GRES this policy does not rewrite


class Action(Choice):
    PASS_THROUGH = "pass_through"
    WHOLE_GPU = "whole_gpu"
    SHARE = "share"
    SHARE_OVERSUBSCRIBED = "share_oversubscribed"


class EstimateSource(Choice):
    UNKNOWN = "unknown"
    CLASS = "class"
    USER_NAME = "user_name"
    ACCOUNT = "account"
    PARTITION = "partition"
    HINT = "hint"


class KeyLevel(Choice):
    """History keys, narrowest first. The estimator falls back along this order."""

    CLASS = "class"  # user + job name + script fingerprint + requested resources
    USER_NAME = "user_name"
    ACCOUNT = "account"
    PARTITION = "partition"

    @property
    def source(self) -> EstimateSource:
        return EstimateSource(self.value)


class ReasonCode(Choice):
    NO_GPU = "no_gpu"
    UNSUPPORTED_REQUEST = "unsupported_request"
    MULTI_GPU = "multi_gpu"
    MULTI_NODE = "multi_node"
    SHARING_DISABLED = "sharing_disabled"
    NO_HISTORY = "no_history"
    ESTIMATE_FROM_HISTORY = "estimate_from_history"
    ESTIMATE_FROM_WIDER_KEY = "estimate_from_wider_key"
    HINT_USED = "hint_used"
    HINT_CAPPED_AT_DEVICE = "hint_capped_at_device"
    HINT_BELOW_HISTORY = "hint_below_history"
    HINT_INVALID = "hint_invalid"
    FITS_IN_SHARDS = "fits_in_shards"
    RAISED_TO_OBSERVED_MAX = "raised_to_observed_max"
    TOO_LARGE_TO_SHARE = "too_large_to_share"
    OOM_PENALTY = "oom_penalty"
    OVERSUBSCRIBED = "oversubscribed"
    OVERSUBSCRIPTION_TOO_COSTLY = "oversubscription_too_costly"
    PRIORITY_CONTENTION = "priority_contention"
    PRIORITY_DEFAULT = "priority_default"
    ALREADY_SHARDS = "already_shards"
    WHOLE_GPU_AS_SHARDS = "whole_gpu_as_shards"
    QUEUE_SHORT = "queue_short"
    QUEUE_UNKNOWN = "queue_unknown"
    PROTECTED_QOS = "protected_qos"
    COMPUTE_SHARDS = "compute_shards"
    COMPUTE_BOUND = "compute_bound"
    COMPUTE_OVERCOMMITTED = "compute_overcommitted"
    INTERFERENCE_SHARDS = "interference_shards"  # charged more shards: co-runners would slow it past the budget
    INTERFERENCE_BUDGET = "interference_budget"  # whole GPU: any co-runner would slow it past the budget (model)
    LONG_QUEUE_OVER_BUDGET = "long_queue_over_budget"  # long queue, floor kept: co-runners would slow it past the budget
    INTERFERENCE_OBSERVED = "interference_observed"  # whole GPU: its class's shared runs were slowed past the budget
    REDECIDED = "redecided"
    OOM_REQUEUED = "oom_requeued"  # the shared run ran out of GPU memory: requeued on a whole GPU
    OOM_NOT_REQUEUED = "oom_not_requeued"  # ... and stays failed (--no-requeue, not batch, turned off)
    TYPED_GPU = "typed_gpu"  # gpu:<type> kept as typed (decisions before typed requests shared)
    INTERACTIVE = "interactive"  # no batch script (srun/salloc): its steps ask for GPUs by name
    HET_JOB = "het_job"  # a component of a heterogeneous job: the request stays
    PER_GPU_OPTION = "per_gpu_option"  # --cpus-per-gpu, --mem-per-gpu, ...: no faithful shard translation
    PER_GPU_DEFAULT = "per_gpu_default"  # the partition's DefCpuPerGPU / DefMemPerGPU: a shard job gets none
    NO_SHARD_GPUS = "no_shard_gpus"  # no GPU the job can land on has shards (gres.conf)
    SHARDS_REFUSED = "shards_refused"  # the controller in control takes no shard job where it can land (LiveShards)
    SHARDS_UNBILLED = "shards_unbilled"  # its partition's TRESBillingWeights would not bill its fraction of a GPU
    WHOLE_GPU_SIZES_DIFFER = "whole_gpu_sizes_differ"  # 22.05: GPUs of different shard counts, whole kept as gpu
    EXCLUSIVE = "exclusive"  # --exclusive: Slurm never starts an exclusive job holding shards
    DRY_RUN_NOT_SLURMCTLD = "dry_run_not_slurmctld"  # an Admit not from slurmctld: answered, not recorded
    SHADOW_MODE = "shadow_mode"  # policy.mode = shadow: decided and recorded, the job left as submitted
    MODE_OFF = "mode_off"  # policy.mode = off: not decided, the job left as submitted
    OVERSUBSCRIPTION_NOT_ENFORCED = "oversubscription_not_enforced"  # nodes do not enforce victim semantics
    TABLE_DECIDED = "table_decided"  # made by the job_submit plugin from the published table, learned from Slurm
    TABLE_GONE = "table_gone"  # ... from a table version no longer archived: recorded from its AdminComment alone


def copied(value, **changes):
    """``dataclasses.replace(value, **changes)`` for a frozen dataclass without __post_init__ nor
    init=False fields (Decision, Rewrite, JobRequest, QueueState): its fields copied as they are,
    in a tenth of the time."""
    out = object.__new__(type(value))
    out.__dict__.update(value.__dict__)
    out.__dict__.update(changes)
    return out


@dataclass(frozen=True)
class Reason:
    code: ReasonCode
    message: str


@dataclass(frozen=True)
class GpuRequest:
    """A job's GPU request, normalised from Slurm's tres_per_* strings."""

    kind: GresKind
    per_node: int = 0  # GPUs (or shards) per node; 0 when none
    gpu_type: str = ""  # e.g. "h100" in gres:gpu:h100:1
    source_field: str = ""  # which job_desc field carried it
    raw: str = ""


@dataclass(frozen=True)
class JobRequest:
    """What the policy knows about a job at submit time."""

    user: str
    account: str
    partition: str
    job_name: str
    script_fingerprint: str
    gpu: GpuRequest
    min_nodes: int = 1
    num_tasks: int = 1
    time_limit_s: int = 0
    hint_bytes: int | None = None
    hint_text: str = ""  # raw hint when it could not be parsed
    qos: str = ""  # the QoS the job asked for ("" when it takes its association's default)
    is_batch: bool = True  # false for the allocations srun and salloc create (no batch script)
    het_job: bool = False  # a component of a heterogeneous job
    # Options the user expressed per GPU, as "--cpus-per-gpu=gres/gpu:2" ... (PER_GPU_OPTIONS order)
    per_gpu_options: tuple[str, ...] = ()
    exclusive: str = ""  # "node", "user", "mcs" (--exclusive[=...]); "" when the job may share nodes
    implicit_gpu_bind: str = ""  # the binding Slurm gave --gpus-per-task itself ("gres/gpu:per_task:1")
    partition_gpu_defaults: tuple[str, ...] = ()  # "DefCpuPerGPU=2", ... of the job's partition(s)
    # Shard counts (distinct, sorted) of the GPUs with shards the job can land on: its partitions'
    # nodes, its GPU type (slurm/fleet.py). None: not known, every GPU has gpu.shards_per_gpu.
    gpu_shard_counts: tuple[int, ...] | None = None
    # Why GPUs of its partitions were left out of gpu_shard_counts: the controller in control
    # refuses shards there now (LiveShards.refuses), one "node: why" per node. Empty: none left out.
    shards_refused: tuple[str, ...] = ()
    # Why a job holding shards of the GPUs it can land on would not bill its fraction of a GPU under
    # its partitions' TRESBillingWeights, and why all the shards of one GPU would not bill what the
    # GPU bills (slurm/billing_weights.py, naming the partition, the weight and the fix). "": they
    # would, or the partitions are not known.
    shards_unbilled: str = ""
    whole_shards_unbilled: str = ""


@dataclass(frozen=True)
class LiveShards:
    """The shards the controller in control reports per node (``sinfo`` %G), read with each queue
    poll: node -> lower-case GPU type ("" where it shows them untyped) -> shards. A node is
    listed only while it takes jobs. ``unread``: why these counts may not be the controller's now
    (it changed since the poll); every GPU then counts as refusing shards until the next poll.

    Measured on Slurm 22.05 (docs/slurm-releases.md): a backup that took over with ``scontrol
    takeover`` reports ``shard:<type>:0`` on every node and refuses every shard job until the
    primary is back; a controller that just started reports slurm.conf's untyped count for the
    seconds before the nodes register, and refuses most shard jobs then. Measured on 24.11 and
    26.05: after a restart or ``scontrol reconfigure`` (which restarts slurmctld there) a node shows
    State=UNKNOWN and its typed shards, and typed shard jobs are refused until it registers:
    ``unregistered`` names those nodes, which refuse every shard job."""

    by_node: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    unread: str = ""
    unregistered: frozenset[str] = frozenset()
    # the nodes refuses() may name, derived from by_node, so that a decision checks those alone: a
    # type's count is 0 (zero), or the shards are untyped (untyped: a refusal only where the fleet types them)
    zero: frozenset[str] = field(init=False, compare=False, repr=False)
    untyped: frozenset[str] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "zero", frozenset(n for n, c in self.by_node.items() if 0 in c.values())
                           | frozenset(self.unregistered))
        object.__setattr__(self, "untyped", frozenset(n for n, c in self.by_node.items() if c and not any(c.keys())))

    def refuses(self, node: str, gpu_type: str | None) -> str:
        """Why the controller would refuse a shard job on ``node``'s GPUs of ``gpu_type`` (None: the
        fleet does not type them); "" when it would not, or does not say (node not listed)."""
        if self.unread:
            return self.unread
        if node in self.unregistered:
            return ("the node has not registered with the controller in control yet (State=UNKNOWN, as after a "
                    "slurmctld restart or reconfigure)")
        counts = self.by_node.get(node)
        if counts is None:
            return ""
        if gpu_type:
            t = gpu_type.lower()
            if t in counts:
                return "" if counts[t] > 0 else f"the controller in control reports 0 {t} shards"
            if counts and not any(counts.keys()):
                return ("the controller in control shows the node's shards untyped (slurm.conf's count: "
                        "the node has not registered with it yet)")
            return ""
        return "" if sum(counts.values()) > 0 or not counts else "the controller in control reports 0 shards"


@dataclass(frozen=True)
class QueueState:
    """How much GPU work waits: a snapshot of the pending GPU jobs (the service polls Slurm)."""

    pending_gpus: float  # GPUs the pending GPU jobs ask for (a shard counts 1/shards_per_gpu)
    total_gpus: int  # GPUs in the cluster's nodes
    age_s: float = 0.0  # how old the snapshot is
    # Per QoS name: GPUs asked for by the pending jobs whose QoS priority is at least that QoS's
    # (the queue ahead of a new job of that QoS). A QoS not listed sees the whole queue.
    ahead_by_qos: tuple[tuple[str, float], ...] = ()
    live_shards: LiveShards | None = None  # the nodes' shards as the same poll read them (None: not read)

    def pending_for(self, qos: str) -> float:
        """GPUs pending ahead of a new job of ``qos`` (the whole queue when unknown)."""
        for name, gpus in self.ahead_by_qos:
            if name == qos:
                return gpus
        return self.pending_gpus

    def pressure_for(self, qos: str) -> float:
        return _pressure(self.pending_for(qos), self.total_gpus)

    @property
    def pressure(self) -> float:
        """Pending GPU demand as a fraction of the cluster's GPUs (infinite when GPU work waits
        and no node takes jobs: every GPU node down or drained)."""
        return _pressure(self.pending_gpus, self.total_gpus)


def _pressure(pending_gpus: float, total_gpus: int) -> float:
    if total_gpus > 0:
        return pending_gpus / total_gpus
    return float("inf") if pending_gpus > 0 else 0.0


@dataclass(frozen=True)
class UserFigure:
    """One user's part of a wide key (account, partition): their measured runs under it and the
    largest peak of those (``core/wide_key.py`` bounds what it may do to others' estimates)."""

    user: str
    samples: int = 0
    max_peak_bytes: int = 0


@dataclass(frozen=True)
class ClassStats:
    """What history says about one key. Updated by ``estimator.observe`` (a pure fold)."""

    samples: int = 0  # observations with a memory figure
    runs: int = 0  # all finished runs
    ewma_peak_bytes: float = 0.0
    ewma_absdev_bytes: float = 0.0
    max_peak_bytes: int = 0
    last_peak_bytes: int = 0
    oom_count: int = 0
    margin_multiplier: float = 1.0
    whole_gpu_runs_left: int = 0
    solo_runs: int = 0
    shared_runs: int = 0
    ewma_solo_runtime_s: float = 0.0
    ewma_shared_runtime_s: float = 0.0
    ewma_corunners: float = 0.0
    util_runs: int = 0  # runs alone on their GPU(s) with a utilisation figure
    ewma_solo_util: float = 0.0  # mean GPU utilisation (0..1) of those runs
    # The last few runs (newest last, at most EstimatorConfig.recent_runs): peak / the point
    # estimate made before the run (an OOM run: its charge / the estimate, a lower bound), and
    # the peaks. The margin is an empirical quantile of the ratios (estimator._quantile_margin).
    recent_ratios: tuple[float, ...] = ()
    recent_peaks: tuple[int, ...] = ()
    # Wide keys only: per user, the most recently seen last (bounds.MAX_WIDE_USERS at most).
    users: tuple[UserFigure, ...] = ()

    def __post_init__(self) -> None:
        # Stats read back from JSON carry lists: keep the frozen value hashable and comparable.
        object.__setattr__(self, "recent_ratios", tuple(float(x) for x in self.recent_ratios))
        object.__setattr__(self, "recent_peaks", tuple(int(x) for x in self.recent_peaks))
        object.__setattr__(self, "users", tuple(u if isinstance(u, UserFigure) else UserFigure(**u)
                                                for u in self.users))


@dataclass(frozen=True)
class JobObservation:
    """What one finished run taught us (from the epilog, joined with the service's records)."""

    runtime_s: float
    exit_code: int
    peak_bytes: int | None
    oom: bool
    shared: bool  # ran on shards (not a whole GPU)
    co_runners: int  # other jobs on the same GPU during the run
    # Mean utilisation (0..1) of the job's GPU(s) while it ran (device-wide NVML figure: the
    # job's own only when it ran alone). None when not measured.
    util_frac: float | None = None


@dataclass(frozen=True)
class DemandEstimate:
    peak_bytes: int  # 0 when unknown
    margin_bytes: int
    source: EstimateSource
    samples: int
    observed_max_bytes: int
    reasons: tuple[Reason, ...] = ()
    class_samples: int = 0  # observed runs of the job's exact class (known or not)

    @property
    def known(self) -> bool:
        return self.source is not EstimateSource.UNKNOWN

    @property
    def sized_bytes(self) -> int:
        """Bytes the decision must make room for: peak plus margin."""
        return self.peak_bytes + self.margin_bytes


@dataclass(frozen=True)
class CoJob:
    """One job on a GPU, as the swap-cost model sees it."""

    name: str
    footprint_bytes: int
    working_set_bytes: int
    access: AccessClass
    priority: float  # higher runs first; victims are the lowest
    solo_time_s: float = 1.0
    sweeps_per_s: float = 2.0  # working-set sweeps per second of solo run time


@dataclass(frozen=True)
class JobSlowdown:
    name: str
    slowdown: float
    offloaded_bytes: int
    victim: bool


@dataclass(frozen=True)
class SwapCost:
    """Predicted slowdowns of co-located jobs, with the parts visible."""

    deficit_bytes: int
    jobs: tuple[JobSlowdown, ...]
    risk: float  # over-commit risk in [0, 1]

    def of(self, name: str) -> JobSlowdown:
        for j in self.jobs:
            if j.name == name:
                return j
        raise KeyError(name)


@dataclass(frozen=True)
class Rewrite:
    """Field changes for job_submit.lua; None means leave the field alone, "" clears it."""

    tres_per_node: str | None = None
    tres_per_job: str | None = None
    tres_per_task: str | None = None
    tres_per_socket: str | None = None
    tres_bind: str | None = None
    site_factor: int | None = None
    admin_comment: str | None = None
    user_message: str | None = None


@dataclass(frozen=True)
class Decision:
    decision_id: str
    model_version: str
    action: Action
    shards: int
    site_factor: int
    estimate: DemandEstimate
    swap_slowdown: float
    offloaded_bytes: int
    risk: float
    reasons: tuple[Reason, ...]
    rewrite: Rewrite
    job_class: str
    decided_at: float
    mode: PolicyMode = PolicyMode.ENFORCE  # shadow: recorded, its rewrite only the AdminComment
