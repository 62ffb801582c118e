"""Primary-backup replication of a ps shard (``TrainConfig.ps_replicas = 2``): a dead ps loses no
acknowledged update.

Placement: shard s's primary is ps:s and its backup ps:(s+1 mod P) (:func:`backup_of`; P >= 2, so
every ps is the primary of its own shard and the backup of the one before it). Workers talk to the
primary only; the primary talks to its backup over one connection of its own (PS_REPLICATE).

What travels, in order (the state machine the backup runs):

1. ``init``: the chief's PS_INIT request (values, optimizer state, settings, step plan, data
   positions), forwarded by the primary as it received it, before anything else. The backup builds
   a :class:`~psflow.ps.store.ParameterStore` for the shard from it, exactly as the primary did.
2. ``batch``: every event the shard's rules (:class:`~psflow.ps.rules.ShardRules`) recorded since,
   in sequence-number order, with the data position of each push and, for each APPLY, the update
   that was applied: in async/ssp the pushed gradient, in sync the step's averaged gradient (after
   aggregation, as the parameter-server paper does: one gradient per step crosses, not N). The
   backup steps its own rules with each event (:meth:`ShardRules.step`, what ``replay`` does) and
   carries the decisions out with the shipped update: the same optimizer step, the same learning
   rate schedule and moving averages, so its values, slots and bookkeeping follow the primary's.

Why the update and not the resulting values: a gradient is one tensor per parameter; the values
plus the optimizer's slots are two to three (Adam: values, exp_avg, exp_avg_sq). The optimizer step
is elementwise and deterministic on CPU, so re-running it on the backup gives the same bits for a
third to a half of the bytes; and the backup then keeps the optimizer state without any extra copy.

The whole design note: ``docs/design/ps-replication.md``.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from psflow.errors import (
    ConfigError,
    NotServingError,
    PeerGoneError,
    PsflowError,
    RemoteError,
    TrainingError,
    TransportError,
)
from psflow.ps.rules import Event, On

log = logging.getLogger("psflow.ps")


def backup_of(shard: int, num_ps: int) -> int:
    """The ps task that holds shard ``shard``'s backup: the next one, wrapping around."""
    if num_ps < 2:
        raise ValueError(f"A ps shard's backup needs a second ps task; this cluster has {num_ps}. Use 2 or more ps "
                         "with ps_replicas=2.")
    return (shard + 1) % num_ps


def pair_other(shard: int, ps: int, num_ps: int) -> int:
    """The other ps of shard ``shard``'s pair (ps:shard and its backup ps), seen from ps ``ps``.

    Raises:
        ConfigError: ``ps`` holds no copy of the shard.
    """
    backup = backup_of(shard, num_ps)
    if ps == shard:
        return backup
    if ps == backup:
        return shard
    raise ConfigError(f"ps:{ps} holds no copy of shard {shard}: its copies live on ps:{shard} and ps:{backup} "
                      "(ps_replicas=2). Is every task running with the same number of ps?")


def shards_held(ps: int, num_ps: int) -> list[int]:
    """The shards ps ``ps`` holds a copy of: its own and the one before it (``num_ps >= 2``)."""
    return sorted({ps, (ps - 1) % num_ps})


class Role(enum.Enum):
    """What a ps does with its copy of one shard (see the module docstring's states)."""

    SERVING = "serving"  # answers workers; forwards its records to the other ps of the pair, if it has re-synced
    BACKUP = "backup"  # follows the serving copy's records; takes over when a client fails over to it
    RESYNCING = "resyncing"  # a restarted ps waiting for the shard's state: refuses everything


def not_serving(ps: int, shard: int, role: Role, num_ps: int, serving: int | None = None) -> NotServingError:
    other = pair_other(shard, ps, num_ps) if serving is None else serving
    why = ("it holds no synced copy of it (restarted, re-syncing, or left out by the shard's view)"
           if role is Role.RESYNCING else "it holds the shard's backup copy")
    return NotServingError(f"ps:{ps} does not serve shard {shard} now: {why}; ps:{other} serves it. Retry there "
                           "(psflow's client routes there by itself).")


# -- records on the wire (plain JSON data: nothing received is unpickled) -------------------------
def event_to_dict(ev: Event) -> dict[str, Any]:
    if ev.on is On.CONFIGURE:
        raise ValueError("A CONFIGURE event is not shipped: the backup configures from the forwarded PS_INIT.")
    d = {"seq": ev.seq, "on": ev.on.value, "worker": ev.worker, "value": ev.value, "seconds": ev.seconds,
         "attempt": ev.attempt, "push_seq": ev.push_seq}
    if ev.redone:
        d["redone"] = True
    if ev.ahead:
        d["ahead"] = ev.ahead
    return d


