"""A run's figures from what its tasks reported: the training rate and the script's own metrics.

**The rates.** One definition each, used by the live status (``status.json``, ``psflow status``),
``summary.json``, the dashboard and the launcher's final line (see :func:`job_rate`)::

    examples_per_sec      = examples trained by all training tasks / the longest wall_time_s of any one
    step_examples_per_sec = examples trained by all training tasks / the longest train_time_s of any one

``examples_per_sec``, the headline, is the wall-clock rate: a task's ``wall_time_s`` runs from the
start of its first step to the end of its last, the script's own work between steps (reading data,
evaluating, printing) included; its setup before the first step is not. ``step_examples_per_sec``
counts only the seconds inside ``trainer.step`` (pull, forward, backward, push, and waits for other
workers in sync and ssp modes): what the training itself could deliver, about 2x the headline for
the MNIST softmax. The workers train side by side, so the job's examples over the slowest worker's
time is what the job delivered. A task's figures are its final ``trainer`` report or, when it ended
without one (Ctrl-C, SIGTERM, killed), its last live ``progress`` report (about once a second): a
stopped run reports the rate it really trained at, not 0.

**The script's metrics.** Every name a task passed to ``task.report(name=number)`` that is not one
of psflow's own report names (:data:`PSFLOW_REPORTS`), kept as it was named: ``test_accuracy`` for
a classifier, ``test_mse`` for a regression, anything else. The evaluator's reports
(``eval={"step": ..., "accuracy": ...}``) appear as ``eval/step``, ``eval/accuracy`` (its TensorBoard
tags). The run's metrics are the chief's, plus those only other tasks reported.

Pure functions over the coordinator's ``reports`` (task -> merged report dict); called by
:mod:`psflow.launch.status`, :func:`psflow.launch.summary.build_summary` and the CLI.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

# Report names psflow's own code sends (trainer, ps, supervisor, evaluator, live progress): not metrics.
PSFLOW_REPORTS = frozenset({"trainer", "progress", "ps_stats", "global_step", "lost_workers", "supervisor", "eval"})


def job_rate(figures: Iterable[Mapping[str, Any]], time_key: str = "wall_time_s") -> float:
    """The job's examples/sec: every training task's examples over the longest of its times.

    Args:
        figures: one mapping per training task with ``examples`` and the time (a trainer's
            ``stats()`` or its progress report); mappings without the time are skipped.
        time_key: ``wall_time_s`` for the headline (wall-clock) rate, ``train_time_s`` for the rate
            inside the steps (``step_examples_per_sec``).

    Returns:
        The rate rounded to 0.1, or 0.0 when no task has trained yet.

    Example:
        >>> job_rate([{"examples": 3000, "wall_time_s": 2.0}, {"examples": 2000, "wall_time_s": 2.5}])
        2000.0
    """
    examples, longest = 0, 0.0
    for f in figures:
        t = f.get(time_key)
        if not _is_number(t):
            continue
        examples += int(f.get("examples") or 0)
        longest = max(longest, float(t))
    return round(examples / longest, 1) if longest > 0 else 0.0


def trainer_figures(reports: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each training task's figures: its final ``trainer`` stats, else its last ``progress``."""
    out: dict[str, dict[str, Any]] = {}
    for task, r in reports.items():
        for key in ("trainer", "progress"):
            figures = r.get(key)
            if isinstance(figures, Mapping) and _is_number(figures.get("train_time_s")):
                out[task] = dict(figures)
                break
    return out


def task_metrics(report: Mapping[str, Any]) -> dict[str, float | int]:
    """The script's own metrics in one task's report (numbers under names that are not psflow's)."""
    # A NaN is kept: a diverged run's metric says so.
    metrics = {k: v for k, v in report.items() if k not in PSFLOW_REPORTS and _is_real(v)}
    evaluation = report.get("eval")
    if isinstance(evaluation, Mapping):
        metrics.update({f"eval/{k}": v for k, v in evaluation.items() if _is_real(v)})
    return metrics


def run_metrics(by_task: Mapping[str, Mapping[str, Any]], first: str | None) -> dict[str, Any]:
    """The run's metrics: those of task ``first`` (the chief), then names only other tasks reported."""
    merged: dict[str, Any] = dict(by_task.get(first, {})) if first is not None else {}
    for task in sorted(by_task):
        for k, v in by_task[task].items():
            merged.setdefault(k, v)
    return merged


def format_metrics(metrics: Mapping[str, Any]) -> str:
    """``name=value`` pairs for one line, floats to 6 significant digits."""
    return " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())


def final_line(summary: Mapping[str, Any]) -> str:
    """The launcher's last line about a run, from its ``summary.json``.

    Example:
        >>> final_line({"status": "succeeded", "global_step": 1200, "metrics": {"test_mse": 0.0123},
        ...             "examples_per_sec": 95000.0, "wall_s": 4.2})
        'psflow: succeeded: global_step=1200 test_mse=0.0123 examples/sec=95000.0 wall=4.2s'
    """
    metrics = format_metrics(summary.get("metrics") or {})
    return (f"psflow: {summary['status']}: {_nothing_trained(summary)}global_step={summary['global_step']} "
            f"{metrics + ' ' if metrics else ''}examples/sec={summary['examples_per_sec']} wall={summary['wall_s']:.1f}s")


def _nothing_trained(summary: Mapping[str, Any]) -> str:
    """The final line's warning for a run that ended well without a training step (an exit 0 is no proof
    of training: a loop over no data, a script that never called step)."""
    if summary.get("status") != "succeeded" or summary.get("examples"):
        return ""
    if "trained_steps" in summary and summary["trained_steps"] is None:
        return ("no task's figures reached the launcher (on Kubernetes they are in the logdir on the volume claim: "
                "psflow status LOGDIR where it is mounted) ")
    return "" if summary.get("trained_steps", 1) else "trained 0 steps (no task took a training step: see its log) "


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return _is_real(v) and math.isfinite(v)  # type: ignore[arg-type]
