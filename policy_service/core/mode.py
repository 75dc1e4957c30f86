"""policy.mode applied to a decision. Pure.

In shadow mode every job is decided and recorded exactly as in enforce mode, but the job is left
as submitted: its rewrite keeps only the AdminComment, which says ``mode=shadow`` and what would
have been done (action, shards, prediction). Nothing else (GRES, site factor, the user's message)
is set, so an admin can watch what swapaware would do before turning it on.
"""
from __future__ import annotations

from dataclasses import replace

from policy_service.config import PolicyMode
from policy_service.core.types import Decision, Reason, ReasonCode, Rewrite

SHADOW_TOKEN = "mode=shadow"


def shadow_comment(comment: str, max_chars: int) -> str:
    """The AdminComment with ``mode=shadow`` after its id (``swapaware:v1 id=X mode=shadow ...``)."""
    head, sep, rest = comment.partition(" action=")
    text = f"{head} {SHADOW_TOKEN}{sep}{rest}" if sep else f"{comment} {SHADOW_TOKEN}"
    return text[:max_chars]


def apply_mode(d: Decision, mode: PolicyMode, max_chars: int) -> Decision:
    """``d`` as the job receives it under ``mode`` (enforce: unchanged). Off never reaches here:
    nothing is decided then."""
    if mode is not PolicyMode.SHADOW:
        return d
    comment = d.rewrite.admin_comment
    reason = Reason(ReasonCode.SHADOW_MODE, "policy.mode = shadow: decided and recorded; the job runs as "
                                            "submitted (its AdminComment says what would have been done)")
    return replace(d, mode=PolicyMode.SHADOW, reasons=(*d.reasons, reason),
                   rewrite=Rewrite(admin_comment=shadow_comment(comment, max_chars) if comment else None))
