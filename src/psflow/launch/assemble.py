"""One way to put a run together: the backend asked for, and the runner that drives it.

``psflow run`` (:mod:`psflow.cli.run`), the launcher the HTTP API starts
(:mod:`psflow.platform.launching`) and ``psflow chaos`` (:mod:`psflow.chaos.harness`) each make a
plan their own way, then call :func:`assemble_run`: the backend of :class:`BackendOptions`
(local processes, steps of a Slurm job, ssh sessions, Kubernetes pods), checked as ``psflow run``
checks its options, and the :class:`~psflow.launch.runner.Runner` that carries the plan out on it.
The run store is handed in (``store``: the platform's records the run in the job store too); this
module imports nothing from the platform.

Example:
    >>> run = assemble_run(plan, BackendOptions(name="local", preload=False))
    >>> run.runner.run(run.plan).exit_code
    0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from psflow.errors import ConfigError
from psflow.launch.backend import Backend
from psflow.launch.plan import LaunchPlan
from psflow.launch.restart import JOBS, RestartPolicy
from psflow.launch.runner import Runner
from psflow.launch.runstore import RunStore
from psflow.launch.watchdog import HangPolicy

BACKEND_NAMES = ("local", "slurm", "k8s")  # and ssh, chosen by hosts
StoreFactory = Callable[[LaunchPlan], RunStore]


@dataclass(frozen=True)
class BackendOptions:
    """Where a run's tasks go, as ``psflow run``'s options say it.

    Args:
        name: ``local``, ``slurm`` or ``k8s`` (``--backend``).
        hosts: ``HOST:SLOTS,...``: the tasks over ssh on these hosts (``--hosts``; ``name`` stays local).
        ssh_config: an ssh configuration file for ``hosts``.
        nodes: Slurm nodes to allocate.
        coordinator_host: the address the nodes (Slurm) or hosts (ssh) reach the launcher at.
        preload: local: fork the tasks from a process that imported torch once.
        live: the live table of the tasks (None: when printing to a terminal).
        dry_run: only the batch script or manifests are wanted (Slurm, Kubernetes).
        k8s: Kubernetes settings (:class:`psflow.launch.k8s.K8sSettings`' fields: ``image``, ``volume_claim``, ...).
        sbatch_args: Slurm: more ``#SBATCH`` options (``--sbatch-arg``; :func:`psflow.launch.slurm.check_sbatch_args`).
        echo: where the backend's console lines go (None: stdout).
    """

    name: str = "local"
    hosts: str | None = None
    ssh_config: str | None = None
    nodes: int | None = None
    coordinator_host: str | None = None
    preload: bool = True
    live: bool | None = None
    dry_run: bool = False
    k8s: Mapping[str, Any] = field(default_factory=dict)
    echo: Callable[[str], None] | None = None
    sbatch_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class AssembledRun:
    """A plan, the backend it runs on and the runner that drives that backend: ``runner.run(plan)``."""

    plan: LaunchPlan
    backend: Backend
    runner: Runner


def assemble_run(plan: LaunchPlan, options: BackendOptions, *, store: Callable[[Backend], StoreFactory] | None = None,
                 register_timeout_s: float = 120.0) -> AssembledRun:
    """The backend of ``options`` and the runner of ``plan`` on it; ``plan`` as it runs there (Kubernetes: no
    watchdog, its pods send no heartbeats; a restart backoff given is said to be Kubernetes' instead).

    Args:
        store: makes the run-store factory for the backend (the platform's ``recording``); None: the
            run's files only.
        register_timeout_s: how long the tasks have to meet at the rendezvous.

    Raises:
        ConfigError: options that do not go together (see :func:`make_backend`).
    """
    backend = make_backend(options)
    if options.name == "k8s" and plan.hangs.enabled:
        # Pods report to no coordinator (the launcher may be outside the cluster): no heartbeat to watch.
        backend.console.warn("--hang-timeout is not applied on Kubernetes: the pods send the launcher no heartbeats.")
        plan = dataclasses.replace(plan, hangs=HangPolicy())
    backoff = backend.restart_backoff(plan.restart)
    if backoff.by is not None and plan.restart.backoff != RestartPolicy().backoff and \
            any(plan.restart.restarts(job) for job in JOBS):
        backend.console.warn(f"--restart-backoff and --restart-backoff-max are not applied on --backend {options.name}: {backoff.by} "
                             f"starts a failed task again after its own backoff ({backoff.base_s:g} s doubling to "
                             f"{backoff.max_s:g} s); the restart budgets still apply.")
    runner = Runner(backend, register_timeout_s=register_timeout_s, store=store(backend) if store else None)
    return AssembledRun(plan, backend, runner)


def make_backend(options: BackendOptions) -> Backend:
    """The backend ``options`` ask for (a LocalBackend, SlurmBackend, SshBackend or K8sBackend).

    Raises:
        ConfigError: --hosts with another backend or --dry-run, --ssh-config without --hosts, a Slurm
            option (--nodes, --dry-run, --sbatch-arg) for another backend, a bad --sbatch-arg, a Kubernetes option for another backend,
            --coordinator-host where nothing listens off this host, a bad --hosts or Kubernetes setting.
    """
    o = options
    if o.name not in BACKEND_NAMES:
        raise ConfigError(f"Backend {o.name!r} is not one of {', '.join(BACKEND_NAMES)}.")
    if o.sbatch_args and (o.name != "slurm" or o.hosts is not None):
        raise ConfigError(f"--sbatch-arg is for --backend slurm; this run is {'ssh (--hosts)' if o.hosts else o.name}.")
    if o.hosts is not None or o.ssh_config is not None:
        return _ssh_backend(o)
    if o.coordinator_host is not None and o.name != "slurm":
        raise ConfigError(f"--coordinator-host is for --backend slurm and --hosts; this run is {o.name}.")
    if o.name == "k8s":
        from psflow.launch.k8swatch import K8sBackend

        return K8sBackend(k8s_settings(**o.k8s), echo=o.echo)
    if any(v for k, v in o.k8s.items() if k not in ("namespace", "ttl_s")):
        raise ConfigError("--image, --volume-claim, --gpus-per-worker, --env-secret and the other Kubernetes options "
                          "(--memory, --toleration, ...) are for --backend k8s; this run is " + o.name + ".")
    if o.name == "slurm":
        from psflow.launch.slurm import SlurmBackend

        return SlurmBackend(nodes=o.nodes or 1, live=o.live, coordinator_host=o.coordinator_host, echo=o.echo,
                            sbatch_args=o.sbatch_args)
    if o.nodes is not None or o.dry_run:
        raise ConfigError(f"{'--nodes' if o.nodes is not None else '--dry-run'} is for --backend slurm; this run is local."
                          + ("" if o.nodes is not None else " (--backend k8s --dry-run prints Kubernetes manifests.)"))
    from psflow.launch import LocalBackend

    return LocalBackend(preload=o.preload, live=o.live, echo=o.echo)


def _ssh_backend(o: BackendOptions) -> Backend:
    """The SshBackend of ``--hosts H:N,... [--ssh-config FILE]``."""
    from psflow.launch.ssh import SshBackend

    if o.hosts is None:
        raise ConfigError("--ssh-config is for --hosts (tasks started over ssh); give --hosts HOST:SLOTS,...")
    if o.name != "local" or o.dry_run:
        raise ConfigError(f"--hosts starts the tasks over ssh; it does not go with {'--dry-run' if o.dry_run else '--backend ' + o.name}.")
    return SshBackend(o.hosts, ssh_config=o.ssh_config, live=o.live, coordinator_host=o.coordinator_host, echo=o.echo)


def k8s_settings(*, image: str | None = None, volume_claim: str | None = None, **rest: Any) -> Any:
    """The Kubernetes settings of ``--image``, ``--volume-claim`` and the other k8s options.

    Raises:
        ConfigError: --image missing, or a bad value (see :class:`psflow.launch.k8s.K8sSettings`).
    """
    from psflow.launch.k8s import K8sSettings

    if not image:
        raise ConfigError("--backend k8s needs --image IMAGE: a container image with Python, psflow and the script.")
    return K8sSettings(image=image, volume_claim=volume_claim, **rest)  # no claim: checked with the plan
