"""Component tests of the update modes (sync N-of-M with backups, ssp, async) on an in-process cluster.

Every ps is a real Server + PsService on 127.0.0.1 port 0; every worker is a real Trainer on its own
thread, talking to the ps over TCP (tests/component/inproc.py). What is proven:

- sync with N = M gives bit-for-bit the parameters of one process that computes each worker's
  gradient, sums them in worker order, divides by N and steps torch.optim (1 and 2 ps shards, a
  tensor split across shards, SGD with momentum and Adam);
- sync with backups (M > N) goes on past a stalled or dead worker, drops its stale gradient and
  counts it; without backups the deadline (sync_timeout_s) ends the wait with an error naming the
  missing worker; a worker that is done lowers the quorum;
- ssp never lets a worker start step c before every worker has pushed step c - s (s = 0 is lock-step),
  also against a worker that has not reported any clock yet;
- the ps applies the learning-rate schedule by global step, also after a restore at step N;
- async applies every push.

Slow or stalled workers are made with threading.Event gates inside the workload (a gradient that
takes until X to compute), never with sleeps as synchronisation; every wait has a deadline.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from inproc import InprocCluster, ThreadGroup, run_threads

from psflow import optim
from psflow.config import TrainConfig
from psflow.errors import RemoteError, TrainingError
from psflow.train.trainer import Trainer

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)

WAIT_S = 8.0  # the deadline of every wait (thread joins, sync/ssp waits) unless a test sets its own
STEPS = 5
Batch = tuple[torch.Tensor, torch.Tensor]


def make_model(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 3)


def make_batches(num_workers: int, steps: int, seed: int = 1) -> list[list[Batch]]:
    """``batches[step][worker]``: fixed, different data per worker and step."""
    g = torch.Generator().manual_seed(seed)
    return [
        [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(num_workers)]
        for _ in range(steps)
    ]


def loss_fn(model: torch.nn.Module, batch: Batch) -> Callable[[], torch.Tensor]:
    x, y = batch
    return lambda: F.cross_entropy(model(x), y)


def start_all(trainers: list[Trainer]) -> None:
    """Chief first (it initializes the ps), then the others (they only wait until it has)."""
    for t in trainers:
        t.prepare()


# -- sync, N = M: the single-process reference -------------------------------------------------

# The ps applies torch's fused kernels (psflow.optim's default): the reference uses the same ones.
# The default for-loop kernels differ from them in the last bits on some CPUs (AVX-512 here).
OPTIMIZERS = {
    "sgd_momentum": (optim.SGD(lr=0.1, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True)),
    "adam": (optim.Adam(lr=0.01), lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True)),
}


def reference_run(
    init: torch.nn.Module, make_opt: Callable, batches: list[list[Batch]]
) -> tuple[torch.nn.Module, list[list[float]]]:
    """One process: each worker's gradient on its batch, summed in worker order, / N, one optimizer step."""
    model = copy.deepcopy(init)
    opt = make_opt(list(model.parameters()))
    losses = []
    for step_batches in batches:
        grads, step_losses = [], []
        for batch in step_batches:
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch)()
            loss.backward()
            step_losses.append(float(loss.detach()))
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            total = grads[0][i].clone()
            for g in grads[1:]:
                total.add_(g[i])
            p.grad = total.div_(len(grads))
        opt.step()
        losses.append(step_losses)
    return model, losses


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("num_ps,split_bytes", [(1, None), (2, 64)], ids=["1ps", "2ps-split"])
def test_sync_matches_single_process_reference(opt_name: str, num_ps: int, split_bytes: int | None) -> None:
    workers = 3
    spec, make_opt = OPTIMIZERS[opt_name]
    init = make_model()
    batches = make_batches(workers, STEPS)
    cfg = TrainConfig(mode="sync", split_bytes=split_bytes, sync_timeout_s=WAIT_S)
    with InprocCluster(num_ps, workers, cfg) as c:
        models = [copy.deepcopy(init) for _ in range(workers)]
        trainers = [c.trainer(w, models[w], spec) for w in range(workers)]
        if split_bytes is not None:  # the weight (96 bytes) really lies on both shards
            assert {p.shard for p in trainers[0].placement.pieces_of("weight")} == {0, 1}

        def work(w: int) -> list[float]:
            return [trainers[w].step(loss_fn(models[w], batches[s][w])) for s in range(STEPS)]

        losses = run_threads([lambda w=w: work(w) for w in range(workers)], timeout_s=WAIT_S)
        assert trainers[0].pull() == STEPS  # N = M: one global step per sync step
        stats = c.status()
    expected, expected_losses = reference_run(init, make_opt, batches)
    # Bit-for-bit: the ps reduces in worker order and the optimizer's update is elementwise, so
    # splitting a tensor across shards changes nothing. Each worker's loss at each step proves it
    # computed on exactly the reference parameters of that step.
    assert [[losses[w][s] for w in range(workers)] for s in range(STEPS)] == expected_losses
    for (name, got), want in zip(models[0].named_parameters(), expected.parameters()):
        assert torch.equal(got, want), f"{name}: max diff {(got - want).abs().max().item()}"
    for shard in stats:
        assert shard["version"] == STEPS
        assert shard["stats"]["pushes"] == workers * STEPS and shard["stats"]["stale_dropped"] == 0
        assert shard["stats"]["steps_without_all"] == 0


