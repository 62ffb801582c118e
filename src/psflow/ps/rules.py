"""The update rules of one ps shard as a pure state machine: events in, decisions out.

:class:`ShardRules` keeps a shard's bookkeeping (its version, the workers that are done or lost,
the sync step's pending workers, the ssp clocks and held workers) and decides, for every event,
what the shard does. It holds no tensors, locks, threads or clocks: time comes in as an argument
where a deadline matters. :class:`psflow.ps.store.ParameterStore` drives it under its lock and
carries the decisions out (optimizer steps, copies, condition waits, errors); tests step it by hand.

Events (``ShardRules`` methods; each records an :class:`Event`)::

    configure(settings, version)   the chief's PS_INIT: mode, N and M, staleness, stop step, start version
    push(worker, step)             a gradient computed from version ``step``
    clock(worker, clock)           ssp: ``worker`` starts clock ``clock`` (once per local step)
    clock_expired(worker, clock, waited_s)   ssp: a held worker's wait ran out
    worker_done(worker)            PS_DONE: the worker finished
    worker_lost(worker)            the worker's connections closed without PS_DONE
    worker_back(worker)            a lost worker sent a request again (restarted)
    tick(now)                      time passed (``now``: monotonic seconds): the lost-worker deadline

Decisions (:class:`Act`), in the order the store must carry them out::

    APPLY       update the values with the gradients of ``workers`` (async/ssp: the one pushed;
                sync: the step's quorum, averaged in worker order); ``version`` is the new version
    HOLD        sync: keep ``workers[0]``'s gradient for the step until N arrived;
                ssp: ``workers[0]`` at ``clock`` waits, too far ahead of the slowest
    RELEASE     ssp: a held worker may go on (``slowest`` is the slowest live clock)
    DROP_STALE  sync: the gradient is of an older version, or a second one in a step: dropped
    STOPPED     the version reached the step plan's stop: the push is not applied
    BACK        a lost worker is waited for again
    WAIT_LOST   every other worker is done: the shard now waits for lost ones only, with a deadline
    FAIL        ``reason`` says why: a push from a newer version (to its sender), a lost worker
                that sync without backups cannot step without, an ssp wait or a lost-worker wait past
                its deadline

States of a worker, seen by this shard::

    live --worker_done--> done                     (final: worker_lost after it changes nothing)
    live --worker_lost--> lost --worker_back / push--> live
    live --clock too far ahead--> held --slowest clocks, others done or lost--> live (RELEASE)
                                        --clock_expired--> live (FAIL to that worker)

Modes: async and ssp apply every push at once (APPLY, ``version`` counts pushes). Sync: ``pending``
fills with one push per worker of the current version (HOLD); once it holds ``needed()`` workers
(N; lowered by done workers, and by lost ones where M > N backups stand in) the step is applied
(APPLY, ``version`` grows by one) and later pushes of that version are stale (DROP_STALE). A done
or lost worker may so complete a step. Without backups a lost worker fails the waiting steps
(FAIL, and :meth:`lost_failure` while it stays lost) until it is back. Ssp: a worker at clock c is
held until every live worker's clock is at least c - staleness (a live worker that never reported
a clock counts as 0). A RELEASE stands: a later event does not hold the worker again.

The lost-worker deadline: once every worker is done or lost and some are lost, the first ``tick``
starts the wait (WAIT_LOST); a tick ``lost_worker_timeout_s`` later fails (FAIL); a tick that finds
the wait over (a worker back) resets it.

Sequence numbers: every recorded event and decision takes the next number of the shard's sequence,
the event first, then its decisions. An event that changes nothing (``worker_back`` of a worker
that is not lost, ``worker_lost`` of a done worker, a ``tick`` with nothing to decide) is not
recorded. Given the same events in the same order a ShardRules makes the same decisions with the
same numbers: :meth:`ShardRules.replay` rebuilds a shard's state from its log, the step
primary-backup replication needs. Reads (:meth:`needed`, :meth:`lost_failure`,
:meth:`sync_wait_message`, :meth:`waiting_only_for_lost`) are not events.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from psflow.config import TrainConfig


class On(enum.Enum):
    """The kinds of event."""

    CONFIGURE = "configure"
    PUSH = "push"
    CLOCK = "clock"
    CLOCK_EXPIRED = "clock_expired"
    DONE = "done"
    LOST = "lost"
    BACK = "back"
    TICK = "tick"


class Act(enum.Enum):
    """The kinds of decision (see the module docstring)."""

    APPLY = "apply"
    HOLD = "hold"
    RELEASE = "release"
    DROP_STALE = "drop_stale"
    STOPPED = "stopped"
    BACK = "back"
    WAIT_LOST = "wait_lost"
    FAIL = "fail"


@dataclass(frozen=True)
class RuleSettings:
    """What the rules need of the job's settings (from TrainConfig and the step plan)."""

    mode: str = "async"
    replicas_to_aggregate: int | None = None  # sync: N; None = every worker
    total_num_replicas: int | None = None  # sync: M; None = every worker
    staleness: int = 4
    stop_at: int | None = None  # no update is applied at or past this version
    lost_worker_timeout_s: float = 300.0

    @classmethod
    def of(cls, config: TrainConfig, stop_at: int | None = None) -> RuleSettings:
        return cls(config.mode, config.replicas_to_aggregate, config.total_num_replicas, config.staleness, stop_at,
                   config.lost_worker_timeout_s)


