"""A worker blocked on a frozen ps says which ps, in async mode too: its client marks the wait and the
task's heartbeats carry it (``waiting_on``), so the launcher's watchdog restarts the ps, not the
workers (issue 22; the watchdog's side is in tests/unit/test_watchdog.py)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from inproc import CuttingProxy, InprocCluster, ThreadGroup, wait_until

from psflow import optim
from psflow.cluster import ClusterSpec, TaskId
from psflow.config import TrainConfig
from psflow.task import Task
from psflow.train.trainer import Trainer

pytestmark = pytest.mark.timeout(60)


def test_an_async_worker_blocked_on_a_frozen_ps_says_which_ps_it_waits_on() -> None:
    with InprocCluster(2, 1, TrainConfig(mode="async", placement="round_robin")) as c:
        proxy = CuttingProxy(c.servers[TaskId("ps", 1)].address)  # ps:1 as its workers see it: frozen on demand
        try:
            routed = ClusterSpec.from_dict({**c.cluster.to_dict(), "ps": [c.cluster.address(TaskId("ps", 0)), proxy.address]})
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 2)
            t = Trainer(model, optim.SGD(lr=0.1), replace(c.task(0), cluster=routed))
            t.prepare()
            x, y = torch.randn(3, 4), torch.tensor([0, 1, 0])
            beat = SimpleNamespace(attempt=0, waiting_for=None, trainers=[t])  # what Task's heartbeat reads
            t.step(lambda: F.cross_entropy(model(x), y))
            assert t.client.awaiting is None and Task.heartbeat_payload(beat)["waiting_on"] is None  # type: ignore[arg-type]

            proxy.hold_replies()  # ps:1 stops answering, as SIGSTOP makes it
            step = ThreadGroup({"worker:0": lambda: t.step(lambda: F.cross_entropy(model(x), y))}).start()
            wait_until(lambda: t.client.awaiting == "ps:1", 10.0, "the worker marking itself blocked on ps:1")
            assert Task.heartbeat_payload(beat) == {"attempt": 0, "waiting": None, "waiting_on": "ps:1"}  # type: ignore[arg-type]

            proxy.release_replies()
            step.join(timeout_s=20.0)
            assert t.client.awaiting is None and t.local_step == 2
            t.close()
        finally:
            proxy.close()
