"""A linear regression with 3 outputs per example, no Supervisor: what a user's non-classification script looks like.

Targets are (N, 3) floats; it reports ``test_mse`` and ``test_r2`` and writes ``test_mse`` as its
own TensorBoard scalar. ``--epochs`` large and a SIGTERM make a run that stops mid-training.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import psflow as pf


def make_data(n: int, seed: int) -> pf.data.Dataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.arange(24, dtype=torch.float32).reshape(8, 3) / 24
    return pf.data.Dataset(x, x @ w + 0.5 + 0.01 * torch.randn(n, 3, generator=g))


def main() -> None:
    task = pf.init()
    if task.is_ps:
        task.join()
        return
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args(task.argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 3)
    trainer = pf.Trainer(model, pf.optim.SGD(lr=0.05), task)
    train, test = make_data(2000, seed=1).shard(task), make_data(500, seed=2)
    for i, (x, y) in enumerate(train.batches(20, epochs=args.epochs, seed=task.replica_index)):
        loss = trainer.step(lambda x=x, y=y: F.mse_loss(model(x), y), batch_size=len(x))
        if i == 20:
            print(f"worker={task.replica_index} training, loss={loss:.4f}", flush=True)
    trainer.pull()
    with torch.no_grad():
        mse = F.mse_loss(model(test.x), test.y).item()
        r2 = 1 - mse / test.y.var().item()
    print(f"worker={task.replica_index}, test_mse = {mse:.6f}", flush=True)
    task.scalar("test_mse", mse)
    task.report(test_mse=mse, test_r2=r2)


if __name__ == "__main__":
    main()
