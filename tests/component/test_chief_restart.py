"""Component tests: a restarted chief takes over its duties from the running ps, in async and sync.

An in-process cluster (tests/component/inproc.py): real ps servers, real Trainers over TCP, and real
Supervisors writing checkpoints and event files under tmp_path. The chief (worker:0) is "killed" by
closing its Trainer's connections without PS_DONE and abandoning its Supervisor (no final
checkpoint, no DONE: what SIGKILL leaves); its restart is a new model, Trainer, data iterator and
Supervisor for the same task with ``attempt`` 1, as the launcher's new process builds. What is proven:

- the new chief finds the ps initialized and does not initialize or restore them: the ps received
  one PS_INIT in the whole job, its version never goes back, the new chief starts at the ps's step
  with the ps's values (not its fresh model's, not the last checkpoint's) and its own data position;
- async: the other worker keeps training while the chief is down;
  sync (N = M = 2): the other worker's step is held for the chief until its attempt 1 pushes;
- checkpoints go on at the next multiple of ``save_model_steps`` after the ps's step (a multiple
  passed while the chief was down is not written late), the final one at max_steps, then DONE;
- summaries go on in the same directory: a new event file, the first one kept, steps continuing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from inproc import InprocCluster, run_threads

from psflow import checkpoint, optim
from psflow.config import TrainConfig
from psflow.data.dataset import BatchIterator, Dataset
from psflow.summary import summary_dir
from psflow.supervisor import DONE_FILE, Supervisor

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)

WAIT_S = 60.0  # the deadline of every thread join (and the sync step's hold)
MAX_STEPS = 20
EVERY = 4  # save_model_steps


class Run:
    """One task's attempt: its model, data iterator, Trainer and entered Supervisor."""

    def __init__(self, c: InprocCluster, index: int, logdir: Path, attempt: int = 0) -> None:
        torch.manual_seed(100 * attempt + index)  # a new process builds a new model
        self.model = torch.nn.Linear(8, 3)
        g = torch.Generator().manual_seed(7)
        shard = Dataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)).shard(index, 2)
        self.data = BatchIterator(shard, 4, epochs=50, seed=index)
        self.trainer = c.trainer(index, self.model, optim.SGD(lr=0.1), attempt=attempt, logdir=str(logdir))
        self.sv = Supervisor(self.trainer.task, trainer=self.trainer, logdir=logdir, save_model_steps=EVERY,
                             save_model_secs=None, max_steps=MAX_STEPS, summary_every_steps=1,
                             data=self.data).__enter__()

    def step(self) -> bool:
        """One batch unless the job should stop; whether it stepped."""
        if self.sv.should_stop():
            return False
        x, y = next(self.data)
        self.sv.step(lambda: F.cross_entropy(self.model(x), y), batch_size=len(x))
        return True

    def finish(self) -> None:
        while self.step():
            pass
        self.sv.__exit__(None, None, None)

    def kill(self) -> None:
        """SIGKILL: the connections close without PS_DONE; no final checkpoint, no DONE. The events
        written so far reached the disk (flushed here: a real kill loses at most the unflushed tail)."""
        assert self.sv._writer is not None
        self.sv._writer.flush()
        self.trainer.client.close()


def ps_version(c: InprocCluster) -> int:
    return int(c.status()[0]["version"])


def checkpoint_steps(logdir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in checkpoint.list_checkpoints(logdir / "checkpoints"))


