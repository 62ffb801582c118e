"""LocalBackend: every task of a plan as a process on this machine.

A :class:`psflow.launch.backend.ProcessBackend`. Each attempt of a task runs in its own process
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
(:mod:`psflow.launch.runner`): ``Runner(LocalBackend()).run(plan)`` runs a whole plan.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from psflow.launch import proctree
from psflow.launch.backend import ProcessBackend
from psflow.launch.console import Console
from psflow.launch.controller import TaskExited
from psflow.launch.forkserver import ForkServer, die_with_parent
from psflow.launch.oomkills import OomKills
from psflow.launch.plan import LaunchPlan, TaskPlan
from psflow.rundir import RunDir


class LocalBackend(ProcessBackend):
    """Local processes. ``echo``/``live``: the console (see :class:`psflow.launch.console.Console`);
    ``preload``: fork tasks from a server that imported torch once; ``keep_logs``: logs of earlier
    runs into the same logdir kept per task (NAME.1.log newest)."""

    join_output = False  # a task's forked children may hold its output open after it exited

    def __init__(
        self, *, echo: Callable[[str], None] | None = None, preload: bool = True,
        live: bool | None = None, keep_logs: int = 5, fork_server_ready_s: float = 60.0,
    ) -> None:
        super().__init__(Console(echo, live=live), keep_logs=keep_logs)
        self.fork_server_ready_s = fork_server_ready_s  # how long the fork server may take to import torch
        self.preload = preload
        self._fork_server: ForkServer | None = None  # closed at the end of the run
        self._forks: ForkServer | None = None  # the one to fork from: None once it failed
        self._oom_kills: OomKills | None = None

    @property
    def live(self) -> bool:
        return self.console.live

    # -- the Backend seam ----------------------------------------------------------------------------
    def open(self, plan: LaunchPlan) -> None:
        super().open(plan)
        self._oom_kills = OomKills()  # the cgroup's OOM-kill count now: a SIGKILL exit with a rise was OOM-killed
        self._fork_server = self._forks = self._start_fork_server(plan) if self.preload else None

    def scale_refusal(self, workers: int | None = None) -> str | None:
        return None  # local processes: a worker is started or stopped like any other task

    def replan(self, plan: LaunchPlan) -> None:
        self._plan = plan

    def stop(self, tasks: Sequence[str], grace_s: float) -> None:
        procs = {t: self._procs[t] for t in tasks if t in self._procs}
        run_id = self._require_plan().run_id
        # What each task started in a session of its own, which the group's signal misses: looked up
        # while the task lives (its forked children hang from it), ended once it is gone.
        left = [pid for t, p in procs.items()
                for pid in proctree.tagged(proctree.tag(run_id, t), roots=[p.pid] if p.poll() is None else [])]
        super().stop(tasks, grace_s)
        for p in procs.values():  # children the tasks left behind in their groups
            _signal_group(p, signal.SIGKILL)
        after = [pid for t in procs for pid in proctree.tagged(proctree.tag(run_id, t))]
        proctree.kill(set(left + after) - {p.pid for p in self._started})  # the tasks' own pids may be reused now

    def close(self) -> None:
        plan = self._plan
        live = [p.pid for p in self._started if p.poll() is None]
        left = proctree.tagged(proctree.tag(plan.run_id), roots=live) if plan is not None else []
        try:
            super().close()
        finally:
            if plan is not None:  # every process of the run, whatever its session (psflow.launch.proctree)
                after = proctree.tagged(proctree.tag(plan.run_id))
                proctree.kill(set(left + after) - {p.pid for p in self._started})  # the tasks' own pids may be reused now
            if self._fork_server is not None:
                self._fork_server.close()
                self._fork_server = self._forks = None

    # -- processes -----------------------------------------------------------------------------------
    def _launch(self, task: TaskPlan, attempt: int, env: Mapping[str, str]) -> tuple[Any, Any]:
        full = {**os.environ, **env}
        full.pop("PSFLOW_SECRET", None)  # the launcher's own, if any: tasks read the run's secret file
        proctree.mark(full, proctree.tag(self._require_plan().run_id, task.task, attempt))  # its descendants end with it
        p, self._forks = self._start_process(task.argv, full, self._forks)
        return p, p.stdout

    def _terminate(self, task: str, p: Any) -> None:
        _signal_group(p, signal.SIGTERM)

    def _kill(self, task: str, p: Any) -> None:
        _signal_group(p, signal.SIGKILL)
        p.wait(timeout=10)

    def _reap(self, p: Any) -> None:
        _signal_group(p, signal.SIGKILL)  # children a task left behind in its group

    def _ask_stacks(self, task: str, p: Any) -> bool:
        os.kill(p.pid, signal.SIGUSR1)
        # A frozen task (SIGSTOP, a stopped job) cannot run its handler: resumed, it dumps at once, and
        # the kill that follows the dump still ends it. A running task ignores SIGCONT.
        os.kill(p.pid, signal.SIGCONT)
        return True

    def _signal(self, task: str, p: Any, signum: int) -> bool:
        try:
            os.killpg(p.pid, signum)  # the task's own process group (its session): children included
        except ProcessLookupError:
            return False
        return True

    def _exited(self, task: str, attempt: int, p: Any, code: int) -> TaskExited:
        oom = code == -signal.SIGKILL and self._oom_kills is not None and self._oom_kills.claim()
        return TaskExited(task, attempt, code, time.time(), oom_killed=oom)

    def _start_fork_server(self, plan: LaunchPlan) -> ForkServer | None:
        """The fork server, once it has imported torch; None (fresh processes) where it cannot run."""
        if not plan.tasks or not hasattr(os, "pidfd_open") or not hasattr(socket, "send_fds"):
            return None
        try:
            forks = ForkServer(plan.tasks[0].argv[0], log_path=RunDir(plan.logdir).logs / "forkserver.log")
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


def _signal_group(p: Any, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
