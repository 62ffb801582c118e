"""What ``psflow runs``, ``psflow status RUN`` and ``psflow logs RUN`` show, read from the job store.

A run is named by its id (or a prefix or suffix only it has) in the job store, or by its log
directory (what ``psflow status LOGDIR`` has always taken; read from ``status.json``, so runs from
before the job store, or recorded elsewhere, still show). :func:`find` turns either into a
:class:`RunRef`; the rest render it: a table of runs, JSON, the status table's input, a task's log,
and a log followed until its run ends.

Readers only: nothing here writes a run (the job store's read-time liveness verdict aside, see
:mod:`psflow.platform.jobstore`). Called by :mod:`psflow.cli`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psflow.errors import ConfigError
from psflow.home import jobs_db_path
from psflow.launch.liveness import assess
from psflow.launch.status import headline, read_status, shown_state
from psflow.platform.jobstore import FINAL_STATES, JobStore, JobStoreError
from psflow.platform.runfiles import root_cause_of
from psflow.rundir import RunDir


@dataclass(frozen=True)
class RunRef:
    """A run found by :func:`find`: its log directory, and its job-store record when named by its id."""

    logdir: Path
    run: dict[str, Any] | None  # None: named by its logdir (status.json is read)
    db_path: Path | None = None

    @property
    def tasks(self) -> list[str]:
        return list((self.run or {}).get("tasks") or {})


def open_store(path: Path | None = None) -> JobStore | None:
    """The job store for reading (read-only: a store this user may not write still reads), or None
    where none was ever written (a fresh machine)."""
    path = path or jobs_db_path()
    return JobStore(path, read_only=True) if path.exists() else None


def list_runs(*, state: str | None = None, path: Path | None = None, metrics: bool = True,
              note: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every recorded run, newest first, each with its tasks' latest metrics (unless ``metrics`` is False);
    ``note`` is told what the reader should know of the store (an older schema, read as it stands)."""
    db = open_store(path)
    if db is None:
        return []
    with db:
        if db.note and note is not None:
            note(db.note)
        return db.runs(state=state, metrics=metrics)


def find(ref: str, *, path: Path | None = None) -> RunRef:
    """The run ``ref`` names: a log directory (with a ``status.json``), or a run id in the job store.

    Raises:
        ConfigError: ``ref`` is neither; the message says where it looked and how to list runs.
        JobStoreError: the job store cannot be read, or ``ref`` fits several runs.
    """
    db_path = path or jobs_db_path()
    if "://" in ref:  # psflow run --logdir URL (psflow.launch.urllogdir)
        return _find_url(ref, db_path)
    if Path(ref).is_dir():  # read from its status.json, as psflow status LOGDIR always has
        return RunRef(Path(ref), None)
    with open_store(db_path) or contextlib.nullcontext() as db:
        run_id = db.find_run(ref) if db is not None else None
        run = db.run(run_id) if db is not None and run_id else None
    if run is None:
        raise ConfigError(f"No run {ref!r}: it is not a log directory, and no run in the job store {db_path} has that "
                          f"id, nor an id that starts or ends with it. `psflow runs` lists the runs recorded there "
                          f"(PSFLOW_HOME chooses the store).")
    return RunRef(Path(run["logdir"]), run, db_path)


def _find_url(url: str, db_path: Path) -> RunRef:
    """The newest run recorded with this logdir URL whose staging directory is still here; otherwise
    the URL's own status.json and logs, downloaded into ``$PSFLOW_HOME/cache`` (a run launched
    elsewhere, or whose staging directory was deleted)."""
    import hashlib

    from psflow.home import psflow_home
    from psflow.launch import urllogdir

    with open_store(db_path) or contextlib.nullcontext() as db:
        runs = db.runs() if db is not None else []
    for run in runs:
        if (run.get("launch") or {}).get("logdir_url", "").rstrip("/") == url.rstrip("/") and Path(run["logdir"]).is_dir():
            return RunRef(Path(run["logdir"]), run, db_path)
    cache = psflow_home() / "cache" / hashlib.sha256(url.encode()).hexdigest()[:16]
    return RunRef(urllogdir.download(url, cache), None)


def status_of(ref: RunRef) -> dict[str, Any]:
    """The run's live state in ``status.json``'s shape (for :func:`psflow.launch.status.render`).

    Raises:
        ConfigError: a logdir without a readable ``status.json``.
    """
    if ref.run is not None:
        return {**ref.run, "run_id": ref.run["id"], "failure": root_cause_of(ref.run)}
    try:
        state = read_status(ref.logdir)
    except (OSError, ValueError) as e:
        raise ConfigError(f"Cannot read {RunDir(ref.logdir).status}: {e}. Give the --logdir of a `psflow run` "
                          f"(it writes that file) or a run id (`psflow runs` lists them).") from e
    state.update(headline(state))
    state["failure"] = _logdir_failure(ref.logdir, state)
    return assess(state, now_unix=time.time())


def _logdir_failure(logdir: Path, state: dict[str, Any]) -> dict[str, Any] | None:
    """The root cause in words of a run read from its logdir, as its launcher put it at the run's end
    (``status.json``, else ``summary.json``); for a run recorded without it, from the root task's
    error report. None while the run goes on (no summary yet)."""
    import json

    from psflow import errorreport

    if (stored := errorreport.recorded_failure(state)) is not None:
        return stored
    try:
        summary = json.loads(RunDir(logdir).summary.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict):
        return None
    if (stored := errorreport.recorded_failure(summary)) is not None:
        return stored
    root = summary.get("root_cause")
    task = (state.get("tasks") or {}).get(root) if isinstance(root, str) else None
    if task is None:
        return errorreport.describe_root_cause(root if isinstance(root, str) else None)
    exits = task.get("exits") or []
    return errorreport.failure_from_files(RunDir(logdir), root, exits[-1].get("cause") if exits else None)


