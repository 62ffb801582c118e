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

Ordering and acknowledgement. The primary queues each event under the store's lock, so the queue's
order is the order of its sequence numbers (:class:`Outbox`). One sender thread (:class:`Forwarder`)
ships what is queued as one batch at a time and records the backup's answer, the last sequence
number it holds. A request that changed the shard (a push, a clock, PS_DONE, a readiness) and a
pull are answered to the worker only once the backup holds every event up to the state the reply
shows (:meth:`Forwarder.wait_acked`): a push is acknowledged once its backup has it. The backup
refuses a batch that skips a number (:func:`check_next`: a gap means a lost batch, and applying
past it would diverge in silence) and skips events it holds already (a batch resent after a
reconnect).

States of the replication, seen by the primary::

    starting --init acked--> replicating --backup unreachable past failover_s--> degraded
    (degraded: the primary goes on alone and logs why; nothing is waited for.)

Failover. A worker's client (:class:`~psflow.ps.client.PsClient` with ``replicas=2``) that loses
its connection to shard s's primary and cannot make it again within its ``failover_s`` sends every
later request for shard s to the backup, naming the shard. The backup's service takes over on the
first such request (:meth:`ParameterStore.take_over`, a recorded TAKEOVER event): it serves the
copy from then on; its version never goes back (it holds every event the primary had acknowledged,
and a pull was answered only with a state the backup held); the sync gradients held for the current
step lived on the primary only, so they and their push numbers are forgotten and their resent pushes
taken again; any other resent push it holds already is a DUPLICATE (by worker, attempt and push
number), so nothing acknowledged is lost and nothing is applied twice. The taken-over shard has no
backup (it survives one ps death, not two).

Not yet: a restarted ps re-syncing from the survivor (the survivor sending it the shard's state and
then its records) and becoming the backup again; until then the restarted ps serves nothing of the
taken-over shard, and its own shard's survivor copy keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from psflow.errors import PsflowError, TrainingError, TransportError
from psflow.ps.rules import Event, On

log = logging.getLogger("psflow.ps")


def backup_of(shard: int, num_ps: int) -> int:
    """The ps task that holds shard ``shard``'s backup: the next one, wrapping around."""
    if num_ps < 2:
        raise ValueError(f"A ps shard's backup needs a second ps task; this cluster has {num_ps}. Use 2 or more ps "
                         "with ps_replicas=2.")
    return (shard + 1) % num_ps


# -- records on the wire (plain JSON data: nothing received is unpickled) -------------------------
def event_to_dict(ev: Event) -> dict[str, Any]:
    if ev.on is On.CONFIGURE:
        raise ValueError("A CONFIGURE event is not shipped: the backup configures from the forwarded PS_INIT.")
    return {"seq": ev.seq, "on": ev.on.value, "worker": ev.worker, "value": ev.value, "seconds": ev.seconds,
            "attempt": ev.attempt, "push_seq": ev.push_seq}


def event_from_dict(d: Mapping[str, Any]) -> Event:
    try:
        on = On(d["on"])
        if on is On.CONFIGURE:
            raise ValueError("CONFIGURE")
        return Event(int(d["seq"]), on, _opt_int(d.get("worker")), _opt_int(d.get("value")),
                     None if d.get("seconds") is None else float(d["seconds"]), None, int(d.get("attempt", 0)),
                     _opt_int(d.get("push_seq")))
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
    """The primary's sender: ships the init, then each batch in order, to the backup; answers
    :meth:`wait_acked`. ``send(meta, tensors) -> reply meta`` is one request to the backup (it
    reconnects itself); it raising for longer than ``failover_s`` degrades the shard (see the module
    docstring)."""

    def __init__(self, shard: int, backup: int, send: Send, init: tuple[dict[str, Any], Sequence[tuple[str, torch.Tensor]]],
                 *, failover_s: float = 5.0) -> None:
        self.shard, self.backup = shard, backup
        self.outbox = Outbox()
        self.degraded: str | None = None  # why the primary goes on without its backup
        self._send, self._init, self._failover_s = send, init, failover_s
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"psflow-replicate-{shard}", daemon=True)

    def start(self, init_seq: int) -> None:
        """Ship the init (the state after the shard's records up to ``init_seq``), then batches."""
        self.outbox.queued_seq = init_seq
        self._init_seq = init_seq
        self._thread.start()

    def add(self, events: list[Event], last_seq: int, positions: Mapping[int, Any],
            updates: Mapping[int, dict[str, torch.Tensor]]) -> None:
        """Queue what the store just recorded (called under the store's lock: the order is the seq order)."""
        with self._cond:
            self.outbox.add(events, last_seq, positions, updates)
            self._cond.notify_all()

    def wait_acked(self, seq: int, timeout_s: float) -> None:
        """Return once the backup holds every record up to ``seq`` (or the shard is degraded).

        Raises:
            TrainingError: it did not within ``timeout_s``.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self.degraded is not None or self.outbox.acked_seq >= seq, timeout_s):
                raise TrainingError(
                    f"ps:{self.shard}'s backup ps:{self.backup} did not confirm record {seq} within {timeout_s:.1f} s "
                    f"(it holds {self.outbox.acked_seq}). The update is not acknowledged; the worker resends it.")

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def _run(self) -> None:
        if not self._ship(*self._init):
            return
        with self._cond:
            self.outbox.acked(self._init_seq)
            self._cond.notify_all()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or bool(self.outbox.queued))
                if self._stop:
                    return
                batch = self.outbox.take()
            if batch is None:
                continue
            if not self._ship(*batch.to_wire(self.shard)):
                return
            with self._cond:
                self.outbox.acked(batch.last_seq)
                self._cond.notify_all()

    def _ship(self, meta: dict[str, Any], tensors: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Send until the backup answers; False (degraded) once it has not for ``failover_s``."""
        deadline = time.monotonic() + self._failover_s
        while True:
            try:
                self._send(meta, tensors)
                return True
            except (TransportError, PsflowError) as e:
                if self._stop:
                    return False
                if time.monotonic() >= deadline:
                    with self._cond:
                        self.degraded = (f"its backup ps:{self.backup} did not answer for {self._failover_s:g} s "
                                         f"({e}); ps:{self.shard} goes on without a copy of its shard")
                        self._cond.notify_all()
                    log.warning("ps:%d: %s.", self.shard, self.degraded)
                    return False
                time.sleep(0.05)
