"""psflow.resolve.order: the cluster sources asked in the documented order, the first answer winning.

Every source is present at once and each test takes away the one that won before, so the order is
read off the answers: init's arguments, the launcher, the seeds' flags, PSFLOW_CLUSTER, TF_CONFIG, Slurm.
"""

from __future__ import annotations

import json

import pytest

from psflow.cluster import ClusterSpec, TaskId
from psflow.errors import ConfigError
from psflow.resolve.flags import parse_cluster_flags
from psflow.resolve.order import resolve_task
from psflow.taskenv import TaskEnv

GIVEN = {"ps": ["g:1"], "worker": ["g:2"]}
FLAGS = ("--ps_hosts=f:1", "--worker_hosts=f:2,f:3", "--job_name=worker", "--task_index=1")
PSFLOW = {"PSFLOW_CLUSTER": json.dumps({"ps": ["j:1"], "worker": ["j:2"]}), "PSFLOW_TASK": "ps:0"}
TF = {"TF_CONFIG": json.dumps({"cluster": {"ps": ["t:1"], "worker": ["t:2"]}, "task": {"type": "worker", "index": 0}})}
SLURM = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "s", "SLURM_STEP_TASKS_PER_NODE": "2"}
LAUNCHER = {"PSFLOW_COORDINATOR": "127.0.0.1:5000", "PSFLOW_TASK": "worker:3"}


def resolve(env: dict[str, str], argv: tuple[str, ...] = (), cluster: dict | None = None, job_name: str | None = None):
    return resolve_task(cluster=cluster, job_name=job_name, task_index=0, flags=parse_cluster_flags(list(argv)),
                        tenv=TaskEnv.parse(env), env=env, require_ps=True)


def test_each_source_wins_over_every_later_one():
    env = {**SLURM, **TF, **PSFLOW}
    assert resolve({**env, **LAUNCHER}, FLAGS, GIVEN, "ps") == (ClusterSpec.from_dict(GIVEN), TaskId("ps", 0))
    assert resolve({**env, **LAUNCHER}, FLAGS) == (None, TaskId("worker", 3))  # the coordinator sends the cluster
    spec, task = resolve(env, FLAGS)
    assert spec.hosts() == {"f"} and task == TaskId("worker", 1)
    spec, task = resolve(env)
    assert spec.hosts() == {"j"} and task == TaskId("ps", 0)
    spec, task = resolve({**SLURM, **TF})
    assert spec.hosts() == {"t"} and task == TaskId("worker", 0)
    spec, task = resolve(SLURM)
    assert spec.to_dict() == {"ps": ["s:2222"], "worker": ["s:2223"]} and task == TaskId("worker", 0)


def test_no_source_and_a_cluster_without_this_tasks_role_are_clear_errors():
    with pytest.raises(ConfigError, match=r"^No cluster given\. Pass the seeds' flags"):
        resolve({})
    with pytest.raises(ConfigError, match=r"^The cluster is known \(from PSFLOW_CLUSTER\) but not this task's role"):
        resolve({"PSFLOW_CLUSTER": PSFLOW["PSFLOW_CLUSTER"]})
    with pytest.raises(ConfigError, match=r"^The cluster is known \(from the seeds' flags\) but not this task's role"):
        resolve({}, ("--ps_hosts=f:1", "--worker_hosts=f:2"))
    with pytest.raises(ConfigError, match=r"^PSFLOW_COORDINATOR is set \('127.0.0.1:5000'\) but PSFLOW_TASK is not"):
        resolve({"PSFLOW_COORDINATOR": "127.0.0.1:5000"})
    with pytest.raises(ConfigError, match=r"^init\(cluster=\.\.\.\) needs job_name"):
        resolve({}, cluster=GIVEN)
