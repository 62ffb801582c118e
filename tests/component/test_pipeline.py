"""The pipeline (TrainConfig.pipeline): a step computes while the one before travels, and every push
is still applied exactly once, in order, with failures raised on the training thread; under ssp a
pipelined worker's lead over the slowest, its steps in flight counted, stays within the staleness."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from inproc import CuttingProxy, InprocCluster, ThreadGroup, wait_until

from psflow import optim, timeline
from psflow.cluster import ClusterSpec, TaskId
from psflow.config import TrainConfig
from psflow.errors import RemoteError, TrainingError
from psflow.train.trainer import Trainer

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)
PIPELINE = TrainConfig(mode="async", pipeline=True, placement="contiguous")


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(5, 8, generator=g), torch.randint(0, 3, (5,), generator=g)


def loss(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m(x), y)


def test_every_pipelined_push_is_applied_once_and_the_model_ends_with_the_ps_values():
    steps = 6
    with InprocCluster(2, 1, PIPELINE) as c:
        model = mlp()
        trainer = c.trainer(0, model, optim.SGD(lr=0.1, momentum=0.9))
        send_push, order = trainer.client.send_push, []

        def recording(shard, *args, **kwargs):
            order.append((kwargs["seq"], shard))
            return send_push(shard, *args, **kwargs)

        trainer.client.send_push = recording
        for i in range(steps):
            trainer.step(loss, batch=batch(i))
        assert trainer.local_step <= steps - 1  # the last step's replies are still on their way
        assert trainer.flush() == steps
        stats = trainer.stats()
        mine = [p.detach().clone() for p in model.parameters()]
        trainer.pull()
        trainer.close()
        status = c.status()
    assert [s["version"] for s in status] == [s["stats"]["applied_updates"] for s in status] == [steps, steps]
    assert stats["local_step"] == steps and stats["examples"] == 5 * steps
    assert stats["pipelined_steps"] == steps - 1 and stats["pipeline_staleness"] == 1
    for a, b in zip(mine, model.parameters()):
        assert torch.equal(a, b)  # after flush the model held the newest values, as a plain step leaves it
    # steps in order, and in each one shard 0 (the data position) last
    assert order == [(seq, shard) for seq in range(1, steps + 1) for shard in (1, 0)]


def test_a_pipelined_step_computes_from_the_values_one_own_update_old():
    """One worker, plain SGD: step t's gradient is taken at w[t-1] (w[0] for the first two steps),
    and the ps applies it to w[t]: delayed SGD with a delay of exactly one step, and nothing else."""
    steps, lr = 6, 0.1
    model = mlp()
    reference = [[p.detach().clone() for p in model.parameters()]]
    with InprocCluster(1, 1, TrainConfig(mode="async", pipeline=True)) as c:
        trainer = c.trainer(0, model, optim.SGD(lr=lr))
        for i in range(steps):
            trainer.step(loss, batch=batch(i))
        trainer.flush()
        trainer.close()
    check = mlp()
    for i in range(steps):
        with torch.no_grad():
            for p, v in zip(check.parameters(), reference[max(i - 1, 0)]):
                p.copy_(v)
        check.zero_grad()
        loss(check, *batch(i)).backward()
        reference.append([w - lr * p.grad for w, p in zip(reference[-1], check.parameters())])
    for got, want in zip(model.parameters(), reference[-1]):
        torch.testing.assert_close(got.detach(), want)


def test_the_next_step_computes_while_the_last_ones_replies_are_held():
    """The ps's replies are held back (a slow link): with the pipeline two steps still compute and
    return; the third waits for the first one's values. Fails without the pipeline (the first
    step waits for its reply)."""
    recorder = timeline.start("pipeline")
    with InprocCluster(1, 1, TrainConfig(mode="async", pipeline=True)) as c:
        proxy = CuttingProxy(c.servers[TaskId("ps", 0)].address)
        try:
            routed = ClusterSpec.from_dict({**c.cluster.to_dict(), "ps": [proxy.address]})
            model = mlp()
            trainer = Trainer(model, optim.SGD(lr=0.1), replace(c.task(0), cluster=routed))
            trainer.prepare()
            proxy.hold_replies()
            returned, go_on = [], threading.Event()

            def train() -> None:
                for i in range(3):
                    trainer.step(loss, batch=batch(i))
                    returned.append(i)
                    if i == 1:
                        go_on.set()

            worker = threading.Thread(target=train, daemon=True)
            worker.start()
            assert go_on.wait(timeout=10), "the first step waited for its reply"
            worker.join(timeout=0.3)
            assert returned == [0, 1]  # the third step waits for the first one's values
            proxy.release_replies()
            worker.join(timeout=20)
            assert returned == [0, 1, 2]
            trainer.close()
            (st,) = c.status()
        finally:
            proxy.close()
            timeline.stop()
    assert st["stats"]["applied_updates"] == 3
    spans = [e for e in recorder.events if e["name"] in ("forward", "pull ps:0")]
    second_forward = [e for e in spans if e["name"] == "forward"][1]
    first_reply = next(e for e in spans if e["name"] == "pull ps:0")
    assert second_forward["ts"] < first_reply["ts"]  # step 1 computed before step 0's values came back


def test_a_shards_next_push_leaves_while_its_reply_to_the_last_is_held():
    """ps:0's replies are held back; ps:1's flow. Step 1's pushes go out to both ps while ps:0 still
    owes step 0's reply (two pushes in flight per connection): ps:0 has applied both. Fails where a
    shard's push waits for its reply to the last one."""
    with InprocCluster(2, 1, PIPELINE) as c:
        proxy = CuttingProxy(c.servers[TaskId("ps", 0)].address)
        try:
            addrs = c.cluster.to_dict()
            routed = ClusterSpec.from_dict({**addrs, "ps": [proxy.address, *addrs["ps"][1:]]})
            model = mlp()
            trainer = Trainer(model, optim.SGD(lr=0.1), replace(c.task(0), cluster=routed))
            trainer.prepare()
            proxy.hold_replies()
            returned: list[int] = []

            def train() -> None:
                for i in range(2):
                    trainer.step(loss, batch=batch(i))
                    returned.append(i)

            worker = threading.Thread(target=train, daemon=True)
            worker.start()
            wait_until(lambda: [s["stats"]["applied_updates"] for s in c.status()] == [2, 2], 10,
                       "both ps applying step 1 while ps:0's reply to step 0 is held")
            proxy.release_replies()
            worker.join(timeout=20)
            assert returned == [0, 1]
            trainer.close()
            status = c.status()
        finally:
            proxy.close()
    assert [s["stats"]["applied_updates"] for s in status] == [2, 2]


