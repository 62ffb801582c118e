"""The update rules of one ps shard as a pure state machine: events in, decisions out.

:class:`ShardRules` keeps a shard's bookkeeping (its version, the workers that are done or lost,
the sync step's pending workers, the ssp clocks and held workers) and decides, for every event,
what the shard does. It holds no tensors, locks, threads or clocks: time comes in as an argument
where a deadline matters. :class:`psflow.ps.store.ParameterStore` drives it under its lock and
carries the decisions out (optimizer steps, copies, condition waits, errors); tests step it by hand.

Events (``ShardRules`` methods; each records an :class:`Event`)::

    configure(settings, version)   the chief's PS_INIT: mode, N and M, staleness, stop step, start version
    push(worker, step, attempt, push_seq)   a gradient computed from version ``step``
    clock(worker, clock, attempt, ahead)   ssp: ``worker`` has every step before ``clock`` applied and
                                   computes up to step ``clock + ahead`` from the values it reads next
    clock_expired(worker, clock, waited_s)   ssp: a held worker's wait ran out
    worker_done(worker, attempt, stays)   PS_DONE: the worker finished (stays: its training, but it
                                   has duties left: the chief's final checkpoint; a PS_DONE without follows)
    worker_failed(worker, attempt, why)   PS_DONE naming an error: the worker stopped without finishing
    worker_lost(worker)            the worker's connections closed without PS_DONE
    never_connected(worker, waited_s)   the worker sent nothing for lost_worker_timeout_s since the ps started
    worker_back(worker)            a lost worker sent a request again
    join(worker, attempt)          PS_READY of a training replica: ``attempt`` is its restart count
    tick(now)                      time passed (``now``: monotonic seconds): the lost-worker deadline
    take_over()                    replication: this copy (a backup) serves the shard now; its primary died
    resize(num_workers)            the job's membership is now replicas 0..num_workers-1 (``psflow scale``)

The decisions (:class:`Act`: APPLY, HOLD, DROP_STALE, DUPLICATE, ...), the order the store carries
them out, and the reasons for each rule: ``docs/design/ps-rules.md``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from psflow.config import TrainConfig
from psflow.modes import Mode, PsMode
from psflow.ps.membership import scaled_quorum


class On(enum.Enum):
    """The kinds of event."""

    CONFIGURE = "configure"
    PUSH = "push"
    CLOCK = "clock"
    CLOCK_EXPIRED = "clock_expired"
    DONE = "done"
    LOST = "lost"
    BACK = "back"
    JOIN = "join"
    TICK = "tick"
    TAKEOVER = "takeover"
    RESIZE = "resize"


# The ``value`` of a DONE event whose worker stays (for its final duties), not done with the shard yet
STAYS = 1
# The ``value`` of a LOST event: why the worker is lost (None: its connections closed without PS_DONE).
FAILED = 1  # its PS_DONE said it stopped on an error
NEVER_CONNECTED = 2  # it sent nothing within lost_worker_timeout_s of the shard's start


class Act(enum.Enum):
    """The kinds of decision (see the module docstring)."""

    APPLY = "apply"
    HOLD = "hold"
    RELEASE = "release"
    DROP_STALE = "drop_stale"
    STOPPED = "stopped"
    BACK = "back"
    REJOINED = "rejoined"
    SUPERSEDED = "superseded"
    DUPLICATE = "duplicate"
    WAIT_LOST = "wait_lost"
    FAIL = "fail"
    RETIRED = "retired"


@dataclass(frozen=True)
class RuleSettings:
    """What the rules need of the job's settings (from TrainConfig and the step plan)."""

    mode: Mode = Mode.ASYNC  # text is taken too: RuleSettings(mode="sync")
    replicas_to_aggregate: int | None = None  # sync: N; None = every worker
    total_num_replicas: int | None = None  # sync: M; None = every worker
    staleness: int = 4
    stop_at: int | None = None  # no update is applied at or past this version
    lost_worker_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))

    @property
    def rules(self) -> PsMode:
        """What the ps does in this mode (when a push is applied, whether clocks are kept)."""
        return self.mode.ps

    @classmethod
    def of(cls, config: TrainConfig, stop_at: int | None = None) -> RuleSettings:
        return cls(config.mode, config.replicas_to_aggregate, config.total_num_replicas, config.staleness, stop_at,
                   config.lost_worker_timeout_s)


