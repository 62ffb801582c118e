"""Component tests: primary-backup replication of ps shards (``ps_replicas = 2``).

An in-process cluster (tests/component/inproc.py) with two ps: shard 0's backup is on ps:1 and
shard 1's on ps:0. Real Trainers train to the job's stop step; what is proven:

- the backup of every shard ends in the primary's exact state: the same values (bit for bit: the
  same optimizer step on the same update), the same version, the same rules' bookkeeping and the
  same count of applied updates, in async, sync (the step's averaged gradient crosses, once) and ssp;
- every push a worker had acknowledged is held by the backup at the moment of the acknowledgement;
- with ``ps_replicas = 1`` (the default) no ps holds a copy and the status has no replication part.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from inproc import InprocCluster, run_threads
from replicated import batch_for, make_model, train

from psflow import optim
from psflow.config import TrainConfig

pytestmark = pytest.mark.timeout(90)
torch.set_num_threads(1)

WAIT_S = 30.0
MAX_STEPS = 12


def run_job(c: InprocCluster, workers: int, optimizer: optim.OptimizerSpec) -> None:
    models = [make_model() for _ in range(workers)]
    trainers = [c.trainer(w, models[w], optimizer) for w in range(workers)]
    trainers[0].plan_steps(stop_at=MAX_STEPS)
    for t in trainers:
        t.prepare()
    run_threads([lambda w=w: train(trainers[w], models[w], w, max_steps=MAX_STEPS) for w in range(workers)], timeout_s=WAIT_S)


def assert_backups_match(c: InprocCluster) -> None:
    c.settle()
    for shard, primary in enumerate(c.services):
        backup = c.services[(shard + 1) % len(c.services)].backups[shard]
        p, b = primary.store, backup
        assert b.version == p.version
        assert b.values.keys() == p.values.keys()
        for k in p.values:
            assert torch.equal(b.values[k], p.values[k]), f"shard {shard}: {k} differs on the backup"
        assert b.rules.state() == p.rules.state()
        assert b.stats.applied_updates == p.stats.applied_updates
        assert b.progress.positions_now() == p.progress.positions_now()


@pytest.mark.parametrize("mode", ["async", "sync", "ssp"])
def test_each_backup_ends_in_its_primarys_exact_state(mode: str) -> None:
    with InprocCluster(2, 2, TrainConfig(mode=mode, ps_replicas=2)) as c:
        run_job(c, 2, optim.Adam(lr=0.01))
        statuses = c.status()
        assert_backups_match(c)
    assert statuses[0]["version"] == MAX_STEPS
    for st in statuses:
        rep = st["replication"]
        assert rep["degraded"] is None and rep["acked_seq"] == rep["seq"]
    assert statuses[1]["replication"]["backups"]["0"]["version"] == MAX_STEPS
    assert statuses[0]["replication"]["backups"]["1"]["applied_updates"] == statuses[1]["stats"]["applied_updates"]


def test_a_push_is_acknowledged_only_once_the_backup_holds_it() -> None:
    with InprocCluster(2, 1, TrainConfig(mode="async", ps_replicas=2)) as c:
        model = make_model()
        t = c.trainer(0, model, optim.SGD(lr=0.1))
        t.plan_steps(stop_at=MAX_STEPS)
        t.prepare()
        x, y = batch_for(0)
        for step in range(1, 6):
            t.step(lambda: F.cross_entropy(model(x), y))
            # The reply came: both backups hold this push already (in memory; applied on their own thread).
            assert c.services[1].holds(0) == c.services[0].store.seq
            assert c.services[0].holds(1) == c.services[1].store.seq
            c.services[1]._drain(0, 10.0)
            c.services[0]._drain(1, 10.0)
            assert c.services[1].backups[0].version == c.services[0].backups[1].version == step
        t.close()


def test_without_replicas_no_ps_holds_a_copy() -> None:
    with InprocCluster(2, 2, TrainConfig(mode="async")) as c:
        run_job(c, 2, optim.SGD(lr=0.1))
        statuses = c.status()
        assert all(not s.backups and s.store.forwarder is None for s in c.services)
    assert all("replication" not in st for st in statuses)
