"""Who learns of a run's state changes, and how: the run controller's callbacks.

The run controller (:mod:`psflow.launch.controller`) is the one source of a run's state: each change
it makes to a task (started, exited, hung, restarting, not restarted, added, retired) goes out as one
:class:`TaskChange` to :meth:`RunSubscriber.on_task_state`, each change of the run's phase
(running, draining, stopping, finished) to :meth:`RunSubscriber.on_run_state`, and the run's end,
once the runner has read the ledger and built the summary, as one :class:`RunOutcome` to
:meth:`RunSubscriber.on_run_end`. The outcome carries the root cause, computed once (by the
controller's rule, :mod:`psflow.launch.rootcause`, then the ledger's verdict) and put in words once
(:func:`psflow.errorreport.describe_root_cause`): every subscriber reads the same.

Subscribers: the run stores (``status.json`` and ``events.jsonl`` through
:class:`psflow.launch.runstore.FileRunStore`, the job store, the alerts: every
:class:`~psflow.launch.runstore.RunStore` is one) and the launcher's console. :class:`Subscribers`
fans each call out to all of them; one that raises is logged and warned about once, and the others
are still called (the run never stops for a subscriber). As Ray Train v2's controller callbacks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from psflow.launch.controller import ExitRecord

log = logging.getLogger("psflow")

TASK_STATES = ("started", "exited", "hung", "restarting", "not_restarted", "added", "retired")


@dataclass(frozen=True)
class TaskChange:
    """One task's change of state, as the controller made it.

    ``state``: ``started`` (``handle``: the backend's id, a pid), ``exited`` (``exit``: the attempt's
    exit record: code, cause, hang), ``hung`` (``hang``: the watchdog's finding, where the stacks
    went), ``restarting`` (``after_s``; ``reason``: how the attempt before ended; ``group``: the restart
    group it restarts with, ``trigger``: the exit that restarts the group; ``by``: who starts it again
    after ``after_s``, None for the launcher, ``"Kubernetes' Job controller"``), ``not_restarted`` (the
    policy would restart the exit ``exit`` but a budget is spent: ``reason``), ``added`` (a scale
    request added the task) or ``retired`` (a scale request retired it).
    """

    task: str
    state: str
    attempt: int
    at: float
    handle: Any = None
    exit: ExitRecord | None = None
    hang: Mapping[str, Any] | None = None
    after_s: float | None = None
    reason: str | None = None
    group: str | None = None
    trigger: str | None = None
    by: str | None = None

    def __post_init__(self) -> None:
        if self.state not in TASK_STATES:
            raise ValueError(f"TaskChange state {self.state!r} is not one of {', '.join(TASK_STATES)}.")


@dataclass(frozen=True)
class RunOutcome:
    """How a run ended: ``status`` (``succeeded``, ``failed``, ``stopped``) and its exit code; the
    root cause (a task, or the ledger's finding that failed the run) and the same in words
    (``failure``: task, exception, message, traceback's tail, text; None when nothing failed); the
    summary (``summary.json``)."""

    status: str
    exit_code: int
    root_cause: str | None
    failure: Mapping[str, Any] | None = None
    summary: Mapping[str, Any] = field(default_factory=dict)


class RunSubscriber:
    """What learns of a run's state changes. Every method is a no-op here: a subscriber overrides
    the ones it needs."""

    def on_task_state(self, change: TaskChange) -> None:
        """A task changed state (see :class:`TaskChange`)."""

    def on_run_state(self, state: str, at: float) -> None:
        """The run's phase changed: ``running``, ``draining``, ``stopping`` or ``finished``."""

    def on_run_end(self, outcome: RunOutcome) -> None:
        """The run ended (once, the last call)."""


class Subscribers(RunSubscriber):
    """Every call to each of ``subscribers``, in order. One that raises is logged (its first failure with
    its traceback, later ones at debug level) and warned about once (``warn``); the others are still
    called, and so is it the next time."""

    def __init__(self, subscribers: Iterable[RunSubscriber], *, warn: Callable[[str], None]) -> None:
        self.subscribers = list(subscribers)
        self.warn = warn
        self._warned: set[int] = set()

    def on_task_state(self, change: TaskChange) -> None:
        self._all("on_task_state", change)

    def on_run_state(self, state: str, at: float) -> None:
        self._all("on_run_state", state, at)

    def on_run_end(self, outcome: RunOutcome) -> None:
        self._all("on_run_end", outcome)

    def _all(self, method: str, *args: Any) -> None:
        for i, sub in enumerate(self.subscribers):
            try:
                getattr(sub, method)(*args)
            except Exception as e:  # noqa: BLE001 (a subscriber's failure, whatever it is, must not end the run)
                if i in self._warned:  # said once with its traceback; a store that keeps failing does not flood stderr
                    log.debug("psflow: %s.%s failed again", type(sub).__name__, method, exc_info=True)
                else:
                    log.exception("psflow: %s.%s failed", type(sub).__name__, method)
                    self._warned.add(i)
                    others = ", ".join(type(o).__name__ for o in self.subscribers if o is not sub) or "none"
                    self.warn(f"cannot record the run in {type(sub).__name__} ({type(e).__name__}: {e}); the run "
                              f"goes on, recorded by the others ({others}).")
