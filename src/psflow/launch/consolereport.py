"""What the launcher's console says about a run's state: one more subscriber of the run controller.

:class:`ConsoleReport` learns a run's changes as the stores do (:mod:`psflow.launch.subscribers`)
and says them to the user: a task restarted (how its attempt ended, which attempt comes next, when
and by whom: the launcher, or Kubernetes' Job controller after its own back-off; the budget), not
restarted (which budget is spent), retired; and, at the run's end, the final table, each restarted
task's attempts, the root cause (the failed task's exit, its error report or its log's last lines,
then the others' errors; or the ledger's finding), the ledger's other findings,
the final line (status, global step, the script's metrics such as accuracy, rate, wall time) and
where the summary and the logs are. The runner prints none of it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from psflow.launch.console import Console
from psflow.launch.controller import ExitRecord, describe_exit
from psflow.launch.metrics import final_line
from psflow.launch.plan import LaunchPlan
from psflow.launch.subscribers import RunOutcome, RunSubscriber, TaskChange
from psflow.rundir import RunDir


class ConsoleReport(RunSubscriber):
    """Says ``plan``'s run on ``console`` (see the module docstring).

    Args:
        console: the launcher's console.
        plan: the run (its tasks, its log dir and the URL it is uploaded to).
        snapshot: the run's live state (the run store's), for the final table.
        max_restarts: the restart policy's budget per task, said with each restart.
    """

    def __init__(self, console: Console, plan: LaunchPlan, *, snapshot: Callable[[], dict[str, Any]],
                 max_restarts: int) -> None:
        self.console, self.plan, self.snapshot, self.max_restarts = console, plan, snapshot, max_restarts
        self.tasks = list(plan.task_names())
        self.attempts: dict[str, int] = {}  # task -> its newest attempt that started
        self.exits: dict[str, list[ExitRecord]] = {}
        self.exit_order: list[tuple[str, ExitRecord]] = []  # every exit, in the order seen

    def on_task_state(self, change: TaskChange) -> None:
        c = change
        if c.state == "added" and c.task not in self.tasks:
            self.tasks.append(c.task)
        elif c.state == "started":
            self.attempts[c.task] = max(c.attempt, self.attempts.get(c.task, 0))
        elif c.state == "exited" and c.exit is not None:
            self.attempts[c.task] = max(c.attempt, self.attempts.get(c.task, 0))
            self.exits.setdefault(c.task, []).append(c.exit)
            self.exit_order.append((c.task, c.exit))
        elif c.state == "restarting" and self.exits.get(c.task):
            why = f"; {c.group} restarts from its newest checkpoint after {c.trigger}" if c.group else ""
            budget = f"restart {c.attempt} of {self.max_restarts} for this task"
            if c.by:  # the backend's place starts it again, after its own back-off (Kubernetes' Job controller)
                how = f"{c.by} replaces it as attempt {c.attempt} in ~{c.after_s or 0.0:g} s (its own back-off; {budget})"
            else:
                how = f"restarting it as attempt {c.attempt} in {c.after_s or 0.0:.1f} s ({budget})"
            self.console.warn(f"{ended(c.task, self.exits[c.task][-1])}{why}; {how}.")
        elif c.state == "not_restarted" and c.exit is not None:
            self.console.warn(f"{ended(c.task, c.exit)}; not restarted: {c.reason}.")
        elif c.state == "retired":
            x = self.exits[c.task][-1] if self.exits.get(c.task) else None
            if x is not None and x.attempt == c.attempt and x.retired:
                self.console.echo(f"psflow: {c.task} (attempt {c.attempt}) retired ({x.cause}).")

    def on_run_end(self, outcome: RunOutcome) -> None:
        self.console.final_table({**self.snapshot(), "failure": None})  # the root cause follows, in full
        self._print_restarts()
        root = outcome.root_cause
        if root is not None and root in self.tasks:
            self._print_root_cause(root)
        elif root is not None:  # every task succeeded; the ledger over the shard copies did not
            self.console.echo(click.style(f"psflow: the run failed. Root cause: {root}", fg="red", bold=True))
        for finding in (outcome.summary.get("ledger") or {}).get("findings") or []:
            if finding.get("message") != root:
                self.console.warn(f"ledger: {finding.get('message')}")
        if outcome.summary:
            self.console.echo(final_line(outcome.summary))
            where = self.plan.logdir_url or self.plan.logdir
            self.console.echo(f"psflow: summary: {where}/summary.json   logs: {where}/logs/")

    def _print_restarts(self) -> None:
        """A line for each task that was restarted: every attempt and how it ended."""
        for t in self.tasks:
            if self.attempts.get(t, 0) < 1:
                continue
            exits = self.exits.get(t, [])
            ends = [f"attempt {x.attempt}: {x.cause}" + (f" after {x.ran_s:.1f} s" if x.ran_s is not None else "")
                    for x in exits]
            if not exits or exits[-1].attempt < self.attempts[t]:  # cannot be at the end; kept for a run cut short
                ends.append(f"attempt {self.attempts[t]}: did not exit")
            self.console.echo(f"psflow: {t}: {self.attempts[t] + 1} attempts; " + "; ".join(ends))

    def _print_root_cause(self, root: str) -> None:
        echo = self.console.echo
        x = self.exits[root][-1] if self.exits.get(root) else None
        report = x.report if x is not None else None
        how = ""
        if x is not None:
            how += f" ({x.cause[len('killed ('):-1]})" if x.cause.startswith("killed (") else ""
            how += f", on attempt {x.attempt} (after {x.attempt} restart{'s' if x.attempt != 1 else ''})" if x.attempt else ""
        code = x.code if x is not None else None
        echo(click.style(f"psflow: the run failed. Root cause: {root} exited with code {code}{how}", fg="red", bold=True))
        rundir = RunDir(self.plan.logdir)
        if report:
            echo(f"  {report.get('exception')}: {report.get('message')}")
            shown_by = self.console.traceback_shown_by(str(report.get("traceback", "")))
            if shown_by:  # in the output above already: not a second time
                echo(f"  (traceback above, from {shown_by}; also in {rundir.errors})")
            else:
                echo("  " + str(report.get("traceback", "")).rstrip().replace("\n", "\n  "))
        elif x is not None and x.hang is not None:
            echo(f"  {x.cause}")
        else:
            log = rundir.log(root)
            echo(f"  (no error report; last lines of {log}:)")
            echo(_tail(log))
        for t, other in self.exit_order:
            if t == root or other.code == 0 or other.restarted:
                continue
            r = other.report
            why = f"{r.get('exception')}: {r.get('message')}" if r else f"{describe_exit(other.code)} (stopped after the root cause)"
            echo(f"  then {t}: {why}")


def ended(task: str, x: ExitRecord) -> str:
    """``worker:1 (attempt 0) was killed (SIGKILL) after 12.3 s``, ``... ended with exit code 1 after 2.0 s``,
    ``... was killed by the watchdog (hung: no progress for 3.4 s; stacks in LOG from line 4) after 7.1 s``."""
    if x.hang is not None:
        how = f"was killed by the watchdog ({x.cause})"
    else:
        how = f"was {x.cause}" if x.cause.startswith("killed") else f"ended with {x.cause}"
    return f"{task} (attempt {x.attempt}) {how}" + (f" after {x.ran_s:.1f} s" if x.ran_s is not None else "")


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join("  " + line for line in path.read_text().splitlines()[-n:])
    except OSError:
        return "  (no log)"