def event_from_dict(d: Mapping[str, Any]) -> Event:
    try:
        on = On(d["on"])
        if on is On.CONFIGURE:
            raise ValueError("CONFIGURE")
        return Event(int(d["seq"]), on, _opt_int(d.get("worker")), _opt_int(d.get("value")),
                     None if d.get("seconds") is None else float(d["seconds"]), None, int(d.get("attempt", 0)),
                     _opt_int(d.get("push_seq")), d.get("redone") is True, ahead=int(d.get("ahead", 0)))
    except (KeyError, TypeError, ValueError) as e:
        raise PsflowError(f"A replicated event is malformed ({e!r}); received {dict(d)!r}. The primary and its "
                          "backup must run the same psflow version.") from None


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def check_next(shard: int, event_seq: int, held_seq: int) -> bool:
    """Whether the backup, holding shard ``shard``'s records up to ``held_seq``, applies the event
    numbered ``event_seq``: True for the next one, False for one it holds already (a resent batch).

    Raises:
        TrainingError: the event skips a number: a batch was lost, and applying past it would diverge.
    """
    if event_seq <= held_seq:
        return False
    if event_seq != held_seq + 1:
        raise TrainingError(
            f"The backup of ps shard {shard} holds its records up to {held_seq} and received event {event_seq}: "
            f"{event_seq - held_seq - 1} records are missing. It refuses to apply past a gap (it would diverge from "
            "the primary in silence); the primary must re-sync it.")
    return True


