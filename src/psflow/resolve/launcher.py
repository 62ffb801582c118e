"""A task ``psflow run`` started: ``PSFLOW_COORDINATOR`` and ``PSFLOW_TASK`` say who it is.

The cluster is not known yet: the task binds port 0, registers the address it got with the
coordinator and receives the whole cluster once every task has registered (``psflow.task``).
"""

from __future__ import annotations

from psflow.cluster import TaskId
from psflow.errors import ConfigError
from psflow.resolve import Resolved


def resolve(coordinator: str | None, task: TaskId | None) -> Resolved | None:
    """This task (the cluster left None), or None when there is no coordinator.

    Raises:
        ConfigError: a coordinator without ``PSFLOW_TASK``.
    """
    if not coordinator:
        return None
    if task is None:
        raise ConfigError(f"PSFLOW_COORDINATOR is set ({coordinator!r}) but PSFLOW_TASK is not: the launcher sets "
                          "both. Start the script with `psflow run`, or unset PSFLOW_COORDINATOR to start a task by hand.")
    return Resolved(None, task, "the launcher")
