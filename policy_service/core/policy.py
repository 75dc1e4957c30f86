"""The admission policy: estimate -> GRES rewrite, priority and a decision record.

``decide`` is pure: the caller injects the decision id, the clock reading and the history.
Its parts: ``route`` (which requests keep their GPU or a whole GPU, and why) and ``shard_sizing``
(how many shards, oversubscription, a whole GPU held as shards); here: the model version, the
site factor, re-decisions of pending jobs, the AdminComment and ``decide`` itself.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import Mapping

from policy_service.config import AccessClass, Config
from policy_service.core.enforcement import EnforcementView
from policy_service.core import estimator
from policy_service.core.dialect import SLURM_22_05, SlurmDialect
from policy_service.core.interference_learn import LearnedModel
from policy_service.core.interference_rule import InterferenceView, model_line, predicted, prior_view
from policy_service.core.request import shard_rewrite
from policy_service.core.route import _keeps_request, _route, _single_gpu
from policy_service.core.shard_sizing import _whole_as_shards, solo_utilisation, whole_gpu_as_shards
from policy_service.core.types import (
    Action,
    ClassStats,
    Decision,
    DemandEstimate,
    GresKind,
    JobRequest,
    KeyLevel,
    QueueState,
    Reason,
    ReasonCode,
    Rewrite,
)

MODEL_VERSION = "swapaware-model/1"
COMMENT_PREFIX = "swapaware:v1"


_VERSIONS: dict[int, tuple[Config, str]] = {}  # id(cfg) -> (cfg, its version), a few configs at most


def model_version(cfg: Config) -> str:
    """Model name plus a digest of the parameters that shape decisions (for replays). Remembered
    per config object: hashing a whole frozen Config (what an lru_cache does on every call) cost
    each Admit ~20 us."""
    known = _VERSIONS.get(id(cfg))
    if known is not None and known[0] is cfg:
        return known[1]
    params = {k: asdict(getattr(cfg, k)) for k in ("gpu", "estimator", "swap_cost", "policy", "interference")}
    digest = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:8]
    if len(_VERSIONS) >= 16:  # tests and the simulator make many configs; a service has one
        _VERSIONS.clear()
    version = f"{MODEL_VERSION}+{digest}"
    _VERSIONS[id(cfg)] = (cfg, version)
    return version


def contention_degree(s: ClassStats | None, min_runs: int) -> float | None:
    """Seed paper: W = (C(N) - C(1)) / C(1) / n, with n the mean number of co-runners."""
    if s is None or s.solo_runs < min_runs or s.shared_runs < min_runs or s.ewma_solo_runtime_s <= 0:
        return None
    n = max(1.0, s.ewma_corunners)
    return max(0.0, (s.ewma_shared_runtime_s - s.ewma_solo_runtime_s) / s.ewma_solo_runtime_s / n)


def predicted_contention(s: ClassStats | None, model: LearnedModel | None, cfg: Config) -> float | None:
    """The contention degree the site's interference model predicts for a class whose shared
    runtimes are not measured yet: its slowdown beside one co-runner of the default utilisation
    (swap_cost.default_solo_util), less one. None without a learned solo utilisation or a model."""
    if s is None or model is None or s.util_runs < 1:
        return None
    return max(0.0, predicted(model, s.ewma_solo_util, cfg.swap_cost.default_solo_util) - 1.0)


def site_factor(s: ClassStats | None, cfg: Config, model: LearnedModel | None = None) -> tuple[int, Reason]:
    """The seed's priority: the class's measured contention degree, else the one the site's
    interference model predicts from its solo utilisation, else 0."""
    w = contention_degree(s, cfg.policy.contention_min_runs)
    cap = cfg.policy.site_factor_max
    if w is None:
        w = predicted_contention(s, model, cfg)
        if w is None:
            return 0, Reason(ReasonCode.PRIORITY_DEFAULT, "no shared-vs-solo runtimes yet: site factor 0")
        value = int(min(cap, round(cfg.policy.site_factor_scale * w)))
        return value, Reason(ReasonCode.PRIORITY_CONTENTION,
                             f"predicted contention degree {w:.3f} (alone {s.ewma_solo_util:.0%} busy, beside a "
                             f"co-runner {cfg.swap_cost.default_solo_util:.0%} busy; {model_line(model)}; no shared "
                             f"runs measured yet): site factor {value} (cap {cap})")
    value = int(min(cap, round(cfg.policy.site_factor_scale * w)))
    return value, Reason(ReasonCode.PRIORITY_CONTENTION,
                         f"contention degree {w:.3f} (shared {s.ewma_shared_runtime_s:.0f}s vs solo "
                         f"{s.ewma_solo_runtime_s:.0f}s): site factor {value} (cap {cap})")


# The history keys whose learning can change a pending job's decision (class, user+name); the
# wide keys (account, partition) change with every job and rarely decide alone.
REDECIDE_KEYS = (KeyLevel.CLASS, KeyLevel.USER_NAME)


def replaces_pending(prev_action: str, new: Decision) -> bool:
    """Whether a re-decision replaces a pending job's decision: only a whole GPU turned into
    shards (a waiting job is never made to ask for more)."""
    return prev_action == Action.WHOLE_GPU.value and new.action in (Action.SHARE, Action.SHARE_OVERSUBSCRIBED)


def admin_comment(d_id: str, version: str, action: Action, shards: int, est: DemandEstimate, sf: int,
                  reasons: tuple[Reason, ...], max_chars: int) -> str:
    """The decision record sacct shows (AdminComment). Stable, greppable key=value text."""
    why = ",".join(dict.fromkeys(r.code.value for r in reasons))
    text = (f"{COMMENT_PREFIX} id={d_id} model={version} action={action.value} shards={shards} "
            f"pred={estimator.fmt_bytes(est.peak_bytes)}+{estimator.fmt_bytes(est.margin_bytes)} "
            f"src={est.source.value} n={est.samples} sf={sf} why={why}")
    return text[:max_chars]


def parse_admin_comment(text: str) -> dict[str, str]:
    """Inverse of ``admin_comment`` for the fields it carries; {} when not ours."""
    if not text or COMMENT_PREFIX not in text:
        return {}
    body = text[text.index(COMMENT_PREFIX) + len(COMMENT_PREFIX):]
    return dict(tok.split("=", 1) for tok in body.split() if "=" in tok)


def decide(req: JobRequest, stats: Mapping[KeyLevel, ClassStats], cfg: Config, *, decision_id: str,
           now: float, job_class: str, gres_fields: Mapping[str, str],
           access: AccessClass | None = None, queue: QueueState | None = None, replaces: str = "",
           dialect: SlurmDialect = SLURM_22_05, enforcement: EnforcementView | None = None,
           whole_because: Reason | None = None, interference: InterferenceView | None = None) -> Decision:
    """Decide how a job runs. Pure: same inputs, same decision. ``replaces``: the id of the
    decision a still-pending job had (a re-decision). ``dialect``: the running Slurm's (the
    rewrite's GRES spelling, whether a whole GPU is held as shards). ``enforcement``: the nodes'
    reported GPU memory enforcement (gates oversubscription under ``auto``; None: not gated).
    ``whole_because``: the job gets a whole GPU for this reason (a requeue after an OOM), whatever
    the route would say. ``interference``: the site's learned interference models (None: the
    configured prior, ``interference_rule.prior_view``)."""
    access = access or cfg.swap_cost.default_access_class
    est = estimator.estimate(req, stats, cfg.estimator, cfg.gpu)
    class_stats = stats.get(KeyLevel.CLASS)
    # An OOM penalty lives with the class; a class never seen yet inherits its user+name's.
    penalty = class_stats if class_stats is not None else stats.get(KeyLevel.USER_NAME)
    view = interference or prior_view(cfg)
    action, shards, slow, off, route_reasons = _route(req, est, penalty, access, cfg, queue, solo_utilisation(stats),
                                                      enforcement, view)
    if whole_because is not None:
        action, shards, slow, off, route_reasons = Action.WHOLE_GPU, 0, 1.0, 0, [whole_because]
    sf, prio_reason = site_factor(class_stats, cfg, view.model_for(req.gpu.gpu_type))
    if (action is Action.WHOLE_GPU and _single_gpu(req) and not _keeps_request(req) and cfg.policy.enable_sharing
            and whole_gpu_as_shards(cfg, dialect)):
        shards, held = _whole_as_shards(req, cfg, dialect)
        if held.code not in {r.code for r in route_reasons}:  # shards_refused said once
            route_reasons.append(held)
    if replaces and whole_because is None:
        route_reasons.insert(0, Reason(ReasonCode.REDECIDED, f"re-decided while the job was pending: replaces "
                                                             f"decision {replaces}"))
    route_codes = {r.code for r in route_reasons}
    reasons = (*route_reasons, *(r for r in est.reasons if r.code not in route_codes), prio_reason)
    version = model_version(cfg)
    fields = {}
    user_message = None
    if shards:
        fields = shard_rewrite(dict(gres_fields), req.gpu.source_field, shards, dialect, req.gpu.gpu_type)
    if action in (Action.SHARE, Action.SHARE_OVERSUBSCRIBED) and cfg.policy.tell_users:
        of_gpu = f"one {req.gpu.gpu_type} GPU" if req.gpu.gpu_type else "one GPU"
        user_message = (f"swapaware: gpu request rewritten to {shards} shard(s) of {of_gpu} "
                        f"(predicted peak {estimator.fmt_bytes(est.peak_bytes)})")
    comment = admin_comment(decision_id, version, action, shards, est, sf, reasons,
                            cfg.policy.admin_comment_max_chars)
    rewrite = Rewrite(
        tres_per_node=fields.get("tres_per_node"), tres_per_job=fields.get("tres_per_job"),
        tres_per_task=fields.get("tres_per_task"), tres_per_socket=fields.get("tres_per_socket"),
        tres_bind="" if shards and req.implicit_gpu_bind else None,
        site_factor=sf if action is not Action.PASS_THROUGH or req.gpu.kind is GresKind.SHARD else None,
        admin_comment=comment if req.gpu.kind is not GresKind.NONE else None,
        user_message=user_message,
    )
    risk = min(1.0, off / est.sized_bytes) if est.sized_bytes and off else 0.0
    return Decision(decision_id=decision_id, model_version=version, action=action, shards=shards,
                    site_factor=sf, estimate=est, swap_slowdown=slow, offloaded_bytes=off, risk=risk,
                    reasons=reasons, rewrite=rewrite, job_class=job_class, decided_at=now)
