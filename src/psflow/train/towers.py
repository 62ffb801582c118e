"""In-graph replication in one process: one model replica ("tower") per device, averaged gradients.

The third seed's multi-GPU program builds the network once per ``/gpu:i``, computes each tower's
gradients on its own slice of data, and averages them with ``average_gradients`` before a single
update of the shared variables. :class:`Towers` is that, for an ordinary ``torch.nn.Module``:

* the **master** copy is the model the caller owns (for parameter-server training: the model the
  Trainer pulls into and pushes gradients from); it never runs a forward pass here;
* **replicas** are deep copies of the master, one per device (several may share a device);
* :meth:`Towers.compute_gradients` runs the loss on every replica, backpropagates, and writes the
  average of the replicas' gradients, taken in replica order (never in completion order, so the
  result is deterministic), onto the master's ``.grad``;
* :meth:`Towers.refresh` copies the master's parameters and buffers into every replica; callers do
  it after every change of the master (the Trainer: after each pull).

Averaging rule: with ``batch=`` the batch is split along dim 0 into one slice per replica and each
replica's gradient is weighted by its share of the examples, so for a loss that is a mean over the
batch the result equals the single-device gradient of the whole batch (for an even split this is
TF's plain mean). With ``batches=`` (one batch per replica, the seed's per-GPU input) the weights
are the batch sizes; with neither, each replica weighs 1/n. The returned loss uses the same weights.

Buffers (e.g. BatchNorm statistics) are taken from replica 0 back into the master after each
computation, as TF's tower 0 owns the update ops.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from psflow.devices import format_device_placement, resolve_device
from psflow.errors import ConfigError

__all__ = ["Towers", "batch_examples", "run_step_closure", "split_batch"]

Batch = Sequence[torch.Tensor]
LossFn = Callable[..., torch.Tensor]


def _as_batch(batch: Any) -> tuple[torch.Tensor, ...]:
    items = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    if not items or not all(isinstance(t, torch.Tensor) for t in items):
        raise ConfigError(
            f"A batch must be a tensor or a tuple of tensors such as (x, y); received {type(batch).__name__} "
            f"of {[type(t).__name__ for t in items]}."
        )
    sizes = {t.shape[0] if t.ndim else None for t in items}
    if len(sizes) != 1 or None in sizes:
        raise ConfigError(
            f"Every tensor of a batch needs the same first dimension (the examples); received shapes "
            f"{[tuple(t.shape) for t in items]}."
        )
    return items


def _scalar_loss(loss: Any, what: str) -> torch.Tensor:
    """``loss`` if it is a one-element tensor; else a ConfigError that starts with ``what``."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError(
            f"{what}; received {type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}."
        )
    return loss


def split_batch(batch: Batch | torch.Tensor, n: int) -> list[tuple[torch.Tensor, ...]]:
    """Split each tensor of ``batch`` along dim 0 into ``n`` slices (sizes differ by at most one).

    Slices may be empty when the batch has fewer than ``n`` examples.

    Raises:
        ConfigError: ``batch`` is not tensors with a common first dimension, or ``n < 1``.

    Example:
        >>> [len(x) for x, _ in split_batch((torch.zeros(5, 2), torch.zeros(5)), 2)]
        [3, 2]
    """
    if n < 1:
        raise ConfigError(f"Cannot split a batch into {n} parts; need at least 1.")
    items = _as_batch(batch)
    parts = [torch.tensor_split(t, n, dim=0) for t in items]
    return [tuple(p[i] for p in parts) for i in range(n)]


