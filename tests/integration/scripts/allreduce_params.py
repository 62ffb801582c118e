"""Test job for tests/integration/test_allreduce.py: a tiny all-reduce run that reports its parameters.

Every rank starts from *different* random weights (seeded by its replica index), so identical final
parameters prove that rank 0's were broadcast; each rank trains on its own fixed batches
(``batch(step, rank)``), so the test can recompute the whole run in one process: the mean of the
ranks' gradients, one SGD step, per step.

    --form closure: trainer.step(lambda: loss(model(x), y))              (explicit all-reduce)
    --form batch:   trainer.step(lambda m, x, y: loss(m(x), y), batch=)  (DistributedDataParallel)
    --form towers:  the batch form with devices=["cpu", "cpu"]            (towers, then all-reduce)
"""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.nn.functional as F

import psflow as pf

IN, OUT, BATCH = 4, 3, 6


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, IN, generator=g), torch.randint(0, OUT, (BATCH,), generator=g)


def make_model(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(IN, OUT)


def main() -> None:
    task = pf.init()
    p = argparse.ArgumentParser()
    p.add_argument("--form", choices=["closure", "batch", "towers"], default="batch")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.5)
    args = p.parse_args(task.argv)
    torch.set_num_threads(1)
    model = make_model(task.replica_index)
    devices = ["cpu", "cpu"] if args.form == "towers" else None
    trainer = pf.Trainer(model, pf.optim.SGD(lr=args.lr), task, devices=devices)
    for step in range(args.steps):
        x, y = batch(step, task.replica_index)
        if args.form == "closure":
            trainer.step(lambda xb=x, yb=y: F.cross_entropy(model(xb), yb), batch_size=len(x))
        else:
            trainer.step(lambda m, xb, yb: F.cross_entropy(m(xb), yb), batch=(x, y))
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    sha = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    print(f"rank {task.replica_index} global_step {trainer.global_step} param_sha256 {sha}", flush=True)
    task.report(
        param_sha256=sha,
        params=flat.tolist(),
        final_step=trainer.global_step,
        backend=trainer.stats()["backend"],
    )


if __name__ == "__main__":
    main()
