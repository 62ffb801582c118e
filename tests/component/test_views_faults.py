"""Component tests: the shard views hold under the faults that split a shard before (issue 22).

An in-process cluster (tests/component/inproc.py) with two ps, each the backup of the other's shard,
and the authority over the views on a server of its own (the launcher's role). Each test injects the
fault that broke the guarantee, and checks what must hold:

- a request that names a shard at its backup (a worker that failed over, or resent a refused push)
  never moves the shard while its serving copy lives;
- copies cut off from each other (psflow chaos's partition) go on alone only at the authority's
  word (a new term); a cut-off backup never serves, comes back as the backup of a later term and
  ends in the serving copy's exact state; nothing acknowledged is lost;
- while a replaced backup loads the state, the serving copy keeps acknowledging (no stall).
"""

from __future__ import annotations

import time

import pytest
import torch
from inproc import SECRET, InprocCluster, run_threads, wait_until
from replicated import Ledger, make_model, train

from psflow import optim
from psflow.cluster import TaskId
from psflow.config import TrainConfig
from psflow.errors import RemoteError
from psflow.ps.replication import Role
from psflow.ps.store import ParameterStore
from psflow.train.trainer import Trainer
from psflow.wire.conn import connect
from psflow.wire.ops import Op

pytestmark = pytest.mark.timeout(150)
torch.set_num_threads(1)

WAIT_S = 90.0
MAX_STEPS = 30
FAST = {"primary_failover_s": 1.0, "backup_failover_s": 1.0}


def start(c: InprocCluster, steps: int = MAX_STEPS) -> tuple[list[Trainer], list[torch.nn.Module], list[Ledger]]:
    models = [make_model() for _ in range(2)]
    trainers = [c.trainer(w, models[w], optim.SGD(lr=0.1)) for w in range(2)]
    trainers[0].plan_steps(stop_at=steps)
    for t in trainers:
        t.prepare()
    return trainers, models, [Ledger(t) for t in trainers]


def same_copies(a: ParameterStore, b: ParameterStore) -> None:
    assert a.version == b.version and a.stats.applied_updates == b.stats.applied_updates
    for k in a.values:
        assert torch.equal(a.values[k], b.values[k]), f"shard {a.shard}: {k} differs between the copies"


def test_a_request_naming_the_shard_at_its_backup_never_moves_it() -> None:
    with InprocCluster(2, 2, TrainConfig(mode="async", ps_replicas=2, **FAST)) as c:
        trainers, models, ledgers = start(c)
        asked: list[str] = []

        def ask_the_backup(t: Trainer) -> None:
            if not asked and t.global_step >= 5:  # what a worker whose push ps:0 refused once would send next
                conn = connect(c.cluster.address(TaskId("ps", 1)), secret=SECRET, task="worker:1", peer="ps:1")
                try:
                    conn.request(Op.PS_PULL, {"shard": 0, "timeout_s": 1.0}, timeout_s=5.0)
                    asked.append("served")
                except RemoteError as e:
                    asked.append(e.kind or str(e))
                finally:
                    conn.close()

        run_threads([lambda: train(trainers[0], models[0], 0, max_steps=MAX_STEPS, on_step=ask_the_backup),
                     lambda: train(trainers[1], models[1], 1, max_steps=MAX_STEPS)], timeout_s=WAIT_S)
        primary, backup = c.services
        assert asked == ["NotServingError"]
        assert backup.roles[0] is Role.BACKUP and primary.roles[0] is Role.SERVING
        assert c.authority is not None and c.authority.book.views[0].term == 1  # no view changed
        same_copies(primary.store, backup.backups[0])
        assert ledgers[0].applied(0) + ledgers[1].applied(0) == primary.store.stats.applied_updates == MAX_STEPS


def test_copies_partitioned_from_each_other_go_on_alone_only_at_the_authoritys_word() -> None:
    with InprocCluster(2, 2, TrainConfig(mode="async", ps_replicas=2, **FAST)) as c:
        trainers, models, ledgers = start(c)
        assert c.authority is not None
        book = c.authority.book
        serving_seen: list[tuple[tuple[int, ...], ...]] = []
        events: list[str] = []

        def synced() -> bool:
            return all(book.views[s].state.value == "synced" for s in (0, 1)) and \
                all(c.services[(s + 1) % 2].roles.get(s) is Role.BACKUP for s in (0, 1))

        def partition(t: Trainer) -> None:
            # psflow chaos's partition: ps:1's links to ps:0 cut both ways (the workers and the launcher still reach both).
            if not events and t.global_step >= 5:
                events.append("cut")
                c.services[1].partition()
            serving_seen.append(tuple(tuple(p.shard for p in c.services if p.roles.get(s) is Role.SERVING) for s in (0, 1)))
            if events == ["cut"] and t.global_step >= 12:
                assert all(book.views[s].state.value == "alone" for s in (0, 1)), book.snapshot()
                events.append("healed")
                c.services[1].partition()
            if events == ["cut", "healed"] and t.global_step >= 20:  # the job goes on once both are synced again
                wait_until(synced, 30.0, "both shards synced again")
                events.append("synced")

        run_threads([lambda: train(trainers[0], models[0], 0, max_steps=MAX_STEPS, on_step=partition),
                     lambda: train(trainers[1], models[1], 1, max_steps=MAX_STEPS)], timeout_s=WAIT_S)
        assert events == ["cut", "healed", "synced"]
        for s in (0, 1):
            story = [cause for cause, v in book.story if v.shard == s]
            assert any("cannot reach its backup" in cause for cause in story), story
            assert book.views[s].serving == s and book.views[s].term >= 3
        assert all(seen == ((0,), (1,)) for seen in serving_seen), "another copy served a shard"
        for s, (serving, backup) in enumerate([(c.services[0].store, c.services[1].backups[0]),
                                                (c.services[1].store, c.services[0].backups[1])]):
            assert ledgers[0].applied(s) + ledgers[1].applied(s) == serving.stats.applied_updates == MAX_STEPS
            wait_until(lambda b=backup, p=serving: b.version == p.version, 10.0, "the backup's last records")
            same_copies(serving, backup)


