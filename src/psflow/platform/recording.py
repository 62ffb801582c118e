"""How the platform records a launched run: the run store its launcher hands to the Runner.

A run started by ``psflow run``, ``psflow restart``, the dashboard or ``psflow chaos`` is recorded in
its log dir's files (:func:`psflow.launch.runstore.file_store`), in the job store
(``$PSFLOW_HOME/jobs.db``, :mod:`psflow.platform.sqlrunstore`) and told to its alerts
(:mod:`psflow.platform.runalerts`: ``PSFLOW_ALERT_WEBHOOK``, else the dashboard's webhook), all
through one :class:`~psflow.launch.runstore.CompositeRunStore`.

launch/ never imports the platform (its layers point one way): whoever starts a run passes
:func:`recording`'s factory as ``store`` (``assemble_run(plan, options, store=recording)``, ``Runner(store=...)``);
a run started without one keeps its files only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from psflow.launch.plan import LaunchPlan
from psflow.launch.restart import RestartPolicy
from psflow.launch.runstore import CompositeRunStore, RunStore, file_store
from psflow.platform.runalerts import run_alerts
from psflow.platform.sqlrunstore import SqliteRunStore, run_record


def backend_name(backend: Any) -> str:
    """The job store's name of a backend: ``LocalBackend`` -> ``local``, ``K8sBackend`` -> ``k8s``."""
    return type(backend).__name__.removesuffix("Backend").lower()


def recorded_store(plan: LaunchPlan, *, backend: str, warn: Callable[[str], None], policy: RestartPolicy | None = None,
                   restarted_from: str | None = None, settings: Mapping[str, Any] | None = None) -> RunStore:
    """The files in the plan's log dir, the run in the job store, and its alerts.

    Args:
        plan: the run.
        backend: the job store's name of the backend (:func:`backend_name`).
        warn: where the stores' warnings go (the launcher's console).
        policy: the restart policy the run goes by; default the plan's.
        restarted_from: the run this one restarts (``psflow restart``), recorded with it.
        settings: the backend's settings (:func:`backend_settings`), recorded for a restart to reuse.

    Raises:
        ConfigError: a bad ``PSFLOW_ALERT_WEBHOOK`` or ``PSFLOW_ALERT_STALL_S``.
    """
    record = run_record(plan, backend=backend, restart_policy=policy or plan.restart, settings=settings)
    if restarted_from is not None:
        record["restarted_from"] = restarted_from
    return CompositeRunStore(file_store(plan), SqliteRunStore(None, record, plan.task_names(), warn=warn),
                             run_alerts(plan.run_id, warn=warn), warn=warn)


def backend_settings(options: Any) -> dict[str, Any]:
    """The settings of a :class:`psflow.launch.assemble.BackendOptions` that a run's record keeps
    (:func:`psflow.platform.sqlrunstore.recordable_settings` drops the credential-like ones)."""
    return {"hosts": options.hosts, "nodes": options.nodes, "coordinator_host": options.coordinator_host,
            "k8s": dict(options.k8s) if options.name == "k8s" else {},  # psflow run passes defaults for every backend
            "sbatch_args": list(options.sbatch_args)}


def recording(backend: Any, *, policy: RestartPolicy | None = None, restarted_from: str | None = None,
              settings: Mapping[str, Any] | None = None) -> Callable[[LaunchPlan], RunStore]:
    """The run-store factory that records a run on ``backend`` (a Backend; its console gets the warnings)
    with the backend's ``settings`` (:func:`backend_settings`).

    Example:
        >>> backend = LocalBackend()
        >>> Runner(backend, store=recording(backend)).run(plan).exit_code   # the run is in psflow runs, the dashboard
        0
    """
    name = backend_name(backend)
    return lambda plan: recorded_store(plan, backend=name, warn=backend.console.warn, policy=policy,
                                       restarted_from=restarted_from, settings=settings)