@dataclass(frozen=True, slots=True)
class Event:
    """One event, as recorded. ``value``: PUSH the gradient's version, CLOCK/CLOCK_EXPIRED the clock,
    CONFIGURE the start version, RESIZE the new number of replicas. ``seconds``: TICK the time now, CLOCK_EXPIRED the time waited."""

    seq: int
    on: On
    worker: int | None = None
    value: int | None = None
    seconds: float | None = None
    settings: RuleSettings | None = None
    attempt: int = 0  # PUSH, CLOCK, DONE, JOIN: the sender's attempt (its restart count)
    push_seq: int | None = None  # PUSH: the sender's push number within its attempt (None: no dedup)
    redone: bool = False  # PUSH (async, ssp): a batch this shard applied already (see "Duplicate pushes")
    # LOST of a failed worker: its error, for messages only (decisions never depend on it; a backup copy,
    # whose records carry no text, says "see its log" instead)
    note: str = ""
    ahead: int = 0  # CLOCK: the steps past ``value`` the worker computes before it reads fresher values


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
    reason: str = ""  # FAIL, SUPERSEDED: the error text; WAIT_LOST: whom the shard waits for
    attempt: int | None = None  # REJOINED: the new attempt; SUPERSEDED: the older attempt refused
    outcome: Act | None = None  # DUPLICATE: what the shard decided for the push the first time


Record = Event | Decision


