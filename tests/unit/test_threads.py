"""A task's torch threads (psflow.threads): the host's cores shared among the job's tasks on it, the
same rule for the launcher and for ``psflow.init()`` by hand, and the user's own setting wins."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from psflow import threads
from psflow.cluster import ClusterSpec, TaskId
from psflow.threads import ThreadChoice, apply_threads, choose_threads, host_cores, tasks_on_host, threads_per_task

WORKER_0 = TaskId("worker", 0)
SPEC = ClusterSpec.from_dict({"ps": ["localhost:2222"], "worker": ["127.0.0.1:2223", "[::1]:2224", "Node-B:2225", "node-b.:2226"],
                              "evaluator": ["10.0.0.3:2227"]})


@pytest.fixture(autouse=True)
def nothing_written(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "_written", {})


def choose(env: dict[str, str] | None = None, task: TaskId = WORKER_0, *, cluster: ClusterSpec | None = SPEC,
           num_threads: int | None = None, launched: bool = False, cores: int = 8,
           cpu_limit: int | None = None) -> ThreadChoice:
    return choose_threads(env or {}, task, cluster=cluster, num_threads=num_threads, launched=launched, cores=cores,
                          cpu_limit=cpu_limit)


def test_every_loopback_name_is_this_host_and_other_hosts_count_by_their_canonical_name() -> None:
    assert [tasks_on_host(SPEC, t) for t in SPEC.tasks()] == [3, 3, 3, 2, 2, 1]


def test_by_hand_a_task_gets_the_hosts_cores_shared_among_the_jobs_tasks_on_it_at_least_one() -> None:
    c = choose()
    assert c.threads == threads_per_task(3, 8) == 2
    assert c.reason == "8 cores / 3 tasks on this host; set OMP_NUM_THREADS or PSFLOW_NUM_THREADS to change it"
    assert c.describe("worker:0") == f"worker:0: 2 torch threads ({c.reason})"
    assert choose(cores=2).threads == 1 and choose(cores=1).describe("ps:0").startswith("ps:0: 1 torch thread (1 core / 3 tasks")
    assert choose(task=TaskId("evaluator", 0)).threads == 8


def test_the_users_setting_and_the_launchers_win() -> None:
    assert choose({"OMP_NUM_THREADS": "3"}) == ThreadChoice(None, "OMP_NUM_THREADS=3, yours")
    assert choose({"OMP_NUM_THREADS": "3"}, num_threads=5) == ThreadChoice(5, "PSFLOW_NUM_THREADS")
    launched = choose({"OMP_NUM_THREADS": "4"}, cluster=None, num_threads=4, launched=True)
    assert launched.threads is None and launched.describe("worker:1") == "worker:1: torch threads as set (the launcher's share: 4)"


def test_a_slurm_task_takes_its_own_cpus_as_its_share() -> None:
    slurm = {"SLURM_PROCID": "1", "SLURM_CPUS_PER_TASK": "4"}
    assert choose(slurm) == ThreadChoice(4, "SLURM_CPUS_PER_TASK, the task's own CPUs")
    assert choose({**slurm, "OMP_NUM_THREADS": "1"}).threads is None
    assert choose({"SLURM_PROCID": "1"}).threads == 2  # no --cpus-per-task, no SLURM_CPUS_ON_NODE: the host's share


def test_a_slurm_task_without_cpus_per_task_shares_the_jobs_cpus_on_its_node() -> None:
    # 3 of SPEC's tasks on this host, 6 of the node's CPUs for the job, 64 cores in the affinity: 2 each.
    on_node = {"SLURM_PROCID": "1", "SLURM_CPUS_ON_NODE": "6"}
    c = choose(on_node, cores=64)
    assert c.threads == 2 and c.reason.startswith("6 CPUs of the job on this node (SLURM_CPUS_ON_NODE) / 3 tasks on it")
    assert choose(on_node, cores=1).threads == 1  # srun bound the task to one CPU: that caps it
    assert choose({**on_node, "SLURM_CPUS_ON_NODE": "2"}, cores=64).threads == 1  # fewer CPUs than tasks: one each
    assert choose({**on_node, "SLURM_CPUS_PER_TASK": "4"}, cores=64).threads == 4  # the task's own CPUs first
    assert choose({"SLURM_CPUS_ON_NODE": "6"}, cores=64).threads == 21  # not a Slurm step: the host's share


def test_a_launched_tasks_share_is_capped_by_its_containers_cpu_limit() -> None:
    capped = choose(cluster=None, num_threads=8, launched=True, cpu_limit=2)
    assert capped == ThreadChoice(2, "the launcher's share 8, capped to this container's CPU limit (2)")
    assert choose(cluster=None, num_threads=2, launched=True, cpu_limit=4).threads is None
    assert choose(cluster=None, num_threads=8, launched=True).threads is None  # no limit


def test_host_cores_are_capped_by_the_container_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    affinity = host_cores_unlimited(monkeypatch)
    monkeypatch.setattr(threads, "container_cpus", lambda: 1)
    assert host_cores() == 1
    monkeypatch.setattr(threads, "container_cpus", lambda: affinity + 5)
    assert host_cores() == affinity


def host_cores_unlimited(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(threads, "container_cpus", lambda: None)
    return host_cores()


def test_apply_sets_torch_and_the_environment_where_the_user_set_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
    calls: list[int] = []
    env = {"MKL_NUM_THREADS": "6"}
    apply_threads(ThreadChoice(2, "why"), env)
    assert env == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "6"} and calls == [2]
    # A second init in this process (an in-process test cluster) does not take psflow's value for the user's.
    assert choose(env, cores=3).threads == 1
    apply_threads(ThreadChoice(1, "why"), env)
    assert env == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "6"} and calls == [2, 1]
    apply_threads(ThreadChoice(None, "yours"), env)
    assert calls == [2, 1]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("user_omp", [None, "2"])
def test_a_task_started_by_hand_sets_its_threads_and_says_so_first(tmp_path: Path, user_omp: str | None) -> None:
    script = tmp_path / "train.py"
    script.write_text("import os, torch, psflow\ntask = psflow.init()\n"
                      "print(torch.get_num_threads(), os.environ['OMP_NUM_THREADS'], os.environ.get('MKL_NUM_THREADS', '-'))\n")
    ps, w0, w1 = _free_ports(3)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSFLOW_", "TF_CONFIG", "OMP_", "MKL_", "SLURM_"))}
    env.update({"OMP_NUM_THREADS": user_omp} if user_omp else {})
    r = subprocess.run([sys.executable, "-W", "ignore", str(script), f"--ps_hosts=localhost:{ps}",
                        f"--worker_hosts=localhost:{w0},127.0.0.1:{w1}", "--job_name=worker", "--task_index=1"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    first = r.stderr.splitlines()[0]
    if user_omp:
        assert first == "psflow: worker:1: torch threads as set (OMP_NUM_THREADS=2, yours)", r.stderr
        assert r.stdout.split() == ["2", "2", "-"]
    else:
        n = max(1, host_cores() // 3)
        s = "s" * (host_cores() != 1)
        assert first.startswith(f"psflow: worker:1: {n} torch thread{'s' * (n != 1)} ({host_cores()} core{s} / 3 tasks"), r.stderr
        assert r.stdout.split() == [str(n)] * 3
