"""Component tests: a restarted worker rejoins a running job, in every mode, and every batch is
applied exactly once.

An in-process cluster (tests/component/inproc.py): real ps servers and real Trainers over TCP. A
worker is "killed" by closing its Trainer's connections without PS_DONE (what SIGKILL does to its
sockets) and abandoning the Trainer; its restart is a new Trainer for the same task with
``attempt`` one higher and a fresh model, as a new process would build. What is proven:

- async, sync without backups (the step is held for the lost worker until its new attempt pushes),
  sync with a backup, and ssp (the restarted worker resumes at a clock that keeps the bound) all
  reach the job's max_steps after a worker restarts;
- a push of an earlier attempt that is still running is dropped, with an error to it;
- exactly once: a counting model whose parameters are the number of times each example's gradient
  was applied shows every example applied exactly once per epoch per worker shard, across kills
  between steps, during the forward pass and after the push was sent; the restarted worker resumes
  from the data position of its last applied gradient, not its last sent or acknowledged one;
- with two ps shards a death between shard pushes redoes that batch, and each shard applies it
  once (shard 0, whose position the worker resumes from, is sent last; the other shard recorded
  the batch's position and answers the redone push as a duplicate);
- a push whose connection drops before its reply (or before the ps got it) is resent on a fresh
  connection and applied exactly once (the ps recognises the resent push by its number).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from inproc import CuttingProxy, InprocCluster, run_threads

from psflow import optim
from psflow.cluster import ClusterSpec, TaskId
from psflow.config import TrainConfig
from psflow.data.dataset import BatchIterator, Dataset
from psflow.errors import RemoteError
from psflow.train.trainer import Trainer

pytestmark = pytest.mark.timeout(90)
torch.set_num_threads(1)

WAIT_S = 30.0  # the deadline of every thread join
MAX_STEPS = 12


class Killed(BaseException):
    """Raised inside a step where the test kills the worker (never caught by psflow's error handling)."""


def make_model(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 3)


def batch_for(worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(worker)
    return torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


def train_until_stopped(t: Trainer, model: torch.nn.Module, worker: int, limit: int = 10 * MAX_STEPS) -> int:
    """Steps until the ps say the job reached its stop step; returns the steps this trainer took."""
    x, y = batch_for(worker)
    while not t.stopped:
        t.step(lambda: F.cross_entropy(model(x), y))
        assert t.local_step <= limit, f"worker:{worker} took {limit} steps without reaching the stop"
    return t.local_step


def kill(t: Trainer) -> None:
    """What SIGKILL does to a worker's connections: they close without PS_DONE."""
    t.client.close()


def restart_and_finish(c: InprocCluster, worker: int, attempt: int = 1) -> tuple[Trainer, int]:
    """A new process for ``worker:worker``: a fresh model, attempt ``attempt``; trains to the stop."""
    model = make_model(seed=attempt)
    t = c.trainer(worker, model, optim.SGD(lr=0.1), attempt=attempt)
    t.prepare()
    steps = train_until_stopped(t, model, worker)
    t.close()
    return t, steps


def start(c: InprocCluster, workers: int) -> tuple[list[Trainer], list[torch.nn.Module]]:
    models = [make_model() for _ in range(workers)]
    trainers = [c.trainer(w, models[w], optim.SGD(lr=0.1)) for w in range(workers)]
    trainers[0].plan_steps(stop_at=MAX_STEPS)  # the chief's step plan: the ps stop the job at MAX_STEPS
    for t in trainers:
        t.prepare()
    return trainers, models


def finish(t: Trainer, model: torch.nn.Module, worker: int) -> int:
    steps = train_until_stopped(t, model, worker)
    t.close()
    return steps


# -- every mode reaches max_steps after a worker restarts --------------------------------------------


def test_async_a_restarted_worker_rejoins_and_the_job_reaches_max_steps() -> None:
    with InprocCluster(1, 2, TrainConfig(mode="async")) as c:
        trainers, models = start(c, 2)
        x, y = batch_for(1)
        for _ in range(3):
            trainers[1].step(lambda: F.cross_entropy(models[1](x), y))
        kill(trainers[1])
        results = run_threads([lambda: finish(trainers[0], models[0], 0), lambda: restart_and_finish(c, 1)],
                              timeout_s=WAIT_S)
        (st,) = c.status()
    restarted, _ = results[1]
    assert restarted.attempt == 1 and restarted.ready_info["version"] >= 3
    assert st["version"] == MAX_STEPS and st["stats"]["applied_updates"] == MAX_STEPS
    assert st["done_workers"] == [0, 1] and st["lost_workers"] == []


def test_sync_without_backups_holds_the_step_for_the_lost_worker_until_its_new_attempt_pushes() -> None:
    """N = M = 2: worker:1 dies after 2 steps. worker:0's step 2 is held (no failure: sync_timeout_s
    is 30 s) until worker:1's attempt 1 joins at version 2 and pushes for it; every step of the job
    has both gradients."""
    with InprocCluster(1, 2, TrainConfig(mode="sync", sync_timeout_s=WAIT_S)) as c:
        trainers, models = start(c, 2)

        def dies_and_restarts() -> tuple[Trainer, int]:
            x, y = batch_for(1)
            for _ in range(2):
                trainers[1].step(lambda: F.cross_entropy(models[1](x), y))
            kill(trainers[1])
            return restart_and_finish(c, 1)

        steps0, (restarted, steps1) = run_threads([lambda: finish(trainers[0], models[0], 0), dies_and_restarts],
                                                  timeout_s=WAIT_S)
        (st,) = c.status()
    assert restarted.ready_info["version"] == 2  # it joined at the step held for it
    assert (steps0, steps1) == (MAX_STEPS, MAX_STEPS - 2)  # worker:0 lost no step; attempt 1 did the rest
    assert st["version"] == MAX_STEPS and st["done_workers"] == [0, 1]
    assert st["stats"]["stale_dropped"] == 0 and st["stats"]["steps_without_all"] == 0


def test_sync_with_a_backup_goes_on_without_the_lost_worker_and_takes_it_back() -> None:
    """N = 2 of M = 3: worker:2 dies after 2 steps; the others go on; its attempt 1 rejoins."""
    cfg = TrainConfig(mode="sync", replicas_to_aggregate=2, total_num_replicas=3, sync_timeout_s=WAIT_S)
    with InprocCluster(1, 3, cfg) as c:
        trainers, models = start(c, 3)

        def dies_and_restarts() -> tuple[Trainer, int]:
            x, y = batch_for(2)
            for _ in range(2):
                trainers[2].step(lambda: F.cross_entropy(models[2](x), y))
            kill(trainers[2])
            return restart_and_finish(c, 2)

        results = run_threads([lambda: finish(trainers[0], models[0], 0), lambda: finish(trainers[1], models[1], 1),
                               dies_and_restarts], timeout_s=WAIT_S)
        (st,) = c.status()
    restarted, _ = results[2]
    assert restarted.ready_info["version"] >= 1
    assert st["version"] == MAX_STEPS and st["done_workers"] == [0, 1, 2] and st["lost_workers"] == []
    # Every push was part of a step, stale, or past the stop: none was lost or counted twice.
    stats = st["stats"]
    assert stats["applied_updates"] == MAX_STEPS


def test_ssp_a_restarted_worker_resumes_at_a_clock_within_the_bound_and_the_job_finishes() -> None:
    staleness = 1
    with InprocCluster(1, 2, TrainConfig(mode="ssp", staleness=staleness, sync_timeout_s=WAIT_S)) as c:
        trainers, models = start(c, 2)

        def dies_and_restarts() -> tuple[Trainer, int]:
            x, y = batch_for(1)
            for _ in range(2):  # clocks 0 and 1
                trainers[1].step(lambda: F.cross_entropy(models[1](x), y))
            kill(trainers[1])
            return restart_and_finish(c, 1)

        _, (restarted, _) = run_threads([lambda: finish(trainers[0], models[0], 0), dies_and_restarts],
                                        timeout_s=WAIT_S)
        (st,) = c.status(clock_log=True)
    # It resumes at its own last clock (1) or later (the slowest live clock), never at 0.
    assert restarted.clock_base >= 1
    log = [tuple(e) for e in st["clock_log"]]
    assert all(clock - slowest <= staleness for _, clock, slowest in log), log
    first_clock_of_attempt_1 = [clock for w, clock, _ in log if w == 1][2]  # after clocks 0 and 1 of attempt 0
    assert first_clock_of_attempt_1 == restarted.clock_base, log
    assert st["version"] == MAX_STEPS and st["done_workers"] == [0, 1]


def test_a_push_of_an_earlier_attempt_still_running_is_dropped_with_an_error_to_it() -> None:
    with InprocCluster(1, 2, TrainConfig(mode="async")) as c:
        trainers, models = start(c, 2)
        old, old_model = trainers[1], models[1]
        x, y = batch_for(1)
        old.step(lambda: F.cross_entropy(old_model(x), y))
        new_model = make_model(seed=1)
        new = c.trainer(1, new_model, optim.SGD(lr=0.1), attempt=1)
        new.prepare()  # attempt 1 joins while attempt 0 is still alive (a hung process the launcher replaced)
        (before,) = c.status()
        with pytest.raises(RemoteError, match="dropped a push of worker:1 attempt 0: attempt 1 of worker:1 has joined"):
            old.step(lambda: F.cross_entropy(old_model(x), y))
        (after,) = c.status()
        new.step(lambda: F.cross_entropy(new_model(x), y))
        (last,) = c.status()
    assert after["version"] == before["version"] == 1 and after["stats"]["superseded"] == 1
    assert last["version"] == 2


# -- exactly once: every batch of every epoch, across restarts ---------------------------------------


class Counts(torch.nn.Module):
    """One parameter per example: a push of a batch's gradient adds 1 to its examples' entries (SGD,
    lr = 1), so the ps's values are the number of times each example's gradient was applied."""

    def __init__(self, num_examples: int, *names: str) -> None:
        super().__init__()
        for name in names or ("counts",):
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(num_examples)))

    def visit(self, ids: torch.Tensor) -> torch.Tensor:
        # The later parameters' gradients are computed first in backward (see the two-shard test).
        return -sum(p.index_select(0, ids).sum() for p in self.parameters())