@dataclass(frozen=True, slots=True)
class Event:
    """One event, as recorded. ``value``: PUSH the gradient's version, CLOCK/CLOCK_EXPIRED the clock,
    CONFIGURE the start version. ``seconds``: TICK the time now, CLOCK_EXPIRED the time waited."""

    seq: int
    on: On
    worker: int | None = None
    value: int | None = None
    seconds: float | None = None
    settings: RuleSettings | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """One decision. ``cause`` is the sequence number of the event it answers; ``version`` the
    shard's version after it."""

    seq: int
    act: Act
    cause: int
    version: int
    workers: tuple[int, ...] = ()
    clock: int | None = None  # HOLD/RELEASE (ssp): the clock held
    slowest: int | None = None  # RELEASE: the slowest live clock
    without_all: bool = False  # APPLY (sync): fewer than the M workers not done contributed
    reason: str = ""  # FAIL: the error text; WAIT_LOST: whom the shard waits for


Record = Event | Decision


class ShardRules:
    """The bookkeeping and update rules of one ps shard; see the module docstring.

    Args:
        shard: the ps shard's index (named in reasons).
        num_workers: the training replicas (chief and workers) that push to the shard.
        keep_log: keep every recorded event and decision in ``log`` (for replay and tests). Off, the
            decisions are only returned: a long run would otherwise keep one record per push.

    Example:
        >>> rules = ShardRules(0, 2, keep_log=True)
        >>> _ = rules.configure(RuleSettings(mode="sync"), 0)
        >>> [d.act.name for d in rules.push(0, 0)], [d.act.name for d in rules.push(1, 0)]
        (['HOLD'], ['HOLD', 'APPLY'])
        >>> rules.version
        1
    """

    def __init__(self, shard: int, num_workers: int, *, keep_log: bool = False) -> None:
        self.shard = shard
        self.num_workers = num_workers
        self.settings = RuleSettings.of(TrainConfig())  # before PS_INIT: the defaults the store's config has
        self.configured = False
        self.version = 0
        self.pending: set[int] = set()  # sync: workers whose gradient of this version is held
        self.done: set[int] = set()
        self.lost: set[int] = set()
        self.lost_at: dict[int, int] = {}  # lost worker -> the version when it was lost
        self.clocks: dict[int, int] = {}  # ssp: each live worker's latest clock
        self.held: set[tuple[int, int]] = set()  # ssp: (worker, clock) waiting for the slowest
        self.lost_wait_since: float | None = None  # when only lost workers were left (tick time)
        self.seq = 0  # the last sequence number taken
        self.log: list[Record] | None = [] if keep_log else None

    # -- events ----------------------------------------------------------------------------
    def configure(self, settings: RuleSettings, version: int = 0) -> list[Decision]:
        ev = self._event(On.CONFIGURE, value=version, settings=settings)
        self.settings = settings
        self.version = version
        self.configured = True
        return self._decided(ev, self._release_held(ev))

    def push(self, worker: int, step: int) -> list[Decision]:
        ev = self._event(On.PUSH, worker, step)
        out: list[Decision] = []
        if worker in self.lost:
            self._bring_back(worker)
            out.append(self._decide(ev, Act.BACK, workers=(worker,)))
        stop_at = self.settings.stop_at
        if stop_at is not None and self.version >= stop_at:
            out.append(self._decide(ev, Act.STOPPED, workers=(worker,)))
        elif self.settings.mode != "sync":
            self.version += 1
            out.append(self._decide(ev, Act.APPLY, workers=(worker,)))
        elif step < self.version or worker in self.pending:
            out.append(self._decide(ev, Act.DROP_STALE, workers=(worker,)))
        elif step > self.version:
            out.append(self._decide(ev, Act.FAIL, workers=(worker,), reason=(
                f"worker:{worker} pushed gradients for version {step}, but ps shard {self.shard} is at "
                f"version {self.version}. The worker pulled from a different job or a restarted ps; restart the worker.")))
        else:
            self.pending.add(worker)
            out.append(self._decide(ev, Act.HOLD, workers=(worker,)))
            out.extend(self._maybe_complete_step(ev))
        return self._decided(ev, out)

    def clock(self, worker: int, clock: int) -> list[Decision]:
        ev = self._event(On.CLOCK, worker, clock)
        self.clocks[worker] = clock
        slowest = self._slowest(clock)
        if clock - slowest <= self.settings.staleness:
            out = [self._decide(ev, Act.RELEASE, workers=(worker,), clock=clock, slowest=slowest)]
        else:
            self.held.add((worker, clock))
            out = [self._decide(ev, Act.HOLD, workers=(worker,), clock=clock)]
        return self._decided(ev, out + self._release_held(ev))

    def clock_expired(self, worker: int, clock: int, waited_s: float) -> list[Decision]:
        ev = self._event(On.CLOCK_EXPIRED, worker, clock, seconds=waited_s)
        self.held.discard((worker, clock))
        return self._decided(ev, [self._decide(ev, Act.FAIL, workers=(worker,), clock=clock, reason=(
            f"worker:{worker} at clock {clock} waited {waited_s:.1f} s for the slowest worker "
            f"(clocks {dict(sorted(self.clocks.items()))}, staleness {self.settings.staleness}). A worker is stalled "
            "or dead; raise sync_timeout_s or restart it."))])

    def worker_done(self, worker: int) -> list[Decision]:
        ev = self._event(On.DONE, worker)
        self.done.add(worker)
        self.clocks.pop(worker, None)
        # Fewer live workers lower the number a step needs; the step may now be complete.
        out = self._maybe_complete_step(ev) if self.settings.mode == "sync" else []
        return self._decided(ev, out + self._release_held(ev))

    def worker_lost(self, worker: int) -> list[Decision]:
        """Stop waiting for ``worker`` where the mode allows (async: nothing to do; ssp: it no longer
        holds the others back; sync with backups: steps need one gradient fewer, its held gradient
        leaves with it; sync without backups: waiting steps fail, naming it)."""
        if worker in self.done:
            return []
        ev = self._event(On.LOST, worker)
        self.lost.add(worker)
        self.lost_at.setdefault(worker, self.version)
        self.clocks.pop(worker, None)
        out: list[Decision] = []
        if self.settings.mode == "sync" and self.configured:
            self.pending.discard(worker)
            out.extend(self._maybe_complete_step(ev))
            reason = self.lost_failure()
            if reason is not None:
                out.append(self._decide(ev, Act.FAIL, workers=tuple(sorted(self.lost)), reason=reason))
        return self._decided(ev, out + self._release_held(ev))

    def worker_back(self, worker: int) -> list[Decision]:
        """A lost ``worker`` sent a request again: wait for it as before. Nothing for one not lost."""
        if worker not in self.lost:
            return []
        ev = self._event(On.BACK, worker)
        self._bring_back(worker)
        return self._decided(ev, [self._decide(ev, Act.BACK, workers=(worker,))])

    def tick(self, now: float) -> list[Decision]:
        """Time passed: start, reset or enforce the wait for lost workers (see the module docstring)."""
        lost = self.waiting_only_for_lost()
        timeout_s = self.settings.lost_worker_timeout_s
        if not lost:
            if self.lost_wait_since is None:
                return []
            ev = self._event(On.TICK, seconds=now)
            self.lost_wait_since = None
            return self._decided(ev, [])
        names = ", ".join(f"worker:{w}" for w in lost)
        steps = ", ".join(f"worker:{w} at global step {step}" for w, step in lost.items())
        if self.lost_wait_since is None:
            ev = self._event(On.TICK, seconds=now)
            self.lost_wait_since = now
            return self._decided(ev, [self._decide(ev, Act.WAIT_LOST, workers=tuple(lost), reason=(
                f"waiting for {names} to finish (connection closed without PS_DONE: {steps}); every other worker is "
                f"done. Giving up in {timeout_s:g} s unless it reconnects (lost_worker_timeout_s)."))])
        if now - self.lost_wait_since < timeout_s:
            return []
        ev = self._event(On.TICK, seconds=now)
        return self._decided(ev, [self._decide(ev, Act.FAIL, workers=tuple(lost), reason=(
            f"ps:{self.shard} waited {timeout_s:g} s for {names} to come back (connection closed without PS_DONE: "
            f"{steps}; killed or crashed?); every other worker is done. Restart the lost worker within "
            "lost_worker_timeout_s (--lost-worker-timeout, or in PSFLOW_TRAIN_CONFIG by hand), or see its log "
            "for why it died."))])

    def step(self, event: Event) -> list[Decision]:
        """Apply a recorded ``event`` (of another ShardRules' log): what :meth:`replay` does."""
        on, w, v = event.on, event.worker, event.value
        if on is On.CONFIGURE:
            return self.configure(event.settings or RuleSettings(), v or 0)
        if on is On.PUSH:
            return self.push(_int(w), _int(v))
        if on is On.CLOCK:
            return self.clock(_int(w), _int(v))
        if on is On.CLOCK_EXPIRED:
            return self.clock_expired(_int(w), _int(v), event.seconds or 0.0)
        if on is On.DONE:
            return self.worker_done(_int(w))
        if on is On.LOST:
            return self.worker_lost(_int(w))
        if on is On.BACK:
            return self.worker_back(_int(w))
        return self.tick(event.seconds or 0.0)

    @classmethod
    def replay(cls, shard: int, num_workers: int, log: Iterable[Record]) -> ShardRules:
        """A ShardRules in the state ``log`` (a shard's whole log, from its start) leads to.

        Raises:
            ValueError: a replayed event did not make the decisions the log holds (the log is not
                the whole log of a shard of this size, or its records are out of order).
        """
        rules = cls(shard, num_workers, keep_log=True)
        records = list(log)
        i = 0
        while i < len(records):
            event = records[i]
            j = i + 1
            while j < len(records) and isinstance(records[j], Decision):
                j += 1
            if not isinstance(event, Event) or event.seq != rules.seq + 1:
                raise ValueError(f"Replay expected the event numbered {rules.seq + 1}; the log has {event}. Replay "
                                 "needs a shard's whole log, in order, from its first record.")
            made = rules.step(event)
            if made != records[i + 1:j]:
                raise ValueError(f"Replaying {event} decided {made}; the log holds {records[i + 1:j]}. The log is not "
                                 f"a shard's whole log, or not one of a shard with {num_workers} workers.")
            i = j
        return rules

    # -- reads -----------------------------------------------------------------------------
    def has_backups(self) -> bool:
        n = self.settings.replicas_to_aggregate or self.num_workers
        return n < (self.settings.total_num_replicas or self.num_workers)

    def needed(self) -> int:
        """Sync: the gradients a step needs now."""
        n = self.settings.replicas_to_aggregate or self.num_workers
        # Finished workers lower the quorum; lost ones only where backups stand in for them (without
        # backups a step never goes on without a worker that did not finish: it fails, naming it).
        gone = self.done | self.lost if self.has_backups() else self.done
        return max(1, min(n, self.num_workers - len(gone)))

    def lost_failure(self) -> str | None:
        """Sync without backups with a lost worker: why no step can complete (else None)."""
        if self.settings.mode != "sync" or not self.lost or self.has_backups():
            return None
        names = ", ".join(f"worker:{w}" for w in sorted(self.lost))
        n = self.settings.replicas_to_aggregate or self.num_workers
        return (
            f"{names} lost its connection to ps shard {self.shard} without finishing (killed or crashed?), and sync "
            f"training without backup workers (replicas_to_aggregate = total_num_replicas = {n}) cannot take a step "
            "without it. Restart the run (it resumes from the last checkpoint under a Supervisor), or give it backup "
            "workers (total_num_replicas > replicas_to_aggregate) so that steps go on without a lost worker."
        )

    def sync_wait_message(self, min_version: int, waited_s: float) -> str:
        """Why a wait for ``min_version`` ran out: the gradients the step has and whose are missing."""
        m = self.settings.total_num_replicas or self.num_workers
        missing = sorted(set(range(m)) - self.done - self.lost - self.pending)
        names = ", ".join(f"worker:{w}" for w in missing) or "none"
        n = self.needed()
        return (
            f"Sync step {self.version} on ps shard {self.shard} waited {waited_s:.1f} s for version {min_version}: "
            f"has {len(self.pending)} of {n} gradients; missing {names}. "
            + ("There are no backup workers (replicas_to_aggregate == total_num_replicas). " if n >= m else "")
            + "A worker is dead or stalled: restart it, add backup workers, or raise sync_timeout_s."
        )

    def waiting_only_for_lost(self) -> dict[int, int]:
        """Lost worker -> the version it was lost at, when every other worker is done; else empty."""
        if not self.lost or len(self.done | self.lost) < self.num_workers:
            return {}
        return {w: self.lost_at.get(w, self.version) for w in sorted(self.lost)}

    def is_held(self, worker: int, clock: int) -> bool:
        return (worker, clock) in self.held

    def state(self) -> dict[str, Any]:
        """The bookkeeping as plain data: what a replica must agree on."""
        return {
            "settings": self.settings, "configured": self.configured, "version": self.version,
            "pending": sorted(self.pending), "done": sorted(self.done), "lost": sorted(self.lost),
            "lost_at": dict(sorted(self.lost_at.items())), "clocks": dict(sorted(self.clocks.items())),
            "held": sorted(self.held), "lost_wait_since": self.lost_wait_since, "seq": self.seq,
        }

    # -- internals -------------------------------------------------------------------------
    def _slowest(self, clock: int) -> int:
        """The slowest live clock, seen by a worker at ``clock``: 0 while a live worker has not
        reported one; its own clock when it is the only one left."""
        gone = self.done | self.lost
        live = [c for w, c in self.clocks.items() if w not in gone]
        if self.num_workers - len(gone) - len(live) > 0:
            return 0
        return min(live, default=clock)

    def _release_held(self, ev: Event) -> list[Decision]:
        out = []
        for worker, clock in sorted(self.held):
            slowest = self._slowest(clock)
            if clock - slowest <= self.settings.staleness:
                self.held.discard((worker, clock))
                out.append(self._decide(ev, Act.RELEASE, workers=(worker,), clock=clock, slowest=slowest))
        return out

    def _maybe_complete_step(self, ev: Event) -> list[Decision]:
        if not self.pending or len(self.pending) < self.needed():
            return []
        workers = tuple(sorted(self.pending))
        m = self.settings.total_num_replicas or self.num_workers
        without_all = len(workers) < m - len(self.done)  # lost workers count as missing here
        self.pending.clear()
        self.version += 1
        return [self._decide(ev, Act.APPLY, workers=workers, without_all=without_all)]

    def _bring_back(self, worker: int) -> None:
        self.lost.discard(worker)
        self.lost_at.pop(worker, None)

    def _event(self, on: On, worker: int | None = None, value: int | None = None, *, seconds: float | None = None,
               settings: RuleSettings | None = None) -> Event:
        self.seq += 1
        return Event(self.seq, on, worker, value, seconds, settings)

    def _decide(self, ev: Event, act: Act, **fields: Any) -> Decision:
        self.seq += 1
        return Decision(self.seq, act, ev.seq, self.version, **fields)

    def _decided(self, ev: Event, decisions: list[Decision]) -> list[Decision]:
        if self.log is not None:
            self.log.append(ev)
            self.log.extend(decisions)
        return decisions


def _int(value: int | None) -> int:
    if value is None:
        raise ValueError("A recorded push, clock, done, lost or back event has no worker or value.")
    return value
