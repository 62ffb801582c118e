"""The timeline's spans in each update mode, on an in-process cluster (real servers and sockets).

The recorder is per process, so here the ps and the workers share one: what is checked is that each
mode's waits carry their own names (async: the ps's reply; ssp: the staleness bound), that every
step is split into its phases, that a ps records receive, apply and send for every push, and that
training never turns the recorder on by itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from inproc import InprocCluster, run_threads

from psflow import optim, timeline
from psflow.config import TrainConfig

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)
STEPS = 6


def train(mode: str) -> None:
    with InprocCluster(2, 2, TrainConfig(mode=mode, staleness=1, split_bytes=64)) as c:
        trainers = [c.trainer(i, torch.nn.Linear(8, 3), optim.SGD(lr=0.1)) for i in range(2)]
        for t in trainers:
            t.prepare()
        x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])

        def work(t) -> None:
            for _ in range(STEPS):
                t.step(lambda m, x, y: F.cross_entropy(m(x), y), batch=(x, y))

        run_threads([lambda t=t: work(t) for t in trainers], timeout_s=30)
        for t in trainers:
            t.close()


@pytest.fixture
def recorder():
    tl = timeline.start("inproc")
    try:
        yield tl
    finally:
        timeline.stop()


@pytest.mark.parametrize(("mode", "wait"), [("async", "ps reply"), ("ssp", "ssp bound"), ("sync", "sync quorum")])
def test_each_mode_names_its_wait_and_every_step_has_its_phases(recorder, mode: str, wait: str) -> None:
    train(mode)
    events = recorder.events
    assert sum(e["cat"] == "step" for e in events) == 2 * STEPS
    names = {e["name"] for e in events}
    assert {"forward", "backward", "push ps:0", "push ps:1", "pull ps:0", "pull ps:1"} <= names
    assert any(wait in n for n in names if n.startswith("wait")), sorted(names)
    if mode == "ssp":
        assert "wait (ssp bound)" in names and "pull" in names  # the clock wait, then the pull after it
    pushes = [e for e in events if e["cat"] == "apply"]
    assert len(pushes) == 2 * 2 * STEPS  # every push of each worker, on each shard
    assert sum(e["name"] == "receive PS_PUSH" for e in events) == sum(e["name"] == "send PS_PUSH" for e in events) == 2 * 2 * STEPS
    shares = timeline.step_shares(events)["shares"]
    assert sum(shares.values()) == pytest.approx(1.0, abs=0.01)


def test_training_never_turns_the_timeline_on_by_itself() -> None:
    assert timeline.ACTIVE is None
    train("async")
    assert timeline.ACTIVE is None
