"""Component tests of gradient compression on an in-process cluster (real servers, real sockets).

What is proven: with each ``compress`` setting (fp16, bf16, top-k with error feedback, fp16 with
values pulled in fp16 too) two workers train a small classifier to a loss bound in async and sync
mode, on two ps shards with a tensor split across them; compressed pushes carry fewer bytes than
uncompressed ones (the connections' own counters); sync with top-k ratio 1 gives exactly the
uncompressed result (the decoder puts every entry where it belongs); a top-k push with an index
out of range gets a clean ERROR reply naming it, and the connection and the ps keep serving.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from inproc import SECRET, InprocCluster, run_threads

from psflow import optim
from psflow.cluster import TaskId
from psflow.config import TrainConfig
from psflow.errors import RemoteError
from psflow.train.trainer import Trainer
from psflow.wire.conn import connect
from psflow.wire.ops import Op

pytestmark = pytest.mark.timeout(90)
torch.set_num_threads(1)

WAIT_S = 30.0
STEPS = 60


def dataset(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """A teacher's labels: a 2-layer net can fit them, a constant cannot."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 16, generator=g)
    teacher = torch.randn(16, 4, generator=g)
    return x, (x @ teacher).argmax(dim=1)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def full_loss(m: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.no_grad():
        return float(F.cross_entropy(m(data[0]), data[1]))


def train(mode: str, compress: str, *, compress_pull: bool = False, steps: int = STEPS) -> tuple[float, float, list[dict]]:
    """Two workers, two ps (split_bytes=256: the first layer's weight is split across both).
    Returns (loss before, loss after, each worker's stats)."""
    data = dataset()
    cfg = TrainConfig(mode=mode, compress=compress, compress_pull=compress_pull, split_bytes=256, sync_timeout_s=WAIT_S)
    with InprocCluster(2, 2, cfg) as c:
        models = [model(), model()]
        before = full_loss(models[0], data)
        trainers = [c.trainer(i, models[i], optim.SGD(lr=0.2, momentum=0.5)) for i in range(2)]
        for t in trainers:
            t.prepare()

        def work(i: int, t: Trainer) -> None:
            g = torch.Generator().manual_seed(10 + i)
            for _ in range(steps):
                idx = torch.randint(0, 256, (32,), generator=g)
                t.step(lambda m, x, y: F.cross_entropy(m(x), y), batch=(data[0][idx], data[1][idx]))

        run_threads([lambda i=i, t=t: work(i, t) for i, t in enumerate(trainers)], timeout_s=WAIT_S * 2)
        trainers[0].pull()
        after = full_loss(models[0], data)
        stats = [t.stats() for t in trainers]
        for t in trainers:
            t.close()
        return before, after, stats


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize(("compress", "pull"), [("fp16", False), ("bf16", False), ("fp16", True), ("bf16", True),
                                                ("topk:0.05", False)])
def test_training_with_compression_reaches_the_loss_bound(mode: str, compress: str, pull: bool) -> None:
    before, after, stats = train(mode, compress, compress_pull=pull)
    assert after < 0.2 * before, f"{compress} ({mode}): loss {before:.3f} -> {after:.3f}"
    assert all(s["compress"] == compress for s in stats)


def test_compressed_pushes_carry_fewer_bytes() -> None:
    _, _, plain = train("async", "none", steps=10)
    _, _, half = train("async", "fp16", steps=10)
    _, _, halfpull = train("async", "fp16", compress_pull=True, steps=10)
    _, _, topk = train("async", "topk:0.01", steps=10)
    sent = {name: s[1]["bytes_sent"] for name, s in (("none", plain), ("fp16", half), ("topk", topk))}
    # Gradients are 2.3 KB a step; headers and meta (a few hundred bytes) do not shrink.
    assert sent["fp16"] < 0.75 * sent["none"]
    assert sent["topk"] < sent["fp16"]
    assert halfpull[1]["bytes_received"] < 0.75 * plain[1]["bytes_received"]
    assert half[1]["bytes_received"] == pytest.approx(plain[1]["bytes_received"], rel=0.05)  # values come back whole


def test_sync_topk_with_ratio_1_matches_the_uncompressed_run_exactly() -> None:
    _, plain, _ = train("sync", "none", steps=15)
    _, whole, _ = train("sync", "topk:1", steps=15)
    assert whole == plain


def test_a_topk_push_with_an_index_out_of_range_is_refused_and_the_ps_keeps_serving() -> None:
    with InprocCluster(1, 1, TrainConfig()) as c:
        trainer = c.trainer(0, torch.nn.Linear(3, 2), optim.SGD(lr=0.1))
        trainer.prepare()
        conn = connect(c.cluster.address(TaskId("ps", 0)), secret=SECRET, task="worker:0", peer="ps:0",
                       deadline_s=WAIT_S)
        try:
            bad = [("weight#i", torch.tensor([0, 6], dtype=torch.int32)), ("weight#v", torch.tensor([1.0, 2.0])),
                   ("bias#i", torch.tensor([0], dtype=torch.int32)), ("bias#v", torch.tensor([1.0]))]
            with pytest.raises(RemoteError, match=re.escape(
                    "Top-k gradient 'weight' has index 6, out of range for a parameter of 6 elements")):
                conn.request(Op.PS_PUSH, {"worker": 0, "version": 0, "compress": "topk"}, bad, timeout_s=WAIT_S)
            assert conn.request(Op.PS_STATUS, {}, timeout_s=WAIT_S).meta["stats"]["pushes"] == 0  # nothing applied
        finally:
            conn.close()
        trainer.step(lambda: F.mse_loss(trainer.model(torch.ones(1, 3)), torch.zeros(1, 2)))  # still serving
        assert c.status()[0]["stats"]["applied_updates"] == 1
        trainer.close()
