"""The launcher's console: its own lines, its tasks' lines, each traceback once, the live table.

One per backend (a backend pumps its tasks' output here; the runner writes its warnings and the
root cause here), so that every line goes through one lock and, while the live table shows, above
it. A traceback several tasks print alike (a script that fails at import) is shown once, in full,
and as one line for each other task; :meth:`Console.traceback_shown_by` lets the root-cause
report point at it instead of printing it twice.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TextIO

import click

from psflow.rundir import RunDir

if TYPE_CHECKING:
    from psflow.launch.plan import LaunchPlan, TaskPlan

# One colour per task, by its place in the plan: the same task keeps its colour across attempts.
COLORS = ["cyan", "green", "yellow", "magenta", "blue", "red", "bright_cyan", "bright_green"]


class Console:
    """Where the launcher's lines go: ``echo`` (default: click.echo); ``live``: show the status table
    under the output (default: when printing to a terminal through click)."""

    def __init__(self, echo: Callable[[str], None] | None = None, *, live: bool | None = None) -> None:
        self._echo: Callable[[str], None] = echo or (lambda line: click.echo(line))
        self.live = live if live is not None else (echo is None and sys.stdout.isatty())
        self._lock = threading.RLock()
        self._tracebacks: dict[str, str] = {}  # each traceback echoed -> the task that printed it

    def echo(self, line: str) -> None:
        with self._lock:
            self._echo(line)

    def warn(self, text: str) -> None:
        """A launcher warning: ``psflow: TEXT`` in yellow."""
        self.echo(click.style(f"psflow: {text}", fg="yellow"))

    def task_traceback(self, task: str, prefix: str, block: list[str]) -> None:
        """Echo a task's whole traceback, or one line if another task printed the same one already."""
        text = "".join(block).strip()
        with self._lock:
            first = self._tracebacks.setdefault(text, task)
            if first != task:
                self._echo(f"{prefix} {block[-1].rstrip()} (the same traceback as {first}'s above)")
                return
            for line in block:
                self._echo(f"{prefix} {line.rstrip()}")

    def follow(self, plan: LaunchPlan, task: TaskPlan, attempt: int, stream: Iterable[str]) -> threading.Thread:
        """Start pumping one attempt's output (a daemon thread, returned started) into the task's log
        ``LOGDIR/logs/<task>.log`` (a new file for attempt 0, appended to by later attempts) and here."""
        color = COLORS[plan.task_names().index(task.task) % len(COLORS)]
        log_file = open(RunDir(plan.logdir).log(task.task), "w" if attempt == 0 else "a")  # noqa: SIM115 (the pump closes it)
        thread = threading.Thread(target=self.pump, args=(task.task, stream, log_file, color), daemon=True)
        thread.start()
        return thread

    def pump(self, task: str, stream: Iterable[str], log_file: TextIO, color: str) -> None:
        """Copy a task's output to its log file and the console, until the stream ends; closes
        ``log_file``. A traceback is echoed once it is whole, and only once per run: the same error in
        every task (a script that fails at import) shows as one traceback and a line per other task.
        The log file keeps everything. Used by every backend that streams its tasks' output."""
        prefix = click.style(f"[{task}]", fg=color)
        block: list[str] | None = None
        with log_file:
            for line in stream:
                log_file.write(line)
                log_file.flush()
                if block is None and line.startswith("Traceback (most recent call last):"):
                    block = [line]
                elif block is not None:
                    block.append(line)
                    if not line[:1].isspace():  # the exception line ends the traceback
                        self.task_traceback(task, prefix, block)
                        block = None
                else:
                    self.echo(f"{prefix} {line.rstrip()}")
            if block:
                self.task_traceback(task, prefix, block)

    def traceback_shown_by(self, traceback: str) -> str | None:
        """The task whose output showed this traceback already, if any."""
        with self._lock:
            return self._tracebacks.get(traceback.strip())

    @contextlib.contextmanager
    def live_table(self, snapshot: Callable[[], dict[str, Any]]) -> Iterator[None]:
        """While the run lasts, keep the status table at the bottom of the terminal (rich), with the
        lines scrolling above it. (The final table is printed once the run is over.)"""
        if not self.live:
            yield
            return
        from rich.console import Console as RichConsole
        from rich.live import Live
        from rich.text import Text

        from psflow.launch.status import render

        plain = self._echo
        with Live(get_renderable=lambda: render(snapshot()), console=RichConsole(), refresh_per_second=2,
                  transient=True) as live:
            self._echo = lambda line: live.console.print(Text.from_ansi(line), soft_wrap=True)
            try:
                yield
            finally:
                self._echo = plain

    def final_table(self, state: dict[str, Any]) -> None:
        """The run's table once it is over (where the live one was shown)."""
        if self.live:
            from rich.console import Console as RichConsole

            from psflow.launch.status import render

            RichConsole().print(render(state))
