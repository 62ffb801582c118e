"""The pipeline's two threads (psflow.train.pipeline.Exchanges): sends in order, a shard's next push
only once the reply before its last is in (two in flight), replies gathered per step; after a failure later sends are skipped
until reset. And the two reply buffers, used in turn."""

from __future__ import annotations

import threading

import pytest
import torch

from psflow.train.pipeline import Exchanges, ReplyBuffers
from psflow.train.sender import NotSent

pytestmark = pytest.mark.timeout(30)


class FakeShards:
    """Replies on demand: shard's reply to its n-th push is {"shard", "n"}; ``hold`` blocks a shard's replies."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.hold = {0: threading.Event(), 1: threading.Event()}
        for e in self.hold.values():
            e.set()

    def send(self, shard: int):
        return lambda: self.log.append(("send", shard))

    def receive(self, shard: int, buffer: int) -> dict:
        assert self.hold[shard].wait(10)
        self.log.append(("reply", shard))
        return {"shard": shard, "buffer": buffer}


def _wait_for(cond, what: str) -> None:
    """A polling wait with a deadline (5 s)."""
    tick = threading.Event()
    for _ in range(500):
        if cond() or tick.wait(0.01):
            return
    raise AssertionError(what)


def test_two_pushes_per_shard_in_flight_the_third_waits_for_the_first_reply():
    shards = FakeShards()
    ex = Exchanges("t", shards.receive)
    shards.hold[0].clear()  # shard 0's replies are late
    steps = []
    for buffer in (0, 1, 0):
        ex.send(1, shards.send(1), buffer)
        ex.send(0, shards.send(0), buffer)
        steps.append(ex.end_step(2, complete=True))
    _wait_for(lambda: shards.log.count(("send", 0)) == 2, f"shard 0's second push, sent with its first reply held: {shards.log}")
    _wait_for(lambda: shards.log.count(("send", 1)) == 3, f"shard 1's third push (its replies flow): {shards.log}")
    assert ("reply", 0) not in shards.log and shards.log.count(("send", 0)) == 2  # shard 0's third waits
    shards.hold[0].set()
    assert [r.result(10) for r in steps] == [[{"shard": 0, "buffer": b}, {"shard": 1, "buffer": b}] for b in (0, 1, 0)]
    third_send_0 = [i for i, e in enumerate(shards.log) if e == ("send", 0)][2]
    assert shards.log.index(("reply", 0)) < third_send_0  # at most two pushes in flight per connection
    ex.close()


def test_after_a_failed_send_the_later_sends_are_skipped_until_reset():
    shards = FakeShards()
    ex = Exchanges("t", shards.receive)

    def fail() -> None:
        raise ConnectionError("ps:1 lost")

    ex.send(1, fail, 0)
    ex.send(0, shards.send(0), 0)
    with pytest.raises(ConnectionError, match="ps:1 lost"):
        ex.end_step(2, complete=True).result(10)
    ex.send(1, shards.send(1), 1)
    ex.send(0, shards.send(0), 1)
    with pytest.raises(NotSent):
        ex.end_step(2, complete=True).result(10)
    assert shards.log == []  # nothing went out after the failure
    ex.reset()
    ex.send(1, shards.send(1), 0)
    ex.send(0, shards.send(0), 0)
    assert [r["shard"] for r in ex.end_step(2, complete=True).result(10)] == [0, 1]
    ex.close()


def test_an_incomplete_step_reads_the_replies_of_the_shards_it_reached_and_gives_none():
    shards = FakeShards()
    ex = Exchanges("t", shards.receive)
    ex.send(1, shards.send(1), 0)
    assert ex.end_step(2, complete=False).result(10) is None
    assert shards.log == [("send", 1), ("reply", 1)]
    ex.close()


def test_reply_buffers_alternate_and_land_into_the_destinations():
    dest = [{"w": torch.zeros(2, 3)}, {"b": torch.zeros(3)}]
    bufs = ReplyBuffers(dest)
    first, second = bufs.take(), bufs.take()
    assert {first, second} == {0, 1} and bufs.take() == first
    bufs[second][0]["w"].fill_(2.0)
    bufs[second][1]["b"].fill_(3.0)
    bufs.land(second, dest)
    assert torch.equal(dest[0]["w"], torch.full((2, 3), 2.0)) and torch.equal(dest[1]["b"], torch.full((3,), 3.0))
    assert bufs[first][0]["w"].data_ptr() != dest[0]["w"].data_ptr()
