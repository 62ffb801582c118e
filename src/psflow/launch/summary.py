"""A run's ``summary.json``: its headline figures, then every task (attempts, exits) and its reports.

Pure: built by the runner once every task has exited, from the coordinator's reports and addresses
and the controller's task records; the rate and the script's metrics follow the one definition of
:mod:`psflow.launch.metrics`. ``ledger``: every ps shard copy's final counters and what
:mod:`psflow.launch.copies` found comparing them (the runner has already failed a run they broke).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from psflow.launch.controller import TaskRecord, signal_name
from psflow.launch.copies import Finding, backup_workers, shard_copies
from psflow.launch.metrics import job_rate, run_metrics, task_metrics, trainer_figures
from psflow.launch.plan import LaunchPlan
from psflow.launch.restart import Backoff
from psflow.rundir import RunDir
from psflow.timeline import job_shares


def build_summary(
    plan: LaunchPlan, reports: Mapping[str, Mapping[str, Any]], addresses: Mapping[str, str],
    records: Mapping[str, TaskRecord], wall_s: float, status: str, root_cause: str | None,
    findings: Sequence[Finding] = (), *, failure: Mapping[str, Any] | None = None, backoff: Backoff | None = None,
) -> dict[str, Any]:
    """The run's summary.json.

    Args:
        plan: the run's plan.
        reports: each task's merged reports (the coordinator's).
        addresses: each task's registered address.
        records: the controller's book on each task (attempts, exits).
        wall_s: the run's wall time.
        status: ``succeeded``, ``failed`` or ``stopped`` (the controller's verdict).
        root_cause: the task that caused a failure, if any (or the ledger's finding that failed the run).
        findings: the ledger's findings over the ps's shard copies (:func:`psflow.launch.copies.check_copies`).
        failure: the root cause in words (:func:`psflow.errorreport.describe_root_cause`), as
            the runner put it once for every reader.
        backoff: the wait before each restart where it is not the policy's (the backend's: Kubernetes').
    """
    # A task stopped or killed has no final report: its last live progress counts (see launch.metrics).
    figures = trainer_figures(reports)
    steps = [r.get("global_step") for r in reports.values() if isinstance(r.get("global_step"), int)]
    steps += [f.get("global_step", 0) for f in figures.values()]
    steps += [r["progress"].get("global_step", 0) for r in reports.values() if isinstance(r.get("progress"), dict)]
    chief = next((t for t in plan.task_names() if t.startswith(("chief", "worker"))), None)
    metrics_by_task = {t: m for t, r in reports.items() if (m := task_metrics(r))}
    metrics = run_metrics(metrics_by_task, chief)
    accs = {t: m["test_accuracy"] for t, m in metrics_by_task.items() if "test_accuracy" in m}
    ps_stats = {t: r["ps_stats"] for t, r in reports.items() if "ps_stats" in r}
    return {
        "run_id": plan.run_id,
        "status": status,
        "root_cause": root_cause,
        **({"failure": dict(failure)} if failure is not None else {}),
        "mode": plan.config.mode,
        "backup_workers": backup_workers(plan.config.mode, plan.config.replicas_to_aggregate,
                                         plan.config.total_num_replicas,
                                         sum(1 for t in plan.task_names() if t.split(":")[0] in ("chief", "worker"))),
        "strategy": plan.config.strategy,
        "global_step": max(steps, default=0),
        "metrics": metrics,  # the script's task.report(name=number), as named (the chief's first)
        "metrics_by_task": metrics_by_task,
        **({"test_accuracy": metrics["test_accuracy"], "test_accuracy_by_task": accs} if accs else {}),
        "examples": sum(int(f.get("examples") or 0) for f in figures.values()),
        # steps the training tasks took in this run (0: none did, whatever the step it started from; None: no
        # task reported to the launcher, as on Kubernetes, where the figures are on the volume claim)
        "trained_steps": sum(int(f.get("local_step") or 0) for f in figures.values()) if reports else None,
        "examples_per_sec": job_rate(figures.values()),  # wall-clock (see psflow.launch.metrics)
        "step_examples_per_sec": job_rate(figures.values(), "train_time_s"),
        "wall_s": round(wall_s, 3),
        "counters": {
            "stale_dropped": sum(s.get("stale_dropped", 0) for s in ps_stats.values()),
            "steps_without_all_workers": max((s.get("steps_without_all", 0) for s in ps_stats.values()), default=0),
            "wait_s": round(sum(s.get("wait_s", 0.0) for s in ps_stats.values()), 3),
        },
        "restarts": sum(1 for r in records.values() for x in r.exits if x.restarted),
        **({"ledger": {"copies": [c.row() for cs in copies.values() for c in cs], "findings": [f.to_dict() for f in findings],
                       "agree": not any(f.fails for f in findings)}} if (copies := shard_copies(reports)) or findings else {}),
        "restart_policy": plan.restart.describe(tuple(dict.fromkeys(t.split(":")[0] for t in plan.task_names())), backoff),
        "tasks": [task_entry(plan, r, addresses.get(t)) for t, r in records.items() if r.started],
        "reports": reports,
        **({"timeline": shares} if (shares := job_shares(reports)) else {}),  # psflow run --timeline
    }


def task_entry(plan: LaunchPlan, record: TaskRecord, address: str | None) -> dict[str, Any]:
    """One task in the summary: its last attempt's pid, exit code and cause, and every attempt's exit
    (code, signal, cause, how long it ran, whether it was restarted, or why not, and the hang the
    watchdog killed it for: kind, quiet time, where its stacks went)."""
    last = record.exits[-1] if record.exits else None
    return {
        "task": record.task,
        "pid": record.handle,
        "address": address,
        "exit_code": last.code if last else None,
        "signal": signal_name(last.code) if last else None,
        "cause": last.cause if last else None,
        "attempts": record.attempts,
        "exits": [{"attempt": x.attempt, "code": x.code, "signal": signal_name(x.code), "cause": x.cause,
                   "oom_killed": x.oom_killed, "time_unix": round(x.at, 3),
                   "ran_s": None if x.ran_s is None else round(x.ran_s, 3), "stopped": x.stopped,
                   "restarted": x.restarted, **({"not_restarted": x.not_restarted} if x.not_restarted else {}),
                   **({"retired": True} if x.retired else {}),
                   **({"hang": x.hang.to_dict()} if x.hang is not None else {})}
                  for x in record.exits],
        "log": str(RunDir(plan.logdir).log(record.task)),
    }
