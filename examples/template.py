"""A template for your own script: copy it, then put in your model, your data and your loss.

It runs as it is, on synthetic data (a noisy linear function to learn), under the launcher, by hand
with the seeds' flags, under Slurm or on Kubernetes:

    .venv/bin/psflow run --ps 1 --workers 2 examples/template.py -- --epochs 5
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import psflow as pf


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="psflow's template: a small regression")
    p.add_argument("--epochs", type=int, default=5, help="passes over this worker's shard")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--logdir", default=None, help="checkpoints and summaries (default: the run's own)")
    return p.parse_args(argv)


def make_data(n: int, seed: int) -> pf.data.Dataset:
    """Your data: inputs and targets, one example per row. Here y = x @ w + noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.linspace(-1, 1, 16).unsqueeze(1)
    return pf.data.Dataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def main() -> None:
    task = pf.init()  # this task's role and cluster: psflow run, the seeds' flags, TF_CONFIG or Slurm
    if task.is_ps:
        task.join()  # a parameter server holds the model until every worker is done
        return
    args = parse_args(task.argv)  # your flags (the cluster flags are taken out)
    torch.manual_seed(0)  # the chief's initial values start the job; the others pull them
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    trainer = pf.Trainer(model, pf.optim.SGD(lr=args.lr), task)  # the ps apply the optimizer
    train, test = make_data(4096, seed=1), make_data(1024, seed=2)
    batches = train.shard(task).batches(args.batch_size, epochs=args.epochs, seed=task.replica_index)
    loss = float("nan")  # a resumed run whose data is all trained takes no step
    # The chief initializes the ps (or restores the newest checkpoint), checkpoints, and stops the job.
    with pf.Supervisor(task, logdir=args.logdir, data=batches) as sv:
        for x, y in batches:
            if sv.should_stop():
                break
            loss = sv.step(lambda x=x, y=y: F.mse_loss(model(x), y), batch_size=len(x))
        trainer.pull()  # the newest parameters from the ps, to evaluate
        with torch.no_grad():
            test_mse = F.mse_loss(model(test.x), test.y).item()
    print(f"{task.task_id}: last loss {loss:.4f}, test mse {test_mse:.4f}", flush=True)
    task.report(test_mse=test_mse)  # into summary.json and the launcher's last line


if __name__ == "__main__":
    main()
