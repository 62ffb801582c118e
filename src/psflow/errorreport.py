"""A task's error report: the small JSON file a failing task leaves for its launcher.

The task writes it (``psflow.init``'s exception hook, or the fork server's child when the script
fails before ``init``) at the path the launcher gave it (``PSFLOW_ERROR_FILE``); the launcher reads
it to name the root cause of a failed run. One report per task: ``{task, exception, message,
traceback, time_unix}``.

Invariant: a reader sees a whole report or none, never half of one: the writer writes a temporary
file next to it and renames it into place. Writing never raises (the task's log keeps the
traceback when the disk cannot); reading returns None for a missing or unreadable report.

A failing task calls :func:`ignore_stop_requests` before its last words (report, error output): it
is on its way out, and ends with its own exit code. The launcher stops every other task on the first
exit; a task that reported its failure but is still tearing down (seconds, with torch loaded on a
busy machine) would otherwise end as stopped (-15), and its report, perhaps the oldest one (the root
cause), would stand beside an exit that says nothing of it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from psflow.rundir import RunDir, task_stem


def path_for(directory: str | os.PathLike[str], task: str) -> Path:
    """Where ``task``'s report lies in ``directory``: ``worker:1`` -> ``DIR/worker-1.json``."""
    return Path(directory) / f"{task_stem(task)}.json"


def build(task: str, exc: BaseException, tb: TracebackType | None = None) -> dict[str, Any]:
    """The report of ``exc`` raised in ``task`` (``tb`` defaults to the exception's own traceback)."""
    tb = exc.__traceback__ if tb is None else tb
    return {
        "task": str(task),
        "exception": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, tb)),
        "time_unix": time.time(),
    }


def one_line(exc: BaseException, max_chars: int = 400) -> str:
    """``exc`` as one short line: what a task that stops on it tells the ps (PS_DONE), which name it.

    Example:
        >>> one_line(ValueError("bad batch in shard 3"))
        'ValueError: bad batch in shard 3'
    """
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= max_chars else text[:max_chars - 1] + "…"


def write(path: str | os.PathLike[str], task: str, exc: BaseException, tb: TracebackType | None = None) -> bool:
    """Write ``exc``'s report for ``task`` to ``path`` atomically (temporary file + rename).

    Returns:
        True if the report is in place; False if the disk refused it (never raises: the task is
        failing already, and its log keeps the traceback).
    """
    target = Path(path)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(build(task, exc, tb), indent=1))
        os.replace(tmp, target)
        return True
    except OSError:
        return False


def read(path_or_dir: str | os.PathLike[str], task: str | None = None) -> dict[str, Any] | None:
    """The report at ``path_or_dir``, or, given ``task``, the report of ``task`` in that directory.

    Returns:
        The report, or None where there is none or it cannot be read as a JSON object.
    """
    path = path_for(path_or_dir, task) if task is not None else Path(path_or_dir)
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def traceback_tail(text: str, frames: int = 3, max_chars: int = 4000) -> str:
    """The end of a formatted traceback: its last ``frames`` frames and the exception line(s) under them.

    The innermost frames say where it failed; the outer ones (the launcher's, the script's entry)
    rarely do. A chained exception's last traceback is the one shown. At most ``max_chars``, its end kept.

    Example:
        >>> traceback_tail('Traceback (most recent call last):\\n  File "a.py", line 1, in <module>\\n    f()\\n'
        ...                '  File "a.py", line 3, in f\\n    1 / 0\\nZeroDivisionError: division by zero\\n', frames=1)
        '  File "a.py", line 3, in f\\n    1 / 0\\nZeroDivisionError: division by zero'
    """
    lines = str(text).rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    if starts:
        lines = lines[starts[-min(frames, len(starts))]:]
    tail = "\n".join(lines)
    return tail if len(tail) <= max_chars else "..." + tail[-max_chars:]


def describe_root_cause(root_cause: str | None, report: Mapping[str, Any] | None = None,
                        exit_cause: str | None = None) -> dict[str, Any] | None:
    """A failed run's root cause in words, for a person: what the run page, an alert and ``psflow status`` show.

    Args:
        root_cause: the run's root cause: a task (``worker:1``), or a finding that failed the run
            (a sentence, :mod:`psflow.launch.copies`); None: the run did not fail.
        report: that task's error report (:func:`read`), if it left one.
        exit_cause: how that task's last attempt ended (``killed (SIGKILL)``): said where it left no report.

    Returns:
        None without a root cause; else ``{task, exception, message, traceback_tail, text}``: ``task``
        None for a finding; ``exception`` None without a report; ``text`` the one line to show
        (``worker:1: ValueError: loss is nan``).
    """
    if not root_cause:
        return None
    is_task = ":" in root_cause and " " not in root_cause
    if not is_task:
        return {"task": None, "exception": None, "message": root_cause, "traceback_tail": "", "text": root_cause}
    if report:
        exception, message = str(report.get("exception") or "Exception"), str(report.get("message") or "")
        tail = traceback_tail(str(report.get("traceback") or ""))
        first = message.strip().splitlines()[0] if message.strip() else ""
        text = f"{root_cause}: {exception}" + (f": {first[:300]}" if first else "")
        return {"task": root_cause, "exception": exception, "message": message, "traceback_tail": tail, "text": text}
    how = f"{exit_cause}; " if exit_cause else ""
    message = f"{how}it left no error report (killed, or it died before psflow could write one): its log says more"
    return {"task": root_cause, "exception": None, "message": message, "traceback_tail": "",
            "text": f"{root_cause}: {message}"}


def recorded_failure(record: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The root cause in words as the launcher put it, once, at the run's end (``failure`` in
    ``status.json``, ``summary.json`` and the job store's summary); None where the record has none."""
    failure = record.get("failure") if isinstance(record, Mapping) else None
    return dict(failure) if isinstance(failure, Mapping) else None


def failure_from_files(run_dir: RunDir, root: str | None, exit_cause: str | None = None) -> dict[str, Any] | None:
    """The root cause in words of a run whose record does not carry it (recorded before the launcher
    put it there, or by a backend that ran outside the Runner): the root task's error report read
    from the run's ``errors/``, and how its last attempt ended. A report whose path leads out of the
    run's directory (a planted symlink) is not read."""
    if not root or ":" not in root or " " in root:  # none, or a finding (a sentence)
        return describe_root_cause(root)
    path = run_dir.error_report(root)
    base = run_dir.path.resolve()
    report = read(path) if base in path.resolve().parents else None
    return describe_root_cause(root, report, exit_cause)


def ignore_stop_requests() -> None:
    """A failing task from now on ignores SIGTERM (the launcher's stop request) and exits by itself,
    with its failure's own exit code; one that hangs on its way out still gets the launcher's SIGKILL
    after the run's ``grace_s``.

    SIG_IGN, not a Python handler: the interpreter puts Python handlers back to the default during
    its teardown (``_PySignal_Fini``, before the slow part: the collection and module teardown with
    torch loaded), and under the default disposition a SIGTERM delivered to any thread ends the
    process. Only the main thread may set handlers: elsewhere this does nothing.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
