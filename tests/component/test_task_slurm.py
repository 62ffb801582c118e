"""``psflow.init`` inside a Slurm step: the cluster comes from Slurm's environment when nothing else gives one.

Each test runs ``init`` in this process with an explicit ``env`` as srun would set it, on loopback
ports from a free base (``PSFLOW_BASE_PORT``); the tasks' servers really bind them. Slurm's tasks
listen on fixed ports (base + SLURM_PROCID), so here, unlike under the launcher, a port is picked
free first and bound after.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from psflow.cluster import ClusterSpec, TaskId
from psflow.errors import ConfigError
from psflow.task import Task, init

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:Running without a job secret")]


def free_base(n: int) -> int:
    """A base port whose next ``n`` ports were free a moment ago (held together, then released)."""
    for _ in range(50):
        held: list[socket.socket] = []
        try:
            first = socket.socket()
            first.bind(("127.0.0.1", 0))
            held.append(first)
            base = first.getsockname()[1]
            if base + n > 65535:
                continue
            for port in range(base + 1, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {n} consecutive free loopback ports")


def slurm_env(procid: int, ntasks: int, base: int, **extra: str) -> dict[str, str]:
    return {"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks), "SLURM_STEP_NODELIST": "127.0.0.1",
            "SLURM_STEP_TASKS_PER_NODE": str(ntasks), "PSFLOW_BASE_PORT": str(base), **extra}


@pytest.fixture
def started() -> Iterator[list[Task]]:
    tasks: list[Task] = []
    yield tasks
    for t in tasks:
        t.finish()


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


def test_each_task_of_a_slurm_step_learns_the_cluster_and_binds_base_port_plus_its_procid(started: list[Task]) -> None:
    base = free_base(3)
    expected = ClusterSpec.from_dict({"ps": [f"127.0.0.1:{base}"], "worker": [f"127.0.0.1:{base + 1}", f"127.0.0.1:{base + 2}"]})
    for procid, task_id in ((0, TaskId("ps", 0)), (2, TaskId("worker", 1))):
        task = init([], env=slurm_env(procid, 3, base))
        started.append(task)
        assert task.task_id == task_id and task.cluster == expected
        assert task.server.address == f"127.0.0.1:{base + procid}" and listening(base + procid)
    assert not started[1].is_chief and started[0].is_ps


def test_psflow_num_ps_sets_how_many_of_the_first_tasks_are_ps(started: list[Task]) -> None:
    base = free_base(4)
    task = init([], env=slurm_env(1, 4, base, PSFLOW_NUM_PS="2"))
    started.append(task)
    assert task.task_id == TaskId("ps", 1) and task.cluster.num_tasks("ps") == 2 and task.num_workers == 2


def test_the_all_reduce_strategy_has_no_ps_by_default(started: list[Task]) -> None:
    base = free_base(2)
    task = init([], env=slurm_env(0, 2, base, PSFLOW_TRAIN_CONFIG='{"strategy": "allreduce", "mode": "sync"}'))
    started.append(task)
    assert task.task_id == TaskId("worker", 0) and task.cluster.num_tasks("ps") == 0 and task.num_workers == 2


def test_flags_and_tf_config_come_before_slurm(started: list[Task]) -> None:
    base, port = free_base(3), free_base(1)
    flagged = init([f"--worker_hosts=127.0.0.1:{port}", "--job_name=worker", "--task_index=0"],
                   env=slurm_env(0, 3, base, PSFLOW_TRAIN_CONFIG='{"strategy": "allreduce", "mode": "sync"}'))
    started.append(flagged)
    assert flagged.cluster.to_dict() == {"worker": [f"127.0.0.1:{port}"]}
    ps_port = free_base(1)
    tf_config = f'{{"cluster": {{"ps": ["127.0.0.1:{ps_port}"], "worker": ["127.0.0.1:{base}"]}}, "task": {{"type": "ps", "index": 0}}}}'
    from_tf = init([], env=slurm_env(1, 3, base, TF_CONFIG=tf_config))
    started.append(from_tf)
    assert from_tf.task_id == TaskId("ps", 0) and from_tf.server.address == f"127.0.0.1:{ps_port}"


def test_an_incomplete_slurm_environment_names_what_is_missing() -> None:
    with pytest.raises(ConfigError, match=r"Slurm environment is incomplete: missing SLURM_STEP_NODELIST or SLURM_JOB_NODELIST"):
        init([], env={"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_TASKS_PER_NODE": "3"})


def test_too_many_ps_for_the_step_names_psflow_num_ps() -> None:
    with pytest.raises(ConfigError, match=r"num_ps=3 must be in 0\.\.2 .*PSFLOW_NUM_PS"):
        init([], env=slurm_env(0, 3, 9000, PSFLOW_NUM_PS="3"))


def test_without_slurm_or_any_other_source_the_message_lists_every_way() -> None:
    with pytest.raises(ConfigError, match=r"No cluster given.*TF_CONFIG, run it as a Slurm step \(srun\), or start the script with `psflow run`"):
        init([], env={})
