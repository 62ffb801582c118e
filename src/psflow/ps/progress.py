"""What one ps shard keeps so that checkpoints and stops fall on exact global steps.

The chief's Supervisor sends a :class:`StepPlan` with the initial parameters: the step at which the
job stops (``max_steps``) and the period of step-based checkpoints (``save_model_steps``). In async
mode the workers' pushes race, so the chief cannot observe every global step, let alone stop the
others at one: the shard does it. Its rules (:mod:`psflow.ps.rules`) refuse updates past
``stop_at`` (the job stops at exactly that step), and it copies its state when its version reaches a
multiple of ``snapshot_every`` (the checkpoint of step 200 holds exactly 200 updates, whenever the
chief asks for it).

It also keeps each worker's data position (epoch, batch, shuffle seed: ``BatchIterator.state_dict``)
as of the last of its batches whose gradients this shard consumed, so that a checkpoint holds every
worker's place in its data, consistent with the parameters it holds, and a restarted worker gets
back (at readiness) the position of its last applied batch, not of its last one sent. A sync
gradient's position waits with it (``pending``) and is forgotten if the gradient leaves unapplied.

Pure bookkeeping, no locks: :class:`psflow.ps.store.ParameterStore` calls it under its own lock.
Workers are keyed by their replica index as a string (JSON object keys).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from psflow.errors import ConfigError

HELD_SNAPSHOTS = 2  # a checkpoint asked for late (the chief was busy saving) still finds its step


@dataclass(frozen=True)
class StepPlan:
    """Step limits of a job, as the chief's PS_INIT carries them (``to_dict``/``from_dict``)."""

    stop_at: int | None = None
    snapshot_every: int | None = None

    def __post_init__(self) -> None:
        for name in ("stop_at", "snapshot_every"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"StepPlan.{name} must be an int >= 1 or None. Received: {value!r}.")

    def to_dict(self) -> dict[str, int | None]:
        return {"stop_at": self.stop_at, "snapshot_every": self.snapshot_every}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> StepPlan:
        data = data or {}
        return cls(data.get("stop_at"), data.get("snapshot_every"))


class Progress:
    """The step plan, each worker's data position and the snapshots held for exact checkpoints."""

    def __init__(self) -> None:
        self.plan = StepPlan()
        self.positions: dict[str, dict[str, Any]] = {}
        self.position_attempts: dict[str, int] = {}  # the attempt whose batch set each async position
        self._pending: dict[str, dict[str, Any]] = {}  # sync: positions of gradients not applied yet
        self._held: dict[int, tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]] = {}

    def configure(self, plan: StepPlan, positions: Mapping[str, Any] | None) -> None:
        """At initialization: the plan, and the positions restored from a checkpoint."""
        self.plan = plan
        self.positions = {str(k): dict(v) for k, v in (positions or {}).items() if isinstance(v, Mapping)}
        self.position_attempts = {}  # restored positions: set by no attempt this shard knows
        self._pending.clear()
        self._held.clear()

    def consumed(self, worker: int, position: Mapping[str, Any] | None, attempt: int = 0) -> None:
        """``worker``'s batch (of its attempt ``attempt``) is done with (applied, or dropped as
        stale): its position moves on."""
        if isinstance(position, Mapping):
            self.positions[str(worker)] = dict(position)
            self.position_attempts[str(worker)] = attempt

    def applied_already(self, worker: int, position: Mapping[str, Any] | None, attempt: int = 0) -> bool:
        """Whether ``worker``'s batch at ``position`` (the position after it), sent by its attempt
        ``attempt``, is at or before the one an *earlier* attempt recorded here: a restarted worker
        redoing a batch this shard took from its dead attempt. Within one attempt a position never
        repeats a batch (a resent push is recognised by its number), so positions are not compared
        there: a script that starts its iterator again (a new one per epoch) is never refused.
        Positions compare by ``(epoch, batch_index)`` when both are a BatchIterator's, with the same
        settings (a different seed, batch size or data shard is another sequence: never a repeat)."""
        seen = self.positions.get(str(worker))
        if not isinstance(position, Mapping) or seen is None:
            return False
        if attempt <= self.position_attempts.get(str(worker), -1):
            return False
        order = ("epoch", "batch_index")
        if not all(type(position.get(k)) is int and type(seen.get(k)) is int for k in order):
            return False
        if {k: v for k, v in position.items() if k not in order} != {k: v for k, v in seen.items() if k not in order}:
            return False
        return (position["epoch"], position["batch_index"]) <= (seen["epoch"], seen["batch_index"])

    def pending(self, worker: int, position: Mapping[str, Any] | None) -> None:
        """Sync: ``worker``'s gradient waits for its step; its position moves on when it is applied."""
        if isinstance(position, Mapping):
            self._pending[str(worker)] = dict(position)

    def discard_pending(self, worker: int) -> None:
        """Sync: ``worker``'s held gradient left without being applied (lost, or a newer attempt
        joined): its position stays where its last applied batch left it, so the batch is redone."""
        self._pending.pop(str(worker), None)

    def step_applied(self) -> None:
        """Sync: the pending gradients were applied together."""
        self.positions.update(self._pending)
        self._pending.clear()

    def wants_snapshot(self, version: int) -> bool:
        every = self.plan.snapshot_every
        return every is not None and version > 0 and version % every == 0

    def hold(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep the state of ``version`` (and the positions now) until a newer ones push it out."""
        self._held[version] = (tensors, {k: dict(v) for k, v in self.positions.items()})
        for old in sorted(self._held)[:-HELD_SNAPSHOTS]:
            del self._held[old]

    def held(self, version: int) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]] | None:
        return self._held.get(version)

    def positions_now(self) -> dict[str, dict[str, Any]]:
        return {k: dict(v) for k, v in self.positions.items()}

    def export(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Everything but the plan and the positions (which travel as a PS_INIT's), for a full
        state transfer: the pending positions, and the held snapshots (tensors ``held/<version>/<name>``)."""
        meta = {"pending": {k: dict(v) for k, v in self._pending.items()}, "position_attempts": dict(self.position_attempts),
                "held": {str(v): {k: dict(p) for k, p in pos.items()} for v, (_, pos) in self._held.items()}}
        tensors = {f"held/{v}/{k}": t for v, (ts, _) in self._held.items() for k, t in ts.items()}
        return meta, tensors

    def restore(self, meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
        """Inverse of :meth:`export`, after :meth:`configure`."""
        self._pending = {str(k): dict(v) for k, v in (meta.get("pending") or {}).items()}
        self.position_attempts = {str(k): int(v) for k, v in (meta.get("position_attempts") or {}).items()}
        held: dict[int, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            _, version, key = name.split("/", 2)
            held.setdefault(int(version), {})[key] = t
        self._held = {v: (held.get(v, {}), {k: dict(p) for k, p in pos.items()})
                      for v, pos in ((int(v), pos) for v, pos in (meta.get("held") or {}).items())}
