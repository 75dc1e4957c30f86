"""What differs between the Slurm releases the service supports (22.05, 24.11, 26.05; see
SLURM_VERSIONS.md): how GRES are spelled in ``tres_per_*``, which ``sacct --json`` data parser
to pin, and which scheduler fixes and features a release has.

The service picks one dialect at start, from the running Slurm (``scontrol --version``) or from
``service.slurm_release``. Pure: no I/O, no logging (callers log what they chose).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

Release = tuple[int, int]

GRES_SLASH_SINCE: Release = (23, 2)  # "gres/gpu:1" in tres_per_*; before: "gres:gpu:1"
MULTIPLE_SHARING_GRES_PJ_SINCE: Release = (23, 11)  # SelectTypeParameters=MULTIPLE_SHARING_GRES_PJ
SLUID_SINCE: Release = (25, 11)  # SLURM_JOB_SLUID: a job id that a state reset cannot repeat


@dataclass(frozen=True)
class Pinned:
    """Values pinned per release, rather than derived from the release number."""

    # sacct's JSON flag: each release drops old data_parser versions on a schedule, so pin
    # one the release has (plain --json: the release's own newest, parsed all the same).
    sacct_json_arg: str
    # A gpu job can be placed on a GPU whose shards are in use (seen on 22.05; the 23.11
    # changelog says fixed: flip an entry only after measuring that release).
    gpu_beside_shard_bug: bool
    # A backup that takes over may refuse shard jobs until it has read the nodes' shards (22.05:
    # `scontrol takeover` left shard:<type>:0 on every node until the primary was back; not seen
    # on 24.11 and 26.05; releases between not measured: taken as 22.05). Where true, a standby
    # service's Admit and another host's admission gate count the shards as unread (LiveShards).
    takeover_zero_shards: bool = True


# Known releases, oldest first. A release not listed takes the entry of the newest release
# listed at or below it; one older than every entry takes the oldest entry.
PINNED: dict[Release, Pinned] = {
    (22, 5): Pinned("--json", True),  # measured: data_parser of 22.05 (v0.0.37-like)
    (23, 2): Pinned("--json", True),
    (23, 11): Pinned("--json", False),
    (24, 5): Pinned("--json", False),
    (24, 11): Pinned("--json=v0.0.42", False, False),  # measured
    (25, 5): Pinned("--json=v0.0.42", False, False),  # v0.0.42 lives from 24.11 to 26.05
    (25, 11): Pinned("--json=v0.0.42", False, False),
    (26, 5): Pinned("--json=v0.0.44", False, False),  # measured (v0.0.41 gone, v0.0.42 goes in 26.11)
}
NEWEST: Release = max(PINNED)
OLDEST: Release = min(PINNED)


@dataclass(frozen=True)
class SlurmDialect:
    release: Release
    gres_prefix: str  # "gres:" before 23.02, "gres/" since
    sacct_json_arg: str
    gpu_beside_shard_bug: bool
    multiple_sharing_gres_pj: bool  # one job's shards may span GPUs (when slurm.conf sets it)
    has_sluid: bool
    takeover_zero_shards: bool = True  # Pinned.takeover_zero_shards

    @property
    def name(self) -> str:
        return release_name(self.release)

    def gres(self, name: str, count: int, gres_type: str = "") -> str:
        """One GRES entry in this release's spelling: 'gres/shard:2', 'gres:gpu:a100:1'."""
        typed = f":{gres_type}" if gres_type else ""
        return f"{self.gres_prefix}{name}{typed}:{count}"

    def describe(self) -> str:
        """For the start-up log: '24.11 (gres/ spelling, sacct --json=v0.0.42, ...)'."""
        yes = {True: "yes", False: "no"}
        return (f"{self.name} ({self.gres_prefix} spelling, sacct {self.sacct_json_arg}, "
                f"gpu-beside-shard bug: {yes[self.gpu_beside_shard_bug]}, "
                f"multiple sharing GRES per job: {yes[self.multiple_sharing_gres_pj]}, "
                f"SLUID: {yes[self.has_sluid]}, shards unread after a takeover: {yes[self.takeover_zero_shards]})")


def release_name(release: Release) -> str:
    return f"{release[0]}.{release[1]:02d}"


_RELEASE_RE = re.compile(r"^\s*(\d+)\.(\d+)(?:\.\d+)?\s*$")


def is_release(text: str) -> bool:
    """Whether ``text`` names a release ('24.11', '24.11.5'): what ``parse_release`` reads."""
    return _RELEASE_RE.match(text) is not None


def parse_release(text: str) -> Release:
    """'24.11' or '24.11.5' -> (24, 11)."""
    m = _RELEASE_RE.match(text)
    if not m:
        raise ValueError(f"not a Slurm release: {text!r} (use e.g. 24.11)")
    return int(m.group(1)), int(m.group(2))


def pinned_for(release: Release) -> Pinned:
    at_or_below = [r for r in PINNED if r <= release]
    return PINNED[max(at_or_below)] if at_or_below else PINNED[OLDEST]


def dialect_for(version: Release | None) -> SlurmDialect:
    """The dialect of a release; None (unknown) gives the newest known release's."""
    release = NEWEST if version is None else version
    pinned = pinned_for(release)
    return SlurmDialect(
        release=release,
        gres_prefix="gres/" if release >= GRES_SLASH_SINCE else "gres:",
        sacct_json_arg=pinned.sacct_json_arg,
        gpu_beside_shard_bug=pinned.gpu_beside_shard_bug,
        multiple_sharing_gres_pj=release >= MULTIPLE_SHARING_GRES_PJ_SINCE,
        has_sluid=release >= SLUID_SINCE,
        takeover_zero_shards=pinned.takeover_zero_shards,
    )


DIALECTS: dict[Release, SlurmDialect] = {r: dialect_for(r) for r in PINNED}
SLURM_22_05 = DIALECTS[(22, 5)]
