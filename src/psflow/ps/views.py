"""Who serves each ps shard, in numbered terms: the authority's state machine and the copies' rules.

With ``ps_replicas = 2`` every shard has two copies on the ps pair ps:s and ps:(s+1 mod P)
(:mod:`psflow.ps.replication`). Which copy serves, and whether the other one holds every
acknowledged update, is decided by one authority (the launcher's coordinator; in the component
tests a server of the test's own) and nobody else: a worker's request never moves a shard. This is
chain replication's master (van Renesse and Schneider, OSDI 2004) and the parameter server's server
manager (Li et al., OSDI 2014), with Raft's terms as fences.

A shard's view is ``(term, serving, backup, state)``; states::

    synced       the backup holds every record the serving copy acknowledged (acks wait for it)
    catching-up  a new backup is loading the state; the serving copy acknowledges alone meanwhile
    alone        no backup; the serving copy acknowledges alone
    lost         the serving copy died while no synced copy existed: acknowledged updates are gone

:class:`ViewBook` (pure; the authority) changes views on four events only (a ps down, a ps up, a
serving copy's report that its backup is unreachable, or that it caught up), each recorded with its
cause (``story``). The copies' rules (:func:`accepts_records`, :func:`serves`, :func:`takes_over`,
:func:`keeps_serving`, :class:`Lease`) fence every message by its term.

The whole note (the events' transitions, fencing, the invariants the simulation checks):
``docs/design/ps-views.md``; the guarantee as users see it: ``docs/replication.md``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from psflow.errors import PsflowError


class Sync(enum.Enum):
    SYNCED = "synced"
    CATCHING_UP = "catching-up"
    ALONE = "alone"
    LOST = "lost"


@dataclass(frozen=True)
class ShardView:
    """One shard's view: ``serving`` and ``backup`` are ps indexes (None: none); ``since``: the
    term in which the serving copy began to serve (a copy that missed terms tells from it whether it
    is the one promoted, or has served throughout)."""

    shard: int
    term: int
    serving: int | None
    backup: int | None
    state: Sync
    since: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {"shard": self.shard, "term": self.term, "serving": self.serving, "backup": self.backup,
                "state": self.state.value, "since": self.since}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ShardView:
        try:
            return cls(int(d["shard"]), int(d["term"]), _opt_int(d.get("serving")), _opt_int(d.get("backup")),
                       Sync(d["state"]), int(d.get("since", 1)))
        except (KeyError, TypeError, ValueError) as e:
            raise PsflowError(f"A shard view is malformed ({e!r}); received {dict(d)!r}. Every task must run the "
                              "same psflow version.") from None

    @property
    def acks_wait_for_backup(self) -> bool:
        """Whether the serving copy answers a change only once its backup holds it."""
        return self.state is Sync.SYNCED


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def pair_of(shard: int, num_ps: int) -> tuple[int, int]:
    """The two ps that may hold shard ``shard``: ps:shard and the next one."""
    return shard, (shard + 1) % num_ps


def initial_views(num_ps: int) -> dict[int, ShardView]:
    """Term 1: each ps serves its own shard, the next ps holds its backup (filled by the forwarded init)."""
    return {s: ShardView(s, 1, s, (s + 1) % num_ps, Sync.SYNCED) for s in range(num_ps)}


class ViewBook:
    """The authority: every shard's view, changed by the events in the module docstring only.

    Each method returns the views it changed (possibly none); ``story`` keeps every change with its cause.
    """

    def __init__(self, num_ps: int) -> None:
        if num_ps < 2:
            raise ValueError(f"Shard views need 2 or more ps (ps_replicas=2); received {num_ps}.")
        self.num_ps = num_ps
        self.views = initial_views(num_ps)
        self.story: list[tuple[str, ShardView]] = []

    def snapshot(self) -> dict[str, Any]:
        return {str(s): v.to_dict() for s, v in sorted(self.views.items())}

    def _set(self, view: ShardView, cause: str) -> ShardView:
        self.views[view.shard] = view
        self.story.append((cause, view))
        return view

    def ps_down(self, ps: int, cause: str) -> list[ShardView]:
        changed = []
        for s, v in sorted(self.views.items()):
            if v.serving == ps:
                if v.backup is not None and v.state is Sync.SYNCED:
                    new = ShardView(s, v.term + 1, v.backup, None, Sync.ALONE, since=v.term + 1)
                else:
                    new = ShardView(s, v.term + 1, None, None, Sync.LOST, since=v.term + 1)
            elif v.backup == ps:
                new = replace(v, term=v.term + 1, backup=None, state=Sync.ALONE)
            else:
                continue
            changed.append(self._set(new, f"ps:{ps} down: {cause}"))
        return changed

    def ps_up(self, ps: int, cause: str) -> list[ShardView]:
        changed = []
        for s, v in sorted(self.views.items()):
            if ps in pair_of(s, self.num_ps) and v.state is Sync.ALONE and v.serving != ps and v.backup is None:
                changed.append(self._set(replace(v, term=v.term + 1, backup=ps, state=Sync.CATCHING_UP),
                                         f"ps:{ps} up: {cause}"))
        return changed

    def unreachable(self, reporter: int, shard: int, term: int, cause: str) -> list[ShardView]:
        v = self.views.get(shard)
        if v is None or v.term != term or v.serving != reporter or v.backup is None:
            return []  # an old report, or not the serving copy's: nothing to decide on it
        return [self._set(replace(v, term=v.term + 1, backup=None, state=Sync.ALONE),
                          f"ps:{reporter} cannot reach its backup ps:{v.backup}: {cause}")]

    def caught_up(self, reporter: int, shard: int, term: int) -> list[ShardView]:
        v = self.views.get(shard)
        if v is None or v.term != term or v.serving != reporter or v.state is not Sync.CATCHING_UP:
            return []
        return [self._set(replace(v, state=Sync.SYNCED), f"ps:{reporter}'s backup ps:{v.backup} caught up")]


# -- the copies' rules -------------------------------------------------------------------------
class Verdict(enum.Enum):
    ACCEPT = "accept"
    STALE = "stale"  # the sender's term is older than the view's, or the view does not name it: refuse
    ASK = "ask"  # the sender knows a newer term: ask the authority before deciding


def accepts_records(view: ShardView, me: int, sender: int, term: int) -> Verdict:
    """A backup copy on ps ``me``, knowing ``view``, receives records (or a state) of term ``term`` from ps ``sender``."""
    if term > view.term:
        return Verdict.ASK
    if term < view.term or view.serving != sender or view.backup != me:
        return Verdict.STALE
    return Verdict.ACCEPT


def serves(view: ShardView, me: int, request_term: int | None) -> Verdict:
    """A worker's request for the shard reaches ps ``me``, which knows ``view``; the worker last
    saw ``request_term`` (None: it has not seen one yet)."""
    if request_term is not None and request_term > view.term:
        return Verdict.ASK
    return Verdict.ACCEPT if view.serving == me else Verdict.STALE


def takes_over(known: ShardView, new: ShardView, me: int, role_is_backup: bool) -> bool:
    """Whether the copy on ps ``me`` (a backup that knew ``known``) may serve in ``new``: only the
    backup of the term the promotion came from (``new.since - 1``: a copy may learn of it terms
    later), which the authority promotes only when synced (a backup need not have heard that its
    view became synced: it holds that term's records either way). Any other copy named serving misses records."""
    return role_is_backup and new.serving == me and new.since == known.term + 1 and known.backup == me


def keeps_serving(known: ShardView, new: ShardView, me: int) -> bool:
    """Whether a copy that served in ``known`` has served throughout, up to ``new``."""
    return known.serving == me and new.serving == me and new.since <= known.term


class Lease:
    """How long a copy may act on its view without hearing from the authority (monotonic seconds)."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self.until = float("-inf")

    def renewed(self, now: float) -> None:
        self.until = now + self.lease_s

    def valid(self, now: float) -> bool:
        return now < self.until
