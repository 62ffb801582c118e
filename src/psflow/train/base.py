"""What every trainer shares, whatever carries its gradients (parameter servers or all-reduce).

``TrainerBase._setup`` resolves the task and the training settings, checks the optimizer spec,
builds the towers for multi-device replicas and zeroes the counters; ``Trainer`` (ps) and
``AllReduceTrainer`` add their own transport on top.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from psflow.config import TrainConfig
from psflow.errors import ConfigError
from psflow.fault import parse_faults
from psflow.optim import OptimizerSpec, Schedule
from psflow.train.towers import Towers

PROGRESS_EVERY_S = 1.0  # how often a trainer sends its counters to the launcher's live status


class TrainerBase:
    config: TrainConfig

    def _setup(
        self,
        model: torch.nn.Module,
        optimizer: OptimizerSpec,
        task: Any,
        *,
        schedule: Schedule | None,
        ema_decay: float | None,
        devices: Sequence[str | torch.device] | None,
        settings: Mapping[str, Any],
        why_spec: str,
    ) -> None:
        if task is None:
            from psflow.task import current_task

            task = current_task()
        if not isinstance(optimizer, OptimizerSpec):
            raise ConfigError(
                f"optimizer must be a psflow optimizer spec such as pf.optim.SGD(lr=0.01); received "
                f"{type(optimizer).__name__}. {why_spec}"
            )
        try:
            self.config = replace(task.config, **settings).resolved(task.num_replicas)
        except TypeError as e:
            raise ConfigError(f"Unknown Trainer setting in {sorted(settings)}: {e}. See psflow.TrainConfig for the fields.") from e
        self.model = model
        self.task = task
        self.optimizer = optimizer
        self.schedule = schedule
        self.ema_decay = ema_decay
        self.worker = task.replica_index
        self.towers = Towers(model, devices) if devices else None
        self.params = dict(model.named_parameters())
        self.global_step = 0
        self.local_step = 0
        self.examples = 0
        self.train_time_s = 0.0
        self.compute_s = 0.0
        self._progress_at: float | None = None
        self._restore: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self._ready = False
        self._closed = False
        self._faults = parse_faults(getattr(task, "fail_at", None))
        if getattr(task, "logdir", None):
            # The progress scalars' writer imports tensorboard (~0.4 s): do it while the cluster gets ready.
            threading.Thread(target=importlib.import_module, args=("torch.utils.tensorboard",), daemon=True).start()

    def _report_progress(self, loss: float) -> None:
        """After a step, at most every PROGRESS_EVERY_S: the counters and the loss, to the launcher."""
        now = time.monotonic()
        if self._progress_at is not None and now - self._progress_at < PROGRESS_EVERY_S:
            return
        self._progress_at = now
        scalar = getattr(self.task, "scalar", None)  # TensorBoard, with or without a Supervisor
        if scalar is not None and getattr(self.task, "logdir", None):
            per_task_rate = self.examples / self.train_time_s if self.train_time_s else 0.0
            for name, value in (("loss", loss), ("examples_per_sec", per_task_rate), ("global_step", self.global_step)):
                scalar(f"progress/{name}", float(value), self.global_step)
        send = getattr(self.task, "report_progress", None)  # tasks without a launcher: a no-op there
        if send is not None:
            # train_time_s travels too: the job's rate is computed from it (psflow.launch.metrics.job_rate)
            send(global_step=self.global_step, local_step=self.local_step, examples=self.examples,
                 train_time_s=round(self.train_time_s, 4),
                 examples_per_sec=round(self.examples / self.train_time_s, 1) if self.train_time_s else 0.0,
                 loss=float(loss))
