"""A ps task for tests/integration/test_hostile_clients.py: the seeds' flags, then serve.

It does the ps's one-time imports (what ``warm_up`` does in the background) before it prints
``serving``, so that a test can take the task's memory baseline after them.
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
