"""psflow: distributed training for PyTorch, the way TensorFlow's distributed runtime did it.

A cluster of tasks in jobs (chief, ps, worker); parameter servers hold the model in shards and
apply the optimizer; workers train ordinary PyTorch models; a launcher starts it all.

Example:
    >>> import psflow as pf
    >>> task = pf.init()                 # cluster + role from flags / TF_CONFIG / `psflow run`
    >>> if task.is_ps:
    ...     task.join()
    ... else:
    ...     trainer = pf.Trainer(model, pf.optim.SGD(lr=0.01), task)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# What ``psflow.X`` names -> the module that defines it. Imported on first use (PEP 562), so that
# ``import psflow.cli`` and the launcher start without torch (about 2 s saved per ``psflow`` command).
_EXPORTS: dict[str, str] = {
    "AllReduceTrainer": "psflow.train.allreduce",
    "AuthError": "psflow.errors",
    "CheckpointError": "psflow.errors",
    "ClusterError": "psflow.errors",
    "ClusterSpec": "psflow.cluster",
    "ConfigError": "psflow.errors",
    "DataError": "psflow.errors",
    "PsflowError": "psflow.errors",
    "RemoteError": "psflow.errors",
    "Server": "psflow.server",
    "Supervisor": "psflow.supervisor",
    "Task": "psflow.task",
    "TaskFailedError": "psflow.errors",
    "TaskId": "psflow.cluster",
    "Towers": "psflow.train.towers",
    "TrainConfig": "psflow.config",
    "Trainer": "psflow.train.trainer",
    "TrainingError": "psflow.errors",
    "TransportError": "psflow.errors",
    "current_task": "psflow.task",
    "format_device_placement": "psflow.devices",
    "init": "psflow.task",
    "resolve_device": "psflow.devices",
}
_SUBMODULES = ("data", "optim")

if TYPE_CHECKING:
    from psflow import data, optim
    from psflow.cluster import ClusterSpec, TaskId
    from psflow.config import TrainConfig
    from psflow.devices import format_device_placement, resolve_device
    from psflow.errors import (
        AuthError,
        CheckpointError,
        ClusterError,
        ConfigError,
        DataError,
        PsflowError,
        RemoteError,
        TaskFailedError,
        TrainingError,
        TransportError,
    )
    from psflow.server import Server
    from psflow.supervisor import Supervisor
    from psflow.task import Task, current_task, init
    from psflow.train.allreduce import AllReduceTrainer
    from psflow.train.towers import Towers
    from psflow.train.trainer import Trainer


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value: Any = importlib.import_module(f"psflow.{name}")
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'psflow' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

__all__ = [
    "AllReduceTrainer",
    "AuthError",
    "CheckpointError",
    "ClusterError",
    "ClusterSpec",
    "ConfigError",
    "DataError",
    "PsflowError",
    "RemoteError",
    "Server",
    "Supervisor",
    "Task",
    "TaskFailedError",
    "TaskId",
    "Towers",
    "TrainConfig",
    "Trainer",
    "TrainingError",
    "TransportError",
    "current_task",
    "data",
    "format_device_placement",
    "init",
    "optim",
    "resolve_device",
]
