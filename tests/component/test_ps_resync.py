"""Component tests: a restarted ps re-syncs from the survivor and becomes its backup (``ps_replicas = 2``).

An in-process cluster (tests/component/inproc.py) with two ps, each the backup of the other's shard.
ps:0 is killed mid-run (its server closes every connection, as SIGKILL does) and started again as
attempt 1 on the same address (what the launcher's restart does). What is proven:

- until it has re-synced, the restarted ps refuses every request with a retryable NotServingError,
  and the clients route to the survivor (no error reaches the trainers, even when ps:0 is back
  before the clients' failover window ran out);
- after the re-sync ps:1 serves both shards (no flip-flop) and ps:0 holds both backups, ending in
  the survivor's exact state (values bit for bit, rules' bookkeeping, counters, data positions);
- killing the survivor next: the re-synced ps:0 takes over both shards and the job reaches its stop
  step with nothing acknowledged lost (a ledger: the pushes acknowledged as applied == the applied
  updates of the copy that finished the job), and the global step never goes back.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from inproc import SECRET, InprocCluster, run_threads, wait_until
from replicated import Ledger, make_model, train

from psflow import optim
from psflow.cluster import TaskId
from psflow.config import TrainConfig
from psflow.ps.replication import Role
from psflow.ps.service import PsService
from psflow.train.trainer import Trainer
from psflow.wire.conn import connect
from psflow.wire.ops import Op

pytestmark = pytest.mark.timeout(150)
torch.set_num_threads(1)

WAIT_S = 90.0
MAX_STEPS = 24
KILL_AT = 5
KILL_SURVIVOR_AT = 14
FAST = {"primary_failover_s": 1.0, "backup_failover_s": 1.0}


def resynced(service: PsService) -> bool:
    return all(service.roles.get(s) is Role.BACKUP for s in (0, 1))


def run_with_faults(c: InprocCluster, *, kill_survivor: bool) -> tuple[list[Ledger], list[list[int]], list[str]]:
    models = [make_model() for _ in range(2)]
    trainers = [c.trainer(w, models[w], optim.SGD(lr=0.1)) for w in range(2)]
    trainers[0].plan_steps(stop_at=MAX_STEPS)
    for t in trainers:
        t.prepare()
    ledgers = [Ledger(t) for t in trainers]
    seen: list[list[int]] = [[], []]
    events: list[str] = []
    lock = threading.Lock()

    def faults(t: Trainer) -> None:
        with lock:
            if not events and t.global_step >= KILL_AT:
                events.append("killed ps:0")
                c.kill_ps(0)
                # Back at once, before the clients' failover window ran out: they reconnect to it.
                c.restart_ps(0).start_resync(30.0)
                wait_until(lambda: resynced(c.services[0]), 30.0, "ps:0's re-sync")
                events.append("ps:0 re-synced")
            elif kill_survivor and len(events) == 2 and t.global_step >= KILL_SURVIVOR_AT:
                events.append("killed ps:1")
                c.kill_ps(1)

    run_threads([lambda: train(trainers[0], models[0], 0, max_steps=MAX_STEPS, seen=seen[0], on_step=faults),
                 lambda: train(trainers[1], models[1], 1, max_steps=MAX_STEPS, seen=seen[1], on_step=faults)], timeout_s=WAIT_S)
    return ledgers, seen, events


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_restarted_ps_resyncs_and_becomes_the_survivors_backup(mode: str) -> None:
    with InprocCluster(2, 2, TrainConfig(mode=mode, ps_replicas=2, **FAST)) as c:
        ledgers, seen, events = run_with_faults(c, kill_survivor=False)
        survivor, restarted = c.services[1], c.services[0]
        status = c.status()
        assert events == ["killed ps:0", "ps:0 re-synced"]
        assert survivor.roles == {0: Role.SERVING, 1: Role.SERVING}  # the survivor stays primary: no flip-flop
        assert restarted.roles == {0: Role.BACKUP, 1: Role.BACKUP}
        c.settle()
        for shard in (0, 1):
            p = survivor.store_of(shard)
            b = restarted.store if shard == 0 else restarted.backups[1]
            assert p.version == b.version == MAX_STEPS
            for k in p.values:
                assert torch.equal(b.values[k], p.values[k]), f"shard {shard}: {k} differs on the re-synced copy"
            assert b.rules.state() == p.rules.state()
            assert b.stats.applied_updates == p.stats.applied_updates
            assert b.progress.positions_now() == p.progress.positions_now()
            if mode == "async":
                assert ledgers[0].applied(shard) + ledgers[1].applied(shard) == p.stats.applied_updates == MAX_STEPS
    for s in seen:
        assert s == sorted(s), f"the global step went back: {s}"
    assert status[1]["replication"]["degraded"] is None  # shard 1 has its backup again
    assert status[0]["replication"]["roles"] == {"0": "backup", "1": "backup"}


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_after_a_resync_the_survivors_death_loses_no_acknowledged_update(mode: str) -> None:
    with InprocCluster(2, 2, TrainConfig(mode=mode, ps_replicas=2, **FAST)) as c:
        ledgers, seen, events = run_with_faults(c, kill_survivor=True)
        last = c.services[0]
        copies = {0: last.store, 1: last.backups[1]}
        roles = dict(last.roles)
    assert events == ["killed ps:0", "ps:0 re-synced", "killed ps:1"]
    assert roles == {0: Role.SERVING, 1: Role.SERVING}
    for shard, copy in copies.items():
        assert copy.version == MAX_STEPS
        if mode == "async":  # every acknowledged applied push is on the last copy, once; nothing else is
            assert ledgers[0].applied(shard) + ledgers[1].applied(shard) == copy.stats.applied_updates == MAX_STEPS
        else:
            assert copy.stats.applied_updates == MAX_STEPS
    for s in seen:
        assert s == sorted(s), f"the global step went back: {s}"


def test_a_restarted_ps_refuses_requests_until_it_has_resynced() -> None:
    with InprocCluster(2, 1, TrainConfig(mode="async", ps_replicas=2, **FAST)) as c:
        model = make_model()
        t = c.trainer(0, model, optim.SGD(lr=0.1))
        t.plan_steps(stop_at=MAX_STEPS)
        t.prepare()
        x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
        for _ in range(3):
            t.step(lambda: F.cross_entropy(model(x), y))
        c.kill_ps(0)
        restarted = c.restart_ps(0)  # it holds nothing, or the backup it is loading: it serves nothing
        conn = connect(c.cluster.address(TaskId("ps", 0)), secret=SECRET, task="worker:0", peer="ps:0", deadline_s=5.0)
        try:
            for op, meta in ((Op.PS_PULL, {}), (Op.PS_PULL, {"shard": 0}), (Op.PS_READY, {"timeout_s": 1.0})):
                conn.send(op, meta)
                reply = conn.recv()
                assert reply.op == Op.ERROR and reply.meta["kind"] == "NotServingError", reply.meta
                assert "ps:1 serves it" in reply.meta["error"], reply.meta
            init = conn.request(Op.PS_INIT, {"optimizer": {"name": "sgd", "lr": 1.0}, "config": TrainConfig().to_dict()})
            assert init.meta["initialized"] is False  # a chief's initial values never replace a restarted shard
        finally:
            conn.close()
        # The trainer's client routes shard 0 to ps:1 on the refusal and goes on without an error.
        t.step(lambda: F.cross_entropy(model(x), y))
        assert t.client.routes == {0: 1} and c.services[1].roles[0] is Role.SERVING
        restarted.resync(30.0)
        assert restarted.roles == {0: Role.BACKUP, 1: Role.BACKUP}
        t.step(lambda: F.cross_entropy(model(x), y))
        restarted._drain(0, 10.0)  # the backup holds the step's records; it applies them on its own thread
        assert restarted.store.version == c.services[1].store_of(0).version == 5
        t.close()