NUM_EXAMPLES, BATCH, EPOCHS = 24, 3, 2


class CountingWorker:
    """One worker task across its attempts: each attempt a new Trainer and iterator (a new process),
    resuming the iterator where the ps say its last applied batch left it, as the Supervisor does."""

    def __init__(self, c: InprocCluster, worker: int, num_workers: int, names: tuple[str, ...] = ()) -> None:
        self.c, self.worker, self.names = c, worker, names
        self.shard = Dataset(torch.arange(NUM_EXAMPLES), torch.zeros(NUM_EXAMPLES)).shard(worker, num_workers)
        self.attempt = -1
        self.resumed_at: list[dict[str, Any] | None] = []  # the position each attempt got at readiness
        self.start()

    def start(self) -> None:
        self.attempt += 1
        self.model = Counts(NUM_EXAMPLES, *self.names)
        self.data = BatchIterator(self.shard, BATCH, epochs=EPOCHS, seed=self.worker)
        self.trainer = self.c.trainer(self.worker, self.model, optim.SGD(lr=1.0), attempt=self.attempt)
        self.trainer.plan_steps(data=self.data)
        self.trainer.prepare()
        position = self.trainer.ready_info.get("data_positions", {}).get(str(self.worker))
        if position is not None:
            self.data.load_state_dict(position)
        self.resumed_at.append(position)

    def step(self) -> bool:
        """One batch; False once the iterator is done (the worker finished: PS_DONE)."""
        try:
            ids, _ = next(self.data)
        except StopIteration:
            self.trainer.close()
            return False
        self.trainer.step(lambda: self.model.visit(ids))
        return True

    def position(self) -> dict[str, int]:
        return self.data.state_dict()

    def killed_during_forward(self) -> dict[str, int]:
        """Dies while computing its next batch (nothing sent). Returns the position before that batch."""
        before = self.position()
        ids, _ = next(self.data)

        def dies() -> torch.Tensor:
            raise Killed()

        with pytest.raises(Killed):
            self.trainer.step(dies)
        kill(self.trainer)
        del ids
        return before

    def killed_after_sending(self, param: str = "counts") -> dict[str, int]:
        """Dies in its next step once the push to the shard of ``param`` is out, before the step
        returns (the worker never learns whether it was applied). Returns the position after it."""
        ids, _ = next(self.data)

        def die(_p: torch.Tensor) -> None:  # runs after the trainer's own hook, which sent the push
            raise Killed()

        handle = getattr(self.model, param).register_post_accumulate_grad_hook(die)
        with pytest.raises(Killed):
            self.trainer.step(lambda: self.model.visit(ids))
        handle.remove()
        kill(self.trainer)
        return self.position()

    def killed_between_steps(self) -> dict[str, int]:
        kill(self.trainer)
        return self.position()