class ShardRules:
    """The bookkeeping and update rules of one ps shard; see the module docstring.

    Args:
        shard: the ps shard's index (named in reasons).
        num_workers: the training replicas (chief and workers) that push to the shard.
        launch_workers: the replicas the job was launched with (what the sync settings N and M were
            written for; default ``num_workers``); a later :meth:`resize` changes ``num_workers`` only.
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

    def __init__(self, shard: int, num_workers: int, *, keep_log: bool = False, launch_workers: int | None = None) -> None:
        self.shard = shard
        self.num_workers = num_workers
        self.launch_workers = launch_workers or num_workers
        self.joining: set[int] = set()  # members a resize added that have not joined (PS_READY) yet
        self.settings = RuleSettings.of(TrainConfig())  # before PS_INIT: the defaults the store's config has
        self.configured = False
        self.version = 0
        self.pending: set[int] = set()  # sync: workers whose gradient of this version is held
        self.done: set[int] = set()
        self.lost: set[int] = set()
        self.lost_at: dict[int, int] = {}  # lost worker -> the version when it was lost
        self.clocks: dict[int, int] = {}  # ssp: each live worker's latest clock
        self.held: set[tuple[int, int]] = set()  # ssp: (worker, clock) waiting for the slowest
        self.ahead: dict[int, int] = {}  # ssp: each worker's ``ahead`` of its latest clock (the pipeline: 1 or 2)
        self.lost_clocks: dict[int, int] = {}  # ssp: a lost worker's last clock (where a new attempt resumes)
        self.attempts: dict[int, int] = {}  # worker -> its newest attempt seen (absent: 0)
        self.last_push: dict[int, tuple[int, int, Act]] = {}  # worker -> (attempt, push_seq, outcome) of its last push
        self.lost_wait_since: float | None = None  # when only lost workers were left (tick time)
        self.failed: set[int] = set()  # lost workers whose PS_DONE said they stopped on an error
        self.staying: set[int] = set()  # done workers whose last PS_DONE is still to come (final duties)
        self.never: set[int] = set()  # lost workers that never sent a request (never_connected)
        self.why: dict[int, str] = {}  # failed worker -> its error, as it said (messages only)
        self.by_hand = False  # no launcher restarts a failed worker (see "The lost-worker deadline")
        # Workers that sent anything (not state: a copy that took over knows those of the records it followed)
        self.heard: set[int] = set()
        self.seq = 0  # the last sequence number taken
        self.log: list[Record] | None = [] if keep_log else None

    # -- events ----------------------------------------------------------------------------
    def configure(self, settings: RuleSettings, version: int = 0) -> list[Decision]:
        ev = self._event(On.CONFIGURE, value=version, settings=settings)
        self.settings = settings
        self.version = version
        self.configured = True
        return self._decided(ev, self._release_held(ev))

    def push(self, worker: int, step: int, attempt: int = 0, push_seq: int | None = None,
             redone: bool = False) -> list[Decision]:
        """A gradient computed from version ``step`` by ``worker``'s attempt ``attempt``; ``push_seq``
        numbers the attempt's pushes (a resent push keeps its number and is a DUPLICATE); ``redone``:
        its batch was applied here already (async, ssp: a DUPLICATE of an APPLY)."""
        redone = redone and self.settings.rules.applies_each_push
        ev = self._event(On.PUSH, worker, step, attempt=attempt, push_seq=push_seq, redone=redone)
        refused = self._retired(ev, worker, "push") or self._superseded(ev, worker, attempt, "push")
        if refused is not None:
            return self._decided(ev, [refused])
        out = self._admit(ev, worker) + self._join(ev, worker, attempt)
        if worker in self.lost:
            self._bring_back(worker)
            out.append(self._decide(ev, Act.BACK, workers=(worker,)))
        last = self.last_push.get(worker)
        if push_seq is not None and last is not None and (attempt, push_seq) <= last[:2]:
            out.append(self._decide(ev, Act.DUPLICATE, workers=(worker,), outcome=last[2]))
            return self._decided(ev, out)
        if redone:
            out.append(self._decide(ev, Act.DUPLICATE, workers=(worker,), outcome=Act.APPLY))
            if push_seq is not None:
                self.last_push[worker] = (attempt, push_seq, Act.APPLY)
            return self._decided(ev, out)
        decided = len(out)
        self._push_rules(ev, worker, step, out)
        if push_seq is not None and out[decided].act is not Act.FAIL:
            self.last_push[worker] = (attempt, push_seq, out[decided].act)
        return self._decided(ev, out)

    def _push_rules(self, ev: Event, worker: int, step: int, out: list[Decision]) -> None:
        stop_at = self.settings.stop_at
        if stop_at is not None and self.version >= stop_at:
            out.append(self._decide(ev, Act.STOPPED, workers=(worker,)))
        elif self.settings.rules.applies_each_push:
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

    def clock(self, worker: int, clock: int, attempt: int = 0, ahead: int = 0) -> list[Decision]:
        """``worker`` has every step before ``clock`` applied (the clock the others' bound sees) and will
        compute steps up to ``clock + ahead`` from values read after the release (0 without the pipeline;
        see psflow.train.pipeline): released once ``clock + ahead`` is within staleness of the slowest."""
        ev = self._event(On.CLOCK, worker, clock, attempt=attempt, ahead=ahead)
        refused = self._retired(ev, worker, "clock") or self._superseded(ev, worker, attempt, "clock")
        if refused is not None:
            return self._decided(ev, [refused])
        joined = self._admit(ev, worker) + self._join(ev, worker, attempt)
        self.clocks[worker] = clock
        self.ahead[worker] = ahead
        slowest = self._slowest(clock)
        if clock + ahead - slowest <= self.settings.staleness:
            out = [self._decide(ev, Act.RELEASE, workers=(worker,), clock=clock, slowest=slowest)]
        else:
            self.held.add((worker, clock))
            out = [self._decide(ev, Act.HOLD, workers=(worker,), clock=clock)]
        return self._decided(ev, joined + out + self._release_held(ev))

    def clock_expired(self, worker: int, clock: int, waited_s: float) -> list[Decision]:
        ev = self._event(On.CLOCK_EXPIRED, worker, clock, seconds=waited_s)
        self.held.discard((worker, clock))
        ahead = self.ahead.get(worker, 0)
        counted = f" (and {ahead} pipelined step{'s' if ahead > 1 else ''} ahead)" if ahead else ""
        return self._decided(ev, [self._decide(ev, Act.FAIL, workers=(worker,), clock=clock, reason=(
            f"worker:{worker} at clock {clock}{counted} waited {waited_s:.1f} s for the slowest worker "
            f"(clocks {dict(sorted(self.clocks.items()))}, staleness {self.settings.staleness}). A worker is stalled "
            "or dead; raise sync_timeout_s or restart it."))])

    def worker_done(self, worker: int, attempt: int = 0, stays: bool = False) -> list[Decision]:
        """PS_DONE: ``worker`` finished; with ``stays``, its training only (see "staying" above)."""
        if worker >= self.num_workers:
            return []  # a retired worker's PS_DONE: it is not waited for already
        ev = self._event(On.DONE, worker, STAYS if stays else None, attempt=attempt)
        superseded = self._superseded(ev, worker, attempt, "PS_DONE")
        if superseded is not None:
            return self._decided(ev, [superseded])
        self.attempts[worker] = attempt  # not older than its newest: that one was SUPERSEDED above
        self.joining.discard(worker)
        self.done.add(worker)
        if stays:
            self.staying.add(worker)
        else:
            self.staying.discard(worker)
        self.clocks.pop(worker, None)
        # Fewer live workers lower the number a step needs; the step may now be complete.
        out = self._maybe_complete_step(ev) if self.settings.rules.waits_for_quorum else []
        return self._decided(ev, out + self._release_held(ev))

    def worker_lost(self, worker: int) -> list[Decision]:
        """Stop waiting for ``worker`` where the mode allows (async: nothing to do; ssp: it no longer
        holds the others back; sync: its held gradient leaves with it, and with backups steps need
        one gradient fewer; without backups the step stays held for it until its deadline or until
        it comes back)."""
        if worker in self.done or worker >= self.num_workers or worker in self.joining:
            return []  # finished, retired, or never joined: nobody waits for it
        return self._lose(self._event(On.LOST, worker))

    def worker_failed(self, worker: int, attempt: int = 0, why: str = "") -> list[Decision]:
        """PS_DONE of a worker that stopped on an error (``why``): it did not finish, so it is lost,
        not done (a launcher may restart it; a done worker is never waited for again). An older
        attempt's is SUPERSEDED."""
        if worker in self.done or worker >= self.num_workers or worker in self.joining:
            return []
        ev = self._event(On.LOST, worker, FAILED, attempt=attempt, note=why)
        superseded = self._superseded(ev, worker, attempt, "PS_DONE")
        if superseded is not None:
            return self._decided(ev, [superseded])
        self.attempts[worker] = attempt  # not older than its newest: that one was SUPERSEDED above
        self.failed.add(worker)
        self.why[worker] = why
        return self._lose(ev)

    def never_connected(self, worker: int, waited_s: float) -> list[Decision]:
        """``worker`` sent nothing in the ``waited_s`` since the shard started: count it lost."""
        if worker in self.done or worker in self.lost or worker >= self.num_workers or worker in self.joining:
            return []
        ev = self._event(On.LOST, worker, NEVER_CONNECTED, seconds=waited_s)
        self.never.add(worker)
        return self._lose(ev)

    def _lose(self, ev: Event) -> list[Decision]:
        worker = _int(ev.worker)
        self.lost.add(worker)
        self.lost_at.setdefault(worker, self.version)
        if worker in self.clocks:
            self.lost_clocks[worker] = self.clocks.pop(worker)
        out: list[Decision] = []
        if self.settings.rules.waits_for_quorum and self.configured:
            if worker in self.pending:
                self.pending.discard(worker)
                # Its held gradient left: the same push, resent after a reconnect, is taken again.
                self.last_push.pop(worker, None)
            out.extend(self._maybe_complete_step(ev))
        return self._decided(ev, out + self._release_held(ev))

    def join(self, worker: int, attempt: int = 0) -> list[Decision]:
        """``worker``'s attempt ``attempt`` asked for readiness. A newer attempt than any seen is a
        restarted worker: REJOINED (its earlier attempt's held gradient and ssp waits leave; ssp: it
        resumes at :meth:`resume_clock`); an older one is SUPERSEDED; the same one changes nothing
        but bringing a lost worker back."""
        known = self.attempts.get(worker, 0)
        if attempt == known and worker not in self.lost and worker not in self.joining and worker < self.num_workers:
            self.heard.add(worker)
            return []
        ev = self._event(On.JOIN, worker, attempt=attempt)
        refused = self._retired(ev, worker, "readiness request") or self._superseded(ev, worker, attempt, "readiness request")
        if refused is not None:
            return self._decided(ev, [refused])
        out = self._admit(ev, worker) + self._join(ev, worker, attempt)
        if worker in self.lost:
            self._bring_back(worker)
            out.append(self._decide(ev, Act.BACK, workers=(worker,)))
        return self._decided(ev, out)

    def worker_back(self, worker: int) -> list[Decision]:
        """A lost ``worker`` sent a request again: wait for it as before. Nothing for one not lost."""
        if worker not in self.lost:  # (a resize forgets the workers it retires: a lost one is a member)
            return []
        ev = self._event(On.BACK, worker)
        self._bring_back(worker)
        return self._decided(ev, [self._decide(ev, Act.BACK, workers=(worker,))])

    def tick(self, now: float) -> list[Decision]:
        """Time passed: start, reset or enforce the wait for lost workers (see the module docstring)."""
        lost = self.waiting_only_for_lost()
        timeout_s = self.settings.lost_worker_timeout_s
        if not lost and self.staying and len(self.done) >= self.num_workers:
            return self._wait_for_staying(now)
        if not lost:
            if self.lost_wait_since is None:
                return []
            ev = self._event(On.TICK, seconds=now)
            self.lost_wait_since = None
            return self._decided(ev, [])
        hopeless = self._hopeless(lost)
        if hopeless is not None:
            ev = self._event(On.TICK, seconds=now)
            return self._decided(ev, [self._decide(ev, Act.FAIL, workers=tuple(lost), reason=hopeless)])
        names = ", ".join(f"worker:{w}" for w in lost)
        if self.lost_wait_since is None:
            ev = self._event(On.TICK, seconds=now)
            self.lost_wait_since = now
            return self._decided(ev, [self._decide(ev, Act.WAIT_LOST, workers=tuple(lost), reason=(
                f"waiting for {names} to finish ({self._why_lost(lost)}){self._others_finished()}. "
                f"Giving up in {timeout_s:g} s unless it reconnects (lost_worker_timeout_s)."))])
        waited_s = now - self.lost_wait_since
        if waited_s < timeout_s:
            return []
        ev = self._event(On.TICK, seconds=now)
        return self._decided(ev, [self._decide(ev, Act.FAIL, workers=tuple(lost), reason=(
            f"ps:{self.shard} waited {waited_s:.1f} s for {names} to come back ({self._why_lost(lost)})"
            f"{self._others_finished()}. Restart a lost worker within lost_worker_timeout_s ({timeout_s:g} s; "
            "--lost-worker-timeout, or in PSFLOW_TRAIN_CONFIG by hand), or see its log for why it stopped."))])

    def _wait_for_staying(self, now: float) -> list[Decision]:
        """Every worker is done; a staying one has its final duties to do, quietly, up to the deadline."""
        if self.lost_wait_since is None:
            ev = self._event(On.TICK, seconds=now)
            self.lost_wait_since = now
            return self._decided(ev, [])
        waited_s = now - self.lost_wait_since
        if waited_s < self.settings.lost_worker_timeout_s:
            return []
        names = ", ".join(f"worker:{w}" for w in sorted(self.staying))
        ev = self._event(On.TICK, seconds=now)
        return self._decided(ev, [self._decide(ev, Act.FAIL, workers=tuple(sorted(self.staying)), reason=(
            f"ps:{self.shard} waited {waited_s:.1f} s for {names} to end after every worker finished training: it "
            "said it stays for its final duties (the chief's final checkpoint) and never said it is done (killed, or "
            f"stuck?); lost_worker_timeout_s is {self.settings.lost_worker_timeout_s:g} s. See its log."))])

    def is_finished(self) -> bool:
        """Every worker is done, and none stays for its final duties: the shard has nobody left to serve."""
        return len(self.done) >= self.num_workers and not self.staying

    def _why_lost(self, lost: dict[int, int]) -> str:
        """Each lost worker, where it was lost and why, for the lost-worker messages."""
        return "; ".join(f"worker:{w} at global step {step}: {self._cause(w)}" for w, step in lost.items())

    def _others_finished(self, sep: str = "; ") -> str:
        """"every other worker has finished", where one did (with only lost workers, nobody did)."""
        return f"{sep}every other worker has finished" if self.done - self.lost else ""

    def _cause(self, worker: int, closed: str = "its connection closed without PS_DONE: killed or crashed?") -> str:
        """What this shard knows of why lost ``worker`` is lost (``closed``: what it says of a closed connection)."""
        if worker in self.never:
            return "never connected"
        if worker in self.failed:
            return f"stopped on an error: {self.why.get(worker) or 'see its log'}"
        return closed

    def _hopeless(self, lost: dict[int, int]) -> str | None:
        """Why waiting for the ``lost`` workers cannot end well, or None (see "The lost-worker deadline")."""
        timeout_s = self.settings.lost_worker_timeout_s
        if all(w in self.never for w in lost):
            names = ", ".join(f"worker:{w}" for w in lost)
            return (f"ps:{self.shard} gave up on {names}: never connected within lost_worker_timeout_s "
                    f"({timeout_s:g} s) of the ps's start{self._others_finished(', and ')}. Start it with the "
                    "same cluster flags (is its host or port right?), or raise lost_worker_timeout_s "
                    "(--lost-worker-timeout, or in PSFLOW_TRAIN_CONFIG by hand).")
        if self.by_hand and not self.done and all(w in self.failed | self.never for w in lost):
            # In the order they stopped: the first one's error is the root cause.
            order = [w for w in self.why if w in lost] + [w for w in lost if w not in self.why]
            return (f"ps:{self.shard} has no worker left to serve: every one stopped without finishing, and no "
                    f"launcher restarts them. In the order they stopped (the first is the root cause): "
                    f"{self._why_lost({w: lost[w] for w in order})}. Fix the cause, then start the job again.")
        return None

    def take_over(self) -> list[Decision]:
        """A backup serves the shard now (its primary died): the sync gradients held for the step
        lived on the primary only, so their workers' pushes are taken again when resent (their push
        numbers are forgotten with them, as a lost worker's are). Nothing is decided."""
        ev = self._event(On.TAKEOVER)
        for worker in self.pending:
            self.last_push.pop(worker, None)
        self.pending.clear()
        return self._decided(ev, [])

    def resize(self, num_workers: int) -> list[Decision]:
        """The job's membership is now replicas ``0 .. num_workers-1`` (``psflow scale``): new ones
        join (counted once they are ready), the highest ones retire (see the module docstring)."""
        if num_workers < 1:
            raise ValueError(f"A ps shard needs at least one training replica; a resize to {num_workers} was asked.")
        if num_workers == self.num_workers:
            return []
        ev = self._event(On.RESIZE, value=num_workers)
        old, out = self.num_workers, []
        if num_workers > old:
            self.joining |= set(range(old, num_workers))
        else:
            gone = set(range(num_workers, old))
            out = [self._decide(ev, Act.RETIRED, workers=(w,), clock=c, reason=(
                f"worker index {w} was waiting at clock {c} on ps shard {self.shard} when a scale request retired it."))
                for w, c in sorted(self.held) if w in gone]
            self.held -= {(w, c) for w, c in self.held if w in gone}
            self.pending -= gone
            self.joining -= gone
            for w in gone:
                self.done.discard(w)
                self.lost.discard(w)
                for book in (self.lost_at, self.clocks, self.lost_clocks, self.last_push):
                    book.pop(w, None)
            out.append(self._decide(ev, Act.RETIRED, workers=tuple(sorted(gone))))
        self.num_workers = num_workers
        if self.settings.rules.waits_for_quorum and self.configured:
            out.extend(self._maybe_complete_step(ev))  # fewer members: the step may be complete now
        return self._decided(ev, out + self._release_held(ev))

    def step(self, event: Event) -> list[Decision]:
        """Apply a recorded ``event`` (of another ShardRules' log): what :meth:`replay` does."""
        on, w, v = event.on, event.worker, event.value
        if on is On.CONFIGURE:
            return self.configure(event.settings or RuleSettings(), v or 0)
        if on is On.PUSH:
            return self.push(_int(w), _int(v), event.attempt, event.push_seq, event.redone)
        if on is On.CLOCK:
            return self.clock(_int(w), _int(v), event.attempt, event.ahead)
        if on is On.CLOCK_EXPIRED:
            return self.clock_expired(_int(w), _int(v), event.seconds or 0.0)
        if on is On.DONE:
            return self.worker_done(_int(w), event.attempt, v == STAYS)
        if on is On.LOST and v == FAILED:
            return self.worker_failed(_int(w), event.attempt, event.note)
        if on is On.LOST and v == NEVER_CONNECTED:
            return self.never_connected(_int(w), event.seconds or 0.0)
        if on is On.LOST:
            return self.worker_lost(_int(w))
        if on is On.BACK:
            return self.worker_back(_int(w))
        if on is On.JOIN:
            return self.join(_int(w), event.attempt)
        if on is On.TAKEOVER:
            return self.take_over()
        if on is On.RESIZE:
            return self.resize(_int(v))
        return self.tick(event.seconds or 0.0)

    @classmethod
    def replay(cls, shard: int, num_workers: int, log: Iterable[Record], *, launch_workers: int | None = None) -> ShardRules:
        """A ShardRules in the state ``log`` (a shard's whole log, from its start) leads to.

        Raises:
            ValueError: a replayed event did not make the decisions the log holds (the log is not
                the whole log of a shard of this size, or its records are out of order).
        """
        rules = cls(shard, num_workers, keep_log=True, launch_workers=launch_workers)
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
    def quorum(self) -> tuple[int, int]:
        """Sync: ``(N, M)`` for the joined membership (:func:`psflow.ps.membership.scaled_quorum`)."""
        return scaled_quorum(self.settings.replicas_to_aggregate, self.settings.total_num_replicas,
                             launch=self.launch_workers, now=self.num_workers - len(self.joining))

    def has_backups(self) -> bool:
        n, m = self.quorum()
        return n < m

    def needed(self) -> int:
        """Sync: the gradients a step needs now."""
        n, m = self.quorum()
        # Finished workers lower the quorum; lost ones only where backups stand in for them (without
        # backups a step never goes on without a worker that did not finish: it fails, naming it).
        gone = self.done | self.lost if n < m else self.done
        return max(1, min(n, self.num_workers - len(self.joining) - len(gone)))

    def lost_hold_message(self, waited_s: float) -> str | None:
        """Sync without backups with a lost worker: why the step is held (else None)."""
        if not self.settings.rules.waits_for_quorum or not self.lost or self.has_backups():
            return None
        names = ", ".join(f"worker:{w}" for w in sorted(self.lost))
        causes = "; ".join(self._cause(w, closed="killed or crashed?") for w in sorted(self.lost))
        n = self.quorum()[0]
        return (
            f"{names} lost its connection to ps shard {self.shard} without finishing ({causes}), and sync "
            f"training without backup workers (replicas_to_aggregate = total_num_replicas = {n}) cannot take a step "
            f"without it: step {self.version} was held {waited_s:.1f} s (sync_timeout_s) for it to come back. Restart "
            "lost workers (psflow run --restart on-failure), or give the job backup workers (total_num_replicas > "
            "replicas_to_aggregate) so that steps go on without a lost worker."
        )

    def resume_clock(self, worker: int) -> int:
        """Ssp: the clock a new attempt of ``worker`` starts at: its last recorded clock, or the
        slowest clock of the other live workers if that is later (it pulls the newest values, so it
        is as fresh as they are; it never starts behind the clock it had)."""
        own = self.clocks.get(worker, self.lost_clocks.get(worker, 0))
        gone = self.done | self.lost
        others = [c for w, c in self.clocks.items() if w != worker and w not in gone]
        return max([own] + ([min(others)] if others else []))

    def sync_wait_message(self, min_version: int, waited_s: float) -> str:
        """Why a wait for ``min_version`` ran out: the gradients the step has and whose are missing
        (a lost worker without backups: :meth:`lost_hold_message`)."""
        held_for_lost = self.lost_hold_message(waited_s)
        if held_for_lost is not None:
            return held_for_lost
        m = self.quorum()[1]
        missing = sorted(set(range(self.num_workers)) - self.done - self.lost - self.pending - self.joining)
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

    def unheard(self) -> list[int]:
        """Members that never sent anything and are neither done, lost nor joining (a resize's)."""
        gone = self.heard | self.done | self.lost | self.joining
        return [w for w in range(self.num_workers) if w not in gone]

    def is_held(self, worker: int, clock: int) -> bool:
        return (worker, clock) in self.held

    def state(self) -> dict[str, Any]:
        """The bookkeeping as plain data: what a replica must agree on."""
        return {
            "settings": self.settings, "configured": self.configured, "version": self.version,
            "pending": sorted(self.pending), "done": sorted(self.done), "lost": sorted(self.lost),
            "lost_at": dict(sorted(self.lost_at.items())), "clocks": dict(sorted(self.clocks.items())),
            "held": sorted(self.held), "ahead": dict(sorted(self.ahead.items())),
            "lost_wait_since": self.lost_wait_since, "seq": self.seq,
            "lost_clocks": dict(sorted(self.lost_clocks.items())), "attempts": dict(sorted(self.attempts.items())),
            "last_push": dict(sorted(self.last_push.items())),
            "num_workers": self.num_workers, "launch_workers": self.launch_workers, "joining": sorted(self.joining),
            "failed": sorted(self.failed), "never": sorted(self.never), "staying": sorted(self.staying),
        }

    def export(self) -> dict[str, Any]:
        """The whole state as plain JSON data (a full state transfer to a re-syncing backup):
        :meth:`restore` of it gives a ShardRules whose :meth:`state` is this one's."""
        st = self.state()
        return {
            **st, "settings": dataclasses.asdict(self.settings),
            "lost_at": _keyed(self.lost_at), "clocks": _keyed(self.clocks), "lost_clocks": _keyed(self.lost_clocks),
            "attempts": _keyed(self.attempts), "held": [list(h) for h in sorted(self.held)], "ahead": _keyed(self.ahead),
            "last_push": {str(w): [a, s, act.value] for w, (a, s, act) in sorted(self.last_push.items())},
        }

    @classmethod
    def restore(cls, shard: int, num_workers: int, data: dict[str, Any]) -> ShardRules:
        """A ShardRules in the state :meth:`export` wrote (the log starts empty)."""
        rules = cls(shard, num_workers)
        rules.settings = RuleSettings(**data["settings"])
        rules.configured = bool(data["configured"])
        rules.version, rules.seq = int(data["version"]), int(data["seq"])
        rules.pending, rules.done, rules.lost = ({int(w) for w in data[k]} for k in ("pending", "done", "lost"))
        rules.lost_at, rules.clocks, rules.lost_clocks, rules.attempts = (
            {int(w): int(v) for w, v in data[k].items()} for k in ("lost_at", "clocks", "lost_clocks", "attempts"))
        rules.held = {(int(w), int(c)) for w, c in data["held"]}
        rules.ahead = {int(w): int(a) for w, a in (data.get("ahead") or {}).items()}
        rules.num_workers = int(data.get("num_workers", num_workers))
        rules.launch_workers = int(data.get("launch_workers", rules.launch_workers))
        rules.joining = {int(w) for w in data.get("joining", ())}
        rules.failed, rules.never, rules.staying = (
            {int(w) for w in data.get(k, ())} for k in ("failed", "never", "staying"))
        rules.last_push = {int(w): (int(a), int(s), Act(act)) for w, (a, s, act) in data["last_push"].items()}
        since = data["lost_wait_since"]
        rules.lost_wait_since = None if since is None else float(since)
        return rules

    # -- internals -------------------------------------------------------------------------
    def _slowest(self, clock: int) -> int:
        """The slowest live clock, seen by a worker at ``clock``: 0 while a live worker has not
        reported one; its own clock when it is the only one left."""
        gone = self.done | self.lost
        live = [c for w, c in self.clocks.items() if w not in gone]
        if self.num_workers - len(self.joining) - len(gone) - len(live) > 0:
            return 0
        return min(live, default=clock)

    def _release_held(self, ev: Event) -> list[Decision]:
        out = []
        for worker, clock in sorted(self.held):
            slowest = self._slowest(clock)
            if clock + self.ahead.get(worker, 0) - slowest <= self.settings.staleness:
                self.held.discard((worker, clock))
                out.append(self._decide(ev, Act.RELEASE, workers=(worker,), clock=clock, slowest=slowest))
        return out

    def _maybe_complete_step(self, ev: Event) -> list[Decision]:
        if not self.pending or len(self.pending) < self.needed():
            return []
        workers = tuple(sorted(self.pending))
        m = self.quorum()[1]
        without_all = len(workers) < m - len(self.done)  # lost workers count as missing here
        self.pending.clear()
        self.version += 1
        return [self._decide(ev, Act.APPLY, workers=workers, without_all=without_all)]

    def _bring_back(self, worker: int) -> None:
        self.lost.discard(worker)
        self.failed.discard(worker)
        self.never.discard(worker)
        self.why.pop(worker, None)
        self.lost_at.pop(worker, None)
        if worker in self.lost_clocks:  # ssp: back at the clock it had, not at 0
            self.clocks[worker] = self.lost_clocks.pop(worker)

    def _retired(self, ev: Event, worker: int, what: str) -> Decision | None:
        """RETIRED if a resize took ``worker`` out of the membership: its request is refused."""
        if worker < self.num_workers:
            return None
        return self._decide(ev, Act.RETIRED, workers=(worker,), reason=(
            f"ps shard {self.shard} refused a {what} of worker index {worker}: a scale request retired it (the job has "
            f"{self.num_workers} training replicas now, 0..{self.num_workers - 1}). A retired worker stops; nothing "
            "is lost (its shard is not read while it is retired)."))

    def _admit(self, ev: Event, worker: int) -> list[Decision]:
        """A member a resize added is ready (or sent its first request): counted from now on (ssp: at
        the slowest live clock). REJOINED, with the attempt and (ssp) the clock; nothing for others."""
        if worker not in self.joining:
            return []
        self.joining.discard(worker)
        self.lost.discard(worker)
        clock = None
        if self.settings.rules.keeps_clocks:
            clock = self.resume_clock(worker)
            self.lost_clocks.pop(worker, None)
            self.clocks[worker] = clock
        return [self._decide(ev, Act.REJOINED, workers=(worker,), attempt=ev.attempt, clock=clock)]

    def _superseded(self, ev: Event, worker: int, attempt: int, what: str) -> Decision | None:
        """SUPERSEDED if ``attempt`` is older than ``worker``'s newest: its request is dropped."""
        newest = self.attempts.get(worker, 0)
        if attempt >= newest:
            return None
        return self._decide(ev, Act.SUPERSEDED, workers=(worker,), attempt=attempt, reason=(
            f"ps shard {self.shard} dropped a {what} of worker:{worker} attempt {attempt}: attempt {newest} of "
            f"worker:{worker} has joined since (the task was restarted). An earlier attempt of a task that is still "
            "running must stop; its work is redone by the newer one."))

    def _join(self, ev: Event, worker: int, attempt: int) -> list[Decision]:
        """A newer attempt of ``worker`` takes over (else nothing): what its earlier attempt left on
        this shard leaves with it (its held sync gradient, its held ssp clocks, its push numbers)."""
        old = self.attempts.get(worker, 0)
        if attempt <= old:
            return []
        self.attempts[worker] = attempt
        self.last_push.pop(worker, None)
        self.pending.discard(worker)
        out = [self._decide(ev, Act.SUPERSEDED, workers=(worker,), clock=c, attempt=old, reason=(
            f"worker:{worker} attempt {old} was waiting at clock {c} when attempt {attempt} joined: it was restarted."))
            for w, c in sorted(self.held) if w == worker]
        self.held -= {(w, c) for w, c in self.held if w == worker}
        clock = None
        if self.settings.rules.keeps_clocks:
            clock = self.resume_clock(worker)
            self.lost_clocks.pop(worker, None)
            if worker not in self.lost:
                self.clocks[worker] = clock
        out.append(self._decide(ev, Act.REJOINED, workers=(worker,), attempt=attempt, clock=clock))
        if worker in self.lost:
            self._bring_back(worker)
            out.append(self._decide(ev, Act.BACK, workers=(worker,)))
            if clock is not None:
                self.clocks[worker] = clock
        return out + self._release_held(ev)

    def _event(self, on: On, worker: int | None = None, value: int | None = None, *, seconds: float | None = None,
               settings: RuleSettings | None = None, attempt: int = 0, push_seq: int | None = None,
               redone: bool = False, note: str = "", ahead: int = 0) -> Event:
        self.seq += 1
        if worker is not None and not (on is On.LOST and value == NEVER_CONNECTED):
            self.heard.add(worker)
        return Event(self.seq, on, worker, value, seconds, settings, attempt, push_seq, redone, note, ahead)

    def _decide(self, ev: Event, act: Act, **fields: Any) -> Decision:
        self.seq += 1
        return Decision(self.seq, act, ev.seq, self.version, **fields)

    def _decided(self, ev: Event, decisions: list[Decision]) -> list[Decision]:
        if self.log is not None:
            self.log.append(ev)
            self.log.extend(decisions)
        return decisions


def _keyed(d: dict[int, int]) -> dict[str, int]:
    return {str(k): v for k, v in sorted(d.items())}


def _int(value: int | None) -> int:
    if value is None:
        raise ValueError("A recorded push, clock, done, lost or back event has no worker or value.")
    return value
