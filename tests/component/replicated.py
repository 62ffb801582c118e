"""What the replicated-ps component tests share: the model, a ledger of acknowledgements, a training loop.

Used by test_ps_failover.py, test_ps_resync.py and test_replication.py, each of which starts an
:class:`inproc.InprocCluster` with ``ps_replicas = 2`` and kills or restarts its ps.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from psflow.train.trainer import Trainer


class TwoLayer(torch.nn.Module):
    """Two parameter tensors per layer, so that every placement puts some on each of two shards."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 6)
        self.b = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return TwoLayer()


def batch_for(worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(worker)
    return torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


class Ledger:
    """Every shard's push replies as the worker received them (the acknowledgements)."""

    def __init__(self, t: Trainer) -> None:
        self.replies: dict[int, list[dict[str, Any]]] = defaultdict(list)
        recv = t.client.recv_push_replies

        def recording(shards, dests):  # noqa: ANN001, ANN202
            shards = list(shards)
            metas = recv(shards, dests)
            for shard, meta in zip(shards, metas):
                self.replies[shard].append(meta)
            return metas

        t.client.recv_push_replies = recording  # type: ignore[method-assign]

    def applied(self, shard: int = 0) -> int:
        """The pushes to ``shard`` this worker saw acknowledged as applied."""
        return sum(1 for m in self.replies[shard] if m.get("applied") and not m.get("stopped"))


def train(t: Trainer, model: torch.nn.Module, worker: int, *, max_steps: int, seen: list[int] | None = None,
          on_step: Callable[[Trainer], None] | None = None) -> int:
    """Step ``t`` on the worker's fixed batch until the job stops; records every global step it saw."""
    x, y = batch_for(worker)
    while not t.stopped:
        t.step(lambda: F.cross_entropy(model(x), y))
        if seen is not None:
            seen.append(t.global_step)
        if on_step is not None:
            on_step(t)
        assert t.local_step <= 10 * max_steps
    t.close()
    return t.local_step

