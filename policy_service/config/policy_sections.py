"""The sections the policy sizes and decides jobs with: [gpu], [estimator], [swap_cost] and
[policy], with their defaults (``policy_service.config.sections`` gathers them into ``Config``)."""
from __future__ import annotations

from dataclasses import dataclass

from policy_service.config.choices import AccessClass, LinkKind, Oversubscription, PolicyMode, WholeGpuAsShards

GIB = 1024**3


@dataclass(frozen=True)
class GpuConfig:
    """The GPUs of the (homogeneous) partition the policy sizes shards for."""

    memory_bytes: int = 80 * GIB
    shards_per_gpu: int = 8
    link: LinkKind = LinkKind.PCIE_GEN5

    @property
    def shard_bytes(self) -> int:
        return self.memory_bytes // self.shards_per_gpu


@dataclass(frozen=True)
class EstimatorConfig:
    # Weight of the newest observation in the class's moving averages.
    ewma_alpha: float = 0.3
    # Margin floor as a fraction of the predicted peak.
    min_margin_frac: float = 0.10
    # Margin in units of the class's mean absolute deviation.
    deviation_k: float = 3.0
    # While a class has fewer than cold_samples observations its deviation is not known yet:
    # the margin is at least cold_margin_frac of the peak.
    cold_margin_frac: float = 0.25
    cold_samples: int = 3
    # After an OOM of a shared job: multiply the class's margin by this (compounds, capped).
    oom_margin_multiplier: float = 1.5
    max_margin_multiplier: float = 4.0
    # After an OOM of a shared job: this many next runs of the class get a whole GPU.
    oom_whole_gpu_runs: int = 2
    # A shared run that failed after using this fraction of its charged shards counts as OOM.
    oom_charge_frac: float = 0.95
    # Wider keys (account, partition) are only used with at least this many samples (another
    # user's counting at most this - 1), and another user's peak counts at most wide_key_user_cap
    # x the largest peak of the rest of the key (core/wide_key.py).
    wide_key_min_samples: int = 5
    wide_key_user_cap: float = 1.5
    # Minimum samples for the exact class / user+name keys. 3 and quantile_floor_frac 0.55: the
    # point of the measured operating curve with the most GPU-hours saved less lost to requeues
    # among those with <= 1 % of shared runs requeued (bench/operating_curve.py, docs/model.md).
    min_samples: int = 3
    # Quantile margin (docs/model.md, estimator): a class keeps its last recent_runs runs' ratios
    # peak / point estimate; with at least quantile_min_runs of them the charge is the point
    # estimate times the conformal margin_quantile of those ratios (the ceil((n+1)q)-th smallest,
    # the largest when n is too small for q), at least (1 + quantile_floor_frac) x the estimate,
    # and the observed maximum is that of the recent runs only. 0 recent_runs: EWMA + k x dev.
    recent_runs: int = 24
    quantile_min_runs: int = 4
    margin_quantile: float = 0.95
    quantile_floor_frac: float = 0.55
    # Each run that did not over-run its charge divides the OOM margin multiplier by this
    # (never below 1): the penalty fades after the class is sized right again. 1: never fades.
    margin_multiplier_decay: float = 1.25


