"""A short supervised regression whose workers then spend ``--pause`` seconds on work after their loop
(a stand-in for an evaluation), longer than the run's ``--hang-timeout``: their training is over, so
the watchdog must not take that for a hang (tests/integration/test_hangs_after_loop.py).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import psflow as pf


def main() -> None:
    task = pf.init()
    if task.is_ps:
        task.join()
        return
    p = argparse.ArgumentParser()
    p.add_argument("--pause", type=float, default=6.0, help="seconds of work after the training loop")
    args = p.parse_args(task.argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 1)
    pf.Trainer(model, pf.optim.SGD(lr=0.05), task)
    x = torch.randn(400, 8, generator=torch.Generator().manual_seed(1))
    batches = pf.data.Dataset(x, x.sum(1, keepdim=True)).shard(task).batches(20, epochs=2, seed=task.replica_index)
    with pf.Supervisor(task, data=batches) as sv:
        for xb, yb in batches:
            if sv.should_stop():
                break
            sv.step(lambda xb=xb, yb=yb: F.mse_loss(model(xb), yb), batch_size=len(xb))
    end = time.monotonic() + args.pause  # busy, as an evaluation is: no step, no wait for a peer
    while time.monotonic() < end:
        torch.randn(64, 64) @ torch.randn(64, 64)
    print(f"worker={task.replica_index} done after its pause", flush=True)


if __name__ == "__main__":
    main()