def test_a_failed_send_is_raised_at_a_later_step_and_the_steps_queued_behind_it_are_not_sent():
    with InprocCluster(2, 1, PIPELINE) as c:
        model = mlp()
        trainer = c.trainer(0, model, optim.SGD(lr=0.1))
        send_push, calls = trainer.client.send_push, []

        def failing(shard, *args, **kwargs):
            calls.append((kwargs["seq"], shard))
            if kwargs["seq"] == 2 and shard == 0:  # step 2's last push (shard 0, after shard 1's)
                raise RemoteError("ps:0: the link broke")
            return send_push(shard, *args, **kwargs)

        trainer.client.send_push = failing
        trainer.step(loss, batch=batch(0))
        trainer.step(loss, batch=batch(1))
        trainer.step(loss, batch=batch(2))  # computed while step 2 was in flight; its sends are skipped
        with pytest.raises(RemoteError, match="the link broke"):
            trainer.step(loss, batch=batch(3))
        assert (3, 0) not in calls and (3, 1) not in calls
        trainer.step(loss, batch=batch(4))  # the connections are in step: training goes on
        trainer.close()
        status = c.status()
    # shard 1 took step 2 (sent before shard 0, which failed); step 3 reached no shard
    assert [s["stats"]["applied_updates"] for s in status] == [2, 3]
    assert trainer.local_step == 2


def test_a_failure_of_the_last_step_in_flight_is_raised_by_close():
    with InprocCluster(2, 1, PIPELINE) as c:
        trainer = c.trainer(0, mlp(), optim.SGD(lr=0.1))
        send_push = trainer.client.send_push

        def failing(shard, *args, **kwargs):
            if kwargs["seq"] == 2:
                raise RemoteError("ps:1: the link broke")
            return send_push(shard, *args, **kwargs)

        trainer.client.send_push = failing
        trainer.step(loss, batch=batch(0))
        trainer.step(loss, batch=batch(1))  # returns: its failure is found on the push thread
        with pytest.raises(RemoteError, match="the link broke"):
            trainer.close()
        assert trainer.failure is not None and "the link broke" in trainer.failure  # what the ps were told
        status = c.status()
    assert [s["stats"]["applied_updates"] for s in status] == [1, 1]


