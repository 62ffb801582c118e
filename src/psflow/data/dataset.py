"""In-memory datasets, per-worker shards and resumable shuffled batches.

A :class:`Dataset` holds whole tensors; ``shard`` gives worker i of n every n-th example; a
:class:`BatchIterator` keeps its position (epoch, batch) as state so a restarted worker can resume
exactly where a checkpoint left it. The order of an epoch is a pure function of (seed, epoch).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from psflow.errors import ConfigError

# --------------------------------------------------------------------------- Dataset


def _as_int(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be an integer. Received: {value!r}.")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"{what} must be an integer. Received: {value!r}.") from None


@dataclass(frozen=True, repr=False)
class Dataset:
    """Examples held in memory: inputs ``x`` (N, ...) and targets ``y`` (N, ...) as torch tensors.

    Targets take any shape and dtype: class labels (N,), regression targets (N,) or (N, k), masks.

    Example:
        >>> train = Dataset(torch.randn(1000, 8), torch.randn(1000, 3))    # a regression with 3 outputs
        >>> for x, y in train.shard(task).batches(50, epochs=5, seed=task.replica_index): ...
    """

    x: torch.Tensor
    y: torch.Tensor
    # The tensors map a file copy-on-write (MNIST's float32 cache twin): shards are views, so the
    # pages stay shared between every worker in the page cache and a (re)started worker copies nothing.
    mapped: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.x, torch.Tensor) and isinstance(self.y, torch.Tensor)):
            raise ConfigError(
                f"Dataset needs torch tensors. Received: x {type(self.x).__name__}, "
                f"y {type(self.y).__name__}."
            )
        if self.x.ndim < 1 or self.y.ndim < 1 or self.x.shape[0] != self.y.shape[0]:
            raise ConfigError(
                f"Dataset needs x of shape (N, ...) and y of shape (N, ...): one target per example. "
                f"Received: x {tuple(self.x.shape)}, y {tuple(self.y.shape)}."
            )

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def __repr__(self) -> str:
        return (f"Dataset(n={len(self)}, x={str(self.x.dtype).removeprefix('torch.')}"
                f"{list(self.x.shape)}, y={str(self.y.dtype).removeprefix('torch.')}{list(self.y.shape)})")

    def shard(self, index_or_task: int | object, count: int | None = None) -> Dataset:
        """Return the shard of one worker: every ``count``-th example starting at ``index``.

        Args:
            index_or_task: The shard index, or an object with ``shard_index`` and
                ``num_shards`` attributes (psflow's ``Task``).
            count: The number of shards; required with an integer index.

        Returns:
            A new :class:`Dataset`: a copy (the full set can be freed), or, for a ``mapped`` set,
            views of its file mapping (nothing private to free).

        Raises:
            ConfigError: The index or count is not an integer, or ``not 0 <= index < count``,
                or ``count`` exceeds the number of examples.
        """
        if count is None:
            if not (hasattr(index_or_task, "shard_index") and hasattr(index_or_task, "num_shards")):
                raise ConfigError(
                    f"Dataset.shard needs (index, count) or a task with shard_index and "
                    f"num_shards. Received: {index_or_task!r} and count=None."
                )
            task: Any = index_or_task
            index_or_task, count = task.shard_index, task.num_shards
        index, count = _as_int(index_or_task, "Shard index"), _as_int(count, "Shard count")
        if count < 1 or not 0 <= index < count:
            raise ConfigError(
                f"Shard index {index} of {count} is out of range. "
                "Use 0 <= index < count and count >= 1."
            )
        if count > len(self):
            raise ConfigError(
                f"Cannot split {len(self)} examples into {count} shards: some would be empty. "
                "Use fewer workers or more data."
            )
        if self.mapped:
            return Dataset(self.x[index::count], self.y[index::count].contiguous(), mapped=True)
        return Dataset(self.x[index::count].contiguous(), self.y[index::count].contiguous())

    def batches(self, batch_size: int, *, epochs: int = 1, shuffle: bool = True, seed: int = 0,
                drop_last: bool = False) -> BatchIterator:
        """Iterate over ``(x, y)`` batches for ``epochs`` passes; see :class:`BatchIterator`."""
        return BatchIterator(self, batch_size, epochs=epochs, shuffle=shuffle, seed=seed,
                             drop_last=drop_last)


# --------------------------------------------------------------------------- BatchIterator


def epoch_permutation(num_examples: int, seed: int, epoch: int) -> torch.Tensor:
    """Return the order of the examples in ``epoch``: a pure function of ``(seed, epoch)``."""
    # SeedSequence mixes the pair, so (seed, epoch + 1) and (seed + 1, epoch) are unrelated.
    mixed = int(np.random.SeedSequence((seed, epoch)).generate_state(1, np.uint64)[0])
    generator = torch.Generator().manual_seed(mixed)
    return torch.randperm(num_examples, generator=generator)


class BatchIterator:
    """Batches of a :class:`Dataset` over several epochs, with its position as state.

    States: ``(epoch, batch_index)`` with ``0 <= batch_index < steps_per_epoch`` and
    ``0 <= epoch <= epochs``; ``epoch == epochs`` (with ``batch_index == 0``) is exhausted.
    Transition: each ``next()`` yields batch ``batch_index`` of the epoch's permutation and
    advances ``batch_index``; past the last batch of an epoch it moves to ``(epoch + 1, 0)``.
    ``state_dict()`` / ``load_state_dict()`` save and restore the position, so a restarted
    worker continues with exactly the batches it had not yet seen.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, epochs: int = 1, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False) -> None:
        self.batch_size = _as_int(batch_size, "batch_size")
        self.epochs = _as_int(epochs, "epochs")
        self.seed = _as_int(seed, "seed")
        if self.batch_size < 1 or self.epochs < 1 or self.seed < 0:
            raise ConfigError(
                f"batches() needs batch_size >= 1, epochs >= 1 and seed >= 0. Received: "
                f"batch_size={self.batch_size}, epochs={self.epochs}, seed={self.seed}."
            )
        n = len(dataset)
        self.steps_per_epoch = n // self.batch_size if drop_last else -(-n // self.batch_size)
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"batches({self.batch_size}, drop_last={drop_last}) of {n} examples yields no "
                "batch. Use a smaller batch_size or drop_last=False."
            )
        self._x, self._y = dataset.x, dataset.y
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        self.epoch = 0
        self.batch_index = 0
        self._order: torch.Tensor | None = None
        self._order_epoch = -1

    @property
    def is_exhausted(self) -> bool:
        """Every batch of every epoch was taken: the next ``next()`` raises StopIteration."""
        return self.epoch >= self.epochs

    @property
    def total_steps(self) -> int:
        """Number of batches over all epochs."""
        return self.epochs * self.steps_per_epoch

    def __len__(self) -> int:
        return self.total_steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.epoch >= self.epochs:
            raise StopIteration
        start = self.batch_index * self.batch_size
        stop = min(start + self.batch_size, len(self._y))
        if self.shuffle:
            if self._order_epoch != self.epoch:
                self._order = epoch_permutation(len(self._y), self.seed, self.epoch)
                self._order_epoch = self.epoch
            index = self._order[start:stop]  # type: ignore[index]
            batch = (self._x.index_select(0, index), self._y.index_select(0, index))
        else:
            batch = (self._x[start:stop], self._y[start:stop])
        self.batch_index += 1
        if self.batch_index == self.steps_per_epoch:
            self.epoch, self.batch_index = self.epoch + 1, 0
        return batch

    def _config(self) -> dict[str, int]:
        return {"seed": self.seed, "batch_size": self.batch_size, "num_examples": len(self._y),
                "shuffle": int(self.shuffle), "drop_last": int(self.drop_last)}

    def state_dict(self) -> dict[str, int]:
        """Return the position and the settings it depends on, as plain ints."""
        return {"epoch": self.epoch, "batch_index": self.batch_index, **self._config()}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume at the position saved by :meth:`state_dict`.

        Args:
            state: A mapping returned by ``state_dict()`` of an iterator over the same data with
                the same ``batch_size``, ``seed``, ``shuffle`` and ``drop_last`` (``epochs`` may
                differ, e.g. to train longer).

        Raises:
            ConfigError: A key is missing, a value is not an integer, the settings differ, or
                the position is outside this iterator's range.
        """
        expected = self.state_dict()
        missing = sorted(set(expected) - set(state))
        if missing:
            raise ConfigError(f"Iterator state lacks {missing}. Received: {dict(state)}. "
                              "Pass a mapping returned by BatchIterator.state_dict().")
        values = {key: _as_int(state[key], f"Iterator state {key!r}") for key in expected}
        differ = {k: (values[k], v) for k, v in self._config().items() if values[k] != v}
        if differ:
            raise ConfigError(
                "Iterator state was saved with other settings: "
                f"{{name: (saved, this)}} = {differ}. "
                "Create the iterator over the same shard with the same batch_size, seed, "
                "shuffle and drop_last."
            )
        epoch, batch_index = values["epoch"], values["batch_index"]
        valid = (0 <= epoch < self.epochs and 0 <= batch_index < self.steps_per_epoch) or (
            epoch == self.epochs and batch_index == 0)
        if not valid:
            raise ConfigError(
                f"Iterator position (epoch={epoch}, batch_index={batch_index}) is outside "
                f"epochs={self.epochs} x steps_per_epoch={self.steps_per_epoch}."
            )
        self.epoch, self.batch_index = epoch, batch_index

