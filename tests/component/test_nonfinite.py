"""Component tests: NaN gradients pushed to a real in-process cluster (TrainConfig.nonfinite).

Real servers and Trainers on 127.0.0.1 (tests/component/inproc.py). What is proven:

- ``refuse`` (default): a worker whose steps produce NaN gradients has those pushes refused by every
  shard, says so once and trains on; the job reaches its stop step with finite values, every shard
  counts the refusals for that worker, and with ``ps_replicas = 2`` each backup ends in its primary's
  exact state (a refused push is never shipped): async and sync (the step waits for the worker's
  next, finite gradient);
- ``fail``: the NaN push's reply is an error naming the worker and step, and the ps's next tick
  fails it with the same reason;
- a chief whose model holds a NaN is refused at initialization, naming the parameter.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from inproc import InprocCluster, run_threads
from replicated import batch_for, make_model, train

from psflow import optim
from psflow.config import TrainConfig
from psflow.errors import RemoteError, TrainingError

pytestmark = pytest.mark.timeout(90)
torch.set_num_threads(1)

WAIT_S = 30.0
MAX_STEPS = 12
NAN_CALLS = {2, 3, 5}  # worker:1's closure calls whose loss (so every gradient) is NaN


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_nan_pushes_are_refused_and_the_job_trains_on(mode: str, caplog: pytest.LogCaptureFixture) -> None:
    with InprocCluster(2, 2, TrainConfig(mode=mode, ps_replicas=2)) as c:
        models = [make_model() for _ in range(2)]
        trainers = [c.trainer(w, models[w], optim.SGD(lr=0.1)) for w in range(2)]
        trainers[0].plan_steps(stop_at=MAX_STEPS)
        for t in trainers:
            t.prepare()
        calls = 0
        x, y = batch_for(1)
        # async: worker:0 starts once worker:1 is past its NaN calls, or on a busy machine it could take the
        # job to its stop step first (sync steps both in lockstep)
        poisoned_done = threading.Event()

        def poisoned(t):  # noqa: ANN001, ANN202 - worker:1's loop, its loss NaN on NAN_CALLS
            def loss() -> torch.Tensor:
                nonlocal calls
                calls += 1
                if calls > max(NAN_CALLS):
                    poisoned_done.set()
                value = F.cross_entropy(models[1](x), y)
                return value * float("nan") if calls in NAN_CALLS else value
            while not t.stopped:
                t.step(loss)
            t.close()

        with caplog.at_level(logging.WARNING):
            run_threads([lambda: (mode == "sync" or poisoned_done.wait(WAIT_S),
                                  train(trainers[0], models[0], 0, max_steps=MAX_STEPS)),
                         lambda: poisoned(trainers[1])], timeout_s=WAIT_S)
        statuses = c.status()
        c.settle()
        for shard, service in enumerate(c.services):
            primary, backup = service.store, c.services[1 - shard].backups[shard]
            assert all(torch.isfinite(v).all() for v in primary.values.values())
            assert backup.version == primary.version and backup.rules.state() == primary.rules.state()
            assert all(torch.equal(backup.values[k], primary.values[k]) for k in primary.values)
    assert trainers[1].refused_pushes == len(NAN_CALLS) and trainers[0].refused_pushes == 0
    assert [st["stats"]["nonfinite_by_worker"] for st in statuses] == [{"1": len(NAN_CALLS)}] * 2
    assert statuses[0]["version"] == MAX_STEPS
    ps_lines = [r.getMessage() for r in caplog.records if r.name == "psflow.ps" and "NaN" in r.getMessage()]
    assert len(ps_lines) == 2 and all("worker:1 " in m for m in ps_lines)  # once per shard, naming it
    worker_lines = [r.getMessage() for r in caplog.records if r.name == "psflow" and "refused" in r.getMessage()]
    assert len(worker_lines) == 1 and worker_lines[0].startswith("worker:1:")


def test_fail_stops_the_job_naming_the_worker_and_step() -> None:
    with InprocCluster(1, 1, TrainConfig(nonfinite="fail")) as c:
        model = make_model()
        t = c.trainer(0, model, optim.SGD(lr=0.1))
        t.prepare()
        x, y = batch_for(0)
        t.step(lambda: F.cross_entropy(model(x), y))
        with pytest.raises((RemoteError, TrainingError), match=r"worker:0 \(attempt 0\) pushed a gradient holding NaN "
                                                               r"or inf to ps shard 0 at step 1 .*nonfinite = fail"):
            t.step(lambda: F.cross_entropy(model(x), y) * float("nan"))
        with pytest.raises(TrainingError, match=r"worker:0 .* at step 1 "):
            c.services[0].watch_lost_workers(time.monotonic())  # what the ps's main loop calls about once a second
        assert c.services[0].store.version == 1


def test_a_chief_with_a_nan_parameter_is_refused_naming_it() -> None:
    with InprocCluster(1, 1) as c:
        model = make_model()
        with torch.no_grad():
            model.b.bias[0] = float("nan")
        t = c.trainer(0, model, optim.SGD(lr=0.1))
        with pytest.raises((RemoteError, TrainingError), match=r"refused the initial values from the chief: NaN or inf in 'b\.bias'"):
            t.prepare()
        assert not c.services[0].store.initialized
