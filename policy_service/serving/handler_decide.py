"""How PolicyHandler decides a job from its facts (Admit, re-decisions and the admission table all
decide here): the request built from the facts, remembered per facts and partitions view, and the
decision made once per (request, statistics, queue figures, enforcement, config) with a placeholder
id and handed out with each Admit's id and time put in its place.

``Deciding`` is mixed into PolicyHandler (handler.py), whose __init__ sets what it reads (cfg, store,
queue, partitions, dialect, standby, node_enforcement, clock, new_id, _requests).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import grpc

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.config import Config
from policy_service.core import policy, queue_rules
from policy_service.core.request import PER_GPU_OPTIONS, RequestError, history_keys, job_request
from policy_service.core.types import Decision, JobRequest, KeyLevel, LiveShards, QueueState, Reason, copied
from policy_service.serving.decision_proto import gres_fields, is_batch
from policy_service.serving.handler_error import HandlerError

MONITOR = object()  # PolicyHandler._decide: decide with the queue monitor's newest snapshot
# PolicyHandler._request: the facts remembered (cleared when full). Each entry holds about 25 objects
# the cyclic collector walks (the request, its template decision, record and reply): at 16,384 a full
# collection walked 480,000 objects for 320 ms, the Admit waiting meanwhile past the plugin's 200 ms
# timeout_ms (bench/gc_pause.py). A repeat the admission table holds never reaches the service.
REQUEST_MEMO_MAX = 4096


# The memo of _decide_made for facts decided once: their next job makes the template. Most new
# facts are seen once (a new class's first job; its repeats meet the admission table), and making a
# template, its record and its reply line cost such an Admit about a fifth more than deciding it.
_SEEN_ONCE = object()
_PLACEHOLDER_ID = "0" * 16  # a decision id's length: the AdminComment is cut at the same place
_ID_TOKEN = f"id={_PLACEHOLDER_ID}"


def _as_decided(queue: QueueState | None, cfg: Config) -> QueueState | None:
    """The queue as policy.decide reads it: its figures and whether it is fresh (an age of 0, or
    infinite), without the live shards (the request carries what they say). Deciding with this
    instead of the snapshot decides the same, and makes the decision a function of what it holds."""
    if queue is None:
        return None
    return QueueState(pending_gpus=queue.pending_gpus, total_gpus=queue.total_gpus,
                      age_s=0.0 if queue_rules.fresh(queue, cfg) else math.inf, ahead_by_qos=queue.ahead_by_qos)


def _with_id(template: Decision, d_id: str, now: float) -> Decision | None:
    """``template`` (made with _PLACEHOLDER_ID at time 0) as made with ``d_id`` at ``now``; None
    when the id cannot be put in its place (another length; the AdminComment cut inside it)."""
    rw = template.rewrite
    if rw.admin_comment is not None:
        if len(d_id) != len(_PLACEHOLDER_ID) or _ID_TOKEN not in rw.admin_comment:
            return None
        rw = copied(rw, admin_comment=rw.admin_comment.replace(_ID_TOKEN, f"id={d_id}", 1))
    return copied(template, decision_id=d_id, decided_at=now, rewrite=rw)


class Deciding:
    """PolicyHandler's decision path: ``_decide`` and what it is made of."""

    def _decide(self, job: pb.JobFacts, replaces: str = "", whole_because: Reason | None = None, *,
                queue: QueueState | None | object = MONITOR, decision_id: str | None = None,
                stats_of: Callable[[dict], dict] | None = None):
        """(decision, request, history keys) of ``job`` now. ``queue``: the queue snapshot to decide
        with (MONITOR: the queue monitor's newest; None: none); ``decision_id``: the id to give it
        (None: a new one); ``stats_of``: reads the history keys' statistics (None: the store).
        Admit, re-decisions and the admission table (admission/entries.py) all decide here."""
        d, jr, keys, _made = self._decide_made(job, replaces, whole_because, queue=queue, decision_id=decision_id,
                                               stats_of=stats_of)
        return d, jr, keys

    def _decide_made(self, job: pb.JobFacts, replaces: str = "", whole_because: Reason | None = None, *,
                     queue: QueueState | None | object = MONITOR, decision_id: str | None = None,
                     stats_of: Callable[[dict], dict] | None = None):
        """``_decide``, and the memo entry (statistics, context, template, [its record's bytes], [its
        brief reply line's pieces]) the decision was made from, None where it was decided directly."""
        if queue is MONITOR:
            queue = self.queue.snapshot() if self.queue is not None else None
        jr, access, fields, keys, last = self._request(job, queue)
        stats = (stats_of or self.store.stats)(keys)
        d_id, now = decision_id or self.new_id(), self.clock()
        enforcement = self.node_enforcement.view(self.clock(), self.cfg.policy.enforcement_max_age_s)
        queue = _as_decided(queue, self.cfg)
        # policy.decide is pure: with the same request (this facts entry), the same statistics
        # objects (HistoryStore._checked hands out one per stored text), queue figures, enforcement,
        # config and dialect it decides the same, but for the id and the time. The decision is made
        # once with the placeholder id and time 0, and handed out with the id put in its place.
        interference = self.interference.view
        context = (self.cfg, self.dialect, queue, enforcement, replaces, whole_because, interference)
        made = last[0]
        if (made is not None and made is not _SEEN_ONCE and made[1] == context and len(made[0]) == len(stats)
                and all(stats.get(level) is s for level, s in made[0])):
            d = _with_id(made[2], d_id, now)
            if d is not None:
                return d, jr, keys, made
        # the arguments every policy.decide here shares (the id and the time aside)
        given = dict(job_class=keys[KeyLevel.CLASS], gres_fields=fields, access=access, queue=queue,
                     replaces=replaces, dialect=self.dialect, whole_because=whole_because,
                     enforcement=enforcement, interference=interference)
        if made is None:  # first seen: decided as it is, the template waits for a second job of these facts
            last[0] = _SEEN_ONCE
            return policy.decide(jr, stats, self.cfg, decision_id=d_id, now=now, **given), jr, keys, None
        template = policy.decide(jr, stats, self.cfg, decision_id=_PLACEHOLDER_ID, now=0.0, **given)
        d = _with_id(template, d_id, now)
        if d is None:  # an id the template cannot take (another length, a comment cut inside it)
            return policy.decide(jr, stats, self.cfg, decision_id=d_id, now=now, **given), jr, keys, None
        last[0] = made = (tuple(stats.items()), context, template, [None], [None])
        return d, jr, keys, made

    def _request(self, job: pb.JobFacts, queue: QueueState | None) -> tuple[JobRequest, object, dict, dict, list]:
        """(request, access class hint, GRES fields, history keys, the slot of the decision last made
        for them) of ``job``: a pure function of its facts, the partitions' view and the live shard
        counts of its partitions and GPU type, remembered per facts (a class's jobs repeat:
        building them was a fifth of an Admit's CPU). Raises HandlerError."""
        parts = self.partitions() if self.partitions else None
        live = self._live_shards(queue) if parts else None
        facts = job.SerializeToString()
        hit = self._requests.get(facts)
        if hit is not None and hit[0] is parts:
            jr, access, fields, keys = hit[2]
            # each queue poll reads the live shards anew: what the request took from them is compared
            if not parts or parts.live_shard_counts(job.partition, jr.gpu.gpu_type, live) == hit[1]:
                return jr, access, dict(fields), dict(keys), hit[3]  # (copies: a caller may keep or change its dicts)
        fields = gres_fields(job)
        try:
            jr, access = job_request(
                user=job.user, account=job.account, partition=job.partition, job_name=job.job_name,
                script_fingerprint=job.script_fingerprint, gres_fields=fields, min_nodes=job.min_nodes,
                num_tasks=job.num_tasks, time_limit_min=job.time_limit_min, comment=job.comment,
                env_mem_hint=job.env_mem_hint, qos=job.qos, is_batch=is_batch(job),
                het_job=job.het_job, per_gpu={f: getattr(job, f) for f, _ in PER_GPU_OPTIONS},
                exclusive=job.exclusive,
                partition_gpu_defaults=parts.for_job(job.partition) if parts else ())
        except RequestError as exc:
            raise HandlerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        counted = None
        if parts:  # the GPUs its partitions hold, of the type it asks for, where the controller takes shard jobs
            counted = counts, refused = parts.live_shard_counts(job.partition, jr.gpu.gpu_type, live)
            unbilled, whole_unbilled = parts.unbilled(job.partition, jr.gpu.gpu_type)  # its TRESBillingWeights
            jr = copied(jr, gpu_shard_counts=counts, shards_refused=refused, shards_unbilled=unbilled,
                        whole_shards_unbilled=whole_unbilled)
        keys = history_keys(jr)
        last: list = [None]  # the decision last made for these facts (_decide)
        if len(self._requests) >= REQUEST_MEMO_MAX:
            self._requests.clear()
        # the view is held (not its id): a view is never taken for another one made later
        self._requests[facts] = (parts, counted, (jr, access, dict(fields), dict(keys)), last)
        return jr, access, fields, keys, last

    def _live_shards(self, queue: QueueState | None | object) -> LiveShards | None:
        """The shards the controller in control reports, from the snapshot decided with; while this
        service is standby an Admit comes from a controller taking over, whose counts it has not read
        (counted so on releases whose backup may refuse shards after a takeover: the dialect's
        takeover_zero_shards)."""
        live = queue.live_shards if isinstance(queue, QueueState) else None
        why = self.standby() if self.standby is not None and self.dialect.takeover_zero_shards else None
        if why is None:
            return live
        return dataclasses.replace(live or LiveShards(), unread=f"this service is standby ({why}): the shards of "
                                                                "the controller taking over are not read yet")

    def shards_refused(self, queue: QueueState | None) -> str:
        """Why the admission table may not decide now: nodes with shards where the controller in
        control refuses shard jobs (the table's decisions assume every GPU takes them); "" when none."""
        parts = self.partitions() if self.partitions else None
        refused = parts.shards_refused(self._live_shards(queue)) if parts else ()
        return f"the controller refuses shards on {len(refused)} node(s): {'; '.join(refused[:3])}" if refused else ""
