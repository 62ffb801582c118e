"""A worker that ignores SIGTERM and trains until it is killed: a stop of its run waits the whole grace
for it, unless the user asks twice (tests/integration/test_outcomes.py)."""

from __future__ import annotations

import signal
import time

import torch

import psflow as pf


def main() -> None:
    task = pf.init()
    if task.is_ps:
        task.join()
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 1)
    trainer = pf.Trainer(model, pf.optim.SGD(lr=0.01), task)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    print("training (SIGTERM ignored)", flush=True)
    while True:
        trainer.step(lambda: model(x).pow(2).mean())
        time.sleep(0.05)


if __name__ == "__main__":
    main()
