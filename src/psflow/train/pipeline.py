"""The async one-step pipeline (``TrainConfig.pipeline``): step t+1 computes while step t travels.

Without it a worker's step is compute, then every shard's push, then the replies (the values after
the update): on 100 Mbit/s links the CNN computes ~0.1-0.3 s and then waits ~0.86 s for its bytes,
and the links idle while it computes. With it, ``step()`` returns once its pushes are queued on the
push thread (:mod:`psflow.train.sender`), whose replies land in one of two reply buffers instead of
the model. The next step first waits for the step before the last one (step t-1 at step t+1),
copies those values into the model and computes from them: a worker's step costs about
max(compute, transfer) instead of their sum.

The price is staleness: step t+1 computes from values that lack this worker's own update t (one
step; the other workers' updates as in any async step), counted in the stats (``pipelined_steps``,
``pipeline_staleness``). Async mode only: a sync step waits for the quorum by definition, and the
ssp bound counts clocks the pipeline would run past unseen, so ``TrainConfig`` refuses it there.

What stays as without it: each push is applied once and in order (one step's exchange at a time
per connection, on the one push thread: step t+1's sends queue behind step t's replies, so the
client's resend-once after a reconnect holds); shard 0, which records the data position, goes last
in each step; a failed send or reply is raised on the training thread at the next step (or flush),
and the steps queued behind it are not sent. After ``step()`` the model holds the values of the
step before, not its own update; :meth:`Trainer.flush` (and ``pull``, checkpoints,
``end_training``, ``close``) waits for every step in flight and lands the newest values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

Replies = list[dict[str, Any]] | None  # None: a step whose compute failed (its sent shards were only drained)


@dataclass(frozen=True)
class Flight:
    """One step whose pushes are queued and whose replies land in reply buffer ``buffer``."""

    replies: Future[Replies]
    buffer: int
    early: int  # pushes that left during backward
    t0: float  # the step's start and end on the training thread (perf_counter)
    end: float
    loss: float
    examples: int | None


class ReplyBuffers:
    """Two copies of the values a trainer receives (shaped like its ``dests``), used in turn."""

    def __init__(self, dests: Sequence[Mapping[str, torch.Tensor]]) -> None:
        self._bufs = [[{k: torch.empty_like(v, memory_format=torch.contiguous_format) for k, v in d.items()}
                       for d in dests] for _ in range(2)]
        self._next = 0

    def take(self) -> int:
        """The buffer for the next step's replies (the other one may still be landing)."""
        i, self._next = self._next, 1 - self._next
        return i

    def __getitem__(self, i: int) -> list[dict[str, torch.Tensor]]:
        return self._bufs[i]

    def land(self, i: int, dests: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Copy buffer ``i``'s values into ``dests`` (the model's own tensors)."""
        for buf, dest in zip(self._bufs[i], dests):
            for k, t in dest.items():
                t.copy_(buf[k])
