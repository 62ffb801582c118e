"""Component tests: a dead primary ps loses no acknowledged update (``ps_replicas = 2``).

An in-process cluster (tests/component/inproc.py) with two ps, each the backup of the other's
shard. The primary of shard 0 is killed mid-run by closing its server abruptly (every connection
drops, as SIGKILL does; its forwarder's connection too). What is proven, in async and sync:

- training goes on with no error reaching the trainers' callers and reaches the stop step;
- the global step a worker sees never goes back;
- a ledger: every push a worker had acknowledged as applied on shard 0 is applied exactly once on
  the surviving copy (acknowledged applied pushes == the survivor's applied updates == its version
  in async; in sync every step is acknowledged to its contributors);
- the survivor serves both shards, and the dead primary's shard is no longer replicated (degraded).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from inproc import InprocCluster, run_threads

from psflow import optim
from psflow.cluster import TaskId
from psflow.config import TrainConfig
from psflow.train.trainer import Trainer

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)

WAIT_S = 60.0
MAX_STEPS = 16
KILL_AT = 5


class TwoLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 6)
        self.b = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return TwoLayer()


class Ledger:
    """Shard 0's push replies as the worker received them (the acknowledgements)."""

    def __init__(self, t: Trainer) -> None:
        self.replies: list[dict[str, Any]] = []
        recv = t.client.recv_push_replies

        def recording(shards, dests):  # noqa: ANN001, ANN202
            shards = list(shards)
            metas = recv(shards, dests)
            if 0 in shards:
                self.replies.append(metas[shards.index(0)])
            return metas

        t.client.recv_push_replies = recording  # type: ignore[method-assign]

    def applied(self) -> int:
        return sum(1 for m in self.replies if m.get("applied") and not m.get("stopped"))


def kill_ps(c: InprocCluster, index: int) -> None:
    """What SIGKILL does to a ps: its listener and every connection close at once."""
    c.servers[TaskId("ps", index)].stop()
    c.services[index].stop()


def train(t: Trainer, model: torch.nn.Module, worker: int, seen: list[int], on_step=None) -> int:  # noqa: ANN001
    g = torch.Generator().manual_seed(worker)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
    while not t.stopped:
        t.step(lambda: F.cross_entropy(model(x), y))
        seen.append(t.global_step)
        if on_step is not None:
            on_step(t)
        assert t.local_step <= 10 * MAX_STEPS
    t.close()
    return t.local_step


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_dead_primary_loses_no_acknowledged_update(mode: str) -> None:
    with InprocCluster(2, 2, TrainConfig(mode=mode, ps_replicas=2)) as c:
        for s in c.services:
            s.failover_s = 1.0  # the survivor stops waiting for its dead backup within a second
        models = [make_model() for _ in range(2)]
        trainers = [c.trainer(w, models[w], optim.SGD(lr=0.1)) for w in range(2)]
        for t in trainers:
            t.client.failover_s = 1.0
        trainers[0].plan_steps(stop_at=MAX_STEPS)
        for t in trainers:
            t.prepare()
        ledgers = [Ledger(t) for t in trainers]
        seen: list[list[int]] = [[], []]
        killed: list[int] = []

        def kill_once(t: Trainer) -> None:
            if not killed and t.global_step >= KILL_AT:
                killed.append(t.global_step)
                kill_ps(c, 0)

        run_threads([lambda: train(trainers[0], models[0], 0, seen[0], kill_once),
                     lambda: train(trainers[1], models[1], 1, seen[1])], timeout_s=WAIT_S)
        survivor = c.services[1]
        copy = survivor.backups[0]
        status = survivor.store_of(0).version, copy.stats.applied_updates, sorted(survivor.serving)
        degraded = survivor.store.forwarder.degraded if survivor.store.forwarder else None
    assert killed, "the primary was never killed"
    version, applied_updates, serving = status
    assert serving == [0] and degraded is not None
    assert version == MAX_STEPS
    for s in seen:
        assert s == sorted(s), f"the global step went back: {s}"
    if mode == "async":
        # Every acknowledged applied push was applied once on the surviving copy, and nothing else was.
        assert ledgers[0].applied() + ledgers[1].applied() == applied_updates == MAX_STEPS
    else:
        assert applied_updates == MAX_STEPS
