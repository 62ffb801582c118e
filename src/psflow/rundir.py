"""The layout of a run's log directory: where each of its files lies.

One value, :class:`RunDir` (``RunDir(logdir)``), names every path of a run: the launcher's records
(``status.json``, ``events.jsonl``, ``summary.json``, the job secret), each task's log
(``logs/worker-1.log``) and error report (``errors/worker-1.json``), the checkpoints, the TensorBoard
summaries, the push ledgers, the timeline, the chief's ``DONE`` marker. The rule that turns a task
id into a file name (``worker:1`` -> ``worker-1``, :func:`task_stem`) and back (:func:`task_of_stem`)
is written here only.

Pure: nothing here touches the disk but :meth:`RunDir.logged_tasks`, which lists ``logs/``. No
torch, no launch/ or platform/ imports: the task side (supervisor, trainer, timeline) and the
launcher's side (backends, runner, job store, API) all read it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

STATUS_FILE = "status.json"
SUMMARY_FILE = "summary.json"
EVENTS_FILE = "events.jsonl"
SECRET_FILE = ".secret"
DONE_FILE = "DONE"
TRACE_FILE = "timeline.json"
LOGS_DIR = "logs"
ERRORS_DIR = "errors"
CHECKPOINTS_DIR = "checkpoints"
SUMMARIES_DIR = "summaries"
LEDGER_DIR = "ledger"
TIMELINE_DIR = "timeline"


def task_stem(task: object) -> str:
    """A task id as a file name: ``worker:1`` (a str or a TaskId) -> ``worker-1``."""
    return str(task).replace(":", "-")


def task_of_stem(stem: str) -> str:
    """The task id a file name was made from: ``worker-1`` -> ``worker:1`` (the inverse of :func:`task_stem`)."""
    return stem.replace("-", ":", 1)


@dataclass(frozen=True, init=False)
class RunDir:
    """A run's log directory and every path in it.

    Example:
        >>> d = RunDir("/tmp/run1")
        >>> str(d.log("worker:1")), str(d.error_report("worker:1")), str(d.summary)
        ('/tmp/run1/logs/worker-1.log', '/tmp/run1/errors/worker-1.json', '/tmp/run1/summary.json')
    """

    path: Path

    def __init__(self, path: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "path", Path(path))

    # -- the launcher's records ------------------------------------------------------------------
    @property
    def status(self) -> Path:
        """The live state (:mod:`psflow.launch.status`)."""
        return self.path / STATUS_FILE

    @property
    def summary(self) -> Path:
        """The summary written at the run's end (:mod:`psflow.launch.summary`)."""
        return self.path / SUMMARY_FILE

    @property
    def events(self) -> Path:
        """The run's history, one JSON object a line."""
        return self.path / EVENTS_FILE

    @property
    def secret(self) -> Path:
        """The job secret (0600; never uploaded)."""
        return self.path / SECRET_FILE

    @property
    def done(self) -> Path:
        """The chief's marker: the job finished."""
        return self.path / DONE_FILE

    # -- per task --------------------------------------------------------------------------------
    @property
    def logs(self) -> Path:
        return self.path / LOGS_DIR

    def log(self, task: object) -> Path:
        """``task``'s output, every attempt's: ``logs/worker-1.log``."""
        return self.logs / f"{task_stem(task)}.log"

    @property
    def errors(self) -> Path:
        return self.path / ERRORS_DIR

    def error_report(self, task: object) -> Path:
        """The report a failed ``task`` leaves: ``errors/worker-1.json``."""
        return self.errors / f"{task_stem(task)}.json"

    def logged_tasks(self) -> list[str]:
        """The tasks with a log in ``logs/`` (sorted; none when it is missing)."""
        return sorted(task_of_stem(p.stem) for p in self.logs.glob("*-*.log"))

    @property
    def summaries(self) -> Path:
        return self.path / SUMMARIES_DIR

    def summaries_of(self, task: object) -> Path:
        """``task``'s TensorBoard event files: ``summaries/worker-1``."""
        return self.summaries / task_stem(task)

    @property
    def ledger(self) -> Path:
        return self.path / LEDGER_DIR

    def ledger_of(self, task: object, attempt: int) -> Path:
        """The push ledger of ``task``'s ``attempt``: ``ledger/worker-1.0``."""
        return self.ledger / f"{task_stem(task)}.{attempt}"

    @property
    def timeline(self) -> Path:
        """Each task's spans, before they are merged (:mod:`psflow.timeline`)."""
        return self.path / TIMELINE_DIR

    def timeline_of(self, task: object, attempt: int) -> Path:
        """The spans of ``task``'s ``attempt``: ``timeline/worker-1.0.json``."""
        return self.timeline / f"{task_stem(task)}.{attempt}.json"

    @property
    def trace(self) -> Path:
        """Every task's spans merged into one trace."""
        return self.path / TRACE_FILE

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    def checkpoint(self, name: str) -> Path:
        """One checkpoint directory: ``checkpoints/ckpt-0000000600``."""
        return self.checkpoints / name
