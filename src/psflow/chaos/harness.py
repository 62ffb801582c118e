"""``psflow chaos``: run a job while its tasks are killed and stopped, then say what it survived and lost.

The I/O shell around the pure parts: with a baseline, the same plan first runs without faults (into
its own log dir); then the chaos run, assembled as every run is (:func:`psflow.launch.assemble.assemble_run`),
goes through its :class:`psflow.launch.runner.Runner` with a
:class:`psflow.chaos.injector.ChaosInjector` on its loop, under the plan's restart policy; the
report (:mod:`psflow.chaos.report`) is built from the injector's faults, the run's summary and the
workers' push ledgers, printed, and written to ``LOGDIR/chaos.json``. Called by ``psflow chaos``
(:mod:`psflow.cli`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from psflow.chaos.injector import ChaosInjector
from psflow.chaos.report import build_report, render
from psflow.chaos.schedule import ChaosSchedule, ChaosSettings
from psflow.launch.assemble import BackendOptions, assemble_run
from psflow.launch.plan import LaunchPlan
from psflow.platform.recording import recording
from psflow.train.ledger import read_ledgers


def run_chaos(plan: LaunchPlan, settings: ChaosSettings, *, options: BackendOptions,
              baseline: LaunchPlan | None = None, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``baseline`` (if given) without faults, then ``plan`` under ``settings``' faults; return
    the report (also in ``plan.logdir/chaos.json``) after printing it.

    Example:
        >>> report = run_chaos(plan, ChaosSettings(every_s=3, duration_s=30, seed=7), options=BackendOptions(preload=False))
        >>> report["ledger"]["lost"]
        0
    """
    base_summary = None
    if baseline is not None:
        echo(f"psflow chaos: the fault-free run first (logs in {baseline.logdir})")
        base_summary = assemble_run(baseline, options, store=recording).runner.run(baseline).summary
    schedule = ChaosSchedule(settings)
    echo(f"psflow chaos: run {plan.run_id}: up to {len(schedule.slots())} faults, one every {settings.every_s:g} s for "
         f"{settings.duration_s:g} s (seed {settings.seed}; {', '.join(f'{k}={w:g}' for k, w in settings.kinds)}; "
         f"targets {', '.join(settings.targets)}); logs in {plan.logdir}")
    if any(k == "partition" for k, _ in settings.kinds):  # the ps cut their links on SIGUSR2 (and only then)
        plan = dataclasses.replace(plan, tasks=tuple(
            dataclasses.replace(tp, env=(*tp.env, ("PSFLOW_CHAOS", "1"))) if tp.job == "ps" else tp for tp in plan.tasks))
    run = assemble_run(plan, options, store=recording)
    injector = ChaosInjector(schedule, run.backend, echo=echo)
    run.runner.on_tick = injector  # the faults, injected through the backend after each turn of the loop
    try:
        result = run.runner.run(plan)
    finally:
        injector.close()
    report = build_report(faults=[f.to_dict() for f in injector.faults], skipped=injector.skipped, summary=result.summary,
                          ledgers=read_ledgers(plan.logdir), baseline=base_summary,
                          settings={**asdict(settings), "kinds": dict(settings.kinds), "restart_policy":
                                    result.summary.get("restart_policy"), "baseline_logdir": baseline.logdir if baseline else None})
    echo(render(report))
    path = Path(plan.logdir) / "chaos.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, path)
    echo(f"psflow chaos: report in {path}")
    return report


def passed(report: dict[str, Any]) -> bool:
    """The chaos run succeeded, lost no acknowledged update (none was compared after a rollback,
    which redoes the updates after its checkpoint by design), and its shards and copies agree."""
    return (report.get("status") == "succeeded" and report["ledger"]["lost"] in (0, None)
            and not any(f["fails"] for f in report.get("findings") or []))