# -- sync with backup workers: a stalled or dead worker ----------------------------------------


def test_backup_worker_lets_sync_finish_when_one_worker_stalls() -> None:
    """N=2 of M=3: worker:2 stalls in its step-2 gradient; the other two go on without it."""
    stall_step, steps_after, solo_steps = 2, 5, 2
    cfg = TrainConfig(mode="sync", replicas_to_aggregate=2, total_num_replicas=3, sync_timeout_s=WAIT_S)
    batches = make_batches(3, 1)[0]
    entered, release = threading.Event(), threading.Event()
    stalled_at: list[int] = []
    with InprocCluster(1, 3, cfg) as c:
        models = [make_model() for _ in range(3)]
        trainers = [c.trainer(w, models[w], optim.SGD(lr=0.1)) for w in range(3)]
        start_all(trainers)
        slow = trainers[2]

        def slow_loss() -> torch.Tensor:
            if slow.local_step == stall_step:
                stalled_at.append(slow.versions[0])  # the version this gradient is computed from
                entered.set()
                assert release.wait(WAIT_S), "the stalled worker was never released"
            return loss_fn(models[2], batches[2])()

        def fast(w: int) -> None:
            # Run until worker:2 is stalled and `steps_after` more global steps went by without it.
            t = trainers[w]
            while not (entered.is_set() and t.global_step >= stalled_at[0] + steps_after):
                t.step(loss_fn(models[w], batches[w]))
            t.close()

        def stalled() -> list[int]:
            stale = []  # stale pushes after each step
            for _ in range(stall_step + 1 + solo_steps):
                slow.step(slow_loss)
                stale.append(slow.stale_pushes)
            slow.close()
            return stale

        group = ThreadGroup({"worker:0": lambda: fast(0), "worker:1": lambda: fast(1), "worker:2": stalled}).start()
        try:
            group.join(["worker:0", "worker:1"], timeout_s=WAIT_S)  # the two finish while worker:2 is still stalled
            assert group.is_alive("worker:2") and not release.is_set()
            (before,) = c.status()
        finally:
            release.set()  # never leave the gated thread behind, even when an assert above failed
        stale = group.join(["worker:2"], timeout_s=WAIT_S)["worker:2"]
        (after,) = c.status()
    assert before["version"] >= stalled_at[0] + steps_after
    assert before["stats"]["steps_without_all"] >= steps_after
    # Its step-2 gradient was computed from an old version: dropped and counted, not applied.
    assert stale[stall_step] == stale[stall_step - 1] + 1 and stale[-1] == stale[stall_step]
    assert after["stats"]["stale_by_worker"].get("2", 0) == slow.stale_pushes >= 1
    assert after["stats"]["stale_dropped"] == sum(after["stats"]["stale_by_worker"].values())
    # Then it pulled the newest values and went on alone (the other two are done: quorum 1).
    assert after["version"] == before["version"] + solo_steps
    assert after["done_workers"] == [0, 1, 2]