class Towers:
    """One replica of ``model`` per device; gradients averaged onto the master copy.

    Args:
        model: the master ``torch.nn.Module`` or a function that builds it.
        devices: one device name per replica, e.g. ``["cuda:0", "cuda:1"]``, ``["/gpu:0", "/gpu:1"]``
            or ``["cpu", "cpu"]``; a device that does not exist falls back (see ``soft_placement``).
        soft_placement: fall back to an existing device with a warning instead of failing.

    Raises:
        ConfigError: no devices, an unreadable device name, or an absent device without soft placement.

    Example:
        >>> towers = Towers(model, ["cpu", "cpu"])
        >>> loss = towers.compute_gradients(lambda m, x, y: F.cross_entropy(m(x), y), batch=(x, y))
        >>> opt.step(); towers.refresh()       # model.grad held the averaged gradients
    """

    def __init__(
        self,
        model: torch.nn.Module | Callable[[], torch.nn.Module],
        devices: Sequence[str | torch.device],
        *,
        soft_placement: bool = True,
    ) -> None:
        if isinstance(devices, (str, torch.device)) or not len(devices):
            raise ConfigError(
                f"Towers needs a list of one device per replica, e.g. ['cuda:0', 'cuda:1']; received {devices!r}."
            )
        master = model if isinstance(model, torch.nn.Module) else model()
        if not isinstance(master, torch.nn.Module):
            raise ConfigError(f"Towers needs a torch.nn.Module or a function returning one; got {type(master).__name__}.")
        self.master = master
        self.requested = [str(d) for d in devices]
        self.devices = [resolve_device(d, soft_placement=soft_placement) for d in devices]
        self.replicas = [copy.deepcopy(master).to(d) for d in self.devices]
        self._master_params = list(master.parameters())
        self._master_buffers = list(master.buffers())

    def __len__(self) -> int:
        return len(self.replicas)

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the master's parameters and buffers into every replica (after each update / pull)."""
        for r in self.replicas:
            for dst, src in zip(r.parameters(), self._master_params):
                dst.copy_(src, non_blocking=True)
            for dst, src in zip(r.buffers(), self._master_buffers):
                dst.copy_(src, non_blocking=True)

    def compute_gradients(
        self,
        loss_fn: LossFn,
        *,
        batch: Batch | torch.Tensor | None = None,
        batches: Sequence[Batch | torch.Tensor] | None = None,
    ) -> float:
        """Run ``loss_fn`` on every replica and put the averaged gradients on the master's ``.grad``.

        Args:
            loss_fn: ``loss_fn(replica, *tensors) -> loss``; the replica is the tower's model and the
                tensors its slice of the batch, already on its device. Without a batch: ``loss_fn(replica)``.
            batch: one batch (a tensor or a tuple such as ``(x, y)``), split across the replicas.
            batches: one batch per replica (the seed's per-GPU input).

        Returns:
            The loss averaged with the same weights as the gradients (a float).

        Raises:
            ConfigError: both ``batch`` and ``batches``, a wrong number of batches, or a loss that
                is not a scalar tensor.
        """
        n = len(self.replicas)
        if batch is not None and batches is not None:
            raise ConfigError("Pass batch= (split across the replicas) or batches= (one per replica), not both.")
        if batches is not None:
            if len(batches) != n:
                raise ConfigError(f"batches= needs one batch per replica ({n}); received {len(batches)}.")
            slices: list[tuple[torch.Tensor, ...]] = [_as_batch(b) for b in batches]
        elif batch is not None:
            slices = split_batch(batch, n)
        else:
            slices = [()] * n
        sizes = [float(s[0].shape[0]) if s else 1.0 for s in slices]
        total = sum(sizes)
        if total == 0:
            raise ConfigError("The batch is empty; there is nothing to compute gradients from.")
        weights = [s / total for s in sizes]
        losses: list[tuple[float, torch.Tensor]] = []
        for replica, device, part, w in zip(self.replicas, self.devices, slices, weights):
            if w == 0:
                continue  # fewer examples than replicas: this tower has none
            for p in replica.parameters():
                p.grad = None
            loss = _scalar_loss(loss_fn(replica, *(t.to(device, non_blocking=True) for t in part)),
                                "The loss function must return a scalar tensor")
            loss.backward()
            losses.append((w, loss.detach()))
        self._average_onto_master(weights)
        with torch.no_grad():
            for dst, src in zip(self._master_buffers, self.replicas[0].buffers()):
                dst.copy_(src)
        # Read the losses only now: on GPUs this is the first synchronization, so towers overlap.
        return sum(w * float(v) for w, v in losses)

    @torch.no_grad()
    def _average_onto_master(self, weights: list[float]) -> None:
        per_replica = [list(r.parameters()) for r in self.replicas]
        for i, mp in enumerate(self._master_params):
            terms = [(w, ps[i].grad) for w, ps in zip(weights, per_replica) if w > 0]
            if all(g is None for _, g in terms):
                mp.grad = None
                continue
            # Replica order, one fused weighted sum: deterministic and independent of timing.
            stacked = torch.stack([
                (g if g is not None else torch.zeros_like(mp)).to(mp.device, mp.dtype) for _, g in terms
            ])
            w = torch.tensor([w for w, _ in terms], dtype=stacked.dtype, device=stacked.device)
            mp.grad = (stacked * w.view(-1, *([1] * mp.ndim))).sum(0)

    def format_placement(self, task: str | None = None) -> str:
        """Which replica runs on which device (with the requested name where soft placement moved it)."""
        return format_device_placement(self.replicas, requested=self.requested, task=task)

    def __repr__(self) -> str:
        return f"Towers({len(self)} replicas on {[str(d) for d in self.devices]})"


def batch_examples(batch: Batch | torch.Tensor | None, batches: Sequence[Batch | torch.Tensor] | None) -> int | None:
    """The number of examples in ``batch`` (or in all of ``batches``); None when neither is given."""
    if batch is not None:
        return int(_as_batch(batch)[0].shape[0])
    if batches is not None:
        return sum(int(_as_batch(b)[0].shape[0]) for b in batches)
    return None


def run_step_closure(
    closure: Callable[..., torch.Tensor],
    model: torch.nn.Module,
    *,
    towers: Towers | None = None,
    batch: Batch | torch.Tensor | None = None,
    batches: Sequence[Batch | torch.Tensor] | None = None,
) -> float:
    """Compute one step's gradients with the trainers' closure conventions; returns the loss.

    - ``batch`` given: ``closure(model, *batch)``; with towers the batch is split across them and
      each tower calls ``closure(replica, *slice)``. This form runs unchanged on 1 or N devices.
    - no batch: ``closure()`` (the closure uses the caller's model itself); single device only.

    Gradients end up in ``model``'s ``.grad`` (with towers: the master's, averaged).

    Raises:
        ConfigError: a form that does not fit (towers without a batch, ``batches=`` without towers,
            a loss that is not a scalar tensor).
    """
    if towers is not None:
        if batch is None and batches is None:
            raise ConfigError(
                f"With devices={[str(d) for d in towers.devices]} the step needs the batch to split: "
                "trainer.step(lambda m, x, y: F.cross_entropy(m(x), y), batch=(x, y))."
            )
        return towers.compute_gradients(closure, batch=batch, batches=batches)
    if batches is not None:
        raise ConfigError("batches= (one batch per device) needs devices=[...] with one device per batch; use batch=.")
    loss = _scalar_loss(closure(model, *_as_batch(batch)) if batch is not None else closure(),
                        "The step's closure must return the loss as a scalar tensor")
    loss.backward()
    return float(loss.detach())
