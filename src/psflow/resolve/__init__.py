"""Where a task learns its cluster and its own place in it: one module per source.

Each source module has a ``resolve(...)`` that returns a :class:`Resolved` (the cluster and this
task) or None when the source has nothing to say; :func:`psflow.resolve.order.resolve_task` asks
them in this order and takes the first answer:

1. :mod:`~psflow.resolve.given`: ``psflow.init(cluster=..., job_name=..., task_index=...)``.
2. :mod:`~psflow.resolve.launcher`: ``PSFLOW_COORDINATOR`` with ``PSFLOW_TASK`` (``psflow run``);
   the cluster comes later, from the coordinator, once every task has registered.
3. :mod:`~psflow.resolve.flags`: the seeds' ``--ps_hosts --worker_hosts --job_name --task_index``.
4. :mod:`~psflow.resolve.clusterjson`: ``PSFLOW_CLUSTER`` (the spec as JSON) with ``PSFLOW_TASK``.
5. :mod:`~psflow.resolve.tfconfig`: ``TF_CONFIG`` (Kubeflow's TFJob).
6. :mod:`~psflow.resolve.slurm`: a Slurm step's environment (``srun``).

Pure: the sources read the values handed in (argv, the environment as a mapping), never the process.
"""

from __future__ import annotations

from dataclasses import dataclass

from psflow.cluster import ClusterSpec, TaskId


@dataclass(frozen=True)
class Resolved:
    """One source's answer: the cluster (None for a launched task: its coordinator sends it), this
    task (None when the source gives a cluster but not which task this process is), and the source
    in words, for messages (``"TF_CONFIG"``)."""

    cluster: ClusterSpec | None
    task: TaskId | None
    source: str
