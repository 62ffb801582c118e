"""A worker that starts a helper in a session of its own (as a data server or a daemonized tool does),
writes its pid to LOGDIR/child-<task>.pid, trains a few steps and exits 0, leaving the helper behind
(tests/integration/test_process_tree.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import psflow as pf


def main() -> None:
    task = pf.init()
    if task.is_ps:
        task.join()
        return
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    name = str(task.task_id).replace(":", "-")
    with open(os.path.join(task.logdir, f"child-{name}.pid"), "w") as f:
        f.write(str(helper.pid))
    model = torch.nn.Linear(4, 1)
    trainer = pf.Trainer(model, pf.optim.SGD(lr=0.01), task)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    for _ in range(5):
        trainer.step(lambda: model(x).pow(2).mean())
    trainer.close()


if __name__ == "__main__":
    main()
