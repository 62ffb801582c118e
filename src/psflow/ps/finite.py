"""Non-finite values (NaN, inf) at the ps: the check and the books of the ``nonfinite`` setting.

One push of NaNs, applied, turns every value it touches into NaN, and the model never recovers.
So before a push is applied or held for a sync step, the store (:class:`psflow.ps.store.ParameterStore`)
asks :func:`nonfinite_keys`; what follows is ``TrainConfig.nonfinite``:

- ``refuse`` (default): the push is not applied and never reaches the shard's rules (so it is
  neither recorded nor shipped to a backup). It is counted per worker, and the first refusal of
  each worker is logged naming it. A worker refused ``nonfinite_limit`` times in a row on one shard
  fails the run, naming it: a worker that only ever sends NaNs trains nothing.
- ``fail``: the first such push fails the run, naming the worker and the step.
- ``apply``: no check; the push is applied as any other (what psflow did before).

A failure is raised to the sender (its push's reply is an error) and kept by :class:`NonfiniteBook`;
the ps's main loop fails the ps with it at its next tick (``ParameterStore.tick``), so the run stops
even when the sender is not a trainer that stops on the error. The same check covers the values a
chief initializes the shard with (``refuse`` and ``fail``: the PS_INIT is refused, naming the keys).

Cost: the check is one sum per tensor (no temporary the size of the gradient), summed in Python:
a sum is finite only if every element is (a NaN or an inf propagates through additions), so the
exact per-element scan runs only when the sum is not finite, which can also be a finite sum that
overflowed; then it names the keys. ``benchmarks/bench_nonfinite.py`` measures it against the push.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

log = logging.getLogger("psflow.ps")

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def nonfinite_keys(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The keys of ``tensors`` holding a NaN or an inf, in order (empty: all finite).

    Example:
        >>> nonfinite_keys({"w": torch.ones(2), "b": torch.tensor([1.0, float("nan")])})
        ['b']
    """
    total = 0.0
    for t in tensors.values():
        if t.is_floating_point() or t.is_complex():
            # torch.isfinite(t).all() costs ~25x this on CPU (it builds temporaries the size of t)
            s = t.sum(dtype=torch.float32) if t.dtype in _LOW_PRECISION else t.sum()
            total += abs(complex(s.item())) if t.is_complex() else float(s.item())
    if math.isfinite(total):
        return []
    return [k for k, t in tensors.items() if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all())]


def describe(keys: list[str]) -> str:
    """The keys a message names (the first five, and how many more)."""
    shown = ", ".join(repr(k) for k in keys[:5])
    return shown + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


@dataclass
class NonfiniteBook:
    """One shard's runs of refused pushes per worker, and the failure the run must stop with (once
    set, it stays). The counts in all are the store's (``StoreStats.nonfinite_by_worker``). Kept under
    the store's lock; not replicated (a refused push is no event of the rules: a backup never sees one)."""

    shard: int
    policy: str = "refuse"
    limit: int = 10
    in_row: dict[int, int] = field(default_factory=dict)
    failure: str | None = None

    def accepted(self, worker: int) -> None:
        """A push of ``worker`` passed the check: its run of refusals ends."""
        if self.in_row:
            self.in_row.pop(worker, None)

    def refused(self, worker: int, attempt: int, version: int, keys: list[str], *, first: bool) -> str | None:
        """A push of ``worker`` computed from ``version`` holds NaN or inf in ``keys``; ``first``:
        the worker's first refusal on this shard (logged). Returns the reason the run fails with
        (``fail``, or ``limit`` refusals in a row under ``refuse``), else None: the push is refused
        and the worker goes on."""
        self.in_row[worker] = self.in_row.get(worker, 0) + 1
        what = (f"worker:{worker} (attempt {attempt}) pushed a gradient holding NaN or inf to ps shard {self.shard} "
                f"at step {version} (in {describe(keys)})")
        reason = None
        if self.policy == "fail":
            reason = (f"{what}; nonfinite = fail stops the run. The model diverged or the worker's data or loss is "
                      "broken: lower the learning rate, clip gradients or check the inputs; or set nonfinite = refuse "
                      "to skip such pushes.")
        elif self.in_row[worker] >= self.limit:
            reason = (f"{what}: {self.in_row[worker]} of its pushes in a row were refused (nonfinite_limit = "
                      f"{self.limit}), so it trains nothing. The model diverged or the worker's data or loss is broken: "
                      "lower the learning rate, clip gradients or check the inputs.")
        elif first:
            log.warning("ps shard %d: %s: refused, not applied (nonfinite = refuse). Later refusals of worker:%d are "
                        "counted in the ps stats (nonfinite_by_worker), not logged; %d in a row fail the run.",
                        self.shard, what, worker, self.limit)
        if reason is not None:
            log.error("ps shard %d: %s", self.shard, reason)
            if self.failure is None:
                self.failure = reason
        return reason
