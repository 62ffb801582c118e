"""What a request carrying a shard's whole state may declare: bounded by what the shard holds.

A shard's :class:`Layout` is the name, shape and dtype of each value it holds: its values once it is
initialized, before that the placement its PS_INIT declares (``meta.placement``, which the chief's
trainer always sends: the pieces :meth:`~psflow.ps.placement.Placement.pieces_on` the shard). The
tensors of a state, :func:`check_state`, are then

- every value of the layout, once, with its shape and dtype;
- optimizer slots ``opt/<key>/<slot>`` of a slot a psflow optimizer keeps
  (:data:`psflow.optim.STATE_SLOTS`), shaped like their value (``step``: a scalar);
- moving averages ``ema/<key>`` like their value;

so a state takes at most the layout's bytes times one plus the slots, plus a scalar per key; a
tensor larger (or smaller) than what the shard holds under its name is refused. Who checks what
(:mod:`psflow.ps.service`, :mod:`psflow.ps.copies`: on a frame's head before its payload is
received, and again in the handler):

- PS_INIT, and its copy forwarded to the backup (PS_REPLICATE ``init``): a state;
- PS_REPLICATE ``state``: a state, plus held snapshots ``held/<version>/<name>`` (each a state) of
  the versions its meta lists (:func:`check_held`);
- PS_REPLICATE ``batch``: updates ``<version>/<key>`` like their value, of at most as many versions
  as the batch has events (:func:`check_updates`).

(A push is bounded by :func:`psflow.wire.compress.push_bytes`.) Each check raises
:class:`~psflow.errors.ConfigError` naming the tensor, what it declares and what the shard holds.
Pure: no I/O, no state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from psflow.checkpoint.keys import EMA_PREFIX, OPT_PREFIX
from psflow.errors import ConfigError
from psflow.wire.frame import ITEMSIZE

Declared = tuple[str, str, tuple[int, ...]]  # (name, dtype without "torch.", shape): a frame's tensor entry


def declared(specs: Iterable[Any]) -> list[Declared]:
    """``(name, dtype, shape)`` of a frame's tensor specs (``TensorSpec``), or of received
    ``(name, tensor)`` pairs."""
    out = []
    for s in specs:
        name, t = (s.name, s) if hasattr(s, "name") else s
        out.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
    return out


@dataclass(frozen=True)
class Layout:
    """What one shard holds: ``{key: (shape, dtype)}``; ``source`` says where that was learned (for errors)."""

    shard: int
    keys: Mapping[str, tuple[tuple[int, ...], str]]
    source: str

    @classmethod
    def of_values(cls, shard: int, values: Mapping[str, Any]) -> Layout:
        """The layout of an initialized shard's values (tensors)."""
        return cls(shard, {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in values.items()},
                   "now")

    @classmethod
    def of_placement(cls, shard: int, placement: object, num_shards: int, what: str) -> Layout:
        """The layout a request's ``meta.placement`` declares for ``shard``.

        Raises:
            ConfigError: no placement, one that is not a valid placement, or one of another number of shards.
        """
        from psflow.ps.placement import Placement

        if placement is None:
            raise ConfigError(f"{what} declares no placement (meta.placement), so ps shard {shard} cannot tell the "
                              "tensors it may hold. The chief's trainer sends it: is the sender running the same "
                              "psflow version as the ps?")
        try:
            p = Placement.from_dict(placement)  # type: ignore[arg-type]
        except ConfigError as e:
            raise ConfigError(f"{what} declares an invalid placement: {e}") from e
        if p.num_shards != num_shards:
            raise ConfigError(f"{what} declares a placement over {p.num_shards} shards; this job has {num_shards} ps. "
                              "Every task must be started with the same cluster.")
        keys = {pc.key: (p.piece_shape(pc), p.param_info(pc.param).dtype) for pc in p.pieces_on(shard)}
        return cls(shard, keys, "by the request's placement")

    @classmethod
    def of_request(cls, shard: int, meta: Mapping[str, Any], num_shards: int, what: str) -> Layout:
        """The layout a PS_INIT (or a state sent to a backup) declares in its ``meta.placement``.

        Raises:
            ConfigError: as :meth:`of_placement`.
        """
        declared = meta.get("meta")
        return cls.of_placement(shard, declared.get("placement") if isinstance(declared, dict) else None, num_shards, what)

    def describe(self, key: str) -> str:
        """``"float32 [7850] (31400 bytes)"``: what the shard holds under ``key``."""
        shape, dtype = self.keys[key]
        return f"{dtype} {list(shape)} ({math.prod(shape) * ITEMSIZE.get(dtype, 8)} bytes)"

    def holds(self, key: str, d: Declared) -> str | None:
        """None if ``d`` is shaped as the shard holds ``key``; otherwise why not."""
        return None if (d[2], d[1]) == self.keys[key] else (
            f"does not fit: shard {self.shard} holds {key!r} as {self.describe(key)} {self.source}")

    def none_of(self) -> str:
        """``"none of the keys shard 0 holds now (b, w)"``, for an error about a tensor of no key."""
        names = sorted(self.keys)
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "") if names else "it holds none"
        return f"none of the keys shard {self.shard} holds {self.source} ({shown})"