def test_killed_worker_with_backup() -> None:
    """N=2 of M=3: worker:2 dies after 2 steps (connections dropped, never says done)."""
    steps_after = 5
    cfg = TrainConfig(mode="sync", replicas_to_aggregate=2, total_num_replicas=3, sync_timeout_s=WAIT_S)
    batches = make_batches(3, 1)[0]
    killed = threading.Event()
    killed_at: list[int] = []
    with InprocCluster(1, 3, cfg) as c:
        models = [make_model() for _ in range(3)]
        trainers = [c.trainer(w, models[w], optim.SGD(lr=0.1)) for w in range(3)]
        start_all(trainers)

        def doomed() -> None:
            t = trainers[2]
            for _ in range(2):
                t.step(loss_fn(models[2], batches[2]))
            killed_at.append(t.global_step)
            t.client.close()  # what SIGKILL does to its sockets: no PS_DONE
            killed.set()

        def survivor(w: int) -> int:
            t = trainers[w]
            while not (killed.is_set() and t.global_step >= killed_at[0] + steps_after):
                t.step(loss_fn(models[w], batches[w]))
            t.close()
            return t.global_step

        steps = run_threads([lambda: survivor(0), lambda: survivor(1), doomed], timeout_s=WAIT_S)
        (st,) = c.status()
    assert min(steps[:2]) >= killed_at[0] + steps_after
    assert st["version"] >= killed_at[0] + steps_after
    assert st["stats"]["steps_without_all"] >= steps_after  # steps of 2 out of the 3 workers
    assert st["done_workers"] == [0, 1]  # worker:2 never said it was done: it is dead, not finished


def test_sync_without_backup_names_the_missing_worker() -> None:
    """N = M = 2: worker:1 stops before pushing step 2; worker:0's step 2 waits until the deadline."""
    cfg = TrainConfig(mode="sync", sync_timeout_s=1.5)
    batches = make_batches(2, 1)[0]
    with InprocCluster(1, 2, cfg) as c:
        models = [make_model() for _ in range(2)]
        trainers = [c.trainer(w, models[w], optim.SGD(lr=0.1)) for w in range(2)]
        start_all(trainers)

        def hangs() -> None:  # stops after 2 steps and never closes: a hung process
            for _ in range(2):
                trainers[1].step(loss_fn(models[1], batches[1]))

        def keeps_going() -> None:
            for _ in range(STEPS):
                trainers[0].step(loss_fn(models[0], batches[0]))

        with pytest.raises((TrainingError, RemoteError)) as err:
            run_threads([keeps_going, hangs], timeout_s=WAIT_S)
    msg = str(err.value)
    assert trainers[0].local_step == 2, msg  # steps 0 and 1 done; step 2's gradient never got its partner
    assert "missing worker:1" in msg and "worker:0" not in msg
    assert "1.5 s" in msg and "sync_timeout_s" in msg and "backup" in msg


def test_worker_done_lowers_the_quorum() -> None:
    """N = M = 2: worker:1 finishes after 2 steps; worker:0's remaining steps need only itself."""
    cfg = TrainConfig(mode="sync", sync_timeout_s=WAIT_S)
    batches = make_batches(2, 1)[0]
    with InprocCluster(1, 2, cfg) as c:
        models = [make_model() for _ in range(2)]
        trainers = [c.trainer(w, models[w], optim.SGD(lr=0.1)) for w in range(2)]
        start_all(trainers)

        def work(w: int, steps: int) -> int:
            for _ in range(steps):
                trainers[w].step(loss_fn(models[w], batches[w]))
            trainers[w].close()
            return trainers[w].local_step

        assert run_threads([lambda: work(0, 6), lambda: work(1, 2)], timeout_s=WAIT_S) == [6, 2]
        (st,) = c.status()
    assert st["version"] == 6  # 2 steps of both, then 4 of worker:0 alone
    assert st["stats"]["stale_dropped"] == 0 and st["done_workers"] == [0, 1]


def test_a_lost_worker_without_backups_holds_the_step_until_its_deadline_then_fails_naming_it() -> None:
    """N = M = 2: worker:1's connections close without PS_DONE (what SIGKILL does). worker:0's next
    step is held for it (a restarted worker:1 would rejoin: tests/component/test_rejoin.py) and fails
    at sync_timeout_s with the lost worker's name and what to do."""
    cfg = TrainConfig(mode="sync", sync_timeout_s=1.5)
    batches = make_batches(2, 1)[0]
    with InprocCluster(1, 2, cfg) as c:
        models = [make_model() for _ in range(2)]
        trainers = [c.trainer(w, models[w], optim.SGD(lr=0.1)) for w in range(2)]
        start_all(trainers)

        def dies() -> None:
            for _ in range(2):
                trainers[1].step(loss_fn(models[1], batches[1]))
            trainers[1].client.close()

        def keeps_going() -> None:
            for _ in range(STEPS):
                trainers[0].step(loss_fn(models[0], batches[0]))

        with pytest.raises((TrainingError, RemoteError)) as err:
            run_threads([keeps_going, dies], timeout_s=WAIT_S)  # sync_timeout_s (1.5 s) < WAIT_S (8 s)
        (st,) = c.status()
    msg = str(err.value)
    assert "worker:1 lost its connection to ps shard 0" in msg and "backup workers" in msg, msg
    assert "was held 1.5 s (sync_timeout_s) for it to come back" in msg, msg
    assert st["lost_workers"] == [1] and st["done_workers"] == []


