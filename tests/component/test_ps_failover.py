"""Component tests: a dead primary ps loses no acknowledged update (``ps_replicas = 2``).

An in-process cluster (tests/component/inproc.py) with two ps, each the backup of the other's
shard. The primary of shard 0 is killed mid-run by closing its server abruptly (every connection
drops, as SIGKILL does; its forwarder's connection too). What is proven, in async (also with the
pipeline: steps in flight at the kill) and sync:

- training goes on with no error reaching the trainers' callers and reaches the stop step;
- the global step a worker sees never goes back;
- a ledger: every push a worker had acknowledged as applied on shard 0 is applied exactly once on
  the surviving copy (acknowledged applied pushes == the survivor's applied updates == its version
  in async; in sync every step is acknowledged to its contributors);
- the survivor serves both shards, each alone in a new term (the authority's views), and nothing forwards to the dead ps.
"""

from __future__ import annotations

import pytest
import torch
from inproc import InprocCluster, run_threads
from replicated import Ledger, make_model, train

from psflow import optim
from psflow.config import TrainConfig
from psflow.train.trainer import Trainer

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)

WAIT_S = 60.0
MAX_STEPS = 16
KILL_AT = 5


@pytest.mark.parametrize("mode", ["async", "sync", "async-pipeline"])
def test_a_dead_primary_loses_no_acknowledged_update(mode: str) -> None:
    # async-pipeline: the kill finds steps in flight (pushes sent, replies read on their own thread)
    config = TrainConfig(mode=mode.split("-")[0], ps_replicas=2, pipeline=mode.endswith("pipeline"))
    with InprocCluster(2, 2, config) as c:
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
                c.kill_ps(0)

        run_threads([lambda: train(trainers[0], models[0], 0, max_steps=MAX_STEPS, seen=seen[0], on_step=kill_once),
                     lambda: train(trainers[1], models[1], 1, max_steps=MAX_STEPS, seen=seen[1])], timeout_s=WAIT_S)
        survivor = c.services[1]
        copy = survivor.backups[0]
        status = survivor.store_of(0).version, copy.stats.applied_updates, sorted(survivor.serving)
        degraded = [survivor.views[s].state.value for s in (0, 1)], [survivor.views[s].term for s in (0, 1)]
        forwarding = survivor.store.forwarder
    assert killed, "the primary was never killed"
    version, applied_updates, serving = status
    assert serving == [0] and degraded == (["alone", "alone"], [2, 2]) and forwarding is None
    assert version == MAX_STEPS
    for s in seen:
        assert s == sorted(s), f"the global step went back: {s}"
    if mode.startswith("async"):
        # Every acknowledged applied push was applied once on the surviving copy, and nothing else was.
        assert ledgers[0].applied() + ledgers[1].applied() == applied_updates == MAX_STEPS
    else:
        assert applied_updates == MAX_STEPS
