"""A short supervised regression whose worker:1, on its first attempt, freezes (SIGSTOP to itself) once
its training loop is over: its PS_DONE was sent, so the ps and the chief finish the job, while the
launcher's watchdog sees a frozen task, dumps its stacks (which resumes it for a moment), kills it and
may restart it
(tests/integration/test_frozen_after_job.py).
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.nn.functional as F

import psflow as pf


def main() -> None:
    task = pf.init()
    if task.is_ps:
        task.join()
        return
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
    if task.replica_index == 1 and task.attempt == 0:
        print("worker=1 freezing after its PS_DONE", flush=True)
        while True:  # frozen for good: every thread stops, its heartbeats too
            os.kill(os.getpid(), signal.SIGSTOP)
            # The watchdog's stack dump resumes it (SIGCONT): the dump is written, and it freezes again.
            time.sleep(0.5)
    print(f"worker={task.replica_index} attempt={task.attempt} done", flush=True)


if __name__ == "__main__":
    main()
