"""A ps task for tests/integration/test_hostile_clients.py: the seeds' flags, then serve.

It builds an optimizer once, as the ps does on PS_INIT, before it prints ``serving``, so that a
test can take the task's memory baseline after that.
"""

from __future__ import annotations

import torch

import psflow as pf


def main() -> None:
    task = pf.init()
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    print("serving", flush=True)
    task.join()


if __name__ == "__main__":
    main()
