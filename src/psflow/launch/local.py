"""LocalBackend: every task of a plan as a process on this machine.

Starts the coordinator (rendezvous + reports) in this process, then each task in its own process
group with a fresh job secret (a 0600 file in the log dir), prefixes every output line with the
task id (and keeps a log file per task), and watches exits:

- a training task (chief/worker) that fails fails the run: the others are stopped, and the first
  failure is printed first as the root cause, from the task's JSON error report;
- once every training task has exited cleanly, the ps tasks exit by themselves (they are told the
  workers are done); one that does not within ``ps_exit_timeout_s`` is stopped, with a warning;
- Ctrl-C or SIGTERM stops every task: SIGTERM to each process group, SIGKILL after ``grace_s``.
  No process is left behind (each task, and the fork server, dies with its parent).

Tasks are forked from a fork server that imported torch once (``forkserver.py``; ``preload=False``
or ``psflow run --no-preload`` starts each as a fresh interpreter): with six tasks on two cores
that starts the run ~3.5 s sooner.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import click

from psflow.launch.backend import Backend, RunResult
from psflow.launch.coordinator import Coordinator
from psflow.launch.forkserver import ForkServer, die_with_parent
from psflow.launch.metrics import job_rate, run_metrics, task_metrics, trainer_figures
from psflow.launch.plan import LaunchPlan
from psflow.launch.rootcause import TaskExit, root_cause
from psflow.launch.status import RunStatus, render
from psflow.server import Server

_FORK_SERVER_READY_S = 60.0
_ROTATED = re.compile(r"\.\d+\.log$")  # worker-0.1.log: an earlier run's (task names never end in .N)
_COLORS = ["cyan", "green", "yellow", "magenta", "blue", "red", "bright_cyan", "bright_green"]


class _Stop(Exception):
    """Raised in the main thread by SIGTERM, handled like Ctrl-C."""


class LocalBackend(Backend):
    def __init__(
        self, *, echo: Callable[[str], None] | None = None, register_timeout_s: float = 120.0, preload: bool = True,
        live: bool | None = None, keep_logs: int = 5,
    ) -> None:
        self.echo = echo or (lambda line: click.echo(line))
        self.register_timeout_s = register_timeout_s
        self.preload = preload  # fork tasks from a server that imported torch once (see forkserver.py)
        # A live table of the tasks under their output: by default when printing to a terminal.
        self.live = live if live is not None else (echo is None and sys.stdout.isatty())
        self._echo_lock = threading.Lock()
        self._tracebacks: dict[str, str] = {}  # each traceback echoed this run -> the task that printed it
        if keep_logs < 0:
            raise ValueError(f"keep_logs must be >= 0; received {keep_logs}.")
        self.keep_logs = keep_logs  # logs of earlier runs into the same logdir kept per task (NAME.1.log newest)

    @contextlib.contextmanager
    def _live_table(self, status: RunStatus) -> Iterator[None]:
        """While the run lasts, keep the status table at the bottom of the terminal (rich), with the
        tasks' output scrolling above it. (The final table is printed once the run is over.)"""
        if not self.live:
            yield
            return
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        console = Console()
        plain = self.echo
        with Live(get_renderable=lambda: render(status.snapshot()), console=console, refresh_per_second=2,
                  transient=True) as live:
            self.echo = lambda line: live.console.print(Text.from_ansi(line), soft_wrap=True)
            try:
                yield
            finally:
                self.echo = plain

    def run(self, plan: LaunchPlan) -> RunResult:
        logdir = Path(plan.logdir)
        (logdir / "logs").mkdir(parents=True, exist_ok=True)
        rotate_logs(logdir / "logs", self.keep_logs)  # a rerun into this logdir keeps the earlier runs' logs
        (logdir / "errors").mkdir(parents=True, exist_ok=True)
        for stale in (logdir / "errors").glob("*.json*"):  # reports (and temporaries) of an earlier run
            stale.unlink()
        secret = secrets.token_hex(32).encode()
        secret_file = logdir / ".secret"
        secret_file.touch(mode=0o600)
        secret_file.write_bytes(secret)
        server = Server("launcher", secret=secret)
        status = RunStatus(plan.run_id, plan.task_names(), logdir, mode=plan.config.mode, strategy=plan.config.strategy)
        coord = Coordinator(server, plan.task_names(), register_timeout_s=self.register_timeout_s,
                            require_ps=plan.config.strategy == "ps", on_event=status.on_event)
        address = server.start()
        t0 = time.time()
        fork_server = forks = self._start_fork_server(plan) if self.preload else None
        procs: dict[str, subprocess.Popen] = {}
        exits: queue.Queue[tuple[str, int]] = queue.Queue()
        codes: dict[str, int] = {}
        seen: list[TaskExit] = []  # exits in the order they came, for the root-cause rule
        root: str | None = None
        stopped_by: str | None = None
        with self._live_table(status):
            old_term = signal.signal(signal.SIGTERM, _raise_stop)
            try:
                for i, tp in enumerate(plan.tasks):
                    env = {**os.environ, **dict(tp.env), "PSFLOW_COORDINATOR": address, "PSFLOW_SECRET_FILE": str(secret_file)}
                    env.pop("PSFLOW_SECRET", None)
                    p, forks = self._start_task(tp.argv, env, forks)
                    procs[tp.task] = p
                    status.started(tp.task, p.pid)
                    log_file = open(logdir / "logs" / f"{tp.file_stem}.log", "w")
                    threading.Thread(target=self._pump, args=(tp.task, p.stdout, log_file, _COLORS[i % len(_COLORS)]), daemon=True).start()
                    threading.Thread(target=lambda t=tp.task, p=p: exits.put((t, p.wait())), daemon=True).start()
                root = self._watch(plan, procs, exits, codes, status, seen)
            except (KeyboardInterrupt, _Stop) as e:
                stopped_by = "SIGTERM" if isinstance(e, _Stop) else "Ctrl-C"
                self.echo(click.style(f"psflow: {stopped_by}: stopping every task (SIGTERM, then SIGKILL after {plan.grace_s:.0f} s)", fg="yellow"))
                self._stop_all(procs, codes, plan.grace_s)
            finally:
                signal.signal(signal.SIGTERM, old_term)
                self._stop_all(procs, codes, plan.grace_s)
                if fork_server is not None:
                    fork_server.close()
                server.stop()
        wall_s = time.time() - t0
        if root is not None:
            root = _root_cause(plan, codes, seen) or root
        summary = build_summary(plan, coord, procs, codes, wall_s, root, stopped_by)
        (logdir / "summary.json").write_text(json.dumps(summary, indent=1))
        for task, code in codes.items():  # the tasks stopped at the end
            status.exited(task, code)
        status.finished(summary["status"])
        if self.live:
            from rich.console import Console

            Console().print(render(status.snapshot()))
        if root is not None:
            self._print_root_cause(plan, root, codes)
        exit_code = 0 if root is None and stopped_by is None else (130 if stopped_by else 1)
        return RunResult(exit_code, summary, root)

    # -- helpers ---------------------------------------------------------------------------
    def _watch(self, plan: LaunchPlan, procs: dict[str, Any], exits: queue.Queue[tuple[str, int]],
               codes: dict[str, int], status: RunStatus, seen: list[TaskExit]) -> str | None:
        """Record exits until every task has exited. The first training task to fail stops the
        others (its name is returned); once the training tasks are done, ps tasks get
        ``ps_exit_timeout_s`` to exit by themselves."""
        root: str | None = None
        trainers = [t.task for t in plan.tasks if t.job in ("chief", "worker")]
        ps_deadline: float | None = None
        while len(codes) < len(procs):
            try:
                task, code = exits.get(timeout=0.5)
            except queue.Empty:
                status.write()  # publish the last changes of a quiet spell
                if ps_deadline is not None and time.monotonic() > ps_deadline:
                    left = [t for t in procs if t not in codes]
                    self.echo(click.style(f"psflow: {', '.join(left)} did not exit {plan.ps_exit_timeout_s:.0f} s after "
                                          "the workers finished; stopping them.", fg="yellow"))
                    self._stop_all(procs, codes, plan.grace_s)
                    ps_deadline = None
                continue
            codes[task] = code
            seen.append(TaskExit(task, code, time.time(), stopped=root is not None))
            status.exited(task, code)
            if code != 0 and root is None:
                root = task
                self._stop_all(procs, codes, plan.grace_s)
            if ps_deadline is None and all(codes.get(t) == 0 for t in trainers):
                ps_deadline = time.monotonic() + plan.ps_exit_timeout_s
        return root

    def _start_fork_server(self, plan: LaunchPlan) -> ForkServer | None:
        """The fork server, once it has imported torch; None (fresh processes) where it cannot run."""
        if not plan.tasks or not hasattr(os, "pidfd_open") or not hasattr(socket, "send_fds"):
            return None
        try:
            forks = ForkServer(plan.tasks[0].argv[0], log_path=Path(plan.logdir) / "logs" / "forkserver.log")
        except OSError as e:
            self.echo(click.style(f"psflow: cannot start the fork server ({e}); starting every task as a fresh process.",
                                  fg="yellow"))
            return None
        if forks.wait_ready(_FORK_SERVER_READY_S):
            return forks
        forks.close()
        self.echo(click.style(f"psflow: the fork server did not start within {_FORK_SERVER_READY_S:.0f} s (see "
                              f"{plan.logdir}/logs/forkserver.log); starting every task as a fresh process.", fg="yellow"))
        return None

    def _start_task(self, argv: tuple[str, ...], env: dict[str, str], forks: ForkServer | None) -> tuple[Any, ForkServer | None]:
        """Fork the task from the fork server when it can be, else start a fresh process. Returns the
        process (Popen or ForkedTask) and the fork server still to use (None after it failed)."""
        if forks is not None and forks.usable_for(argv, env, os.environ):
            try:
                return forks.spawn(argv, env, os.getcwd()), forks
            except OSError as e:  # it stays up for the tasks it forked already; the run closes it
                self.echo(click.style(f"psflow: {e}; starting the remaining tasks as fresh processes.", fg="yellow"))
                forks = None
        if env.get("PSFLOW_NUM_THREADS"):
            # A fresh interpreter's torch takes its thread count from OMP_NUM_THREADS at import,
            # before the script could call set_num_threads (which still wins).
            env = {**env, "OMP_NUM_THREADS": env["PSFLOW_NUM_THREADS"]}
        p = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, text=True, bufsize=1, preexec_fn=die_with_parent,
        )
        return p, forks

    def _pump(self, task: str, stream: TextIO, log_file: TextIO, color: str) -> None:
        """Copy a task's output to its log file and the console. A traceback is echoed once it is
        whole, and only once per run: the same error in every task (a script that fails at import)
        shows as one traceback and a line per other task. The log file keeps everything."""
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
                        self._echo_traceback(task, prefix, block)
                        block = None
                else:
                    with self._echo_lock:
                        self.echo(f"{prefix} {line.rstrip()}")
            if block:
                self._echo_traceback(task, prefix, block)

    def _echo_traceback(self, task: str, prefix: str, block: list[str]) -> None:
        text = "".join(block).strip()
        with self._echo_lock:
            first = self._tracebacks.setdefault(text, task)
            if first != task:
                self.echo(f"{prefix} {block[-1].rstrip()} (the same traceback as {first}'s above)")
                return
            for line in block:
                self.echo(f"{prefix} {line.rstrip()}")

    def _stop_all(self, procs: dict[str, subprocess.Popen], codes: dict[str, int], grace_s: float) -> None:
        alive = [p for p in procs.values() if p.poll() is None]
        for p in alive:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in alive:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait(timeout=10)
        for p in procs.values():  # children the tasks may have left in their groups
            _signal_group(p, signal.SIGKILL)
        for t, p in procs.items():
            codes.setdefault(t, p.returncode if p.returncode is not None else -9)

    def _print_root_cause(self, plan: LaunchPlan, root: str, codes: dict[str, int]) -> None:
        report = _error_report(plan, root)
        self.echo(click.style(f"psflow: the run failed. Root cause: {root} exited with code {codes[root]}", fg="red", bold=True))
        if report:
            self.echo(f"  {report.get('exception')}: {report.get('message')}")
            shown_by = self._tracebacks.get(str(report.get("traceback", "")).strip())
            if shown_by:  # in the output above already: not a second time
                self.echo(f"  (traceback above, from {shown_by}; also in {Path(plan.logdir) / 'errors'})")
            else:
                self.echo("  " + report.get("traceback", "").rstrip().replace("\n", "\n  "))
        else:
            self.echo(f"  (no error report; last lines of {Path(plan.logdir) / 'logs' / (root.replace(':', '-') + '.log')}:)")
            self.echo(_tail(Path(plan.logdir) / "logs" / f"{root.replace(':', '-')}.log"))
        others = [t for t, c in codes.items() if t != root and c != 0]
        for t in others:
            r = _error_report(plan, t)
            why = f"{r.get('exception')}: {r.get('message')}" if r else f"exit code {codes[t]} (stopped after the root cause)"
            self.echo(f"  then {t}: {why}")


