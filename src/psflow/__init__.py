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