# Serial: under the parallel suite's load worker:2's second gradient can miss every quorum while the others
# wait for its death (seen once under xdist: died.wait timed out), a race of the threads, not a slow deadline.
@pytest.mark.serial
def test_a_lost_worker_with_backups_no_longer_counts_once_the_others_finish_at_different_times() -> None:
    """N = 2 of M = 3: worker:2 dies after 2 steps; worker:0 finishes after 6 steps (PS_DONE);
    worker:1 goes on to 12 steps alone. Without knowing worker:2 is gone, worker:1 would wait for a
    second gradient until the deadline."""
    cfg = TrainConfig(mode="sync", replicas_to_aggregate=2, total_num_replicas=3, sync_timeout_s=60.0)
    batches = make_batches(3, 1)[0]
    with InprocCluster(1, 3, cfg) as c:
        models = [make_model() for _ in range(3)]
        trainers = [c.trainer(w, models[w], optim.SGD(lr=0.1)) for w in range(3)]
        start_all(trainers)
        died = threading.Event()

        def dies() -> int:
            for _ in range(2):
                trainers[2].step(loss_fn(models[2], batches[2]))
            trainers[2].client.close()
            died.set()
            return trainers[2].local_step

        def works(w: int, steps: int) -> int:
            for i in range(steps):
                if i == 3:
                    assert died.wait(WAIT_S)  # the death happens mid-run, before anyone finishes
                trainers[w].step(loss_fn(models[w], batches[w]))
            trainers[w].close()
            return trainers[w].local_step

        assert run_threads([lambda: works(0, 6), lambda: works(1, 12), dies], timeout_s=WAIT_S) == [6, 12, 2]
        (st,) = c.status()
    assert st["done_workers"] == [0, 1] and st["lost_workers"] == [2]


def test_ssp_goes_on_when_the_slowest_worker_is_lost() -> None:
    """staleness 1: worker:1 dies at clock 1; worker:0 runs 8 steps ahead without waiting for it."""
    cfg = TrainConfig(mode="ssp", staleness=1, sync_timeout_s=60.0)
    batches = make_batches(2, 1)[0]
    with InprocCluster(1, 2, cfg) as c:
        models = [make_model() for _ in range(2)]
        trainers = [c.trainer(w, models[w], optim.SGD(lr=0.1)) for w in range(2)]
        start_all(trainers)
        trainers[1].step(loss_fn(models[1], batches[1]))
        trainers[1].client.close()

        def runs_ahead() -> int:
            for _ in range(8):
                trainers[0].step(loss_fn(models[0], batches[0]))
            trainers[0].close()
            return trainers[0].local_step

        assert run_threads([runs_ahead], timeout_s=WAIT_S) == [8]
        (st,) = c.status()
    assert st["lost_workers"] == [1]


def test_evaluation_pull_between_sync_steps_does_not_stall() -> None:
    """A worker that reads the newest parameters mid-training (e.g. to evaluate) keeps its sync step."""
    cfg = TrainConfig(mode="sync", sync_timeout_s=WAIT_S)
    batches = make_batches(2, 1)[0]
    with InprocCluster(1, 2, cfg) as c:
        models = [make_model() for _ in range(2)]
        trainers = [c.trainer(w, models[w], optim.SGD(lr=0.1)) for w in range(2)]
        start_all(trainers)

        def work(w: int) -> None:
            for _ in range(STEPS):
                trainers[w].step(loss_fn(models[w], batches[w]))
                if w == 0:
                    trainers[w].pull()  # may already see the step this push completed
            trainers[w].close()

        run_threads([lambda: work(0), lambda: work(1)], timeout_s=WAIT_S)
        (st,) = c.status()
    assert st["version"] == STEPS and st["stats"]["stale_dropped"] == 0


