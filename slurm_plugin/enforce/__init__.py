"""Per-node GPU memory enforcement: which mechanism fences a shared job's memory, and how.

Each backend says what it enforces (``detect``), and turns a job's charge into what the
mechanism reads (``apply``: environment lines for the TaskProlog, files for the root prolog).
``choose`` picks the configured backend, or with ``agent.enforcement = auto`` the strongest one
the node has; ``advisory`` (framework allocator settings) is the fallback and says it is advisory.

Strength order (auto): nvml-cgroup (hard cap + soft limit whose holders the driver evicts first:
victim semantics), hami (hard cap in a preloaded library), mps (hard cap per client process),
advisory (nothing enforced).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class Capability:
    """What a backend enforces on this node, and why (shown by ``swapaware doctor``, reported
    to the service with each job start)."""

    backend: str
    available: bool  # the mechanism is present on this node
    hard_cap: bool  # an allocation beyond the cap fails (in the job, not in its neighbour)
    victim: bool  # over-cap memory of a designated victim goes to host memory / is evicted first
    detail: str

    def line(self) -> str:
        if not self.available:
            return f"{self.backend}: not available ({self.detail})"
        what = ("hard cap + victim semantics" if self.hard_cap and self.victim else
                "hard cap, no victim semantics" if self.hard_cap else "advisory only, nothing enforced")
        return f"{self.backend}: {what} ({self.detail})"


@dataclass(frozen=True)
class JobCap:
    """One job's share on one node: its charge (shards x shard bytes) and, when oversubscribed,
    the predicted need above it (0: not oversubscribed)."""

    job_id: int
    cap_bytes: int
    device_bytes: int
    visible_gpus: int | None = None  # count in CUDA_VISIBLE_DEVICES; None: unknown
    need_bytes: int = 0
    user_env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Applied:
    env: dict[str, str]  # export NAME=value (TaskProlog)
    files: dict[Path, str]  # path -> content, written by root (prolog / agent)
    message: str  # one line for the job's output: what is enforced, or that it is advisory
    enforced: bool


class Backend(Protocol):
    name: str

    def detect(self) -> Capability: ...

    def apply(self, job: JobCap) -> Applied: ...

    def release(self, job_id: int) -> list[Path]: ...


MIB = 1024 * 1024


def fmt_mib(n: int) -> str:
    return f"{n // MIB} MiB"
