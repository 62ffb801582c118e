"""SshBackend: the tasks of a plan on a few hosts, each started over ssh.

A :class:`psflow.launch.backend.ProcessBackend` (``psflow run --hosts h1:2,h2:2 ...``, horovodrun's
convention: each host and how many tasks it takes). How a run maps onto the hosts, and why:

- **Placement**: the plan's tasks fill the hosts in order, each up to its slots (:func:`place`): with
  ``--ps 1 --workers 2 --hosts a:1,b:2``, ps:0 on a, worker:0 and worker:1 on b. More tasks than
  slots is an error naming both counts.
- **One ssh session per task attempt**: ``ssh [-F CONFIG] HOST PYTHON -m psflow.launch.sshagent``
  (:func:`ssh_argv`); the agent (:mod:`psflow.launch.sshagent`) reads the task (argv, environment,
  working directory, the job secret) as one JSON line on its stdin, starts it, relays its output
  and takes signals (``TERM``, ``KILL``, ``USR1``) as later lines. The secret is never on a
  command line nor in a file on the hosts. PYTHON is the plan's interpreter: the same path on every
  host, as horovodrun assumes (a shared virtualenv, or one built alike on each). The task runs in the
  launcher's working directory; the log dir (checkpoints, summaries) must be one directory shared by
  the hosts at the same path (an NFS mount), as under Slurm.
- **Addresses**: each task binds its host's name as given (``PSFLOW_BIND_HOST``) on a free port and
  registers with the launcher's coordinator, which listens on the address the hosts reach the
  launcher at (:func:`route_address`: the source address of the route to the first remote host).
  Off loopback every connection, the coordinator's included, must prove the job secret.
- **Output and errors**: each task's output streams to the console with its ``[task]`` prefix and
  into ``LOGDIR/logs/<task>.log`` on the launcher's host; its error report comes back through the
  session (the agent's ``report`` line) into ``LOGDIR/errors/``, so root causes need no shared disk.
- **Restarts**: the run controller's, as for local tasks (a new session, the same host). **Scale**
  (``psflow scale``): a new worker takes a free host slot (:func:`grow_placement`), a retired one
  frees its; more workers than the slots hold is refused, saying how many fit.
- **Stopping**: ``TERM`` to the agent (the task's own SIGTERM handling), ``KILL`` after ``grace_s``,
  then the ssh client itself; if the launcher dies, each agent sees its session end and kills its task.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import socket
import subprocess
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psflow.cluster import is_loopback_host
from psflow.errors import ConfigError
from psflow.launch.backend import ProcessBackend
from psflow.launch.console import Console
from psflow.launch.controller import TaskExited
from psflow.launch.forkserver import die_with_parent
from psflow.launch.plan import LaunchPlan, TaskPlan
from psflow.launch.sshagent import MARK
from psflow.taskenv import TaskEnv

SSH_FAILED = 255  # ssh's own exit status when the session could not be had


# ------------------------------------------------------------------------------------ pure parts


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def parse_hosts(spec: str) -> list[Host]:
    """``h1:2,h2:2`` (horovodrun's ``--hosts``): each host and its slots (1 where omitted).

    Raises:
        ConfigError: an empty list, a host twice, slots that are not a positive integer.
    """
    hosts: list[Host] = []
    for item in (i.strip() for i in (spec or "").split(",")):
        if not item:
            continue
        name, sep, slots = item.rpartition(":") if item.count(":") == 1 else (item, "", "")
        if not sep:
            name, slots = item, "1"
        if not name or not slots.isdigit() or int(slots) < 1:
            raise ConfigError(f"--hosts {spec!r}: {item!r} is not HOST or HOST:SLOTS with SLOTS a positive integer. "
                              "Example: --hosts node1:2,node2:2.")
        if any(h.name == name for h in hosts):
            raise ConfigError(f"--hosts {spec!r}: {name} is given twice; give each host once, with all its slots.")
        hosts.append(Host(name, int(slots)))
    if not hosts:
        raise ConfigError(f"--hosts needs at least one HOST:SLOTS; received {spec!r}. Example: --hosts node1:2,node2:2.")
    return hosts


def place(tasks: Sequence[str], hosts: Sequence[Host]) -> dict[str, str]:
    """Each task's host: the hosts filled in order, each up to its slots.

    Raises:
        ConfigError: more tasks than slots; a loopback name (localhost) beside other hosts, whose
            tasks could not reach a task there by that name.
    """
    loopback = [h.name for h in hosts if is_loopback_host(h.name)]
    if loopback and len(loopback) < len(hosts):
        raise ConfigError(f"--hosts names {', '.join(loopback)} beside other hosts: a task there would listen on loopback, "
                          "where the tasks on the other hosts cannot reach it. Name this host by an address or name "
                          "the others reach (e.g. its hostname).")
    slots = [h.name for h in hosts for _ in range(h.slots)]
    if len(tasks) > len(slots):
        raise ConfigError(f"--hosts gives {len(slots)} slot(s) ({', '.join(f'{h.name}:{h.slots}' for h in hosts)}) for "
                          f"{len(tasks)} tasks ({', '.join(tasks)}). Add slots (HOST:SLOTS) or hosts.")
    return dict(zip(tasks, slots))


def grow_placement(placement: Mapping[str, str], tasks: Sequence[str], hosts: Sequence[Host], *,
                   ended: Collection[str] = ()) -> dict[str, str]:
    """``placement`` with each task of ``tasks`` it lacks on the host with the most free slots (hosts
    in order on a tie); a slot is busy while a task placed there has not ``ended``. A task placed
    before keeps its host. With no slot free, the least busy host takes it (``scale_refusal``
    counts slots before a scale, so only a retiring task still ending can leave none).

    Example:
        >>> grow_placement({"ps:0": "a", "worker:0": "b"}, ["ps:0", "worker:0", "worker:1"], [Host("a", 1), Host("b", 2)])
        {'ps:0': 'a', 'worker:0': 'b', 'worker:1': 'b'}
    """
    out = dict(placement)
    busy = {h.name: 0 for h in hosts}
    for task, host in out.items():
        if task not in ended and host in busy:
            busy[host] += 1
    for task in tasks:
        if task in out:
            continue
        host = max(hosts, key=lambda h: (h.slots - busy[h.name], -hosts.index(h)))
        out[task] = host.name
        busy[host.name] += 1
    return out


def ssh_argv(host: str, python: str, *, ssh: Sequence[str] = ("ssh",), config: str | None = None) -> list[str]:
    """The ssh command that starts the agent for one task on ``host`` (no secret, no task: those go on stdin)."""
    return [*ssh, *(["-F", config] if config else []), "-T", "-o", "BatchMode=yes", host,
            shlex.join([python, "-m", "psflow.launch.sshagent"])]


def agent_header(task: TaskPlan, env: Mapping[str, str], *, host: str, secret: str, cwd: str) -> str:
    """The agent's first line: the task's argv, its environment on ``host``, where it runs, the secret."""
    full = {k: v for k, v in env.items() if k not in ("PSFLOW_SECRET", "PSFLOW_SECRET_FILE")}
    full.setdefault("PSFLOW_BIND_HOST", host)
    if full.get("PSFLOW_NUM_THREADS"):  # a fresh interpreter's torch reads it at import
        full["OMP_NUM_THREADS"] = full["PSFLOW_NUM_THREADS"]
    full["PYTHONUNBUFFERED"] = "1"
    return json.dumps({"argv": list(task.argv), "env": full, "cwd": cwd, "secret": secret}) + "\n"


def route_address(host: str) -> str:
    """This machine's address on the route to ``host`` (no packet is sent: a UDP socket's connect
    only picks the route). Loopback for a loopback host.

    Raises:
        ConfigError: ``host`` does not resolve, or no route leads there.
    """
    if is_loopback_host(host):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 22))
            return str(s.getsockname()[0])
    except OSError as e:
        raise ConfigError(f"--hosts: cannot find a route to {host!r} ({e}). Check the name, or give an address.") from e


# ------------------------------------------------------------------------------------ the backend


class SshBackend(ProcessBackend):
    """Every task of a plan on a host of ``hosts``, started over ssh (see the module's docstring).

    Args:
        hosts: ``"h1:2,h2:2"`` or :class:`Host` values.
        ssh_config: an ssh configuration file (``ssh -F``): keys, users, ports, known hosts.
        ssh: the ssh command (default ``("ssh",)``).
        coordinator_host: where the launcher's coordinator listens (default: :func:`route_address`
            of the first host that is not loopback).
        echo, live: the console (see :class:`psflow.launch.console.Console`).
        keep_logs: logs of earlier runs into the same log dir kept per task.

    Example, with ``node1`` and ``node2`` reachable by ssh (not a doctest: it needs those hosts)::

        result = Runner(SshBackend("node1:1,node2:2")).run(make_plan("train.py", num_ps=1, num_workers=2))
        assert result.exit_code == 0
    """

    def __init__(self, hosts: str | Sequence[Host], *, ssh_config: str | None = None, ssh: Sequence[str] = ("ssh",),
                 coordinator_host: str | None = None, echo: Callable[[str], None] | None = None, live: bool | None = None,
                 keep_logs: int = 5) -> None:
        super().__init__(Console(echo, live=live), keep_logs=keep_logs)
        self.hosts = parse_hosts(hosts) if isinstance(hosts, str) else list(hosts)
        self.ssh_config = ssh_config
        self.ssh = tuple(ssh)
        self._coordinator_host = coordinator_host
        self.placement: dict[str, str] = {}
        self._announced: set[str] = set()  # the tasks whose host the console has said
        self._codes: dict[int, int] = {}  # ssh client pid -> the task's exit code, as the agent said

    # -- the Backend seam ----------------------------------------------------------------------------
    def scale_refusal(self, workers: int | None = None) -> str | None:
        if workers is None or self._plan is None:
            return None  # workers join on a free host slot (replan) and leave theirs free
        others = [t for t in self._plan.task_names() if not t.startswith("worker:")]
        slots = sum(h.slots for h in self.hosts)
        if len(others) + workers <= slots:
            return None
        return (f"the ssh backend's hosts have {slots} slot(s) ({', '.join(f'{h.name}:{h.slots}' for h in self.hosts)}) "
                f"for this run's {len(others)} other task(s) and {workers} workers; ask for at most "
                f"{max(0, slots - len(others))} workers, or stop the run and start it again with more slots (--hosts)")

    def replan(self, plan: LaunchPlan) -> None:
        """``plan`` grew (``psflow scale``): each new task gets a free host slot; a task whose process
        has ended frees its slot."""
        ended = {t for t, p in self._procs.items() if p.poll() is not None}
        self._plan = plan
        self.placement = grow_placement(self.placement, plan.task_names(), self.hosts, ended=ended)
        added = [t for t in plan.task_names() if t not in self._announced]
        if added:
            self._announced |= set(added)
            self.console.echo(f"psflow: over ssh: {', '.join(f'{t}@{self.placement[t]}' for t in added)}")

    def open(self, plan: LaunchPlan) -> None:
        self.placement = place(plan.task_names(), self.hosts)
        self._announced = set(self.placement)
        super().open(plan)
        self._codes = {}
        where = ", ".join(f"{t}@{h}" for t, h in self.placement.items())
        self.console.echo(f"psflow: over ssh: {where}")

    def coordinator_host(self) -> str:
        if self._coordinator_host is None:
            remote = [h.name for h in self.hosts if not is_loopback_host(h.name)]
            self._coordinator_host = route_address(remote[0]) if remote else "127.0.0.1"
        return self._coordinator_host

    # -- the sessions --------------------------------------------------------------------------------
    def _launch(self, task: TaskPlan, attempt: int, env: Mapping[str, str]) -> tuple[Any, Any]:
        host = self.placement[task.task]
        secret_file = env.get("PSFLOW_SECRET_FILE")
        if not secret_file:
            raise ConfigError("SshBackend.start needs the run's secret file (PSFLOW_SECRET_FILE, set by the runner).")
        secret = Path(secret_file).read_text().strip()
        argv = ssh_argv(host, task.argv[0], ssh=self.ssh, config=self.ssh_config)
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             bufsize=1, start_new_session=True, preexec_fn=die_with_parent)
        assert p.stdin is not None and p.stdout is not None
        header = agent_header(task, {**env, **TaskEnv(attempt=attempt).render()}, host=host, secret=secret, cwd=str(Path.cwd()))
        # False where ssh ended already (it could not connect): its exit and message come through _exited and the log
        _tell(p, header.rstrip("\n"))
        return p, self._lines(task.task, p)

    def _terminate(self, task: str, p: Any) -> None:
        _tell(p, "TERM")

    def _kill(self, task: str, p: Any) -> None:
        _tell(p, "KILL")
        try:
            p.wait(timeout=10)  # the agent reports the kill, then the session ends
        except subprocess.TimeoutExpired:
            _kill_client(p)

    def _reap(self, p: Any) -> None:
        _kill_client(p)

    def _ask_stacks(self, task: str, p: Any) -> bool:
        if not _tell(p, "USR1"):
            raise OSError(f"the ssh session of {task} is closed")
        return True

    def _lines(self, task: str, p: subprocess.Popen[str]) -> Iterator[str]:
        """The task's output, less the agent's own lines (its report is written to the errors dir, its
        exit code kept for :meth:`_exited`)."""
        assert p.stdout is not None
        for line in p.stdout:
            if not line.startswith(MARK):
                yield line
                continue
            kind, _, rest = line[len(MARK):].rstrip("\n").partition(" ")
            if kind == "exit" and rest.lstrip("-").isdigit():
                self._codes[p.pid] = int(rest)
            elif kind == "report":
                with contextlib.suppress(ValueError, OSError):
                    report = json.loads(rest)
                    self.error_file(task).write_text(json.dumps(report))

    def _exited(self, task: str, attempt: int, p: Any, code: int) -> TaskExited:
        ssh_code, agent_code = code, self._codes.get(p.pid)
        if agent_code is None:  # no word from the agent: the session failed (ssh says why, in the log) or was cut
            agent_code = ssh_code if ssh_code != 0 else SSH_FAILED
            if ssh_code == SSH_FAILED:
                self.console.warn(f"{task}: ssh to {self.placement.get(task)} failed (exit 255); its log has ssh's message.")
        return TaskExited(task, attempt, agent_code, time.time())


def _tell(p: subprocess.Popen[str], command: str) -> bool:
    """A command line to an agent; False where its session is closed."""
    try:
        assert p.stdin is not None
        p.stdin.write(command + "\n")
        p.stdin.flush()
        return True
    except (OSError, ValueError):
        return False


def _kill_client(p: subprocess.Popen[str]) -> None:
    """End an ssh client (its agent then sees the session end and ends its task) and reap it."""
    if p.poll() is None:
        with contextlib.suppress(OSError, ValueError):
            if p.stdin is not None:
                p.stdin.close()
        try:
            p.wait(timeout=_CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)


_CLOSE_WAIT_S = 10.0  # an agent whose stdin closed takes its task down within its own grace (5 s)