# Serial: under the parallel suite's load the restarted backup's 1 s lease lapsed and it loaded the state a
# third time (seen once under xdist), which the exact count of loads below reads as a failure.
@pytest.mark.serial
def test_the_serving_copy_acknowledges_while_a_replaced_backup_loads_the_state(monkeypatch) -> None:  # noqa: ANN001
    steps = 4000  # a few seconds of training: longer than the loads below
    with InprocCluster(2, 2, TrainConfig(mode="async", ps_replicas=2, **FAST)) as c:
        trainers, models, ledgers = start(c, steps)
        loads: list[tuple[float, float]] = []  # when each state load ran (the backup's side)
        load_state = ParameterStore.load_state

        def slow_load(self, meta, tensors):  # noqa: ANN001, ANN202
            began = time.monotonic()
            time.sleep(1.0)  # a big model's state crossing: the serving copy must not wait for it
            loads.append((began, time.monotonic()))
            return load_state(self, meta, tensors)

        monkeypatch.setattr(ParameterStore, "load_state", slow_load)
        steps_at: list[float] = []
        killed: list[int] = []

        def replace_backup(t: Trainer) -> None:
            steps_at.append(time.monotonic())
            if not killed and t.global_step >= 5:
                killed.append(t.global_step)
                c.kill_ps(1)
                c.restart_ps(1).start_resync(30.0)

        run_threads([lambda: train(trainers[0], models[0], 0, max_steps=steps, on_step=replace_backup),
                     lambda: train(trainers[1], models[1], 1, max_steps=steps,
                                   on_step=lambda t: steps_at.append(time.monotonic()))], timeout_s=WAIT_S)
        survivor, restarted = c.services
        wait_until(lambda: all(restarted.roles.get(s) is Role.BACKUP for s in (0, 1)), 30.0, "ps:1's re-sync")
        assert len(loads) == 2 and max(end for _, end in loads) < steps_at[-1], "the job ended before the loads"
        for began, ended in loads:  # steps went on (the serving copy acknowledged alone) while each state loaded
            during = sum(1 for t in steps_at if began + 0.2 < t < ended)
            assert during >= 3, f"training stalled while the backup loaded a state: {during} steps in {ended - began:.1f} s"
        for shard in (0, 1):
            copy = restarted.store if shard == 1 else restarted.backups[0]
            wait_until(lambda c=copy, s=shard: c.version == survivor.store_of(s).version, 10.0, "the backup's last records")
            same_copies(survivor.store_of(shard), copy)
            assert ledgers[0].applied(shard) + ledgers[1].applied(shard) == steps


def test_a_request_with_a_newer_term_makes_the_copy_ask_the_authority_first() -> None:
    with InprocCluster(2, 2, TrainConfig(mode="async", ps_replicas=2, **FAST)) as c:
        trainers, models, ledgers = start(c)
        run_threads([lambda: train(trainers[0], models[0], 0, max_steps=MAX_STEPS),
                     lambda: train(trainers[1], models[1], 1, max_steps=MAX_STEPS)], timeout_s=WAIT_S)
        assert trainers[0].client.terms == {0: 1, 1: 1}  # every reply showed its term; the client sends it on
        primary = c.services[0]
        primary.lease.lease_s = 400.0  # its own poll now comes every 100 s: only the request can tell it
        primary._ask("get")
        assert c.authority is not None
        c.authority._change(lambda: c.authority.book.unreachable(0, 0, 1, "a test's report"))
        assert primary.views[0].term == 1  # it does not know yet
        conn = connect(c.cluster.address(TaskId("ps", 0)), secret=SECRET, task="worker:1", peer="ps:0")
        try:
            reply = conn.request(Op.PS_PULL, {"term": 2, "timeout_s": 1.0}, timeout_s=5.0)
        finally:
            conn.close()
        assert primary.views[0].term == 2 and primary.views[0].state.value == "alone"
        assert reply.meta["term"] == 2


def test_a_lost_caught_up_report_is_made_again() -> None:
    """The serving copy's word that its backup caught up is lost once: the launcher still records the
    shard synced (the copy says it again), so the backup can be promoted if the serving copy dies."""
    with InprocCluster(2, 2, TrainConfig(mode="async", ps_replicas=2, **FAST)) as c:
        trainers, models, ledgers = start(c, 4000)
        assert c.authority is not None
        book = c.authority.book
        caught_up, dropped = book.caught_up, []

        def lose_the_first(reporter: int, shard: int, term: int):  # noqa: ANN202
            if shard not in dropped:
                dropped.append(shard)
                return []
            return caught_up(reporter, shard, term)

        book.caught_up = lose_the_first  # type: ignore[method-assign]
        killed: list[int] = []

        def replace_backup(t: Trainer) -> None:
            if not killed and t.global_step >= 5:
                killed.append(t.global_step)
                c.kill_ps(1)
                c.restart_ps(1).start_resync(30.0)
            if killed and len(killed) == 1 and t.global_step >= 50:
                wait_until(lambda: all(book.views[s].state.value == "synced" for s in (0, 1)), 30.0, "both synced")
                killed.append(t.global_step)

        run_threads([lambda: train(trainers[0], models[0], 0, max_steps=4000, on_step=replace_backup),
                     lambda: train(trainers[1], models[1], 1, max_steps=4000)], timeout_s=WAIT_S)
        assert sorted(dropped) == [0, 1] and len(killed) == 2