def runs_text(runs: Sequence[dict[str, Any]], width: int | None = None) -> str:
    """The runs as a table of plain text: id, state, progress, examples/s, started, script; ``width``:
    the terminal's (the script column folds to fit; None: whole rows). Formatted here rather than by
    rich: a thousand rows in milliseconds, not a second."""
    rows = []
    for r in runs:
        started = r.get("started_unix") or r.get("created_unix")
        rows.append((r["id"], shown_state(r), progress_text(r), f"{r.get('examples_per_sec') or 0:,.0f}",
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "",
                     " ".join([r.get("script") or "", *r.get("args", [])])))
    head = ("id", "state", "progress", "examples/s", "started", "script")
    widths = [max([len(head[i])] + [len(row[i]) for row in rows]) for i in range(5)]
    lead = sum(widths) + 3 * 5 + 1  # the columns before the script, their gaps and the margin
    room = max(10, (width or 10**6) - lead - 1)
    widths.append(min(room, max([len(head[5])] + [len(row[5]) for row in rows])))

    def line(cells: Sequence[str], first: bool = True) -> list[str]:
        script = cells[5]
        parts = [script[i:i + widths[5]] for i in range(0, len(script), widths[5])] or [""]
        fixed = [c.rjust(w) if i == 3 else c.ljust(w) for i, (c, w) in enumerate(zip(cells[:5], widths))]
        out = [" " + "   ".join([*fixed, parts[0].ljust(widths[5])]).rstrip()]
        blank = " " * lead
        return out + [blank + p for p in parts[1:]]

    lines = line(head) + ["─" * (lead + widths[5])]
    for row in rows:
        lines += line(row)
    return "\n".join(lines)


def progress_text(run: dict[str, Any]) -> str:
    """``step 1,200`` and, while the run goes on, how many of its tasks are up: ``step 40, 3/3 up``."""
    text = f"step {run.get('global_step') or 0:,}"
    if run.get("state") == "running":
        text += f", {run.get('running', 0)}/{len(run.get('tasks') or {})} up"
    return text


def runs_json(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs for ``psflow runs --json``: each run's record, tasks and metrics, less its full summary."""
    return [{k: v for k, v in r.items() if k != "summary"} for r in runs]


def log_files(ref: RunRef, task: str | None) -> list[tuple[str, Path]]:
    """The log file of ``task`` (``worker:1``), or of each of the run's tasks.

    Raises:
        ConfigError: ``task`` is not one of the run's, or the run's logs are gone.
    """
    run_dir = RunDir(ref.logdir)
    tasks = ref.tasks or _logdir_tasks(ref.logdir)
    if task is not None:
        if tasks and task not in tasks:
            raise ConfigError(f"--task {task!r} is not a task of this run. Its tasks: {', '.join(tasks)}.")
        tasks = [task]
    if not run_dir.logs.is_dir():
        raise ConfigError(f"The run's logs are not at {run_dir.logs} (the log directory was moved or deleted).")
    return [(t, run_dir.log(t)) for t in tasks]


def is_over(ref: RunRef) -> Callable[[], bool]:
    """A check of whether the run has ended (finished, or abandoned by a launcher that died)."""
    if ref.run is not None and ref.db_path is not None:
        run_id, db_path = ref.run["id"], ref.db_path

        def over_in_store() -> bool:
            try:
                with JobStore(db_path, read_only=True) as db:
                    run = db.run(run_id, metrics=False)
            except JobStoreError:
                return False  # locked for now: ask again at the next poll
            return run is None or run["state"] in FINAL_STATES
        return over_in_store

    def over_in_logdir() -> bool:
        try:
            return status_of(ref).get("state") != "running"
        except ConfigError:
            return True
    return over_in_logdir


def follow(files: Sequence[tuple[str, Path]], over: Callable[[], bool], write: Callable[[str], None], *,
           prefix: bool, poll_s: float = 0.5) -> None:
    """Write each file's lines as they come (from its start), until ``over()`` says the run ended;
    then what the files still hold, and return. No deadline: a run may go on for days (Ctrl-C ends it).

    ``prefix``: put ``task | `` before each line (several files interleaved).
    """
    offsets = {path: 0 for _, path in files}
    partial = {path: "" for _, path in files}
    while True:
        ended = over()  # before reading: the last read then sees everything the run wrote
        for task, path in files:
            text, offsets[path] = _read_from(path, offsets[path])
            lines = (partial[path] + text).split("\n")
            partial[path] = lines.pop()
            for line in lines:
                write(f"{task} | {line}" if prefix else line)
        if ended:
            for task, path in files:
                if partial[path]:
                    write(f"{task} | {partial[path]}" if prefix else partial[path])
            return
        time.sleep(poll_s)  # a poll interval, not a synchronisation: the loop ends on the run's state


def _read_from(path: Path, offset: int) -> tuple[str, int]:
    try:
        with path.open("rb") as f:
            if f.seek(0, 2) < offset:  # truncated or rotated: read the new file from its start
                offset = 0
            f.seek(offset)
            data = f.read()
    except OSError:
        return "", offset  # not written yet
    return data.decode(errors="replace"), offset + len(data)


def _logdir_tasks(logdir: Path) -> list[str]:
    try:
        return list(read_status(logdir).get("tasks") or {})
    except (OSError, ValueError):
        return RunDir(logdir).logged_tasks()

