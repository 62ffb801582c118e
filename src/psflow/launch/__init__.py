"""Launching runs: a plan (pure data) carried out by a runner, under a controller's rules, on a backend
(local processes, Slurm, ssh, Kubernetes).

What a task shares with the launcher (its environment, :mod:`psflow.taskenv`; its error report,
:mod:`psflow.errorreport`; the logdir's lock, :mod:`psflow.logdirlock`) lies outside this package,
below it: the task side imports nothing from here. This package loads its backends lazily, so that
the CLI starts without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from psflow.launch.backend import Backend, RunResult
    from psflow.launch.controller import RunController
    from psflow.launch.local import LocalBackend
    from psflow.launch.plan import LaunchPlan, TaskPlan, make_plan
    from psflow.launch.restart import RestartPolicy
    from psflow.launch.runner import Runner

_EXPORTS = {
    "Backend": "psflow.launch.backend",
    "RunResult": "psflow.launch.backend",
    "LocalBackend": "psflow.launch.local",
    "LaunchPlan": "psflow.launch.plan",
    "TaskPlan": "psflow.launch.plan",
    "make_plan": "psflow.launch.plan",
    "RestartPolicy": "psflow.launch.restart",
    "RunController": "psflow.launch.controller",
    "Runner": "psflow.launch.runner",
}

__all__ = ["Backend", "LaunchPlan", "LocalBackend", "RestartPolicy", "RunController", "RunResult", "Runner", "TaskPlan",
           "make_plan"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'psflow.launch' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups (and monkeypatch.setattr) see a plain attribute
    return value
