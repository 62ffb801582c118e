"""Communication overlaps backward: a shard's gradients leave as soon as backward produced them."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from inproc import InprocCluster

from psflow import optim, timeline
from psflow.config import TrainConfig
from psflow.train.sender import PushSender

pytestmark = pytest.mark.timeout(60)
STEPS = 4


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 3))


def train(placement: str, num_ps: int = 2) -> tuple[torch.nn.Module, dict]:
    model = mlp()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 8, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(STEPS)]
    with InprocCluster(num_ps, 1, TrainConfig(mode="async", placement=placement)) as c:
        trainer = c.trainer(0, model, optim.SGD(lr=0.1, momentum=0.9))
        for x, y in batches:
            trainer.step(lambda m, x, y: F.cross_entropy(m(x), y), batch=(x, y))
        return model, trainer.stats()


@pytest.mark.parametrize("placement", ["contiguous", "balanced"])
def test_gradients_of_late_layers_leave_during_backward_with_model_order_placements(placement: str):
    _, stats = train(placement)
    # ps:1 holds only the last layers, whose gradients backward produces first: sent early every step.
    assert stats["early_pushes"] >= STEPS


def test_overlap_does_not_change_the_result():
    overlapped, _ = train("contiguous")
    reference, stats = train("round_robin", num_ps=1)  # one shard: nothing can leave early
    assert stats["early_pushes"] == 0
    for a, b in zip(overlapped.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def test_a_failing_closure_after_an_early_push_leaves_the_connections_usable():
    model = mlp()
    with InprocCluster(2, 1, TrainConfig(mode="async", placement="contiguous")) as c:
        trainer = c.trainer(0, model, optim.SGD(lr=0.1))
        x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])

        def failing(m, x, y):
            loss = F.cross_entropy(m(x), y)
            # hooks fire during this backward; the error comes after some shards were sent
            loss.backward(retain_graph=True)
            raise RuntimeError("boom after backward")

        before = trainer.global_step
        with pytest.raises(RuntimeError, match="boom"):
            trainer.step(failing, batch=(x, y))
        trainer.step(lambda m, x, y: F.cross_entropy(m(x), y), batch=(x, y))
        assert trainer.global_step > before


def held_push(threaded: bool) -> tuple[list[bool], list[dict]]:
    """One step whose push to ps:1 (the last layers, ready first) is held until backward has produced
    the first layer's gradient (at most 5 s). Returns whether that came in time, and the spans."""
    model = mlp()
    first_layer_done = threading.Event()
    model[0].weight.register_post_accumulate_grad_hook(lambda _p: first_layer_done.set())
    recorder = timeline.start("overlap")
    try:
        with InprocCluster(2, 1, TrainConfig(mode="async", placement="contiguous")) as c:
            trainer = c.trainer(0, model, optim.SGD(lr=0.1))
            trainer.sender = PushSender(threaded=threaded)
            trainer.prepare()
            send_push, held = trainer.client.send_push, []

            def slow_link(shard, *args, **kwargs):
                if shard == 1:  # a transfer that lasts until backward is done with the first layer
                    held.append(first_layer_done.wait(timeout=5))
                return send_push(shard, *args, **kwargs)

            trainer.client.send_push = slow_link
            x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
            first_layer_done.clear()
            trainer.step(lambda m, x, y: F.cross_entropy(m(x), y), batch=(x, y))
            trainer.close()
    finally:
        timeline.stop()
    return held, recorder.events


def test_backward_runs_on_while_an_early_push_is_on_its_way():
    held, events = held_push(threaded=True)
    assert held == [True], "backward stood still while ps:1's gradients were being sent"
    spans = {e["name"]: e for e in events}
    push, backward = spans["push ps:1"], spans["backward"]
    assert push["args"]["during_backward"] and push["tid"] != backward["tid"]  # sent beside backward
    assert backward["ts"] <= push["ts"] < backward["ts"] + backward["dur"]  # it left during backward


def test_a_push_sent_on_the_training_thread_holds_backward():
    """The reference the A/B measurements compare against, and the check that the test above tells
    the two apart: sent from the hook on the training thread, the push holds backward."""
    held, _ = held_push(threaded=False)
    assert held == [False]