@dataclass(frozen=True)
class SwapCostConfig:
    """Parameters of the swap-cost model. Sources: docs/model.md."""

    # Effective host<->device bandwidth per link kind (bytes/s), one direction.
    pcie_gen4_bytes_per_s: float = 25e9
    pcie_gen5_bytes_per_s: float = 50e9
    nvlink_c2c_bytes_per_s: float = 400e9
    # Cost of one demand-paging fault batch (s) and the bytes it brings.
    fault_latency_s: float = 30e-6
    fault_granularity_bytes: int = 64 * 1024
    # Compute interference when jobs merely share SMs (no oversubscription), per co-runner.
    # Superseded by the utilisation knee below (swapcost.compute_slowdown); kept for the
    # simulator's legacy COUNT/DEMAND interference models.
    compute_interference_per_corunner: float = 0.15
    # Utilisation knee (swapcost.interference_slowdown): a job with solo utilisation u next to
    # co-runners summing v is slowed 1 + base x v + knee_slope x max(0, u + v - 1). Fitted to
    # Gavel's V100 pairs (policy_service.sim.loaders.fit_knee: base 0.58, slope 2.9, quantile
    # rms 0.097; docs/simulation.md). default_solo_util: a job with no learned utilisation.
    compute_interference_base: float = 0.58
    compute_interference_knee_slope: float = 2.9
    default_solo_util: float = 0.5
    # Default traffic intensity: how many times per second a job sweeps its working set.
    default_sweeps_per_s: float = 2.0
    default_working_set_frac: float = 0.8
    default_access_class: AccessClass = AccessClass.STREAMING

    def link_bytes_per_s(self, link: LinkKind) -> float:
        return {
            LinkKind.PCIE_GEN4: self.pcie_gen4_bytes_per_s,
            LinkKind.PCIE_GEN5: self.pcie_gen5_bytes_per_s,
            LinkKind.NVLINK_C2C: self.nvlink_c2c_bytes_per_s,
        }[link]


@dataclass(frozen=True)
class PolicyConfig:
    # enforce | shadow | off (PolicyMode); the one setting a running service re-reads on SIGHUP.
    mode: PolicyMode = PolicyMode.ENFORCE
    enable_sharing: bool = True
    # Hold a whole-GPU decision for a single-GPU job as all shards of one GPU: on Slurm 22.05 a
    # gpu job can be placed on a GPU whose shards are in use, a job holding every shard cannot.
    # auto: only on releases with that bug (SlurmDialect.gpu_beside_shard_bug); true; false.
    whole_gpu_as_shards: WholeGpuAsShards = WholeGpuAsShards.AUTO
    # Charge fewer shards than the predicted peak only when the predicted slowdown of the
    # job, as designated victim, stays within this budget, and (auto) only when the nodes enforce
    # victim semantics: every node that reported its enforcement within enforcement_max_age_s says
    # so (soft limits with eviction first, nvml-cgroup). true / false: always / never.
    allow_oversubscription: Oversubscription = Oversubscription.AUTO
    enforcement_max_age_s: float = 3600.0
    max_victim_slowdown: float = 1.25
    # Priority: site_factor = round(scale * contention_degree), clamped to [0, max].
    site_factor_scale: float = 1000.0
    site_factor_max: int = 1000
    # Contention degree is only learned from at least this many shared and solo runs.
    contention_min_runs: int = 1
    # Share only while GPU work waits: when the pending GPU jobs ask for less than this
    # fraction of the cluster's GPUs, a job that would start at once keeps its whole GPU
    # (sharing then only adds compute interference). 0 shares regardless of the queue.
    share_min_queue: float = 0.05
    # Count only the pending jobs ahead of a job of a given --qos (QoS priority at least its
    # own; Slurm starts those first). false: every job sees the whole queue (more sharing of
    # high-QoS jobs, more throughput when the cluster is overloaded).
    queue_per_qos: bool = True
    # Charge a shared job at least its learned solo GPU utilisation in shards
    # (ceil(util x shards_per_gpu)), so the jobs on a GPU ask for no more than its compute.
    compute_aware: bool = True
    # ...except while the pending GPU jobs ask for at least this fraction of the cluster's GPUs:
    # then waiting costs more than co-runners' interference and jobs are sized by memory alone.
    # 0 never overcommits compute.
    overcommit_compute_min_queue: float = 1.0
    # Re-decide pending jobs that were kept whole (nothing known yet, short queue, ...) once
    # what the policy knows, or the queue, changed, and rewrite them to shards while they still
    # wait (scontrol update TresPerNode + AdminComment). It helps most when bursts of new jobs
    # queue, and costs a little when the queue is short (docs/simulation.md). At most
    # redecide_max_per_poll jobs per queue poll (one scontrol show + update each).
    redecide_pending: bool = True
    redecide_max_per_poll: int = 20
    # A shared job that ends out of GPU memory is requeued once on a whole GPU (Slurm's requeue:
    # batch jobs that allow it; --no-requeue, JobRequeue=0 and interactive jobs fail as before,
    # the reason in their AdminComment). Off: every such job fails as before.
    requeue_after_oom: bool = True
    # QoS names whose jobs always keep whole GPUs (no co-runner can slow them down).
    whole_gpu_qos: tuple[str, ...] = ()
    # The most a shared job may be slowed by its co-runners' compute (the site's interference
    # model, learned from its own shared runs: [interference]). A job with a learned utilisation is
    # charged enough shards that co-runners filling the rest of the GPU slow it at most this much
    # by the model, else it keeps a whole GPU; a class whose shared runs took longer than this
    # times its solo runs (interference_min_shared_runs of each) keeps a whole GPU. 0: no budget.
    max_interference_slowdown: float = 2.0
    interference_min_shared_runs: int = 3
    # How often the service reads the pending GPU jobs from Slurm; a snapshot older than three
    # periods counts as unknown (the queue rule is then skipped, with a reason).
    queue_poll_s: float = 15.0
    # Admin comment length cap (Slurm stores it as text; keep sacct output readable).
    admin_comment_max_chars: int = 400
    # Tell the submitting user, on sbatch/srun's stderr, when a request was rewritten to shards
    # (slurm.log_user). Off: users see exactly what they see without swapaware (scripts that
    # capture `sbatch --parsable ... 2>&1` get the job id alone); the rewrite is in the
    # AdminComment and `swapaware explain`.
    tell_users: bool = False