def _bytes(d: Declared) -> int:
    return math.prod(d[2]) * ITEMSIZE.get(d[1], 8)


def _tensor(d: Declared) -> str:
    return f"{d[0]!r} ({d[1]} {list(d[2])}, {_bytes(d)} bytes)"


def _state_error(layout: Layout, d: Declared, name: str) -> str | None:
    """Why ``d`` is no tensor of a state of ``layout`` (``name``: its name inside the state), or None."""
    from psflow.optim import STATE_SLOTS

    if name.startswith(OPT_PREFIX):
        key, _, slot = name[len(OPT_PREFIX):].rpartition("/")
        if key not in layout.keys:
            return f"is an optimizer slot of {key!r}, {layout.none_of()}"
        if slot not in STATE_SLOTS:
            return f"is slot {slot!r}, which no psflow optimizer keeps (they keep {', '.join(sorted(STATE_SLOTS))})"
        if slot == "step":
            return None if d[2] == () else "must be a scalar (shape []), as an optimizer's step is"
        return layout.holds(key, d)
    key = name[len(EMA_PREFIX):] if name.startswith(EMA_PREFIX) else name
    if key not in layout.keys:
        return f"is {layout.none_of()}"
    return layout.holds(key, d)


def check_state(what: str, layout: Layout, tensors: Iterable[Declared]) -> None:
    """A shard's whole state (values, optimizer slots, moving averages), as a PS_INIT carries it.

    Raises:
        ConfigError: a tensor that is none of the layout's, of another shape or dtype, or a value of
            the layout missing; names it, what it declares and what the shard holds.
    """
    seen = set()
    for d in tensors:
        why = _state_error(layout, d, d[0])
        if why is not None:
            raise ConfigError(f"{what} refused: tensor {_tensor(d)} {why}. Nothing was changed. Every task must "
                              "build the same model with the same placement.")
        seen.add(d[0])
    missing = sorted(set(layout.keys) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ConfigError(f"{what} refused: it lacks {len(missing)} of the values shard {layout.shard} holds {layout.source} "
                          f"({shown}). Nothing was changed. Every task must build the same model with the same placement.")


def check_held(what: str, layout: Layout, tensors: Iterable[Declared], versions: object) -> list[Declared]:
    """A full state's held snapshots ``held/<version>/<name>``, each a state's tensor, of the
    versions ``versions`` (its meta's ``progress.held``) lists, at most the
    :data:`~psflow.ps.progress.HELD_SNAPSHOTS` a shard keeps. Returns the other tensors.

    Raises:
        ConfigError: as :func:`check_state`, a snapshot of a version the meta does not list, or more
            versions than a shard keeps.
    """
    from psflow.ps.progress import HELD_SNAPSHOTS

    listed = {str(v) for v in versions} if isinstance(versions, Mapping) else set()
    if len(listed) > HELD_SNAPSHOTS:
        raise ConfigError(f"{what} refused: it holds snapshots of {len(listed)} versions; a shard keeps at most "
                          f"{HELD_SNAPSHOTS}. Nothing was changed.")
    rest = []
    for d in tensors:
        if not d[0].startswith("held/"):
            rest.append(d)
            continue
        _, version, name = (d[0].split("/", 2) + ["", ""])[:3]
        why = (f"is a snapshot of version {version!r}, which the state's meta does not hold (it holds "
               f"{sorted(listed) or 'none'})" if version not in listed else _state_error(layout, d, name))
        if why is not None:
            raise ConfigError(f"{what} refused: tensor {_tensor(d)} {why}. Nothing was changed.")
    return rest


def check_updates(what: str, layout: Layout, tensors: Iterable[Declared], events: int) -> None:
    """A record batch's updates ``<version>/<key>``, each like its value, of at most ``events`` versions.

    Raises:
        ConfigError: an update of a key the shard does not hold, of another shape or dtype, or more
            versions than the batch has events.
    """
    versions = set()
    for d in tensors:
        version, _, key = d[0].partition("/")
        why = ("is not named <version>/<key>" if not version.isdigit() else
               f"is of {key!r}, {layout.none_of()}" if key not in layout.keys else
               layout.holds(key, d))
        if why is not None:
            raise ConfigError(f"{what} refused: update {_tensor(d)} {why}. Nothing was changed.")
        versions.add(version)
        if len(versions) > events:
            raise ConfigError(f"{what} refused: it carries updates of more versions than its {events} event(s); each "
                              "applied version is one event. Nothing was changed.")
