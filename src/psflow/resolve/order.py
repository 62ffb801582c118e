"""The order in which a task asks the cluster sources (:mod:`psflow.resolve` lists it): the first answer wins."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from psflow.cluster import ClusterSpec, TaskId
from psflow.errors import ConfigError
from psflow.resolve import Resolved, clusterjson, given, launcher, slurm, tfconfig
from psflow.resolve import flags as seed_flags

if TYPE_CHECKING:
    from psflow.taskenv import TaskEnv

_NO_CLUSTER = ("No cluster given. Pass the seeds' flags (--ps_hosts=localhost:2222 --worker_hosts=localhost:2223 "
               "--job_name=worker --task_index=0), set TF_CONFIG, run it as a Slurm step (srun), "
               "or start the script with `psflow run`.")


def resolve_task(*, cluster: ClusterSpec | Mapping[str, Sequence[str] | str] | None, job_name: str | None,
                 task_index: int, flags: seed_flags.FlagConfig, tenv: TaskEnv, env: Mapping[str, str],
                 require_ps: bool) -> tuple[ClusterSpec | None, TaskId]:
    """The cluster (None for a launched task: its coordinator sends it) and this task, from the
    first source that has them.

    Args:
        cluster, job_name, task_index: ``psflow.init``'s arguments.
        flags: the seeds' flags found in the script's arguments.
        tenv: the task's ``PSFLOW_*`` variables; env: its whole environment (TF_CONFIG, SLURM_*).
        require_ps: whether the spec must have a ps (the parameter-server strategy).

    Raises:
        ConfigError: no source has a cluster, or the one that has does not say this task's role.
    """
    found = (given.resolve(cluster, job_name, task_index, require_ps=require_ps)
             or launcher.resolve(tenv.coordinator, tenv.task)
             or seed_flags.resolve(flags)
             or clusterjson.resolve(tenv.cluster_json, tenv.task, require_ps=require_ps)
             or tfconfig.resolve(env, require_ps=require_ps)
             or slurm.resolve(env, num_ps=tenv.num_ps, base_port=tenv.base_port, require_ps=require_ps))
    return _checked(found)


def _checked(found: Resolved | None) -> tuple[ClusterSpec | None, TaskId]:
    if found is None:
        raise ConfigError(_NO_CLUSTER)
    if found.task is None:
        raise ConfigError(f"The cluster is known (from {found.source}) but not this task's role. Pass --job_name and "
                          "--task_index (or TF_CONFIG's task, or PSFLOW_TASK with PSFLOW_CLUSTER).")
    return found.cluster, found.task
