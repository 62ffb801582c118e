"""TensorBoard event files of one task: scalars and histograms (the third seed's summaries).

Owns the layout ``LOGDIR/summaries/<task>/events.out.tfevents.*`` with ``<task>`` the task id with
``:`` replaced by ``-`` (``worker-1``, ``evaluator-0``). Each task writes only its own directory,
so no two processes ever append to one file, and TensorBoard shows one run per task.

Tags written by psflow:

- progress (every task that trains and has a logdir, with or without a Supervisor; from the
  trainer's progress reports, about once a second): ``progress/loss`` (the last step's),
  ``progress/examples_per_sec`` (this task's examples over the wall-clock time from its first step
  to its last), ``progress/step_examples_per_sec`` (over the time inside its steps),
  ``progress/global_step``;
- training under a Supervisor: ``loss`` (averaged over the interval), ``examples_per_sec``,
  ``global_steps_per_sec``, ``learning_rate``; histograms ``parameters/<name>`` and
  ``gradients/<name>`` (the seed's ``var.op.name`` and ``gradients_on_average/...``);
- evaluation (the evaluator task): ``eval/<metric>``;
- the script's own: ``task.scalar(name, value, step)``.

Called by :mod:`psflow.supervisor`, :mod:`psflow.evaluator` and :meth:`psflow.task.Task.scalar`
(the task's writer, which the trainer's progress reports use). TensorBoard's writer is imported
when a writer is created, so ``import psflow`` stays cheap.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from psflow.errors import ConfigError
from psflow.rundir import RunDir


def summary_dir(logdir: str | os.PathLike[str], task: object) -> Path:
    """The event-file directory of ``task`` (a TaskId or ``"worker:1"``) under ``logdir``."""
    return RunDir(logdir).summaries_of(task)


class EventWriter:
    """Scalars and histograms for one task, written as TensorBoard event files.

    Args:
        logdir: the run's log directory.
        task: the task id the directory is named after.
        flush_secs: how often pending events reach the disk (``close()`` always flushes).

    Example:
        >>> w = EventWriter("runs/mnist", "worker:0")
        >>> w.scalars(100, {"loss": 0.31, "examples_per_sec": 15292.3})
        >>> w.close()
    """

    def __init__(self, logdir: str | os.PathLike[str], task: object, *, flush_secs: float = 10.0) -> None:
        if not (isinstance(flush_secs, (int, float)) and flush_secs > 0):
            raise ConfigError(f"flush_secs must be a positive number of seconds; received {flush_secs!r}.")
        from torch.utils.tensorboard import SummaryWriter

        self.path = summary_dir(logdir, task)
        self._writer: Any = SummaryWriter(log_dir=str(self.path), flush_secs=int(max(1, flush_secs)))
        self._closed = False

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Write each ``tag -> value`` at ``step``; non-finite values are written as they are."""
        for tag, value in values.items():
            self._writer.add_scalar(tag, float(value), global_step=int(step))

    def histograms(self, step: int, tensors: Mapping[str, torch.Tensor], *, prefix: str = "") -> None:
        """Write a histogram of each tensor at ``step``, tagged ``prefix + name``.

        A tensor with a NaN or infinity is skipped (TensorBoard cannot bin it); the loss scalar and
        the NaN guard report such values instead.
        """
        for name, t in tensors.items():
            values = t.detach().to("cpu", torch.float32).reshape(-1)
            if values.numel() == 0 or not bool(torch.isfinite(values).all()):
                continue
            self._writer.add_histogram(prefix + name, values.numpy(), global_step=int(step))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._writer.close()
