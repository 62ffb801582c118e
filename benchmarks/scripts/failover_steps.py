"""The failover benchmark's task script: the seed's MNIST softmax, every step's start and end on disk.

Run by ``bench_failover.py`` through ``psflow chaos`` (faults injected into it) and ``psflow run``.
Each trainer attempt appends one line ``start_unix end_unix`` per step it completed to
``LOGDIR/steps/<task>.<attempt>`` (unbuffered writes: a SIGKILL loses no completed step), so that
the benchmark can measure, against the time the chaos injector sent each SIGKILL, how long the job
took to complete a step again: after a ps primary's death, the first step any worker began after
the kill and completed (its push acknowledged by every shard, the failed one's backup included);
after a worker's death, the restarted attempt's first completed step.

The loop is ``examples/mnist_softmax.py``'s (a Supervisor with the data iterator, so a restarted
worker resumes at its data position), with batch 100, SGD lr 0.01, zeros init.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import psflow as pf
from psflow.rundir import task_stem


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--seconds", type=float, default=None,
                   help="each worker stops after this many seconds of training (the Supervisor's max_seconds)")
    return p.parse_args(argv)


def main() -> None:
    task = pf.init()
    if task.is_ps:
        task.join()
        return
    args = parse_args(task.argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    w = torch.nn.Parameter(torch.zeros(784, 10))
    b = torch.nn.Parameter(torch.zeros(10))
    model = torch.nn.Module()
    model.register_parameter("w", w)
    model.register_parameter("b", b)
    pf.Trainer(model, pf.optim.SGD(lr=0.01), task)  # the task holds it; the Supervisor steps it
    train = pf.data.mnist("train", source=task.data_dir).shard(task)
    batches = train.batches(100, epochs=args.epochs, seed=task.replica_index)
    folder = Path(task.logdir) / "steps"
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / f"{task_stem(task.task_id)}.{task.attempt}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        with pf.Supervisor(task, data=batches, max_seconds=args.seconds) as sv:
            for x, y in batches:
                if sv.should_stop():
                    break
                t0 = time.time()
                sv.step(lambda x=x, y=y: F.cross_entropy(x @ w + b, y), batch_size=len(x))
                os.write(fd, f"{t0:.6f} {time.time():.6f}\n".encode())
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
