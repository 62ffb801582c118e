"""LocalBackend: every task of a plan as a process on this machine.

Implements :class:`psflow.launch.backend.Backend`. Each attempt of a task runs in its own process
group (session); its output is prefixed with the task id on the console (each traceback once per
run, see :mod:`psflow.launch.console`) and kept in ``LOGDIR/logs/<task>.log`` (a rerun into the
same logdir rotates the earlier runs' logs, logrotate style; a restarted attempt appends). Exits
are seen by a thread per process and handed out by :meth:`LocalBackend.poll` (a SIGKILL exit is
marked ``oom_killed`` where the cgroup's OOM-kill counter rose, :mod:`psflow.launch.oomkills`); :meth:`LocalBackend.stop`
sends SIGTERM to each process group and SIGKILL after ``grace_s``, then SIGKILL to the group for
children a task left behind; :meth:`LocalBackend.dump_stacks` sends SIGUSR1 to the task's process
alone (not its group: a child without psflow's handler, a data loader's worker, would die of it).
No process is left behind: each task, and the fork server, dies with its parent, and :meth:`LocalBackend.close` kills every group it started.

Tasks are forked from a fork server that imported torch once (``forkserver.py``; ``preload=False``
or ``psflow run --no-preload`` starts each as a fresh interpreter): with six tasks on two cores
that starts the run ~3.5 s sooner.

What to start and stop, and when, is the runner's and the controller's business
(:mod:`psflow.launch.runner`); ``LocalBackend().run(plan)`` runs a whole plan through them.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psflow.launch import errorreport, proctree
from psflow.launch.backend import Backend, RunResult, drain, log_end
from psflow.launch.console import Console
from psflow.launch.controller import TaskExited
from psflow.launch.forkserver import ForkServer, die_with_parent
from psflow.launch.oomkills import OomKills
from psflow.launch.plan import LaunchPlan, TaskPlan
from psflow.launch.watchdog import StackDump

if TYPE_CHECKING:
    from psflow.launch.runstore import RunStore

_ROTATED = re.compile(r"\.\d+\.log$")  # worker-0.1.log: an earlier run's (task names never end in .N)


class LocalBackend(Backend):
    """Local processes. ``echo``/``live``: the console (see :class:`psflow.launch.console.Console`);
    ``preload``: fork tasks from a server that imported torch once; ``keep_logs``: logs of earlier
    runs into the same logdir kept per task (NAME.1.log newest); ``register_timeout_s``: the
    rendezvous deadline, for :meth:`run`."""

    def __init__(
        self, *, echo: Callable[[str], None] | None = None, register_timeout_s: float = 120.0, preload: bool = True,
        live: bool | None = None, keep_logs: int = 5, fork_server_ready_s: float = 60.0,
    ) -> None:
        super().__init__(Console(echo, live=live))
        self.fork_server_ready_s = fork_server_ready_s  # how long the fork server may take to import torch
        self.register_timeout_s = register_timeout_s
        self.preload = preload
        if keep_logs < 0:
            raise ValueError(f"keep_logs must be >= 0; received {keep_logs}.")
        self.keep_logs = keep_logs
        self._plan: LaunchPlan | None = None
        self._fork_server: ForkServer | None = None  # closed at the end of the run
        self._forks: ForkServer | None = None  # the one to fork from: None once it failed
        self._procs: dict[str, Any] = {}  # task -> its current attempt's process (Popen or ForkedTask)
        self._started: list[Any] = []  # every process of the run, for close()
        self._exits: queue.Queue[TaskExited] = queue.Queue()
        self._oom_kills: OomKills | None = None

    @property
    def live(self) -> bool:
        return self.console.live

    def run(self, plan: LaunchPlan, *, store: Callable[[LaunchPlan], RunStore] | None = None) -> RunResult:
        """Run ``plan`` to its end with the default rules (see :class:`psflow.launch.runner.Runner`).
        ``store``: makes the run's store (default: its files only; :func:`psflow.platform.recording.recording`
        records it in the job store too).

        Example:
            >>> LocalBackend().run(make_plan("train.py", num_ps=1, num_workers=2)).exit_code
            0
        """
        from psflow.launch.runner import Runner

        return Runner(self, register_timeout_s=self.register_timeout_s, store=store).run(plan)

    # -- the Backend seam ----------------------------------------------------------------------------
    def open(self, plan: LaunchPlan) -> None:
        prepare_logdir(Path(plan.logdir), self.keep_logs)
        self._plan = plan
        self._procs, self._started, self._exits = {}, [], queue.Queue()
        self._oom_kills = OomKills()  # the cgroup's OOM-kill count now: a SIGKILL exit with a rise was OOM-killed
        self._fork_server = self._forks = self._start_fork_server(plan) if self.preload else None

    def scale_refusal(self) -> str | None:
        return None  # local processes: a worker is started or stopped like any other task

    def replan(self, plan: LaunchPlan) -> None:
        self._plan = plan

    def start(self, task: TaskPlan, attempt: int, env: Mapping[str, str]) -> int:
        plan = self._require_plan()
        full = {**os.environ, **env}
        full.pop("PSFLOW_SECRET", None)  # the launcher's own, if any: tasks read the run's secret file
        proctree.mark(full, proctree.tag(plan.run_id, task.task, attempt))  # its descendants end with it
        if attempt > 0:  # the last attempt's report was read when it exited
            self._error_file(task.task).unlink(missing_ok=True)
        p, self._forks = self._start_process(task.argv, full, self._forks)
        self._procs[task.task] = p
        self._started.append(p)
        self.console.follow(plan, task, attempt, p.stdout)
        threading.Thread(target=self._watch, args=(task.task, attempt, p), daemon=True).start()
        return p.pid

    def poll(self, timeout_s: float = 0.0) -> list[TaskExited]:
        return drain(self._exits, timeout_s)

    def stop(self, tasks: Sequence[str], grace_s: float) -> None:
        procs = {t: self._procs[t] for t in tasks if t in self._procs}
        run_id = self._require_plan().run_id
        # What each task started in a session of its own, which the group's signal misses: looked up
        # while the task lives (its forked children hang from it), ended once it is gone.
        left = [pid for t, p in procs.items()
                for pid in proctree.tagged(proctree.tag(run_id, t), roots=[p.pid] if p.poll() is None else [])]
        self._stop_processes(list(procs.values()), grace_s)
        after = [pid for t in procs for pid in proctree.tagged(proctree.tag(run_id, t))]
        proctree.kill(set(left + after) - {p.pid for p in self._started})  # the tasks' own pids may be reused now

    def error_report(self, task: str) -> dict[str, Any] | None:
        return errorreport.read(self._error_file(task))

    def dump_stacks(self, task: str) -> StackDump | None:
        p = self._procs.get(task)
        if p is None or p.poll() is not None:
            return None
        log = Path(self._require_plan().logdir) / "logs" / f"{task.replace(':', '-')}.log"
        where = StackDump(str(log), log_end(log))
        os.kill(p.pid, signal.SIGUSR1)
        # A frozen task (SIGSTOP, a stopped job) cannot run its handler: resumed, it dumps at once, and
        # the kill that follows the dump still ends it. A running task ignores SIGCONT.
        os.kill(p.pid, signal.SIGCONT)
        return where

    def send_signal(self, task: str, signum: int) -> bool:
        p = self._procs.get(task)
        if p is None or p.poll() is not None:
            return False
        try:
            os.killpg(p.pid, signum)  # the task's own process group (its session): children included
        except ProcessLookupError:
            return False
        return True

    def close(self) -> None:
        grace_s = self._plan.grace_s if self._plan is not None else 0.0
        live = [p.pid for p in self._started if p.poll() is None]
        left = proctree.tagged(proctree.tag(self._plan.run_id), roots=live) if self._plan is not None else []
        self._stop_processes(self._started, grace_s)
        if self._plan is not None:  # every process of the run, whatever its session (psflow.launch.proctree)
            after = proctree.tagged(proctree.tag(self._plan.run_id))
            proctree.kill(set(left + after) - {p.pid for p in self._started})  # the tasks' own pids may be reused now
        if self._fork_server is not None:
            self._fork_server.close()
            self._fork_server = self._forks = None

    # -- processes -----------------------------------------------------------------------------------
    def _require_plan(self) -> LaunchPlan:
        if self._plan is None:
            raise RuntimeError("LocalBackend.start called before open(plan).")
        return self._plan

    def _error_file(self, task: str) -> Path:
        return errorreport.path_for(Path(self._require_plan().logdir) / "errors", task)

    def _watch(self, task: str, attempt: int, p: Any) -> None:
        code = p.wait()
        oom = code == -signal.SIGKILL and self._oom_kills is not None and self._oom_kills.claim()
        self._exits.put(TaskExited(task, attempt, code, time.time(), oom_killed=oom))

    def _stop_processes(self, procs: Sequence[Any], grace_s: float) -> None:
        """SIGTERM to each live process group, SIGKILL after ``grace_s``; then SIGKILL to every group,
        for children the tasks left behind."""
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in alive:
            if not self.wait_within(p, deadline):  # past the grace, or hurried (a second Ctrl-C)
                _signal_group(p, signal.SIGKILL)
                p.wait(timeout=10)
        for p in procs:
            _signal_group(p, signal.SIGKILL)

    def _start_fork_server(self, plan: LaunchPlan) -> ForkServer | None:
        """The fork server, once it has imported torch; None (fresh processes) where it cannot run."""
        if not plan.tasks or not hasattr(os, "pidfd_open") or not hasattr(socket, "send_fds"):
            return None
        try:
            forks = ForkServer(plan.tasks[0].argv[0], log_path=Path(plan.logdir) / "logs" / "forkserver.log")
        except OSError as e:
            self.console.warn(f"cannot start the fork server ({e}); starting every task as a fresh process.")
            return None
        if forks.wait_ready(self.fork_server_ready_s):
            return forks
        forks.close()
        self.console.warn(f"the fork server did not start within {self.fork_server_ready_s:.0f} s (see "
                          f"{plan.logdir}/logs/forkserver.log); starting every task as a fresh process.")
        return None

    def _start_process(self, argv: tuple[str, ...], env: dict[str, str], forks: ForkServer | None) -> tuple[Any, ForkServer | None]:
        """Fork the task from the fork server when it can be, else start a fresh process. Returns the
        process (Popen or ForkedTask) and the fork server still to use (None after it failed)."""
        if forks is not None and forks.usable_for(argv, env, os.environ):
            try:
                return forks.spawn(argv, env, os.getcwd()), forks
            except OSError as e:  # it stays up for the tasks it forked already; close() closes it
                self.console.warn(f"{e}; starting the remaining tasks as fresh processes.")
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

def prepare_logdir(logdir: Path, keep_logs: int) -> None:
    """``logs/`` and ``errors/`` of a run about to start: the earlier runs' logs rotated (see
    :func:`rotate_logs`), their error reports gone. Called by a backend's ``open``."""
    (logdir / "logs").mkdir(parents=True, exist_ok=True)
    rotate_logs(logdir / "logs", keep_logs)  # a rerun into this logdir keeps the earlier runs' logs
    (logdir / "errors").mkdir(parents=True, exist_ok=True)
    for stale in (logdir / "errors").glob("*.json*"):  # reports (and temporaries) of an earlier run
        stale.unlink()


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


def _signal_group(p: Any, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
