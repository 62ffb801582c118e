"""The launch-backend seam: how tasks are started, watched and stopped somewhere.

A backend does the I/O of one kind of place (local processes today; Slurm and Kubernetes next) and
no policy: it starts the attempts it is told to, reports exits as :class:`TaskExited` events, stops
the tasks it is told to, and hands over a task's error report. What to start, stop or restart, and
when the run is over, is decided by :class:`psflow.launch.controller.RunController`; the loop that
connects the two is :class:`psflow.launch.runner.Runner`.

Lifecycle: ``open(plan)`` -> ``start`` / ``poll`` / ``stop`` / ``dump_stacks`` / ``error_report`` /
``ended_by`` -> ``close()`` (always called, also after an error: nothing the backend started may outlive it).
``hurry()`` (a second Ctrl-C, from a signal handler) makes a stop under way, and every later one,
skip the rest of its grace: SIGKILL at once.
"""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psflow.launch.console import Console
from psflow.launch.controller import TaskExited
from psflow.launch.plan import LaunchPlan, TaskPlan
from psflow.launch.watchdog import StackDump


@dataclass
class RunResult:
    exit_code: int
    summary: dict[str, Any] = field(default_factory=dict)
    root_cause: str | None = None


class Backend(ABC):
    """Starts, watches and stops the tasks of one run. ``console``: where their output goes."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self._hurried = threading.Event()

    def hurry(self) -> None:
        """A stop under way, and every later one, skips the rest of its grace (SIGKILL now): the
        user asked twice. Called from a signal handler, so it only sets a flag that the waits read."""
        self._hurried.set()

    def wait_within(self, proc: Any, deadline: float) -> bool:
        """Wait for ``proc`` (a Popen, or anything whose ``wait(timeout)`` raises TimeoutExpired) to
        exit until ``deadline`` (``time.monotonic()``), or until :meth:`hurry`. True if it exited."""
        while True:
            left = 0.0 if self._hurried.is_set() else deadline - time.monotonic()
            try:
                proc.wait(timeout=max(0.0, min(left, 0.1)))
                return True
            except subprocess.TimeoutExpired:
                if left <= 0.1:
                    return False

    def open(self, plan: LaunchPlan) -> None:  # noqa: B027 (a hook: most backends need nothing here)
        """Prepare for ``plan`` before its first task starts."""

    def close(self) -> None:  # noqa: B027
        """Stop whatever is still running and release what :meth:`open` took."""

    def coordinator_host(self) -> str:
        """The address the launcher's coordinator listens on, asked after :meth:`open`: loopback (the
        default: the tasks run on this host), or one the tasks' hosts reach the launcher at (ssh).
        Off loopback the coordinator, like every task, admits only connections that prove the job secret."""
        return "127.0.0.1"

    def ended_by(self) -> str | None:
        """Why the place the tasks run in ended the run from outside (a scheduler job cancelled,
        out of time), once, or None. The runner takes it as a stop request, before the exits it
        caused. Default: never (local processes end only when the runner says)."""
        return None

    def failed_by(self) -> tuple[str, str] | None:
        """``(task, why)`` once, when the place the tasks run in failed the run from outside in a way
        no restart mends (a Slurm allocation lost with a node); ``task`` is blamed. Default: never."""
        return None

    def scale_refusal(self) -> str | None:
        """Why this backend cannot add or retire workers of a running run (``psflow scale``), with what
        to do instead; None when it can (then :meth:`replan` gets the grown plan before a new task starts)."""
        return (f"the {type(self).__name__.removesuffix('Backend').lower()} backend cannot add or retire workers of a "
                "running run; stop it (psflow stop RUN) and start it again with --workers N")

    def replan(self, plan: LaunchPlan) -> None:  # noqa: B027 (a hook: backends that scale take the grown plan)
        """``plan`` is the run's plan now (``psflow scale`` added tasks to it)."""

    @abstractmethod
    def start(self, task: TaskPlan, attempt: int, env: Mapping[str, str]) -> Any:
        """Start attempt ``attempt`` of ``task`` with ``env`` added to its environment; return its
        handle (a pid for local processes)."""

    @abstractmethod
    def poll(self, timeout_s: float = 0.0) -> list[TaskExited]:
        """The exits seen since the last call, in the order they happened; waits up to ``timeout_s``
        for the first one."""

    @abstractmethod
    def stop(self, tasks: Sequence[str], grace_s: float) -> None:
        """Stop ``tasks``: ask them to exit (SIGTERM), force them after ``grace_s`` (SIGKILL). Their
        exits come through :meth:`poll`."""

    @abstractmethod
    def error_report(self, task: str) -> dict[str, Any] | None:
        """The error report ``task``'s last attempt wrote, or None."""

    def dump_stacks(self, task: str) -> StackDump | None:
        """Have ``task``'s running attempt write the stacks of all its threads into its log (SIGUSR1,
        which every psflow task answers with a stack dump, psflow.heartbeat); return where they go (the log and the line
        they start at or after), or None when the task has no running attempt.

        Raises:
            NotImplementedError: this backend cannot signal its tasks (the default); the message says so.
            OSError: the signal could not be sent.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot signal a task for its stacks")


    def take_notes(self) -> list[tuple[str, dict[str, Any]]]:
        """What the place the tasks run in said since the last call, oldest first, as ``(kind, data)``
        events for the run's history (a scheduler's job id, its queue state and pending reason: the job
        page shows them whatever the backend). Taken by the runner once its store exists, then every
        tick. Default: nothing."""
        return []

    def send_signal(self, task: str, signum: int) -> bool:
        """Send ``signum`` to ``task``'s running attempt (every process of it: SIGKILL, SIGSTOP and
        SIGCONT reach its children too), as ``psflow chaos`` does; True if sent, False when the task
        has no running attempt. The exit it causes comes through :meth:`poll`.

        Raises:
            NotImplementedError: this backend cannot signal its tasks (the default); the message says so.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot send signals to its tasks")


def log_end(log: Path) -> int:
    """The line a dump written to ``log`` from now on starts at or after (1-based): its lines so far, plus one."""
    lines = 0
    try:
        with log.open("rb") as f:
            while chunk := f.read(1 << 20):
                lines += chunk.count(b"\n")
    except FileNotFoundError:
        pass
    return lines + 1


def drain(exits: queue.Queue[TaskExited], timeout_s: float) -> list[TaskExited]:
    """Every exit queued by a backend's watcher threads: waits up to ``timeout_s`` for the first
    (none: returns at once), then takes what else is there without waiting. ``Backend.poll``'s body."""
    try:
        first = exits.get(timeout=timeout_s) if timeout_s > 0 else exits.get_nowait()
    except queue.Empty:
        return []
    found = [first]
    while True:
        try:
            found.append(exits.get_nowait())
        except queue.Empty:
            return found
