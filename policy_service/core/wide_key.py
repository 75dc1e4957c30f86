"""Wide keys (account, partition): how far one user's runs may move the estimate others get. Pure.

A wide key pools the runs of every user of an account or partition, and its estimate sizes the
jobs whose own keys (class, user+name) know too little: a new class of anyone under it. Its peak
used to be the largest peak ever observed under it, so one run of one user set it for all (issue
32: one 87 GB run made every new class of three users' account too large to share). Now:

* **Per-user figures.** The key keeps, per user, their measured runs under it and their largest
  peak (``ClassStats.users``, the ``MAX_WIDE_USERS`` most recently seen). Statistics stored
  before there were figures count as one user, ``LEGACY``.
* **Bounded peak.** For a job of user U the key's peak is the largest figure, each figure but
  U's own held to at most ``wide_key_user_cap`` (1.5) x the largest figure of anyone else. U's
  own runs size U's jobs as they would through U's own keys; another user can lift U's estimate
  to at most 1.5 x what the rest of the key shows, however many runs they make and however large.
* **Bounded evidence.** Toward ``wide_key_min_samples`` U's own runs (and ``LEGACY``'s) count in
  full, every other user's at most ``wide_key_min_samples - 1``: no single other user makes the
  key usable on their own.
* **No OOM multiplier.** An OOM of a shared run raises the margin of its class and user+name
  keys (``estimator.observe``), not of the wide keys: one user's failures do not widen everyone's
  margin. (A multiplier stored before fades as before.)

The narrow keys need no such bound: a class is one user's by construction (the user is part of
it), and a ``user_name`` key folds each run exactly as the run's class does.
"""
from __future__ import annotations

from policy_service.config import EstimatorConfig
from policy_service.core.bounds import MAX_WIDE_USERS
from policy_service.core.types import ClassStats, KeyLevel, UserFigure

WIDE = (KeyLevel.ACCOUNT, KeyLevel.PARTITION)
LEGACY = "(before per-user figures)"  # not a user name Slurm can have


def figures(s: ClassStats) -> tuple[UserFigure, ...]:
    """The key's per-user figures; statistics stored before figures were kept are one, ``LEGACY``."""
    if s.users or s.samples == 0:
        return s.users
    return (UserFigure(LEGACY, s.samples, s.max_peak_bytes),)


def add_run(s: ClassStats, user: str, peak_bytes: int) -> tuple[UserFigure, ...]:
    """The figures with one more measured run of ``user`` (moved last: the most recently seen)."""
    figs = figures(s)
    mine = next((f for f in figs if f.user == user), UserFigure(user))
    rest = tuple(f for f in figs if f.user != user)
    return (rest + (UserFigure(user, mine.samples + 1, max(mine.max_peak_bytes, peak_bytes)),))[-MAX_WIDE_USERS:]


def _own(figure: UserFigure, user: str) -> bool:
    return figure.user == LEGACY or (bool(user) and figure.user == user)


def evidence(s: ClassStats, user: str, cfg: EstimatorConfig) -> int:
    """The measured runs that count toward ``wide_key_min_samples`` for a job of ``user``."""
    cap = max(1, cfg.wide_key_min_samples - 1)
    return sum(f.samples if _own(f, user) else min(f.samples, cap) for f in figures(s))


def _peak(figure: UserFigure) -> int:
    return figure.max_peak_bytes


def bounded_peak(s: ClassStats, user: str, cfg: EstimatorConfig) -> tuple[int, str]:
    """The key's peak for a job of ``user``, and whose it is ("3 user(s), 1 held to 1.5 x ...")."""
    figs = [f for f in figures(s) if f.max_peak_bytes > 0]
    peak, held = 0, 0
    top = max(figs, key=_peak, default=None)  # the largest figure; every other one's others include it
    rest = max((g.max_peak_bytes for g in figs if g is not top), default=None)  # the others' of the largest
    for f in figs:
        value = f.max_peak_bytes
        others = rest if f is top else top.max_peak_bytes  # the largest peak of the figures but f
        if others is not None and not (user and f.user == user):
            value = min(value, int(cfg.wide_key_user_cap * others))
            held += value < f.max_peak_bytes
        peak = max(peak, value)
    how = f", {held} held to {cfg.wide_key_user_cap:g} x the others' largest peak" if held else ""
    return peak, f"{len(figs)} user(s){how}"
