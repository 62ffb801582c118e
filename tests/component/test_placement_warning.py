"""The chief warns, once, when its placement leaves one ps with most of the parameter bytes.

A real :class:`psflow.task.Task` (the chief's or another worker's) and a real Trainer against two
in-process ps shards: the warning is the Task's, so the InprocTask stand-in cannot show it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from inproc import SECRET, InprocCluster

from psflow import optim
from psflow.cluster import TaskId
from psflow.config import TrainConfig
from psflow.identity import TaskIdentity
from psflow.ps.placement import ImbalancedPlacementWarning
from psflow.task import Task
from psflow.train.trainer import Trainer

pytestmark = pytest.mark.timeout(60)


def cnn_like() -> torch.nn.Module:
    """The seed CNN's layer shapes without the conv compute: a 6.4 MB fc1 among small tensors."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 32, 5), torch.nn.Conv2d(32, 64, 5), torch.nn.Linear(3136, 512),
                               torch.nn.Linear(512, 10))


@pytest.fixture
def cluster() -> Iterator[InprocCluster]:
    with InprocCluster(2, 2) as c:
        yield c


def trainers(c: InprocCluster, index: int, placement: str, count: int = 1) -> list[warnings.WarningMessage]:
    """Build ``count`` trainers on a real Task of ``worker:index``; return the warnings they raised."""
    tid = TaskId("worker", index)
    task = Task(TaskIdentity(tid, c.cluster), secret=SECRET, server=c.servers[tid], config=TrainConfig(placement=placement),
                argv=[], coordinator=None, logdir=None, connect_timeout_s=5.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(count):
            client = Trainer(cnn_like(), optim.SGD(lr=0.1), task).client
            # One round trip first: the ps have finished their side of the handshake before the close.
            client.status()
            client.close()
    return [w for w in caught if issubclass(w.category, ImbalancedPlacementWarning)]


def test_round_robin_on_two_ps_warns_once_on_the_chief_naming_shard_share_and_option(cluster):
    caught = trainers(cluster, 0, "round_robin", count=2)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith("worker:0: Unbalanced ps shards: ps:0 holds ")
    assert "under --placement round_robin" in message and "--placement balanced (the default)" in message
    assert caught[0].filename == __file__  # points at the user's Trainer(...) line


def test_the_default_placement_does_not_warn(cluster):
    assert trainers(cluster, 0, "balanced") == []


def test_a_worker_that_is_not_the_chief_does_not_warn(cluster):
    assert trainers(cluster, 1, "round_robin") == []
