"""The names of a training state's tensors: values, optimizer slots and moving averages, one scheme.

A checkpoint, a ps's snapshot and the chief's PS_INIT name the tensors of a training state so::

    <name>               the value of a parameter, or of a piece of one (``w#0:392``)
    opt/<name>/<slot>    one optimizer slot of it (``momentum_buffer``, ``exp_avg``, ``step``)
    ema/<name>           its moving average

Invariants:

- Building and parsing are inverse: ``parse_key(opt_key(n, s)) == StateKey("opt", n, s)`` and
  ``parse_key(k).key == k`` for every well-formed key.
- ``<name>`` is never empty; ``<slot>`` is never empty and has no ``/`` (a parameter's name may,
  since a slot is what follows the *last* ``/``). A key that starts with ``opt/`` or ``ema/`` but
  breaks these rules is refused with a :class:`~psflow.errors.CheckpointError` naming it, never
  read as a value.
- The part after ``opt/`` is the flat form :func:`psflow.optim.optimizer_state_tensors` gives
  (``<name>/<slot>``): :func:`opt_key_of` and :func:`split_state` convert between the two.

Callers: the ps store's snapshot and the ps service's PS_INIT (:mod:`psflow.ps`), the ps trainer
splitting whole tensors into pieces and the all-reduce trainer's save and restore
(:mod:`psflow.train`), and :mod:`psflow.checkpoint.assembly` putting pieces back together.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal, TypeVar

from psflow.errors import CheckpointError

__all__ = ["EMA_PREFIX", "OPT_PREFIX", "StateKey", "ema_key", "opt_key", "opt_key_of", "parse_key", "split_state"]

OPT_PREFIX = "opt/"
EMA_PREFIX = "ema/"
_SCHEME = "<name>, opt/<name>/<slot> or ema/<name>"

T = TypeVar("T")
Kind = Literal["value", "opt", "ema"]


@dataclass(frozen=True)
class StateKey:
    """One parsed tensor name of a training state.

    Attributes:
        kind: ``"value"``, ``"opt"`` (an optimizer slot) or ``"ema"`` (a moving average).
        name: The parameter's name or piece key.
        slot: The optimizer slot for ``"opt"``, else None.
    """

    kind: Kind
    name: str
    slot: str | None = None

    @property
    def key(self) -> str:
        """The tensor name this key stands for (what :func:`parse_key` took apart)."""
        if self.kind == "opt":
            return opt_key(self.name, self.slot or "")
        if self.kind == "ema":
            return ema_key(self.name)
        return self.name

    def renamed(self, name: str) -> StateKey:
        """The same kind of key (same slot) for another parameter or piece, e.g. a piece of this one."""
        return replace(self, name=name)


def opt_key(name: str, slot: str) -> str:
    """The name of optimizer slot ``slot`` of parameter (or piece) ``name``: ``opt/<name>/<slot>``.

    Raises:
        CheckpointError: ``name`` is empty, or ``slot`` is empty or holds a ``/``.

    Example:
        >>> opt_key("w#0:392", "exp_avg")
        'opt/w#0:392/exp_avg'
    """
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"An optimizer slot needs a parameter name. Received: {name!r}. Pass the parameter's name or piece key.")
    if not isinstance(slot, str) or not slot or "/" in slot:
        raise CheckpointError(
            f"Optimizer slot {slot!r} of {name!r} cannot be named in a checkpoint: a slot is a non-empty "
            "name without '/'. Rename the optimizer's state key."
        )
    return f"{OPT_PREFIX}{name}/{slot}"


def ema_key(name: str) -> str:
    """The name of the moving average of parameter (or piece) ``name``: ``ema/<name>``.

    Raises:
        CheckpointError: ``name`` is empty.
    """
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"A moving average needs a parameter name. Received: {name!r}. Pass the parameter's name or piece key.")
    return f"{EMA_PREFIX}{name}"


def opt_key_of(state_key: str) -> str:
    """The name of an entry of :func:`psflow.optim.optimizer_state_tensors` (``<name>/<slot>``).

    Raises:
        CheckpointError: ``state_key`` has no ``/`` or an empty part.
    """
    name, _, slot = state_key.rpartition("/")
    if not name:
        raise CheckpointError(
            f"Optimizer state entry {state_key!r} is not <name>/<slot>. It must come from psflow.optim.optimizer_state_tensors."
        )
    return opt_key(name, slot)


def parse_key(key: str) -> StateKey:
    """Takes a tensor name of a training state apart (the inverse of :func:`opt_key` / :func:`ema_key`).

    Raises:
        CheckpointError: ``key`` is empty, or starts with ``opt/`` or ``ema/`` but is malformed.

    Example:
        >>> parse_key("opt/fc.weight/exp_avg")
        StateKey(kind='opt', name='fc.weight', slot='exp_avg')
    """
    if not isinstance(key, str) or not key:
        raise CheckpointError(f"A state tensor name must be a non-empty str. Received: {key!r}. Names are {_SCHEME}.")
    if key.startswith(OPT_PREFIX):
        name, sep, slot = key[len(OPT_PREFIX):].rpartition("/")
        if not sep or not name or not slot:
            raise CheckpointError(
                f"Malformed optimizer-slot name {key!r}: expected opt/<name>/<slot>, both parts non-empty. "
                "The tensors were not written by psflow, or their names were damaged."
            )
        return StateKey("opt", name, slot)
    if key.startswith(EMA_PREFIX):
        if key == EMA_PREFIX:
            raise CheckpointError(
                f"Malformed moving-average name {key!r}: expected ema/<name> with a non-empty name. "
                "The tensors were not written by psflow, or their names were damaged."
            )
        return StateKey("ema", key[len(EMA_PREFIX):])
    return StateKey("value", key)


def split_state(tensors: Mapping[str, T]) -> tuple[dict[str, T], dict[str, T], dict[str, T]]:
    """Sorts a training state's tensors by kind, each under its plain name.

    Returns:
        (values by name, optimizer slots by ``<name>/<slot>`` as
        :func:`psflow.optim.load_optimizer_state_tensors` takes them, moving averages by name).

    Raises:
        CheckpointError: a name is malformed (see :func:`parse_key`).
    """
    values: dict[str, T] = {}
    slots: dict[str, T] = {}
    averages: dict[str, T] = {}
    for k, v in tensors.items():
        key = parse_key(k)
        if key.kind == "opt":
            slots[f"{key.name}/{key.slot}"] = v
        elif key.kind == "ema":
            averages[key.name] = v
        else:
            values[key.name] = v
    return values, slots, averages