def test_a_failing_closure_leaves_the_pipeline_usable():
    with InprocCluster(2, 1, PIPELINE) as c:
        trainer = c.trainer(0, mlp(), optim.SGD(lr=0.1))

        def failing(m, x, y):
            out = F.cross_entropy(m(x), y)
            out.backward(retain_graph=True)  # the hooks send some shards
            raise RuntimeError("boom after backward")

        trainer.step(loss, batch=batch(0))
        with pytest.raises(RuntimeError, match="boom"):
            trainer.step(failing, batch=batch(1))
        for i in range(2, 5):
            trainer.step(loss, batch=batch(i))
        trainer.close()
        status = c.status()
    assert trainer.local_step == 4  # the failed step is not counted; the shards it reached applied it
    assert all(s["stats"]["applied_updates"] >= 4 for s in status)


@pytest.mark.parametrize("direction", ["reply", "request"])
def test_a_pipelined_push_whose_connection_drops_is_resent_and_applied_exactly_once(direction: str):
    steps = 5
    with InprocCluster(1, 1, TrainConfig(mode="async", pipeline=True)) as c:
        proxy = CuttingProxy(c.servers[TaskId("ps", 0)].address)
        try:
            routed = ClusterSpec.from_dict({**c.cluster.to_dict(), "ps": [proxy.address]})
            task = replace(c.task(0), cluster=routed, resolve=lambda peer: proxy.address)
            model = mlp()
            t = Trainer(model, optim.SGD(lr=0.1), task)
            t.prepare()
            for step in range(steps):
                if step == 2:
                    proxy.cut_next(direction)
                t.step(loss, batch=batch(step))
            t.close()
            (st,) = c.status()
        finally:
            proxy.close()
    assert proxy.cuts == 1 and t.local_step == steps
    assert st["version"] == st["stats"]["applied_updates"] == steps
    # Two pushes in flight: a dropped reply's push the ps had, and maybe the next one already; a dropped
    # request's push it never had, but maybe the one before it, whose reply the drop lost. All of them
    # are resent; the ones it had are recognised, never applied twice.
    assert st["stats"]["duplicates"] in ((1, 2) if direction == "reply" else (0, 1))


@pytest.mark.parametrize("lost", ["both replies", "the second push"])
def test_two_pushes_in_flight_when_their_connection_drops_are_resent_in_order_and_applied_once(lost: str):
    """ps:0's replies are held while the worker's next push goes out beside the first (two in flight
    on one connection); then the connection drops. The fresh connection carries both, oldest first:
    what the ps had is a DUPLICATE, the rest is applied, each exactly once. "the second push": the
    proxy drops the second push's bytes, so the ps applied only the first before the drop."""
    steps = 5
    with InprocCluster(1, 1, TrainConfig(mode="async", pipeline=True)) as c:
        proxy = CuttingProxy(c.servers[TaskId("ps", 0)].address)
        try:
            routed = ClusterSpec.from_dict({**c.cluster.to_dict(), "ps": [proxy.address]})
            t = Trainer(mlp(), optim.SGD(lr=0.1), replace(c.task(0), cluster=routed, resolve=lambda peer: proxy.address))
            t.prepare()
            proxy.hold_replies()
            t.step(loss, batch=batch(0))
            wait_until(lambda: c.status()[0]["stats"]["applied_updates"] == 1, 10, "the first push applied")
            if lost == "the second push":
                proxy.cut_next("request")
            threads = ThreadGroup({"train": lambda: [t.step(loss, batch=batch(i)) for i in range(1, steps)]}).start()
            if lost == "both replies":
                wait_until(lambda: c.status()[0]["stats"]["applied_updates"] == 2, 10,
                           "the second push applied while the reply to the first is held")
                proxy.cut_all()
            else:
                wait_until(lambda: proxy.cuts == 1, 10, "the second push's bytes dropped (and its connection)")
            proxy.release_replies()
            threads.join(timeout_s=30)
            t.close()
            (st,) = c.status()
        finally:
            proxy.close()
    assert t.local_step == steps
    assert st["version"] == st["stats"]["applied_updates"] == steps
    assert st["stats"]["duplicates"] == (2 if lost == "both replies" else 1)


def test_the_pipeline_is_refused_in_sync_mode_and_under_ssp_below_staleness_2():
    from psflow.errors import ConfigError

    with pytest.raises(ConfigError, match="only async or ssp mode"):
        TrainConfig(mode="sync", pipeline=True)
    for staleness in (0, 1):
        with pytest.raises(ConfigError, match=f"needs staleness >= 2; received staleness={staleness}"):
            TrainConfig(mode="ssp", staleness=staleness, pipeline=True)
    assert TrainConfig(mode="ssp", staleness=2, pipeline=True).pipeline


# -- ssp: the bound counts the pipeline's steps -------------------------------------------------