@dataclass(frozen=True)
class InterferenceConfig:
    """The site's compute interference, learned from its own shared runs (core/interference_learn.py,
    docs/model.md "Learning the site's interference"). The prior is swap_cost.compute_interference_*."""

    # Learn from the history's shared runs; false: the prior alone decides.
    learn: bool = True
    prior_name: str = "gavel"  # what the configured prior is called in reasons
    refit_s: float = 60.0  # the model is refitted at most this often, when new shared runs came
    prior_weight: float = 25.0  # the prior counts as this many shared runs
    min_runs: int = 25  # a GPU type's model is learned from at least this many shared runs ...
    min_users: int = 3  # ... of at least this many users; before, the prior decides
    max_user_share: float = 0.1  # one user's runs weigh at most this share of the evidence
    max_class_share: float = 0.1  # one class's likewise
    window: int = 2000  # the most recent shared runs per GPU type that count
    slowdown_min: float = 0.5  # observed slowdowns are clamped to [slowdown_min, slowdown_max]
    slowdown_max: float = 20.0
    max_others_util: float = 7.0  # co-runners' summed utilisation above this is refused
    base_max: float = 3.0  # the fit's bounds: a in [0, base_max], b in [0, slope_max]
    slope_max: float = 8.0


def interference_checks(c: InterferenceConfig) -> list[tuple[bool, str]]:
    """(holds, message) for each rule [interference] must keep (config/load.py)."""
    return [
        (c.refit_s > 0, "interference.refit_s must be > 0"),
        (c.prior_weight > 0, "interference.prior_weight must be > 0"),
        (c.min_runs >= 1 and c.min_users >= 1, "interference.min_runs and min_users must be >= 1"),
        (0 < c.max_user_share < 0.5, "interference.max_user_share must be in (0, 0.5): a user at half the weight "
                                     "or more could move the fit alone"),
        (0 < c.max_class_share < 0.5, "interference.max_class_share must be in (0, 0.5)"),
        (c.window >= c.min_runs, "interference.window must be >= interference.min_runs"),
        (0 < c.slowdown_min <= 1 <= c.slowdown_max, "interference.slowdown_min must be in (0, 1], slowdown_max >= 1"),
        (c.max_others_util > 0 and c.base_max > 0 and c.slope_max >= 0,
         "interference.max_others_util and base_max must be > 0, slope_max >= 0"),
    ]
