"""The chief's final checkpoint in sync and ssp is the job's last step's (issue 23 item 9).

With a backup worker (N < M), or a chief whose shard is shorter, the others' steps go on after the
chief's data ran out. The chief used to write its final checkpoint (and read the values its script
evaluates) at its own last step, a few dozen steps before the job's end. Now it tells the ps that
its training is over (they count it done for every step, and serve it until it closes), waits for
the others, and only then ends: the final checkpoint, DONE and its final pull are the last step's.

An in-process cluster (tests/component/inproc.py): real ps servers, Trainers and Supervisors over TCP.
"""

from __future__ import annotations

import json
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
CHIEF_BATCHES, OTHER_BATCHES = 6, 14  # the chief's data runs out first


def train(c: InprocCluster, index: int, logdir: Path) -> dict[str, torch.Tensor]:
    """One worker's script: its loop under a Supervisor, then a final pull (what it would evaluate)."""
    torch.manual_seed(index)
    model = torch.nn.Linear(8, 3)
    g = torch.Generator().manual_seed(index)
    n = 4 * (CHIEF_BATCHES if index == 0 else OTHER_BATCHES)
    data = BatchIterator(Dataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)), 4, seed=index)
    trainer = c.trainer(index, model, optim.SGD(lr=0.1), logdir=str(logdir))
    with Supervisor(trainer.task, trainer=trainer, logdir=logdir, save_model_secs=None, summary_every_steps=None,
                    data=data, poll_s=0.05) as sv:
        for x, y in data:
            sv.step(lambda x=x, y=y: F.cross_entropy(model(x), y), batch_size=len(x))
        trainer.pull()  # the example scripts' last values, for their final accuracy
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mode", ["sync-backup", "sync", "ssp"])
def test_the_chief_ends_with_the_jobs_last_step_when_its_data_runs_out_first(tmp_path: Path, mode: str) -> None:
    cfg = (TrainConfig(mode="sync", replicas_to_aggregate=2, total_num_replicas=3, sync_timeout_s=WAIT_S)
           if mode == "sync-backup" else TrainConfig(mode=mode, sync_timeout_s=WAIT_S, staleness=2))
    logdir = tmp_path / "run"
    with InprocCluster(1, 3, cfg) as c:
        chief_values, *_ = run_threads([lambda i=i: train(c, i, logdir) for i in range(3)], timeout_s=WAIT_S)
        (st,) = c.status()
        final = c.services[0].store.snapshot()[1]
    last = st["version"]
    assert st["done_workers"] == [0, 1, 2]
    newest = max(checkpoint.list_checkpoints(logdir / "checkpoints"), key=lambda p: p.name)
    assert int(newest.name.split("-")[1]) == last  # the final checkpoint is the job's last step's
    assert json.loads((logdir / DONE_FILE).read_text())["global_step"] == last
    for name in ("weight", "bias"):  # the values the chief's script evaluates are the final model's
        assert torch.equal(chief_values[name], final[name]), name