def rotate_logs(logs: Path, keep: int) -> None:
    """Keep the logs of earlier runs into the same logdir, as logrotate does: ``worker-0.log`` becomes
    ``worker-0.1.log``, an older ``worker-0.1.log`` becomes ``worker-0.2.log``, and so on; beyond
    ``keep`` the oldest is deleted. Called once, before any task of the new run writes its log."""
    for current in sorted(logs.glob("*.log")):
        if _ROTATED.search(current.name):
            continue
        stem = current.name[: -len(".log")]
        for n in range(keep, 0, -1):
            older = logs / f"{stem}.{n}.log"
            if older.exists():
                if n == keep:
                    older.unlink()
                else:
                    older.replace(logs / f"{stem}.{n + 1}.log")
        if keep:
            current.replace(logs / f"{stem}.1.log")
        else:
            current.unlink()


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _root_cause(plan: LaunchPlan, codes: dict[str, int], seen: list[TaskExit]) -> str | None:
    """The rule of :mod:`psflow.launch.rootcause` over this run's exits and error reports. Tasks
    whose exit the launcher only collected while stopping the run count as stopped."""
    now = time.time()
    noticed = {e.task for e in seen}
    exits = seen + [TaskExit(t, c, now, stopped=True) for t, c in codes.items() if t not in noticed]
    reports = {t: r for t in codes if (r := _error_report(plan, t)) is not None}
    return root_cause(plan.task_names(), exits, reports)


