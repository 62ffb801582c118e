"""A cluster in psflow's own variables: ``PSFLOW_CLUSTER`` (the spec as JSON) with ``PSFLOW_TASK``."""

from __future__ import annotations

from psflow.cluster import ClusterSpec, TaskId
from psflow.resolve import Resolved


def resolve(cluster_json: str | None, task: TaskId | None, *, require_ps: bool) -> Resolved | None:
    """The spec ``PSFLOW_CLUSTER`` holds and the task ``PSFLOW_TASK`` names; None without a spec.

    Raises:
        ConfigError: malformed JSON or an invalid spec.
    """
    if not cluster_json:
        return None
    return Resolved(ClusterSpec.from_json(cluster_json, require_ps=require_ps), task, "PSFLOW_CLUSTER")
