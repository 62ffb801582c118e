"""psflow.identity.TaskIdentity: a task's place in the job, from its id, the cluster and the data shard count."""

from __future__ import annotations

import dataclasses

import pytest

from psflow.cluster import ClusterSpec, TaskId
from psflow.errors import ConfigError
from psflow.identity import TaskIdentity

WITH_CHIEF = ClusterSpec.from_dict({"chief": ["h:1"], "ps": ["h:2", "h:3"], "worker": ["h:4", "h:5"], "evaluator": ["h:6"]})
WORKERS_ONLY = ClusterSpec.from_dict({"ps": ["h:1"], "worker": ["h:2", "h:3", "h:4"]})


def test_the_chief_is_chief_0_or_worker_0_without_a_chief_job_and_replicas_count_it():
    chief, worker = TaskIdentity(TaskId("chief", 0), WITH_CHIEF), TaskIdentity(TaskId("worker", 0), WITH_CHIEF)
    assert (chief.is_chief, chief.replica_index, worker.is_chief, worker.replica_index) == (True, 0, False, 1)
    assert (chief.num_replicas, chief.num_ps, chief.num_workers) == (3, 2, 2)
    first = TaskIdentity(TaskId("worker", 0), WORKERS_ONLY)
    assert (first.is_chief, first.replica_index, first.num_replicas) == (True, 0, 3)


def test_roles_follow_the_job():
    ps = TaskIdentity(TaskId("ps", 1), WITH_CHIEF)
    assert (ps.job, ps.index, ps.is_ps, ps.is_worker, ps.is_evaluator, ps.is_chief) == ("ps", 1, True, False, False, False)
    ev = TaskIdentity(TaskId("evaluator", 0), WITH_CHIEF)
    assert (ev.is_evaluator, ev.is_worker) == (True, False)
    assert TaskIdentity(TaskId("chief", 0), WITH_CHIEF).is_worker
    for task in (ps, ev):
        with pytest.raises(ConfigError, match=r"is not a training replica; only chief and worker tasks train"):
            task.replica_index  # noqa: B018


def test_a_worker_added_past_the_launch_reads_an_existing_shard_again():
    scaled = ClusterSpec.from_dict({"ps": ["h:1"], "worker": ["h:2", "h:3", "h:4", "h:5", "h:6"]})
    shards = [(w.shard_index, w.num_shards) for w in (TaskIdentity(TaskId("worker", i), scaled, data_shards=3) for i in range(5))]
    assert shards == [(0, 3), (1, 3), (2, 3), (0, 3), (1, 3)]
    assert TaskIdentity(TaskId("worker", 4), scaled).num_shards == 5  # without PSFLOW_DATA_SHARDS: the replicas


def test_an_identity_is_a_frozen_value():
    me = TaskIdentity(TaskId("worker", 1), WORKERS_ONLY)
    assert me == TaskIdentity(TaskId("worker", 1), ClusterSpec.from_dict(WORKERS_ONLY.to_dict()))
    with pytest.raises(dataclasses.FrozenInstanceError):
        me.task_id = TaskId("worker", 0)  # type: ignore[misc]
