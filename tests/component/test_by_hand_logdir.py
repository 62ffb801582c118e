"""Component test: a run whose tasks name no logdir (started by hand) writes one logdir of its own.

An in-process cluster (tests/component/inproc.py): a real ps, real Trainers over TCP, real
Supervisors, none given a logdir. The chief makes ``runs/<script>-<time>-<id>`` and sends it with
its PS_INIT; the other worker and a restarted chief (attempt 1, which takes over) learn it from the
ps's readiness reply, so the run's summaries and checkpoints share that one directory, and a second
run started the same way gets another.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from inproc import InprocCluster, run_threads

from psflow import checkpoint, optim
from psflow.config import TrainConfig
from psflow.data.dataset import BatchIterator, Dataset
from psflow.supervisor import DONE_FILE, Supervisor

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)

WAIT_S = 60.0


def supervised(c: InprocCluster, index: int, attempt: int = 0) -> tuple[Supervisor, torch.nn.Module, BatchIterator]:
    """One task's attempt with no logdir anywhere (no --logdir, no PSFLOW_LOGDIR): its entered Supervisor."""
    model = torch.nn.Linear(8, 3)
    g = torch.Generator().manual_seed(7)
    data = BatchIterator(Dataset(torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)).shard(index, 2),
                         4, epochs=20, seed=index)
    trainer = c.trainer(index, model, optim.SGD(lr=0.1), attempt=attempt)
    sv = Supervisor(trainer.task, trainer=trainer, save_model_steps=4, save_model_secs=None, max_steps=12, data=data)
    return sv.__enter__(), model, data


def steps(sv: Supervisor, model: torch.nn.Module, data: BatchIterator, n: int | None = None) -> None:
    while not sv.should_stop() and (n is None or n > 0):
        x, y = next(data)
        sv.step(lambda x=x, y=y: F.cross_entropy(model(x), y), batch_size=len(x))
        n = None if n is None else n - 1


def test_every_task_and_a_restarted_chief_write_the_logdir_the_chief_made(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["my_model.py"])
    with InprocCluster(1, 2, TrainConfig(mode="async")) as c:

        def job() -> tuple[Path, Path, Path]:
            chief, worker = supervised(c, 0), supervised(c, 1)
            steps(*chief, n=5)
            chief[0].trainer.client.close()  # the chief dies (SIGKILL: no PS_DONE, no final checkpoint)
            chief[0]._held.close()  # and the kernel releases its flock on the logdir
            restarted = supervised(c, 0, attempt=1)
            assert restarted[0].took_over
            steps(*worker)
            steps(*restarted)
            worker[0].__exit__(None, None, None)
            restarted[0].__exit__(None, None, None)
            return chief[0].logdir, worker[0].logdir, restarted[0].logdir

        ((made, followed, taken_over),) = run_threads([job], timeout_s=WAIT_S)

    assert made.parent == Path("runs") and made.name.startswith("my_model-"), made
    assert followed == taken_over == made
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [made.name]  # one directory for the run
    assert {p.name for p in (tmp_path / made / "summaries").iterdir()} == {"worker-0", "worker-1"}
    assert [ck.name for ck in checkpoint.list_checkpoints(tmp_path / made / "checkpoints")][0] == "ckpt-0000000012"
    assert (tmp_path / made / DONE_FILE).exists()


def test_a_second_run_with_no_logdir_starts_fresh_in_another(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    logdirs = []
    for _ in range(2):
        with InprocCluster(1, 2, TrainConfig(mode="async")) as c:

            def job() -> tuple[Path, int]:
                tasks = [supervised(c, 0), supervised(c, 1)]
                for t in tasks:
                    steps(*t)
                for sv, _, _ in reversed(tasks):  # the chief's exit waits for the other worker's (async)
                    sv.__exit__(None, None, None)
                return tasks[0][0].logdir, tasks[0][0].start_step

            ((logdir, start_step),) = run_threads([job], timeout_s=WAIT_S)
        assert start_step == 0  # not the first run's step 12
        logdirs.append(logdir)
    assert logdirs[0] != logdirs[1]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(d.name for d in logdirs)