@dataclass
class Batch:
    """Events to ship, in order: ``positions`` by push event seq, ``updates`` by the APPLY's new version."""

    events: list[Event] = field(default_factory=list)
    positions: dict[int, Any] = field(default_factory=dict)
    updates: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    last_seq: int = 0  # the primary's sequence number after the last event's decisions

    def to_wire(self, shard: int) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
        meta = {"kind": "batch", "shard": shard, "last_seq": self.last_seq,
                "events": [event_to_dict(e) for e in self.events],
                "positions": {str(k): v for k, v in self.positions.items()}}
        tensors = [(f"{version}/{k}", t) for version, ts in self.updates.items() for k, t in ts.items()]
        return meta, tensors

    @classmethod
    def from_wire(cls, meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> Batch:
        updates: dict[int, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            version, _, key = name.partition("/")
            updates.setdefault(int(version), {})[key] = t
        return cls([event_from_dict(e) for e in meta.get("events", [])],
                   {int(k): v for k, v in (meta.get("positions") or {}).items()}, updates, int(meta.get("last_seq", 0)))


class Outbox:
    """What the primary has recorded and its backup does not hold yet, in sequence order. Pure:
    the store adds under its lock, the forwarder takes and acknowledges under its own."""

    def __init__(self) -> None:
        self.queued: list[Batch] = []
        self.queued_seq = 0  # the last sequence number queued (or shipped at init)
        self.acked_seq = 0  # the last sequence number the backup holds

    def add(self, events: Iterable[Event], last_seq: int, positions: Mapping[int, Any],
            updates: Mapping[int, dict[str, torch.Tensor]]) -> None:
        evs = list(events)
        if evs:
            self.queued.append(Batch(evs, dict(positions), dict(updates), last_seq))
        self.queued_seq = max(self.queued_seq, last_seq)

    def take(self) -> Batch | None:
        """Everything queued, as one batch (None: nothing to ship)."""
        if not self.queued:
            return None
        out = Batch()
        for b in self.queued:
            out.events += b.events
            out.positions.update(b.positions)
            out.updates.update(b.updates)
            out.last_seq = max(out.last_seq, b.last_seq)
        self.queued = []
        return out

    def acked(self, seq: int) -> None:
        self.acked_seq = max(self.acked_seq, seq)


Send = Callable[[dict[str, Any], Sequence[tuple[str, torch.Tensor]]], dict[str, Any]]


class Forwarder:
    """The serving copy's sender: ships the init (or a full state), then each batch in order, to the
    backup; answers :meth:`wait_acked`. ``send(meta, tensors) -> reply meta`` is one request to the
    backup (it reconnects itself); it raising for longer than ``failover_s`` degrades the shard (see
    the module docstring).

    Who ships (group commit). A request waiting for its records (:meth:`wait_acked`) ships what is
    queued itself, on its own thread, when no batch is in flight: the records go out the moment a
    reply needs them, with no hand-over to another thread and back. Records nobody waits for yet (a
    sync step's first pushes: their replies wait for the step first) stay queued, so a sync step's
    pushes and its aggregated update cross in one batch, one round trip per step. While a batch is in
    flight, what is recorded meanwhile queues and leaves as the next batch, shipped by the first
    waiter to see the backup's answer. One batch is in flight at a time, so the backup receives them
    in sequence order. The forwarder's own thread ships the init, then whatever stayed queued for
    ``flush_s`` with no waiter (a lost worker, a tick's decision), so the backup never lags for long.
    """

    def __init__(self, shard: int, backup: int, send: Send,
                 init: tuple[dict[str, Any], Sequence[tuple[str, torch.Tensor]]] | None = None,
                 *, term: int = 1, failover_s: float = 5.0, flush_s: float = 0.02,
                 on_unreachable: Callable[[str], None] | None = None, on_stale: Callable[[], None] | None = None) -> None:
        self.shard, self.backup, self.term = shard, backup, term
        self.outbox = Outbox()
        self.degraded: str | None = None  # why the view moved on without this backup (set by drop)
        self._on_unreachable = on_unreachable or (lambda why: None)
        self._on_stale = on_stale or (lambda: None)
        self.replaced = False  # a re-sync started a new forwarder for this shard: this one is done
        self.batches_shipped = 0  # batches the backup confirmed (the init or state not counted)
        self._send, self._init, self._failover_s, self._flush_s = send, init, failover_s, flush_s
        self._cond = threading.Condition()
        self._stop = False
        self._sending = False  # a batch (or the init) is in flight: the next one waits for its answer
        self._queued_since = 0.0  # when the oldest record now queued was queued (monotonic)
        self._init_acked = False
        self._thread = threading.Thread(target=self._run, name=f"psflow-replicate-{shard}", daemon=True)

    def start(self, init_seq: int, init: tuple[dict[str, Any], Sequence[tuple[str, torch.Tensor]]] | None = None) -> None:
        """Ship the init (the state after the shard's records up to ``init_seq``), then batches.
        ``init`` replaces the one given at construction (a full state, captured under the store's lock)."""
        if init is not None:
            self._init = init
        if self._init is None:
            raise ValueError("A Forwarder needs the state it starts from (init) before it starts.")
        self.outbox.queued_seq = init_seq
        self._init_seq = init_seq
        self._thread.start()

    def add(self, events: list[Event], last_seq: int, positions: Mapping[int, Any],
            updates: Mapping[int, dict[str, torch.Tensor]]) -> None:
        """Queue what the store just recorded (called under the store's lock: the order is the seq order).
        Degraded or replaced, nothing is queued: nobody would ship it."""
        with self._cond:
            if self.degraded is not None or self.replaced:
                return
            was_empty = not self.outbox.queued
            self.outbox.add(events, last_seq, positions, updates)
            if was_empty and self.outbox.queued:
                self._queued_since = time.monotonic()  # the flush's clock starts with the oldest record queued
            self._cond.notify_all()

    def _done_for(self, seq: int) -> bool:
        return self.degraded is not None or self.replaced or self.outbox.acked_seq >= seq

    def wait_acked(self, seq: int, timeout_s: float) -> None:
        """Return once the backup holds every record up to ``seq`` (or the shard is degraded, or
        this forwarder was replaced: the caller then waits on the new one). Ships the queued
        records itself when no batch is in flight (see the class docstring).

        Raises:
            TrainingError: it did not within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._done_for(seq):
                if self._init_acked and not self._sending and not self._stop and self.outbox.queued:
                    self._ship_queued()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TrainingError(
                        f"Shard {self.shard}'s backup ps:{self.backup} did not confirm record {seq} within "
                        f"{timeout_s:.1f} s (it holds {self.outbox.acked_seq}). The update is not acknowledged; "
                        "the worker resends it.")
                self._cond.wait(left)

    def replace(self) -> None:
        """A new forwarder serves this shard's backup from now on: stop, and release the waiters."""
        with self._cond:
            self.replaced = True
            self.outbox.queued = []
        self.close()

    def drop(self, why: str) -> None:
        """The view no longer has this backup (or this term): stop, and release the waiters."""
        with self._cond:
            self.degraded = self.degraded or why
        self.replace()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def _ship_queued(self) -> bool:
        """Under the lock, with nothing in flight: ship everything queued as one batch, the lock
        released while it travels. False: the shard degraded (or this forwarder stopped)."""
        batch = self.outbox.take()
        if batch is None:
            return True
        self._sending = True
        self._cond.release()
        try:
            ok = self._ship(*batch.to_wire(self.shard))
        finally:
            self._cond.acquire()
            self._sending = False
            self._cond.notify_all()
        if ok:
            self.outbox.acked(batch.last_seq)
            self.batches_shipped += 1
        return ok

    def _run(self) -> None:
        assert self._init is not None
        with self._cond:
            self._sending = True
        ok = self._ship(*self._init)
        with self._cond:
            self._sending = False
            if ok:
                self.outbox.acked(self._init_seq)
                self._init_acked = True
            self._cond.notify_all()
        if not ok:
            return
        with self._cond:
            while True:
                self._cond.wait_for(lambda: self._stop or (bool(self.outbox.queued) and not self._sending))
                if self._stop:
                    return
                # Give the records' waiters the first chance to ship them (they batch a step's records):
                # ship only what has stayed queued for flush_s. A notification (another record, a
                # waiter's batch answered) is no reason to ship early; records a waiter shipped meanwhile
                # are gone from the queue, and newer ones have their own flush_s.
                left = self._queued_since + self._flush_s - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                if not self._sending and not self._ship_queued():
                    return

    def _ship(self, meta: dict[str, Any], tensors: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Send until the backup answers; False once this forwarder is stopped (the view moved on).
        A backup silent for ``failover_s`` (gone: at once) is reported to the authority, again every
        ``failover_s`` while it stays so. Called without the lock held."""
        meta = {**meta, "term": self.term}
        deadline = time.monotonic() + self._failover_s
        while not self._stop:
            try:
                self._send(meta, tensors)
                return True
            except RemoteError as e:
                if e.kind == "StaleTermError":  # the backup knows a newer term: so must this copy
                    self._on_stale()
                elif time.monotonic() >= deadline:
                    self._report(e)
                    deadline = time.monotonic() + self._failover_s
            except (TransportError, PsflowError) as e:
                if isinstance(e, PeerGoneError) or time.monotonic() >= deadline:
                    self._report(e)
                    deadline = time.monotonic() + self._failover_s
            if not self._stop:
                time.sleep(0.05)
        return False

    def _report(self, e: Exception) -> None:
        why = f"its backup ps:{self.backup} did not confirm shard {self.shard}'s records for {self._failover_s:g} s ({e})"
        log.warning("shard %d: %s; asking the authority.", self.shard, why)
        self._on_unreachable(why)


class Applier:
    """A backup copy's records, held in order and applied on a thread of its own: the backup
    acknowledges a batch once it holds it (in memory, as the serving copy does), so the serving copy's
    reply does not wait for the backup's optimizer step. :meth:`drain` before anything reads the
    copy as a whole (a takeover, the final report): it returns once every held batch is applied.

    A batch that skips a number is refused when it arrives (:func:`check_next`'s rule); an apply that
    fails (the copies diverged) is kept, refused to every later batch (the serving copy reports this
    backup unreachable, and the launcher drops it) and raised by :meth:`drain`.
    """

    def __init__(self, shard: int, follow: Callable[[Batch], int], held_seq: int,
                 on_applied: Callable[[], None] | None = None) -> None:
        self.shard, self._follow = shard, follow
        self.store: Any = None  # the copy it applies to (a loaded state makes a new copy, and a new applier)
        self.held_seq = held_seq  # the last record held (applied or queued)
        self.error: PsflowError | None = None
        self._on_applied = on_applied or (lambda: None)
        self._queue: list[Batch] = []
        self._busy = False
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"psflow-apply-{shard}", daemon=True)
        self._thread.start()

    def hold(self, batch: Batch) -> int:
        """Queue ``batch`` (records it holds already are skipped when applied). Returns the last
        record held.

        Raises:
            TrainingError: the batch skips a number, or an earlier apply failed.
        """
        with self._cond:
            if self.error is not None:
                raise self.error
            if batch.events and batch.events[0].seq > self.held_seq + 1:
                check_next(self.shard, batch.events[0].seq, self.held_seq)  # raises: records are missing
            if batch.last_seq > self.held_seq:
                self._queue.append(batch)
                self.held_seq = batch.last_seq
                self._cond.notify_all()
            return self.held_seq

    def drain(self, timeout_s: float) -> None:
        """Return once every held batch is applied.

        Raises:
            TrainingError: an apply failed, or they were not all applied within ``timeout_s``.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self.error is not None or (not self._queue and not self._busy),
                                       timeout=timeout_s):
                raise TrainingError(f"The backup of ps shard {self.shard} did not apply the records it holds within "
                                    f"{timeout_s:g} s.")
            if self.error is not None:
                raise self.error

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._queue = []
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or bool(self._queue))
                if self._stop:
                    return
                batch, self._busy = self._queue.pop(0), True
            try:
                self._follow(batch)
            except PsflowError as e:
                log.error("shard %d: the backup could not apply records up to %d: %s", self.shard, batch.last_seq, e)
                with self._cond:
                    self.error, self._queue = e, []
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
            self._on_applied()
