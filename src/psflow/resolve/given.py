"""The cluster given to ``psflow.init(cluster=..., job_name=..., task_index=...)``: it overrides every other source."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from psflow.cluster import ClusterSpec, TaskId
from psflow.errors import ConfigError
from psflow.resolve import Resolved


def resolve(cluster: ClusterSpec | Mapping[str, Sequence[str] | str] | None, job_name: str | None, task_index: int,
            *, require_ps: bool) -> Resolved | None:
    """The spec given (a ClusterSpec, or a mapping read by :meth:`ClusterSpec.from_dict`) and the task
    ``job_name:task_index``; None when no cluster is given.

    Raises:
        ConfigError: an invalid spec, or a cluster without ``job_name``.
    """
    if cluster is None:
        return None
    spec = cluster if isinstance(cluster, ClusterSpec) else ClusterSpec.from_dict(cluster, require_ps=require_ps)
    if job_name is None:
        raise ConfigError("init(cluster=...) needs job_name (and task_index) to know which task this process is.")
    return Resolved(spec, TaskId(job_name, task_index), "init(cluster=...)")
