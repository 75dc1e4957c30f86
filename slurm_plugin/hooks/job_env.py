"""What Slurm's environment says about a job's GPUs, for the hooks, the TaskProlog and the
enforcement backends (no I/O, no imports beyond the standard library)."""
from __future__ import annotations

import re
from typing import Mapping


def parse_gpu_indices(env: Mapping[str, str]) -> list[int]:
    """GPU indices of the job: SLURM_JOB_GPUS ('0,2'), else CUDA_VISIBLE_DEVICES; ranges allowed."""
    for var in ("SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        text = env.get(var, "").strip()
        if not text:
            continue
        out: list[int] = []
        for part in text.split(","):
            m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
            if not m:
                out = []
                break
            lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
            out.extend(range(lo, hi + 1))
        if out:
            return sorted(set(out))
    return []