def _error_report(plan: LaunchPlan, task: str) -> dict[str, Any] | None:
    path = Path(plan.logdir) / "errors" / f"{task.replace(':', '-')}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join("  " + line for line in path.read_text().splitlines()[-n:])
    except OSError:
        return "  (no log)"


def build_summary(
    plan: LaunchPlan, coord: Coordinator, procs: dict[str, subprocess.Popen], codes: dict[str, int],
    wall_s: float, root: str | None, stopped_by: str | None,
) -> dict[str, Any]:
    """The run's summary.json: headline figures first, then every task and its reports."""
    reports = coord.reports
    # A task stopped or killed has no final report: its last live progress counts (see launch.metrics).
    figures = trainer_figures(reports)
    steps = [r.get("global_step") for r in reports.values() if isinstance(r.get("global_step"), int)]
    steps += [f.get("global_step", 0) for f in figures.values()]
    steps += [r["progress"].get("global_step", 0) for r in reports.values() if isinstance(r.get("progress"), dict)]
    chief = next((t for t in plan.task_names() if t.startswith(("chief", "worker"))), None)
    metrics_by_task = {t: m for t, r in reports.items() if (m := task_metrics(r))}
    metrics = run_metrics(metrics_by_task, chief)
    accs = {t: m["test_accuracy"] for t, m in metrics_by_task.items() if "test_accuracy" in m}
    ps_stats = {t: r["ps_stats"] for t, r in reports.items() if "ps_stats" in r}
    return {
        "run_id": plan.run_id,
        "status": "succeeded" if root is None and stopped_by is None else ("stopped" if stopped_by else "failed"),
        "root_cause": root,
        "mode": plan.config.mode,
        "strategy": plan.config.strategy,
        "global_step": max(steps, default=0),
        "metrics": metrics,  # the script's task.report(name=number), as named (the chief's first)
        "metrics_by_task": metrics_by_task,
        **({"test_accuracy": metrics["test_accuracy"], "test_accuracy_by_task": accs} if accs else {}),
        "examples": sum(int(f.get("examples") or 0) for f in figures.values()),
        "examples_per_sec": job_rate(figures.values()),
        "wall_s": round(wall_s, 3),
        "counters": {
            "stale_dropped": sum(s.get("stale_dropped", 0) for s in ps_stats.values()),
            "steps_without_all_workers": max((s.get("steps_without_all", 0) for s in ps_stats.values()), default=0),
            "wait_s": round(sum(s.get("wait_s", 0.0) for s in ps_stats.values()), 3),
        },
        "tasks": [
            {
                "task": t,
                "pid": p.pid,
                "address": coord.addresses.get(t),
                "exit_code": codes.get(t),
                "attempts": 1,
                "log": str(Path(plan.logdir) / "logs" / f"{t.replace(':', '-')}.log"),
            }
            for t, p in procs.items()
        ],
        "reports": reports,
    }
