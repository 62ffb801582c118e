"""The live state of a run: kept by the launcher, written to ``LOGDIR/status.json``, shown as a table.

Owns: every task's state (``starting`` -> ``running`` once registered -> ``exited`` with its code;
a task the restart policy restarts is ``restarting`` through its backoff, then ``starting`` again
with its next ``attempt``; a task the watchdog caught is ``hung`` until its kill is seen, and its
``hang`` says how and where its stacks went: ``{"attempt", "kind", "quiet_s", "cause", "stacks":
{"log", "line"}}``), every attempt's exit (``exits``: attempt, code, signal, cause, how long it ran,
whether it was restarted, and the ``hang`` that ended it), pid, address and last progress report
(global step, local step, examples, examples/sec, loss), and
the run's state (``running`` -> ``succeeded`` | ``failed`` | ``stopped``) and, while it runs, its
``phase`` (``running``, ``draining``, ``stopping``, ``finished``: the controller's). Updates are pure and
under a lock (they come from the launcher's threads); :meth:`RunStatus.write` publishes the whole
state atomically (temporary file + rename), at most every ``min_interval_s`` unless forced, so a
reader — ``psflow status``, a dashboard, a test — never sees half a file. The launcher writes it
through :class:`psflow.launch.runstore.FileRunStore`.

:func:`render` turns a status dict into a rich table: the launcher's live display on a terminal,
and ``psflow status LOGDIR``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from psflow.launch.controller import attempt_cause, signal_name
from psflow.launch.liveness import process_identity
from psflow.launch.metrics import job_rate
from psflow.rundir import RunDir

# Trainers report the first nine; a ps reports global_step, pushes, stale_dropped and resyncing (with replicas:
# a copy still loading, or a shard of its pairs not synced; psflow chaos waits for it before it hits a ps).
_PROGRESS_KEYS = ("global_step", "local_step", "examples", "train_time_s", "wall_time_s", "examples_per_sec",
                  "step_examples_per_sec", "loss", "time_unix", "pushes", "stale_dropped", "resyncing")


class RunStatus:
    """The launcher's view of a run, for ``status.json`` and the live table."""

    def __init__(self, run_id: str, tasks: Sequence[str], logdir: str | os.PathLike[str], *,
                 mode: str = "async", strategy: str = "ps", min_interval_s: float = 0.5,
                 heartbeat_s: float = 5.0) -> None:
        self.path = RunDir(logdir).status
        self.min_interval_s = min_interval_s
        self.heartbeat_s = heartbeat_s  # written at least this often, changed or not: a reader tells a live launcher
        self._lock = threading.Lock()
        self._written: float | None = None  # never written (not 0.0: a young machine's monotonic clock starts near 0)
        self._dirty = True
        self._state: dict[str, Any] = {
            "run_id": run_id,
            "state": "running",
            "mode": mode,
            "strategy": strategy,
            "started_unix": time.time(),
            "updated_unix": time.time(),
            "heartbeat_unix": time.time(),
            # Who writes this file: `psflow status` tells a live run from one whose launcher died.
            "launcher": process_identity(os.getpid()),
            "tasks": {t: {"state": "starting", "attempt": 0, "pid": None, "address": None, "exit_code": None, "progress": {},
                          "exits": []}
                      for t in tasks},
        }

    # -- updates (any thread) ------------------------------------------------------------------
    def started(self, task: str, pid: int, attempt: int = 0) -> None:
        # A restart starts over; the first attempt keeps a state its registration may have set already.
        again = {"state": "starting", "exit_code": None, "address": None, "restart_unix": None, "hang": None} if attempt > 0 else {}
        self._update(task, pid=pid, identity=process_identity(pid), attempt=attempt, started_unix=time.time(), **again)

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        """The coordinator's events: ``registered`` (a task is up) and ``report`` (its metrics)."""
        task = str(data.get("task"))
        if kind == "registered":
            self._update(task, state="running", address=data.get("address"))
        elif kind == "report":
            metrics = data.get("metrics") or {}
            # Live progress from trainers; at the end, a trainer's final stats or a ps's global step.
            for key in ("progress", "trainer"):
                if isinstance(metrics.get(key), dict):
                    self._progress(task, metrics[key])
            if isinstance(metrics.get("global_step"), int):
                self._progress(task, {"global_step": metrics["global_step"]})

    def exited(self, task: str, code: int, *, attempt: int = 0, at: float | None = None, oom_killed: bool = False,
               hang: dict[str, Any] | None = None, cause: str | None = None) -> None:
        """Attempt ``attempt`` of ``task`` ended with ``code``; its exit joins the task's ``exits``
        (``hang``: the watchdog killed it; its cause is the exit's; ``cause``: why it ended, as the
        controller recorded it, else :func:`~psflow.launch.controller.attempt_cause`)."""
        at = time.time() if at is None else at
        with self._lock:
            entry = self._state["tasks"].get(task)
            started = entry.get("started_unix") if entry else None
            if entry is not None:
                entry["exits"].append({
                    "attempt": attempt, "code": code, "signal": signal_name(code),
                    "cause": cause or attempt_cause(code, oom_killed, hang),
                    "time_unix": round(at, 3), "ran_s": None if started is None else round(max(0.0, at - started), 3),
                    "restarted": False, **({"hang": hang} if hang else {})})
        self._update(task, state="exited", exit_code=code)
        self.write(force=True)

    def add_tasks(self, tasks: Sequence[str]) -> None:
        """``psflow scale`` added ``tasks`` (a retired one added back keeps its history)."""
        with self._lock:
            for t in tasks:
                self._state["tasks"].setdefault(t, {"state": "starting", "attempt": 0, "pid": None, "address": None,
                                                    "exit_code": None, "progress": {}, "exits": []})
            self._dirty = True
        self.write(force=True)

    def retired(self, task: str) -> None:
        """``psflow scale`` retired ``task``: its last exit is an expected end."""
        with self._lock:
            entry = self._state["tasks"].get(task)
            if entry is not None and entry["exits"]:
                entry["exits"][-1]["retired"] = True
        self._update(task, state="retired")
        self.write(force=True)

    def hung(self, task: str, hang: dict[str, Any]) -> None:
        """The watchdog caught ``task`` (see :meth:`psflow.launch.watchdog.Hang.to_dict`); it is killed next."""
        self._update(task, state="hung", hang=hang)
        self.write(force=True)

    def restarting(self, task: str, attempt: int, after_s: float) -> None:
        """``task`` will start again as attempt ``attempt`` in ``after_s`` seconds."""
        with self._lock:
            entry = self._state["tasks"].get(task)
            if entry is not None and entry["exits"]:
                entry["exits"][-1]["restarted"] = True
        self._update(task, state="restarting", restart_unix=round(time.time() + after_s, 3))
        self.write(force=True)

    def phase(self, phase: str) -> None:
        """The run's phase changed (``running``, ``draining``, ``stopping``, ``finished``: the controller's)."""
        with self._lock:
            self._state["phase"] = phase
            self._dirty = True
        self.write(force=True)

    def finished(self, state: str, *, failure: Mapping[str, Any] | None = None) -> None:
        """The run ended in ``state``; ``failure``: its root cause in words (the launcher's, computed once)."""
        with self._lock:
            self._state["state"] = state
            if failure is not None:
                self._state["failure"] = dict(failure)
            self._dirty = True
        self.write(force=True)

    def _progress(self, task: str, figures: dict[str, Any]) -> None:
        self._update(task, progress={k: figures[k] for k in _PROGRESS_KEYS if k in figures})

    def _update(self, task: str, *, progress: dict[str, Any] | None = None, **fields: Any) -> None:
        with self._lock:
            entry = self._state["tasks"].get(task)
            if entry is None:
                return
            entry.update(fields)
            entry["progress"].update(progress or {})
            self._state["updated_unix"] = time.time()
            self._dirty = True
        self.write()

    # -- reading and publishing -------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """A copy of the state, with the run's headline figures (see :func:`headline`)."""
        with self._lock:
            state = json.loads(json.dumps(self._state))
        state.update(headline(state))
        return state

    def write(self, *, force: bool = False) -> None:
        """Publish ``status.json`` atomically. Unless forced, only if something changed since the last
        write and that write is ``min_interval_s`` old: call it periodically too, so that the last
        change of a quiet spell is published."""
        now = time.monotonic()
        with self._lock:
            age = None if self._written is None else now - self._written
            due = self._dirty or age is None or age >= self.heartbeat_s
            if not force and (not due or (age is not None and age < self.min_interval_s)):
                return
            self._written, self._dirty = now, False
            self._state["heartbeat_unix"] = time.time()
        state = self.snapshot()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_text(json.dumps(state, indent=1))
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)  # the log directory went away: the run's own output still shows it


