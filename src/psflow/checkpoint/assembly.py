"""A training run's checkpoint: the meta the chief stores, and whole tensors out of the ps's pieces.

The ps each save their own pieces of the parameters (``w#0:392``), with their optimizer slots
(``opt/w#0:392/<slot>``) and moving averages (``ema/w#0:392``), named by
:mod:`psflow.checkpoint.keys`. The manifest's meta, built by :func:`run_meta`, holds the writer's
placement, so the pieces can be put back into whole tensors (:func:`load_whole_tensors`) and
restored into any number of ps, or exported (:func:`state_dict_from`).

Invariants: every key :func:`run_meta` writes is read here or by the Supervisor (``data_position``)
and nowhere else spelled; a whole tensor is built only from all of its pieces (a slot present on
some pieces of a parameter and not on others is refused).

Callers: the Supervisor (``run_meta`` when saving, ``load_whole_tensors`` when restoring), the
evaluator and :mod:`psflow.checkpoint.export` (``state_dict_from``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from psflow.checkpoint.keys import ema_key, opt_key, split_state
from psflow.checkpoint.reader import Checkpoint
from psflow.errors import CheckpointError, ConfigError
from psflow.ps.placement import Placement, assemble


def run_meta(
    *,
    step: int,
    placement: Placement,
    optimizer: Mapping[str, Any],
    schedule: Mapping[str, Any] | None,
    ema_decay: float | None,
    export_averages: bool,
    shard_versions: Sequence[int],
    data_positions: Mapping[str, Any],
    writer: str,
) -> dict[str, Any]:
    """The meta a psflow run stores in each checkpoint's manifest (JSON-able).

    Args:
        step: the global step the checkpoint holds.
        placement: how the parameters were split over the ps (needed to put the pieces back).
        optimizer: the optimizer spec (``OptimizerSpec.to_dict()``).
        schedule: the learning-rate schedule (``Schedule.to_dict()``), or None.
        ema_decay: the moving averages' decay, or None when the run kept none.
        export_averages: whether the averages stand for the model in export and evaluation.
        shard_versions: each ps shard's version when it saved.
        data_positions: every worker's data position by task id.
        writer: the task that committed the checkpoint.
    """
    return {
        "global_step": step,
        "placement": placement.to_dict(),
        "optimizer": dict(optimizer),
        "schedule": dict(schedule) if schedule is not None else None,
        "ema_decay": ema_decay,
        "export": "averages" if export_averages else "values",
        "shard_versions": list(shard_versions),
        "data_position": dict(data_positions),
        "writer": writer,
    }


def load_whole_tensors(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, with the pieces of split parameters put back together.

    Returns:
        Whole tensors by parameter name, plus ``opt/<param>/<slot>`` and ``ema/<param>`` when the
        checkpoint has them: the form :meth:`psflow.Trainer.restore_from` takes.

    Raises:
        CheckpointError: a shard is corrupt, the manifest has no placement, or a piece is missing.
    """
    raw = ckpt.meta.get("placement")
    if not isinstance(raw, Mapping):
        raise CheckpointError(
            f"Checkpoint {ckpt.path} has no placement in its manifest meta, so its pieces cannot be put back "
            "together. It was not written by psflow's Supervisor; restore it with psflow.checkpoint directly."
        )
    try:
        placement = Placement.from_dict(raw)
    except ConfigError as e:
        raise CheckpointError(f"Checkpoint {ckpt.path} has an invalid placement in its manifest: {e}") from e
    return assemble_pieces(ckpt.load_all(), placement, where=str(ckpt.path))


def assemble_pieces(stored: Mapping[str, torch.Tensor], placement: Placement, *, where: str = "the checkpoint") -> dict[str, torch.Tensor]:
    """Put stored pieces (``w#0:392``, ``opt/w#0:392/<slot>``, ``ema/w#0:392``) back into whole tensors."""
    values, flat_slots, ema = split_state(stored)
    slots: dict[str, dict[str, torch.Tensor]] = {}
    for flat, t in flat_slots.items():
        piece, _, slot = flat.rpartition("/")
        slots.setdefault(slot, {})[piece] = t
    try:
        out = assemble(placement.params, values, placement)
        if ema:
            out.update({ema_key(n): t for n, t in assemble(placement.params, ema, placement).items()})
    except ConfigError as e:
        raise CheckpointError(f"Cannot put the pieces of {where} back together: {e}") from e
    for slot, by_piece in slots.items():
        for info in placement.params:
            pieces = placement.pieces_of(info.name)
            found = [by_piece.get(p.key) for p in pieces]
            if all(t is None for t in found):
                continue  # this parameter has no such slot (it never stepped)
            if any(t is None for t in found):
                missing = [p.key for p, t in zip(pieces, found) if t is None]
                raise CheckpointError(f"{where} has optimizer slot {slot!r} for some pieces of {info.name!r} but not for {missing}.")
            whole = len(pieces) == 1 and pieces[0].rows is None
            shaped = all(tuple(t.shape) == placement.piece_shape(p) for p, t in zip(pieces, found))  # type: ignore[union-attr]
            # A slot shaped like its piece is split like the parameter; a scalar (Adam's step) is the same on every piece.
            out[opt_key(info.name, slot)] = found[0] if whole or not shaped else torch.cat(found)  # type: ignore[arg-type]
    return out


def state_dict_from(ckpt: Checkpoint, *, averages: bool | None = None) -> dict[str, torch.Tensor]:
    """The model's parameters from a checkpoint as an ordinary ``state_dict`` (whole tensors by name).

    Args:
        ckpt: the checkpoint.
        averages: the moving averages instead of the values; None: what the run chose
            (``Supervisor(ema_for_export=...)``).

    Raises:
        CheckpointError: averages were asked for and the run kept none (no ``ema_decay``).
    """
    tensors = load_whole_tensors(ckpt)
    if averages is None:
        averages = exports_averages(ckpt)
    names = [info["name"] for info in ckpt.meta["placement"]["params"]]
    if averages and any(ema_key(n) not in tensors for n in names):
        raise CheckpointError(
            f"Checkpoint {ckpt.path} has no moving averages: the run trained without ema_decay. "
            "Export the values instead (drop --averages) or train with Trainer(..., ema_decay=0.99)."
        )
    return {n: tensors[ema_key(n) if averages else n].contiguous() for n in names}


def exports_averages(ckpt: Checkpoint) -> bool:
    """Whether the run chose its moving averages to stand for the model (``ema_for_export``)."""
    return ckpt.meta.get("export") == "averages"