WAIT_S = 10.0


def held_clocks(c: InprocCluster, worker: int) -> tuple[list[int], dict[int, int]]:
    """ps:0's held clocks of ``worker`` and every worker's clock, read under the store's lock."""
    store = c.services[0].store
    with store._cond:
        return sorted(k for w, k in store.rules.held if w == worker), dict(store.rules.clocks)


@pytest.mark.parametrize("staleness", [2, 3])
@pytest.mark.parametrize("held_at", [0, 2])
def test_under_ssp_a_pipelined_worker_leads_the_slowest_by_at_most_staleness_steps(staleness: int, held_at: int):
    """2 pipelined workers under ssp. worker:1 stops inside its step ``held_at`` (a gate): its clock
    is ``held_at`` (its steps before are applied, none after). worker:0 runs on until the bound holds
    its push thread at some clock k; its training thread then computes step k + 1 from the values of
    step k - 1 and waits for step k's. The largest step it computes while worker:1 is held must be
    exactly held_at + staleness: one more where the bound missed a pipelined step, two without them."""
    steps = held_at + staleness + 4
    cfg = TrainConfig(mode="ssp", staleness=staleness, pipeline=True, sync_timeout_s=3 * WAIT_S)
    released = threading.Event()
    computed: list[tuple[int, bool]] = []  # worker:0's steps: (step, whether worker:1 was released by then)
    with InprocCluster(1, 2, cfg) as c:
        trainers = [c.trainer(w, mlp(), optim.SGD(lr=0.1)) for w in range(2)]
        for t in trainers:
            t.prepare()

        def work(w: int) -> None:
            for i in range(steps):
                def closure(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, i: int = i) -> torch.Tensor:
                    if w == 0:
                        computed.append((i, released.is_set()))
                    if w == 1 and i == held_at:
                        assert released.wait(WAIT_S), "worker:1 was never released"
                    return loss(m, x, y)

                trainers[w].step(closure, batch=batch(i))
            trainers[w].close()

        group = ThreadGroup({"worker:0": lambda: work(0), "worker:1": lambda: work(1)}).start()
        try:
            held: list[int] = []

            def worker0_waits_at_the_bound() -> bool:
                nonlocal held
                held, clocks = held_clocks(c, 0)
                return clocks.get(1) == held_at and len(held) == 1 and len(computed) == held[0] + 2

            wait_until(worker0_waits_at_the_bound, WAIT_S, "worker:0 held at the bound, its last step computed")
            lead = max(i for i, after in computed) - held_at
        finally:
            released.set()
        group.join(timeout_s=WAIT_S)
        (st,) = c.status(clock_log=True)
    assert lead == staleness, (held, computed)
    assert max(i for i, after in computed if not after) == held_at + staleness
    assert st["version"] == st["stats"]["applied_updates"] == 2 * steps  # every push applied once
    assert st["stats"]["duplicates"] == 0
    assert all(step - slowest <= staleness for _, step, slowest in st["clock_log"]), st["clock_log"]
    # released at the bound: its clock + 2 pipelined steps exactly staleness past worker:1 once that moved on
    assert (0, held_at + staleness + 1, held_at + 1) in [tuple(e) for e in st["clock_log"]], st["clock_log"]


def test_under_ssp_a_pipelined_worker_whose_bound_runs_out_fails_at_its_next_step_and_pushes_nothing_past_it():
    """staleness 2, worker:1 never takes a step: worker:0's push thread may send steps 0 (clock 0 + 2
    pipelined steps <= 2), not step 1. Its training thread computes steps 0-2 and raises the bound's
    error at step 3, which waits for step 1's values."""
    cfg = TrainConfig(mode="ssp", staleness=2, pipeline=True, sync_timeout_s=1.0)
    computed: list[int] = []
    with InprocCluster(1, 2, cfg) as c:
        trainers = [c.trainer(w, mlp(), optim.SGD(lr=0.1)) for w in range(2)]
        for t in trainers:
            t.prepare()

        def closure(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            computed.append(len(computed))
            return loss(m, x, y)

        with pytest.raises((TrainingError, RemoteError)) as err:
            for i in range(6):
                trainers[0].step(closure, batch=batch(i))
        trainers[0].close()
        (st,) = c.status(clock_log=True)
    assert "worker:0 at clock 1 (and 2 pipelined steps ahead) waited 1.0 s" in str(err.value)
    assert computed == [0, 1, 2] and trainers[0].local_step == 1
    assert st["version"] == 1 and all(step - slowest <= 2 for _, step, slowest in st["clock_log"])