def headline(state: dict[str, Any]) -> dict[str, Any]:
    """The run's figures from its tasks' last progress: the job's global step (the largest any
    task reported), the job's examples/sec, wall-clock and inside the steps
    (:func:`psflow.launch.metrics.job_rate`, the same figures as ``summary.json``'s), the number of
    running tasks."""
    tasks = state.get("tasks", {})
    progress = [t.get("progress") or {} for t in tasks.values()]
    steps = [p["global_step"] for p in progress if isinstance(p.get("global_step"), int)]
    return {
        "global_step": max(steps, default=0),
        "examples_per_sec": job_rate(progress),
        "step_examples_per_sec": job_rate(progress, "train_time_s"),
        "running": sum(1 for t in tasks.values() if t.get("state") == "running"),
    }


def read_status(logdir: str | os.PathLike[str]) -> dict[str, Any]:
    """Read ``LOGDIR/status.json`` (raises FileNotFoundError or json.JSONDecodeError)."""
    return json.loads(RunDir(logdir).status.read_text())


def render(state: dict[str, Any]) -> Any:
    """A rich Table of the run: one row per task, the headline in the title; under it, a failed run's
    root cause in words (``state["failure"]``: :func:`psflow.errorreport.describe_root_cause`)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    title = (f"psflow run {state.get('run_id')} ({shown_state(state)}, {state.get('mode')}): global step "
             f"{state.get('global_step', 0):,}, {state.get('examples_per_sec', 0):,.0f} examples/s")
    notes = ([state["note"]] if state.get("note") else []) + _restart_lines(state)  # note: an abandoned run's
    caption = Text("\n".join(notes)) if notes else None
    table = Table(title=Text(title), title_justify="left", caption=caption, caption_justify="left",
                  expand=False)  # Text: no rich markup in names
    tasks = state.get("tasks", {})
    restarted = any(t.get("attempt") or t.get("state") == "restarting" for t in tasks.values())
    columns = ("task", "state", *(("attempt",) if restarted else ()), "pid", "global step", "local step", "examples/s", "loss")
    states = {name: _state_cell(t) for name, t in tasks.items()}
    widths = {"task": max(map(len, tasks), default=4), "state": max(map(len, states.values()), default=5)}
    for col in columns:
        # A task's name and state are never cut ("worker…" would not say which); the figures give way.
        table.add_column(col, justify="left" if col in widths else "right", no_wrap=col in widths,
                         min_width=widths.get(col))
    for name, t in tasks.items():
        p = t.get("progress") or {}
        table.add_row(
            name,
            states[name],
            *((str(t.get("attempt") or 0),) if restarted else ()),
            str(t.get("pid") or ""),
            f"{p['global_step']:,}" if "global_step" in p else "",
            f"{p['local_step']:,}" if "local_step" in p else "",
            f"{p['examples_per_sec']:,.0f}" if "examples_per_sec" in p else "",
            f"{p['loss']:.4g}" if isinstance(p.get("loss"), (int, float)) else "",
        )
    failure = state.get("failure")
    return Group(table, _failure_text(failure)) if isinstance(failure, dict) else table


def shown_state(run: Mapping[str, Any]) -> str:
    """A run's state as said to the user: a running run's phase once its training is over or it is
    being stopped (``draining``, ``stopping``), else its state."""
    state = str(run.get("state"))
    return str(run["phase"]) if state == "running" and run.get("phase") in ("draining", "stopping") else state


def _failure_text(failure: dict[str, Any]) -> Any:
    """``root cause: worker:1: ValueError: loss is nan``, then the traceback's tail, indented."""
    from rich.text import Text

    text = Text("root cause: ", style="bold red")
    text.append(str(failure.get("text", "")))
    tail = str(failure.get("traceback_tail") or "")
    if tail:
        text.append("\n  " + tail.replace("\n", "\n  "))
    return text


