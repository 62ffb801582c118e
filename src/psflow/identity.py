"""Who a task is in its job: one value, computed once when the task starts and never changed.

:class:`TaskIdentity` holds this task's id, the cluster and the job's data shard count, and answers
every question about the task's place that follows from them (its job and index, whether it is the
chief, its training replica and its data shard). ``psflow.task`` builds it once the cluster is
known (a launched task: after it registered with the launcher's coordinator) and the Task, and
through it the Supervisor and the trainers, read it. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from psflow.cluster import ClusterSpec, TaskId
from psflow.errors import ConfigError


@dataclass(frozen=True)
class TaskIdentity:
    """This task's place in the job.

    Example:
        >>> c = ClusterSpec.from_dict({"chief": ["h:1"], "ps": ["h:2"], "worker": ["h:3", "h:4"]})
        >>> me = TaskIdentity(TaskId("worker", 1), c)
        >>> me.job, me.index, me.is_chief, me.replica_index, me.num_replicas
        ('worker', 1, False, 2, 3)
    """

    task_id: TaskId
    cluster: ClusterSpec
    data_shards: int | None = None  # PSFLOW_DATA_SHARDS: the launch's replicas, for a worker psflow scale added

    @property
    def job(self) -> str:
        return self.task_id.job

    @property
    def index(self) -> int:
        return self.task_id.index

    @property
    def is_chief(self) -> bool:
        """The cluster's chief: ``chief:0``, or ``worker:0`` without a chief job."""
        return self.cluster.is_chief(self.task_id)

    @property
    def is_ps(self) -> bool:
        return self.task_id.job == "ps"

    @property
    def is_worker(self) -> bool:
        """A training replica: a worker or the chief."""
        return self.task_id.job in ("worker", "chief")

    @property
    def is_evaluator(self) -> bool:
        return self.task_id.job == "evaluator"

    @property
    def num_ps(self) -> int:
        return self.cluster.num_tasks("ps")

    @property
    def num_workers(self) -> int:
        return self.cluster.num_tasks("worker")

    @property
    def num_replicas(self) -> int:
        """Training replicas: the chief (if the cluster has a chief job) plus every worker."""
        return self.cluster.num_tasks("chief") + self.cluster.num_tasks("worker")

    @property
    def replica_index(self) -> int:
        """This replica's rank: the chief 0, then the workers in order.

        Raises:
            ConfigError: the task is not a training replica (a ps or the evaluator).
        """
        if self.task_id.job == "chief":
            return 0
        if self.task_id.job == "worker":
            return self.cluster.num_tasks("chief") + self.task_id.index
        raise ConfigError(f"{self.task_id} is not a training replica; only chief and worker tasks train.")

    @property
    def num_shards(self) -> int:
        """The job's data shards: its training replicas at launch (fixed for the run, ``psflow scale``
        or not: see :mod:`psflow.ps.membership`)."""
        return self.data_shards or self.num_replicas

    @property
    def shard_index(self) -> int:
        """This replica's data shard: its index modulo :attr:`num_shards` (a worker added past the
        launch's replicas reads the shard of replica ``index mod num_shards`` again)."""
        return self.replica_index % self.num_shards
