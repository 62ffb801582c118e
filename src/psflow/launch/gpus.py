"""GPUs per worker on this machine: which GPUs each training task of a local run sees (pure).

A local run asked for ``gpus_per_worker = G`` gives each training task (the chief, then the workers,
in the plan's order) its own ``G`` GPUs through ``CUDA_VISIBLE_DEVICES``: task ``k`` sees GPUs
``k*G .. k*G+G-1``, which it addresses as ``cuda:0 .. cuda:G-1`` (:mod:`psflow.devices`). The ps
and evaluator tasks are left as they are. A machine with fewer than ``trainers * G`` GPUs is refused
before anything starts, saying what it has and what was asked. (Kubernetes runs ask the scheduler
for ``nvidia.com/gpu`` instead: :mod:`psflow.launch.k8s`.)

Called by :func:`psflow.platform.launching.plan_of` (the dashboard's start form, the HTTP API).
"""

from __future__ import annotations

from collections.abc import Sequence

from psflow.errors import ConfigError

VISIBLE = "CUDA_VISIBLE_DEVICES"


class GpuRequestError(ConfigError):
    """GPUs per worker that cannot be given: a bad count, a machine with fewer, a backend psflow does not place."""


def is_trainer(task: str) -> bool:
    return task.startswith(("chief:", "worker:"))


def assign_gpus(tasks: Sequence[str], gpus_per_worker: int, available: int) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for each training task in ``tasks`` (empty when ``gpus_per_worker`` is 0).

    Args:
        tasks: the plan's task names (``chief:0``, ``ps:0``, ``worker:1``, ...), in the plan's order.
        gpus_per_worker: GPUs each chief or worker gets.
        available: the GPUs this machine has (``torch.cuda.device_count()``).

    Raises:
        GpuRequestError: a negative count, or fewer GPUs here than the training tasks need.

    Example:
        >>> assign_gpus(["ps:0", "worker:0", "worker:1"], 2, 4)
        {'worker:0': '0,1', 'worker:1': '2,3'}
    """
    if isinstance(gpus_per_worker, bool) or not isinstance(gpus_per_worker, int) or gpus_per_worker < 0:
        raise GpuRequestError(f"GPUs per worker must be a whole number, 0 or more; received {gpus_per_worker!r}.")
    if gpus_per_worker == 0:
        return {}
    trainers = [t for t in tasks if is_trainer(t)]
    needed = len(trainers) * gpus_per_worker
    if needed > available:
        raise GpuRequestError(
            f"GPUs per worker {gpus_per_worker} for {len(trainers)} training task(s) needs {needed} GPU(s), but this "
            f"machine has {available} (torch.cuda.device_count()). Ask for fewer workers or GPUs per worker, or 0 to "
            "train on the CPU.")
    return {t: ",".join(str(k * gpus_per_worker + i) for i in range(gpus_per_worker)) for k, t in enumerate(trainers)}


def gpu_count() -> int:
    """The GPUs PyTorch sees on this machine (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