def _state_cell(t: dict[str, Any]) -> str:
    """``running``, ``done``, ``exit 1``, ``exit -9 (SIGKILL)``, ``exit -9 (hung)``, ``restarting`` (why:
    in the caption)."""
    code = t.get("exit_code")
    exits = t.get("exits") or []
    if t.get("state") == "restarting":
        return "restarting"
    if t.get("state") == "retired":  # psflow scale retired it: an expected end, whatever its code
        return "retired" if code is None else f"retired (exit {code})"
    if code is None:
        return "gone" if t.get("alive") is False else t.get("state", "?")  # gone: its process died unseen
    if code == 0:
        return "done"
    if exits and exits[-1].get("hang"):
        return f"exit {code} ({exits[-1]['hang'].get('kind', 'hung')})"
    cause = exits[-1].get("cause", "") if exits else ""
    detail = cause[len("killed ("):-1] if cause.startswith("killed (") else signal_name(code)
    return f"exit {code}" + (f" ({detail})" if detail else "")


def _restart_lines(state: dict[str, Any]) -> list[str]:
    """A line per attempt that was restarted or hung: ``worker:1 attempt 0: killed (SIGKILL) after 4.7 s;
    restarted``, ``worker:1 attempt 0: hung: no progress for 3.1 s; stacks in LOG from line 57 ...``; and
    one for a task caught now, before its kill. (The table's ``attempt`` column, shown once a task was
    restarted, is each task's current attempt.)"""
    lines = []
    for name, t in state.get("tasks", {}).items():
        for x in t.get("exits") or []:
            if x.get("restarted") or x.get("hang"):
                ran = f" after {x['ran_s']:.1f} s" if isinstance(x.get("ran_s"), (int, float)) else ""
                then = "; restarted" if x.get("restarted") else ""
                lines.append(f"{name} attempt {x.get('attempt')}: {x.get('cause')}{ran}{then}")
        hang = t.get("hang")
        if t.get("state") == "hung" and isinstance(hang, dict):
            lines.append(f"{name} attempt {hang.get('attempt')}: {hang.get('cause')}; being killed")
    return lines