def applied_counts(c: InprocCluster, names: tuple[str, ...] = ("counts",)) -> dict[str, torch.Tensor]:
    """The ps's values of every counting parameter, read with an evaluator's client."""
    client = c.client()
    num_ps = c.cluster.num_tasks("ps")
    dests = [{} for _ in range(num_ps)]
    for i, name in enumerate(names):
        dests[i % num_ps][name] = torch.empty(NUM_EXAMPLES)  # round-robin placement: parameter i on shard i % num_ps
    client.pull(dests)
    return {name: dests[i % num_ps][name] for i, name in enumerate(names)}


def test_async_every_example_is_applied_exactly_once_per_epoch_across_restarts() -> None:
    """Two workers over their own shards for 2 epochs (8 batches each), interleaved in one thread
    (async needs no lockstep). worker:1 is killed three ways, the chief once; each restart resumes
    where its last applied batch left it."""
    with InprocCluster(1, 2, TrainConfig(mode="async")) as c:
        chief = CountingWorker(c, 0, 2)
        worker = CountingWorker(c, 1, 2)
        for _ in range(2):
            chief.step(), worker.step()
        # Killed between steps: its last step was applied and acknowledged.
        expected = worker.killed_between_steps()
        worker.start()
        assert worker.resumed_at[-1] == expected
        worker.step(), chief.step()
        # Killed while computing: nothing of that batch was sent; it is redone.
        expected = worker.killed_during_forward()
        worker.start()
        assert worker.resumed_at[-1] == expected
        worker.step()
        # Killed after its push went out, before the step returned: the ps applied it, so the new
        # attempt does not redo it although the dead one never saw its reply.
        expected = worker.killed_after_sending()
        worker.start()
        assert worker.resumed_at[-1] == expected
        # The chief dies too (its restart does not initialize the ps again).
        expected = chief.killed_after_sending()
        chief.start()
        assert chief.resumed_at[-1] == expected
        while chief.step() | worker.step():
            pass
        counts = applied_counts(c)["counts"]
        (st,) = c.status()
    assert counts.tolist() == [float(EPOCHS)] * NUM_EXAMPLES, counts
    assert st["version"] == 2 * EPOCHS * (NUM_EXAMPLES // 2 // BATCH)  # 16 batches, each applied once
    assert (worker.attempt, chief.attempt) == (3, 1) and st["done_workers"] == [0, 1]


def test_two_shards_a_death_between_shard_pushes_redoes_that_batch_and_each_shard_applies_it_once() -> None:
    """2 ps, parameter ``a`` on shard 0 (whose data position the worker resumes from), ``b`` on shard
    1. The worker dies after its push reached shard 1 and before shard 0 (which is sent last). It
    resumes from shard 0's position, before that batch, and redoes it: shard 0 applies it, shard 1
    (which recorded the batch's position) answers it as a duplicate. Every batch is applied exactly
    once on both shards."""
    names = ("a", "b")
    with InprocCluster(2, 1, TrainConfig(mode="async")) as c:
        chief = CountingWorker(c, 0, 1, names)
        assert {pc.param: pc.shard for s in range(2) for pc in chief.trainer.placement.pieces_on(s)} == {"a": 0, "b": 1}
        for _ in range(3):
            chief.step()
        before = chief.position()
        chief.killed_after_sending("b")
        partial = applied_counts(c, names)
        chief.start()
        assert chief.resumed_at[-1] == before  # shard 0 never got it: the batch is redone
        while chief.step():
            pass
        counts = applied_counts(c, names)
        statuses = c.status()
    # The death left the batch on shard 1 only (the later parameter's gradient is produced first).
    assert partial["b"].sum() == partial["a"].sum() + BATCH, partial
    assert counts["a"].tolist() == [float(EPOCHS)] * NUM_EXAMPLES
    assert counts["b"].tolist() == [float(EPOCHS)] * NUM_EXAMPLES
    assert [st["version"] for st in statuses] == [EPOCHS * NUM_EXAMPLES // BATCH] * 2
    assert [st["stats"]["duplicates"] for st in statuses] == [0, 1]


# -- a push resent after its connection dropped is applied exactly once --------------------------------


@pytest.mark.parametrize("direction", ["reply", "request"])
def test_a_push_whose_connection_drops_is_resent_and_applied_exactly_once(direction: str) -> None:
    """The worker reaches the ps through a path that drops one connection: after the ps applied the
    push, before its reply ("reply"), or before the ps got it ("request"). The client reconnects
    (its resolver names the path again) and resends the push: the ps applies it once either way."""
    steps = 5
    with InprocCluster(1, 1, TrainConfig(mode="async")) as c:
        proxy = CuttingProxy(c.servers[TaskId("ps", 0)].address)
        try:
            routed = ClusterSpec.from_dict({**c.cluster.to_dict(), "ps": [proxy.address]})
            task = replace(c.task(0), cluster=routed, resolve=lambda peer: proxy.address)
            model = make_model()
            t = Trainer(model, optim.SGD(lr=0.1), task)
            t.prepare()
            x, y = batch_for(0)
            for step in range(steps):
                if step == 2:
                    proxy.cut_next(direction)
                t.step(lambda: F.cross_entropy(model(x), y))
            t.close()
            (st,) = c.status()
        finally:
            proxy.close()
    assert proxy.cuts == 1 and t.local_step == steps
    assert st["version"] == st["stats"]["applied_updates"] == steps
    assert st["stats"]["duplicates"] == (1 if direction == "reply" else 0)