def test_step_after_reading_moving_averages_computes_from_the_real_values() -> None:
    """pull(averages=True) puts the averages into the model (to evaluate); the next step must not train on them."""
    x = make_batches(1, 1)[0][0][0]
    with InprocCluster(1, 1, TrainConfig(mode="sync", sync_timeout_s=WAIT_S)) as c:
        model = make_model()
        t = c.trainer(0, model, optim.SGD(lr=0.5), ema_decay=0.5)
        t.step(lambda: model(x).pow(2).sum())
        values = model.weight.detach().clone()
        t.pull(averages=True)
        assert not torch.equal(model.weight, values)  # the averages lag the values
        computed_from: list[torch.Tensor] = []

        def closure() -> torch.Tensor:
            computed_from.append(model.weight.detach().clone())
            return model(x).pow(2).sum()

        t.step(closure)
        assert t.global_step == 2 and t.stale_pushes == 0
    assert torch.equal(computed_from[0], values)


# -- ssp ---------------------------------------------------------------------------------------


def run_ssp(staleness: int, steps: int) -> tuple[list[list[int]], list[tuple[int, int, int]]]:
    """3 workers under ssp: worker:0 fast, worker:1 a little slow, worker:2 gated.

    worker:2 cannot finish its step 0 until worker:0 computes step ``staleness`` and cannot finish
    step 1 until worker:0 computes step ``staleness + 1``, so worker:0 must wait at clock
    ``staleness + 1`` for worker:2 to reach clock 1: a release at a gap of exactly ``staleness``.

    Returns (for each worker, the ps version it pulled at each clock) and the ps's clock log.
    """
    workers = 3
    cfg = TrainConfig(mode="ssp", staleness=staleness, sync_timeout_s=WAIT_S)
    batches = make_batches(workers, 1)[0]
    gate0, gate1 = threading.Event(), threading.Event()
    seen: list[list[int]] = [[] for _ in range(workers)]
    with InprocCluster(1, workers, cfg) as c:
        models = [make_model() for _ in range(workers)]
        trainers = [c.trainer(w, models[w], optim.SGD(lr=0.05)) for w in range(workers)]
        start_all(trainers)

        def work(w: int) -> None:
            t = trainers[w]
            base = loss_fn(models[w], batches[w])

            def closure() -> torch.Tensor:
                seen[w].append(t.versions[0])  # what this step's gradient is computed from
                if w == 0 and t.local_step == staleness:
                    gate0.set()
                if w == 0 and t.local_step == staleness + 1:
                    gate1.set()
                if w == 2 and t.local_step in (0, 1):
                    assert (gate0 if t.local_step == 0 else gate1).wait(WAIT_S), "gate never opened"
                if w == 1:
                    torch.mm(torch.randn(64, 64), torch.randn(64, 64))  # a little slower: real work
                return base()

            for _ in range(steps):
                t.step(closure)
            t.close()

        try:
            run_threads([lambda w=w: work(w) for w in range(workers)], timeout_s=WAIT_S)
        finally:
            gate0.set(), gate1.set()  # a failing worker must not leave worker:2 at its gate
        (st,) = c.status(clock_log=True)
    assert st["version"] == workers * steps  # ssp updates are async: every push applied
    return seen, [tuple(e) for e in st["clock_log"]]


@pytest.mark.parametrize("staleness", [1, 3])
def test_ssp_never_exceeds_staleness(staleness: int) -> None:
    steps, workers = staleness + 5, 3
    seen, log = run_ssp(staleness, steps)
    assert len(log) == workers * steps  # one release per step of every worker
    assert all(clock - slowest <= staleness for _, clock, slowest in log), log
    assert (0, staleness + 1, 1) in log, log  # worker:0 was held at the bound until worker:2 reached clock 1
    for w in range(workers):
        for clock, version in enumerate(seen[w]):
            # Every worker had pushed at least clock - s steps before this one pulled.
            assert version >= workers * (clock - staleness), (w, clock, version)


def test_ssp_zero_is_lockstep() -> None:
    steps, workers = 5, 3
    seen, log = run_ssp(0, steps)
    assert len(log) == workers * steps
    assert all(clock == slowest for _, clock, slowest in log), log
    for w in range(workers):
        for clock, version in enumerate(seen[w]):
            # Every step-(c-1) update is in, no step-(c+1) update can be: between W*c and W*c + W-1.
            assert workers * clock <= version <= workers * clock + workers - 1, (w, clock, version)