def scalar_steps_by_file(logdir: Path, tag: str) -> list[list[tuple[int, float]]]:
    """Each event file of worker:0, oldest first: its ``tag`` scalars as (step, value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(summary_dir(logdir, "worker:0").glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns)
    out = []
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        out.append([(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else [])
    return out


def assert_took_over(chief: Run, *, at: int, position: dict[str, Any], ps_values: dict[str, torch.Tensor]) -> None:
    sv = chief.sv
    assert sv.took_over and sv.restored_from is None and sv.start_step == at
    assert chief.data.state_dict() == position  # its own data position, from the ps's record
    for name, p in chief.model.named_parameters():  # the ps's values, not its fresh model's
        assert torch.equal(p.detach(), ps_values[name]), name


def assert_summaries_continue(logdir: Path, killed_at: int, restarted_at: int) -> None:
    losses = scalar_steps_by_file(logdir, "loss")
    assert len(losses) == 2, losses  # a new event file; the first one kept, not clobbered
    before, after = [s for s, _ in losses[0]], [s for s, _ in losses[1]]
    assert before and max(before) == killed_at, before
    assert after and min(after) > restarted_at and max(after) == MAX_STEPS, after
    (_, eps_after) = scalar_steps_by_file(logdir, "examples_per_sec")
    assert eps_after and all(v > 0 for _, v in eps_after), eps_after


def test_async_a_restarted_chief_takes_over_while_the_other_worker_keeps_training(tmp_path: Path) -> None:
    """One thread interleaves the two workers' steps (async needs no lockstep), so every global step
    is known: the chief's steps make the odd versions. It dies at version 6 (its checkpoint at 4
    written); worker:1 alone takes the job to 11, passing 8; attempt 1 starts at 11 and checkpoints
    12, 16 and 20 (max_steps), not 8."""
    logdir = tmp_path / "run"
    with InprocCluster(1, 2, TrainConfig(mode="async")) as c:

        def job() -> tuple[Run, Run, list[int]]:
            chief, worker = Run(c, 0, logdir), Run(c, 1, logdir)
            assert not chief.sv.took_over
            versions = [ps_version(c)]
            for _ in range(3):
                chief.step(), worker.step()
            chief.kill()
            versions.append(ps_version(c))
            for _ in range(5):  # nothing waits for the chief: readiness, pushes, the ps
                assert worker.step()
            versions.append(ps_version(c))
            positions = c.client().wait_ready(worker.trainer.digest, 5.0)["data_positions"]  # the ps's record
            ps_values = {n: p.detach().clone() for n, p in worker.model.named_parameters()}  # its push-pull's: version 11
            restarted = Run(c, 0, logdir, attempt=1)
            versions.append(ps_version(c))
            assert_took_over(restarted, at=11, position=positions["0"], ps_values=ps_values)
            while restarted.step() | worker.step():
                versions.append(ps_version(c))
            worker.finish()
            restarted.finish()
            return chief, restarted, versions

        ((chief, restarted, versions),) = run_threads([job], timeout_s=WAIT_S)
        (st,) = c.status()
    assert versions == sorted(versions) and versions[:4] == [0, 6, 11, 11], versions  # never back
    assert st["stats"]["init_requests"] == 1  # attempt 1 sent no PS_INIT
    assert st["version"] == MAX_STEPS and st["done_workers"] == [0, 1]
    assert chief.sv.checkpoints == [4] and restarted.sv.checkpoints == [12, 16, 20]
    assert checkpoint_steps(logdir) == [4, 12, 16, 20]
    assert json.loads((logdir / DONE_FILE).read_text())["global_step"] == MAX_STEPS
    assert restarted.trainer.task.reports["supervisor"]["took_over"] is True
    assert_summaries_continue(logdir, killed_at=5, restarted_at=11)


def test_sync_the_other_worker_waits_for_the_restarted_chief_and_the_job_finishes(tmp_path: Path) -> None:
    """N = M = 2, MAX_STEPS steps in lockstep. The chief dies after step 6 (checkpoint 4 written);
    worker:1's step 6 is held for it (sync_timeout_s is the deadline) until attempt 1 joins at 6
    and pushes; attempt 1 checkpoints 8, 12, 16 and 20."""
    logdir = tmp_path / "run"
    cfg = TrainConfig(mode="sync", sync_timeout_s=WAIT_S)
    with InprocCluster(1, 2, cfg) as c:
        # Both Supervisors are entered before the threads start: worker:1 waits for the chief's init.
        chief_box: dict[str, Run] = {}

        def chief_dies_and_restarts() -> Run:
            chief = chief_box["run"] = Run(c, 0, logdir)
            for _ in range(6):
                assert chief.step()
            chief.kill()
            assert ps_version(c) == 6  # worker:1's gradient for step 6 is held, not applied without the chief
            restarted = Run(c, 0, logdir, attempt=1)
            assert restarted.sv.took_over and restarted.sv.start_step == 6
            restarted.finish()
            return restarted

        def worker() -> Run:
            w = Run(c, 1, logdir)
            w.finish()
            return w

        restarted, w = run_threads([chief_dies_and_restarts, worker], timeout_s=WAIT_S)
        (st,) = c.status()
    chief = chief_box["run"]
    assert st["stats"]["init_requests"] == 1
    assert st["version"] == MAX_STEPS and st["done_workers"] == [0, 1]
    assert st["stats"]["steps_without_all"] == 0  # every step had the chief's gradient
    assert w.trainer.local_step == MAX_STEPS and restarted.trainer.local_step == MAX_STEPS - 6
    assert chief.sv.checkpoints == [4] and restarted.sv.checkpoints == [8, 12, 16, 20]
    assert checkpoint_steps(logdir) == [4, 8, 12, 16, 20]
    assert json.loads((logdir / DONE_FILE).read_text())["global_step"] == MAX_STEPS
    assert_summaries_continue(logdir, killed_at=6, restarted_at=6)
