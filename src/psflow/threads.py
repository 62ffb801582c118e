"""A task's torch threads: one rule for the tasks the launcher starts and for those started by hand.

Left at torch's default, every task starts one intra-op thread per core: three tasks on a host run
three times as many busy threads as there are cores, and OpenMP threads that spin while they wait
for each other slow every task (a by-hand MNIST run took 11x longer than with one thread each). So a
host's cores are shared out evenly among the job's tasks on it (:func:`threads_per_task`):

- ``psflow run`` (:mod:`psflow.launch.plan`) shares out the cores of the host it starts the tasks on
  and hands each task its count as ``PSFLOW_NUM_THREADS`` (its fork server or OMP_NUM_THREADS apply it).
- A task started by hand (the seeds' flags, TF_CONFIG, ``PSFLOW_CLUSTER``, ``srun``) has no launcher:
  ``psflow.init()`` asks :func:`choose_threads`, which shares this host's cores among the cluster
  spec's tasks on this host (:func:`tasks_on_host`), and :func:`apply_threads` sets torch's count
  and OMP_NUM_THREADS / MKL_NUM_THREADS for what the process starts later.

The user's own setting wins: OMP_NUM_THREADS already in the environment, ``PSFLOW_NUM_THREADS``,
and a ``torch.set_num_threads`` the script calls after ``psflow.init()``.

A host's cores are where the task runs, not where it was launched from: the process's CPU affinity,
capped by its container's CPU limit (:mod:`psflow.cpulimit`: Kubernetes' ``limits.cpu``, a cgroup
quota the affinity does not show; a launched task's share is capped by it too). Under Slurm the
task's own CPUs (``SLURM_CPUS_PER_TASK``) are its share; without them the CPUs the job holds on this
node (``SLURM_CPUS_ON_NODE``) are shared among the step's tasks on it.

Pure apart from :func:`host_cores` (reads the CPU affinity and the cgroup) and :func:`apply_threads`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from psflow.cluster import ClusterSpec, TaskId, address_key, is_loopback_host, parse_address
from psflow.cpulimit import container_cpus

# What the user sets to choose the threads themselves (psflow reads it, never overrides it).
_USER_VARIABLE = "OMP_NUM_THREADS"
# Set for what the process starts later (torch reads OMP_NUM_THREADS at import, MKL its own).
_SET_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# The values this process's psflow.init() wrote: a second init in the same process (in-process
# test clusters) must not take them for the user's.
_written: dict[str, str] = {}


@dataclass(frozen=True)
class ThreadChoice:
    """The torch threads :func:`choose_threads` decided on, and why.

    ``threads`` is None where the count is left as it is (the user's OMP_NUM_THREADS, or the
    launcher's count, which its fork server or OMP_NUM_THREADS already applied).
    """

    threads: int | None
    reason: str

    def describe(self, task: TaskId | str) -> str:
        """The task's log line about it, e.g. ``worker:0: 1 torch thread (2 cores / 3 tasks on this host; ...)``."""
        count = "torch threads as set" if self.threads is None else f"{self.threads} torch thread{'s' * (self.threads != 1)}"
        return f"{task}: {count} ({self.reason})"


def host_cores() -> int:
    """The cores this process may run on: its CPU affinity (which a cpuset, taskset or srun's binding
    narrows), capped by its container's CPU limit (:func:`psflow.cpulimit.container_cpus`)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    limit = container_cpus()
    return cores if limit is None else min(cores, limit)


def threads_per_task(num_tasks: int, cores: int) -> int:
    """Torch threads for each of ``num_tasks`` tasks sharing ``cores``: an even share, at least one.

    Every task counts, ps included (it applies the updates with torch ops).

    Example:
        >>> threads_per_task(3, 8)
        2
    """
    return max(1, cores // max(1, num_tasks))


def tasks_on_host(cluster: ClusterSpec, task: TaskId) -> int:
    """How many of ``cluster``'s tasks run on ``task``'s host (``task`` included).

    Hosts are compared by :func:`psflow.cluster.address_key` (no DNS lookup); every loopback name
    (``localhost``, 127.0.0.0/8, ``::1``) is this host.

    Example:
        >>> spec = ClusterSpec.from_dict({"ps": ["localhost:1"], "worker": ["127.0.0.1:2", "10.0.0.2:3"]})
        >>> tasks_on_host(spec, TaskId("worker", 0))
        2
    """
    def key(host: str) -> str:
        return "loopback" if is_loopback_host(host) else address_key(host)

    mine = key(parse_address(cluster.address(task), allow_port_zero=True)[0])
    return sum(1 for t in cluster.tasks() if key(parse_address(cluster.address(t), allow_port_zero=True)[0]) == mine)


def choose_threads(
    env: Mapping[str, str],
    task: TaskId,
    *,
    cluster: ClusterSpec | None,
    num_threads: int | None,
    launched: bool,
    cores: int,
    cpu_limit: int | None = None,
) -> ThreadChoice:
    """The torch threads of ``task``, in this order: the launcher's, the user's, this host's share.

    Args:
        env: the task's environment (OMP_NUM_THREADS, SLURM_CPUS_PER_TASK are read from it).
        task: this task.
        cluster: the cluster spec (None under the launcher, which knows the hosts itself).
        num_threads: ``PSFLOW_NUM_THREADS`` as :class:`psflow.taskenv.TaskEnv` parsed it.
        launched: started by ``psflow run`` (``PSFLOW_COORDINATOR`` is set).
        cores: this process's cores (:func:`host_cores`).
        cpu_limit: its container's CPU limit in whole CPUs (:func:`psflow.cpulimit.container_cpus`),
            None if none: a launched task's share above it is capped to it.

    Returns:
        A :class:`ThreadChoice`; its ``threads`` is None where nothing is to be changed.

    Example:
        >>> spec = ClusterSpec.from_dict({"ps": ["localhost:1"], "worker": ["localhost:2", "localhost:3"]})
        >>> choose_threads({}, TaskId("worker", 1), cluster=spec, num_threads=None, launched=False, cores=8).threads
        2
    """
    if launched:
        if num_threads and cpu_limit is not None and num_threads > cpu_limit:
            # The launcher shared out the cores of the host it ran on; this container may use fewer.
            return ThreadChoice(cpu_limit, f"the launcher's share {num_threads}, capped to this container's "
                                f"CPU limit ({cpu_limit})")
        return ThreadChoice(None, f"the launcher's share: {num_threads}" if num_threads else "the launcher's")
    if num_threads is not None:
        return ThreadChoice(num_threads, "PSFLOW_NUM_THREADS")
    omp = env.get(_USER_VARIABLE, "").strip()
    if omp and omp != _written.get(_USER_VARIABLE):
        return ThreadChoice(None, f"{_USER_VARIABLE}={omp}, yours")
    n = tasks_on_host(cluster, task) if cluster is not None else 1
    slurm = _slurm_threads(env, n, cores)
    if slurm is not None:
        return slurm
    return ThreadChoice(threads_per_task(n, cores), f"{cores} core{'s' * (cores != 1)} / {n} task{'s' * (n != 1)} on "
                        f"this host; set {_USER_VARIABLE} or PSFLOW_NUM_THREADS to change it")


def _positive(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def _slurm_threads(env: Mapping[str, str], n: int, cores: int) -> ThreadChoice | None:
    """A Slurm task's threads from what Slurm gave it (None outside a Slurm step, or without the variables).

    The job's CPUs on this node are its share whatever the node has; srun may also have bound each
    task to fewer (its affinity, ``cores``), which then caps the share.
    """
    if not env.get("SLURM_PROCID", "").strip():
        return None
    per_task = _positive(env, "SLURM_CPUS_PER_TASK")
    if per_task is not None:
        # srun binds each task to its own CPUs: they are its share already.
        return ThreadChoice(per_task, "SLURM_CPUS_PER_TASK, the task's own CPUs")
    on_node = _positive(env, "SLURM_CPUS_ON_NODE")
    if on_node is None:
        return None
    threads = max(1, min(cores, on_node // n))
    return ThreadChoice(threads, f"{on_node} CPUs of the job on this node (SLURM_CPUS_ON_NODE) / {n} "
                        f"task{'s' * (n != 1)} on it; set {_USER_VARIABLE} or PSFLOW_NUM_THREADS to change it")


def apply_threads(choice: ThreadChoice, environ: MutableMapping[str, str] | None = None) -> None:
    """Set torch's intra-op threads to ``choice.threads`` (if torch is imported; if not, it reads
    OMP_NUM_THREADS when it is) and OMP_NUM_THREADS / MKL_NUM_THREADS where the user set none.
    Does nothing when ``choice.threads`` is None."""
    if choice.threads is None:
        return
    environ = os.environ if environ is None else environ
    for name in _SET_VARIABLES:
        if environ.get(name, "").strip() in ("", _written.get(name)):
            environ[name] = _written[name] = str(choice.threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(choice.threads)