# -- async -------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_ps", [1, 2])
def test_async_applies_every_push(num_ps: int) -> None:
    """Two workers push known gradients; the ps applied each one, whatever the order."""
    workers, lr = 2, 0.5
    cfg = TrainConfig(mode="async", split_bytes=64)
    init = make_model()
    with torch.no_grad():  # small integers and multiples of 1/8: every sum below is exact in float32
        init.weight.copy_(torch.arange(24.0).reshape(3, 8))
        init.bias.copy_(torch.tensor([1.0, -2.0, 3.0]))

    def grad_of(w: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = (w + 1) * (step + 1) / 8
        return torch.full((3, 8), k), torch.tensor([k, -k, 2 * k])

    with InprocCluster(num_ps, workers, cfg) as c:
        models = [copy.deepcopy(init) for _ in range(workers)]
        trainers = [c.trainer(w, models[w], optim.SGD(lr=lr)) for w in range(workers)]

        def work(w: int) -> None:
            m = models[w]
            for s in range(STEPS):
                gw, gb = grad_of(w, s)
                trainers[w].step(lambda: (m.weight * gw).sum() + (m.bias * gb).sum())  # noqa: B023 (called within this iteration)

        run_threads([lambda w=w: work(w) for w in range(workers)], timeout_s=WAIT_S)
        assert trainers[0].pull() == workers * STEPS  # global_step counts every push
        stats = c.status()
    total_w = sum(grad_of(w, s)[0] for w in range(workers) for s in range(STEPS))
    total_b = sum(grad_of(w, s)[1] for w in range(workers) for s in range(STEPS))
    assert torch.equal(models[0].weight.detach(), init.weight.detach() - lr * total_w)
    assert torch.equal(models[0].bias.detach(), init.bias.detach() - lr * total_b)
    for shard in stats:
        assert shard["version"] == workers * STEPS
        assert shard["stats"]["pushes"] == shard["stats"]["applied_updates"] == workers * STEPS


def test_ssp_holds_a_fast_worker_at_the_bound_of_a_worker_that_never_stepped() -> None:
    """staleness 1: worker:1 has joined but never takes a step (no clock reported). worker:0 may
    compute steps 0 and 1, and its step 2 waits for worker:1 until the deadline."""
    cfg = TrainConfig(mode="ssp", staleness=1, sync_timeout_s=1.0)
    batches = make_batches(2, 1)[0]
    with InprocCluster(1, 2, cfg) as c:
        models = [make_model() for _ in range(2)]
        trainers = [c.trainer(w, models[w], optim.SGD(lr=0.1)) for w in range(2)]
        start_all(trainers)

        def runs_ahead() -> None:
            for _ in range(4):
                trainers[0].step(loss_fn(models[0], batches[0]))

        with pytest.raises((TrainingError, RemoteError)) as err:
            run_threads([runs_ahead], timeout_s=WAIT_S)
        (st,) = c.status(clock_log=True)
    assert trainers[0].local_step == 2, str(err.value)
    assert "worker:0 at clock 2 waited 1.0 s" in str(err.value)
    assert st["version"] == 2 and all(clock - slowest <= 1 for _, clock, slowest in st["clock_log"])


def test_ps_applies_the_lr_schedule_by_global_step_after_a_restore() -> None:
    """The chief restores at step 4 with PiecewiseConstant (1.0 up to step 5, then 0.25); three
    steps are applied at versions 4, 5, 6: rates 1.0, 1.0, 0.25 (the optimizer's lr, 8.0, unused)."""
    g = torch.tensor([[1.0, 2.0]])
    with InprocCluster(1, 1, TrainConfig(mode="async")) as c:
        model = torch.nn.Linear(2, 1, bias=False)
        trainer = c.trainer(0, model, optim.SGD(lr=8.0), schedule=optim.PiecewiseConstant(boundaries=(5,), values=(1.0, 0.25)))
        trainer.restore_from(4, {"weight": torch.zeros(1, 2)})
        for _ in range(3):
            trainer.step(lambda: (model.weight * g).sum())
        assert trainer.global_step == 7
    assert torch.equal(model.weight.detach(), -(1.0 + 1.0 + 0.25) * g)
