"""SlurmBackend: the tasks of a plan as steps of one Slurm job.

A :class:`psflow.launch.backend.ProcessBackend` (``psflow run --backend slurm --nodes K``). The
mapping in brief (each choice, and why: ``docs/design/slurm.md``):

- one allocation per run, held by the script of :func:`batch_script` (``--dry-run`` prints it)
  until the launcher writes ``end`` into ``LOGDIR/slurm/heartbeat``, or that file stands still for
  ``hold_timeout_s`` (a launcher killed with SIGKILL holds no nodes for ever);
- one job step per task attempt (``srun --overlap -N1 -n1 -w NODE``, :func:`step_argv`): its srun
  client's output and exit are the task's, so a task restarts alone; task *i* runs on node *i* mod K;
  ``psflow scale`` adds a worker as one more step (on node *i* mod K) and retires one by ending its;
- a task binds port 0 on its node and registers with the launcher's coordinator, as a local one does;
- signals, stack dumps and stops are ``scancel --signal=NAME JOB.STEP`` (:func:`signal_argv`; a stop
  is TERM, then KILL after ``grace_s``); srun's exit 128+N becomes -N, as a local task's signal;
- the job is followed through ``squeue``, ``scontrol`` and ``sacct``; a job that ends under the run
  (scancel, its time limit) stops it (:meth:`SlurmBackend.ended_by`);
- a lost node (:func:`node_failure`) is a failure, never a stop: the job asks for ``--no-kill
  --no-requeue``, so it goes on without the node, whose tasks exit with its report ("node N failed")
  and restart on the nodes left under the run's policy; a job that ends with the node (the batch
  host's, or a site that requeues anyway) fails the run (:meth:`SlurmBackend.failed_by`);
- the coordinator listens on this host's address on the nodes' network (:mod:`psflow.launch.nodenet`)
  or ``coordinator_host``; the log dir is one directory for the launcher and every node.

States of the job, as the backend sees it::

    (none) --open: sbatch--> PENDING --squeue: RUNNING--> running --close: "end" | scancel--> ended
    running --scancel / time limit (ended_by)--> ended
    running --a node lost (no-kill: the job goes on without it)--> running, on fewer nodes
    running --a node lost, and the job ended or was requeued (failed_by)--> ended
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psflow.errors import ClusterError, ConfigError
from psflow.launch.backend import ProcessBackend
from psflow.launch.console import Console
from psflow.launch.controller import TaskExited
from psflow.launch.forkserver import die_with_parent
from psflow.launch.nodenet import coordinator_address, local_interfaces, resolve, route_source
from psflow.launch.plan import LaunchPlan, TaskPlan
from psflow.resolve.slurm import expand_slurm_nodelist
from psflow.rundir import task_stem
from psflow.taskenv import TaskEnv

_WAITING = ("PENDING", "CONFIGURING", "REQUEUED", "RESIZING")  # not running yet, may still run
_RUNNING = ("RUNNING",)
_NODE_LOST = ("DOWN", "FAIL", "NOT_RESPONDING")  # words of a node's state that mean it is gone
NODE_LOST_EXIT = 255  # a task whose node was lost: its srun client may say 0 (seen on Slurm 22.05)
_CLI_TIMEOUT_S = 30.0  # one squeue/scontrol/scancel call (a dead slurmctld makes each hang)


# ------------------------------------------------------------------------------------ rendering


@dataclass(frozen=True)
class SlurmSettings:
    """What the batch script and the steps ask Slurm for.

    Args:
        nodes: nodes in the allocation (``--nodes``); the plan's tasks are spread over them.
        hold_timeout_s: the batch script releases the allocation once the launcher's heartbeat has
            stood still this long.
        sbatch_args: more ``#SBATCH`` options, as written on sbatch's command line
            (``("--partition=gpu", "--time=01:00:00")``; ``psflow run --sbatch-arg``), checked by
            :func:`check_sbatch_args`. sbatch's own environment (SBATCH_PARTITION, SBATCH_ACCOUNT,
            SBATCH_TIMELIMIT) applies too.
    """

    nodes: int = 1
    hold_timeout_s: float = 60.0
    sbatch_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "sbatch_args", check_sbatch_args(self.sbatch_args))
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise ConfigError(f"--nodes must be a positive number of Slurm nodes; received {self.nodes!r}.")
        if not self.hold_timeout_s > 0:
            raise ConfigError(f"hold_timeout_s must be a positive number of seconds; received {self.hold_timeout_s!r}.")


# sbatch options the batch script sets from the run's own settings: given again, they would contradict them.
_OWN_OPTIONS = {
    "--job-name": "the run's id names the job", "--nodes": "give psflow run --nodes K",
    "--ntasks": "psflow sizes the job from the run's tasks", "--ntasks-per-node": "psflow sizes the job from the run's tasks",
    "--cpus-per-task": "give psflow run --threads N", "--output": "the job's output goes to LOGDIR/slurm",
    "--chdir": "the job runs where psflow run runs", "--requeue": "a requeued job would hold nodes no task runs on",
}


def check_sbatch_args(args: Sequence[str]) -> tuple[str, ...]:
    """``args`` as ``#SBATCH`` lines take them: each one long sbatch option, on one line, that psflow
    does not set itself (``--partition=gpu``, ``--time=02:00:00``, ``--account=ml``, ``--qos=high``,
    ``--gres=gpu:2``).

    Example:
        >>> check_sbatch_args(["--partition=gpu", "--gres=gpu:2"])
        ('--partition=gpu', '--gres=gpu:2')

    Raises:
        ConfigError: naming the value and what to write instead: one that does not start with ``--``
            (a short option, a bare word), one holding a newline or another control character (it
            would end the ``#SBATCH`` line and start a line of the script), one psflow sets itself.
    """
    if isinstance(args, str):
        args = (args,)
    for arg in args:
        if not isinstance(arg, str) or not arg.startswith("--") or len(arg) < 3 or any(ord(c) < 32 for c in arg):
            raise ConfigError(f"--sbatch-arg {arg!r} is not one sbatch option: give sbatch's long form, starting with "
                              "--, on one line, one option per --sbatch-arg, e.g. --sbatch-arg=--partition=gpu "
                              "--sbatch-arg=--time=02:00:00 (not -p gpu).")
        name = arg.split("=", 1)[0].split()[0]
        if name in _OWN_OPTIONS:
            raise ConfigError(f"--sbatch-arg {arg!r}: psflow writes {name} into the batch script itself "
                              f"({_OWN_OPTIONS[name]}); leave it out.")
    return tuple(args)


def sbatch_line(arg: str) -> str:
    """The ``#SBATCH`` line of one option, as sbatch reads it back: it splits a directive's line at
    whitespace outside double quotes and takes a backslash as an escape, so both are escaped and an
    option holding a space is quoted whole.

    Example:
        >>> sbatch_line("--comment=two words")
        '#SBATCH "--comment=two words"'
    """
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"')
    return f'#SBATCH "{escaped}"' if any(c.isspace() for c in arg) else f"#SBATCH {escaped}"


def slurm_dir(plan: LaunchPlan) -> Path:
    """Where the run's Slurm files lie: the batch script, its output, the heartbeat (absolute: the
    batch script and the steps read them on the nodes)."""
    return Path(plan.logdir).resolve() / "slurm"


def tasks_per_node(num_tasks: int, nodes: int) -> int:
    """The most tasks any node runs when ``num_tasks`` are spread round-robin over ``nodes``."""
    return max(1, -(-num_tasks // nodes))


def node_of(index: int, nodes: Sequence[str]) -> str:
    """The node the plan's task ``index`` runs on: round-robin over the allocation's ``nodes``."""
    return nodes[index % len(nodes)]


def step_name(task: str, attempt: int) -> str:
    """The job step's name for ``task``'s ``attempt``: ``worker:1``, 2 -> ``worker-1.a2``."""
    return f"{task_stem(task)}.a{attempt}"


def step_argv(job_id: str, node: str, task: TaskPlan, attempt: int, *, threads: int, cwd: str) -> list[str]:
    """The srun command that runs ``task``'s ``attempt`` as a step of job ``job_id`` on ``node``."""
    return ["srun", f"--jobid={job_id}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
            f"--cpus-per-task={threads}", f"--job-name={step_name(task.task, attempt)}", f"--chdir={cwd}",
            "--unbuffered", *task.argv]


def batch_script(plan: LaunchPlan, settings: SlurmSettings, *, cwd: str | None = None) -> str:
    """The sbatch script of ``plan``: it asks for the allocation and holds it (see the module's
    docstring); the comments show the step each task runs as. Pure: the same plan and settings give
    the same text.

    Example:
        >>> print(batch_script(make_plan("train.py"), SlurmSettings(nodes=3)))  # doctest: +SKIP
        #!/bin/bash
        #SBATCH --job-name=psflow-20250101-120000-ab12cd
        ...
    """
    cwd = cwd or os.getcwd()
    sdir = slurm_dir(plan)
    per_node = tasks_per_node(len(plan.tasks), settings.nodes)
    nodes = [f"NODE{i}" for i in range(settings.nodes)]
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=psflow-{plan.run_id}",
        f"#SBATCH --nodes={settings.nodes}",
        f"#SBATCH --ntasks-per-node={per_node}",
        f"#SBATCH --cpus-per-task={plan.threads}",
        f"#SBATCH --output={sdir}/batch-%j.out",
        f"#SBATCH --chdir={cwd}",
        "#SBATCH --no-kill",  # a lost node ends its own tasks, not the job: the rest goes on (restarts move)
        "#SBATCH --no-requeue",  # a requeued job would come back later holding nodes with no task on them
        *(sbatch_line(a) for a in settings.sbatch_args),
        "#",
        f"# psflow run {plan.run_id}: this job holds the allocation; the launcher (psflow run --backend slurm)",
        "# starts each task as a step of it, and restarts one alone under the run's restart policy:",
    ]
    for i, tp in enumerate(plan.tasks):
        argv = step_argv("JOB", node_of(i, nodes), tp, 0, threads=plan.threads, cwd=cwd)
        lines.append(f"#   {tp.task:<12} {shlex.join(argv)}")
    lines += [
        f"# (JOB: this job; NODE0..NODE{settings.nodes - 1}: the allocation's nodes in order), each with its PSFLOW_* environment.",
        "# The job ends when the launcher writes 'end' into the heartbeat file, or when the heartbeat has",
        f"# stood still for {settings.hold_timeout_s:g} s (the launcher is gone).",
        "set -u",
        f"heartbeat={shlex.quote(str(sdir / 'heartbeat'))}",
        f"hold_s={max(1, round(settings.hold_timeout_s))}",
        'last="" quiet=0',
        "while :; do",
        '  beat=$(cat "$heartbeat" 2>/dev/null || true)',
        '  [ "$beat" = end ] && exit 0',
        '  if [ "$beat" != "$last" ]; then last=$beat quiet=0; else quiet=$((quiet + 1)); fi',
        '  if [ "$quiet" -ge "$hold_s" ]; then',
        '    echo "psflow: no heartbeat from the launcher for ${hold_s} s in $heartbeat: releasing the allocation." >&2',
        "    exit 1",
        "  fi",
        "  sleep 1",
        "done",
    ]
    return "\n".join(lines) + "\n"


def signal_argv(step: str, signum: int) -> list[str]:
    """The scancel command that sends ``signum`` to every task of job step ``step`` (``JOB.STEP``),
    leaving the job and its other steps alone.

    Raises:
        ValueError: ``signum`` is not a signal number, or ``step`` is not ``JOB.STEP``.
    """
    try:
        name = signal.Signals(signum).name.removeprefix("SIG")
    except ValueError:
        raise ValueError(f"{signum!r} is not a signal number; pass one of the signal module's (signal.SIGKILL ...).") from None
    job, dot, step_id = step.partition(".")
    if not (dot and job.isdigit() and step_id.isdigit()):
        raise ValueError(f"A Slurm job step is written JOB.STEP (squeue -s); received {step!r}.")
    return ["scancel", f"--signal={name}", step]


def _delivered_anyway(stderr: str, step: str, running: set[str]) -> bool:
    """Whether a failed ``scancel --signal`` of ``step`` reached it all the same. Slurm 22.05 answers
    a signal other than KILL to a step of a job on more than one node with exit code 225 and "Kill job
    error on job step id J: Invalid job id specified", yet the step's own node delivers it (seen on
    ``tools/slurm_cluster.sh``: the step's process is stopped, resumed, or gets SIGUSR1's dump). So:
    that error, while the step still runs, counts as sent; any other error does not."""
    return "Invalid job id specified" in stderr and step in running


def exit_code_of(srun_code: int) -> int:
    """A task's exit code from its srun client's: 128+N (a task killed by signal N) becomes -N."""
    if 128 < srun_code < 128 + signal.NSIG:
        return -(srun_code - 128)
    return srun_code


def parse_job_id(sbatch_out: str) -> str:
    """The job id of ``sbatch --parsable``'s output (``123`` or ``123;cluster``)."""
    job_id = sbatch_out.strip().split(";")[0]
    if not job_id.isdigit():
        raise ClusterError(f"sbatch did not answer with a job id. Received: {sbatch_out.strip()!r}.")
    return job_id


def parse_scontrol_job(text: str) -> tuple[str, str]:
    """``(state, reason)`` from ``scontrol -o show job``'s line (``JobState=CANCELLED Reason=None``)."""
    fields = dict(f.split("=", 1) for f in text.split() if "=" in f)
    return fields.get("JobState", "UNKNOWN"), fields.get("Reason", "None")


def parse_nodes(text: str) -> dict[str, dict[str, str]]:
    """Node name -> ``{"addr", "state", "reason"}`` from ``scontrol -o show node``'s lines (a field's
    value may hold spaces, as OS= does: each is read by its own pattern)."""
    out: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        name = re.search(r"\bNodeName=(\S+)", line)
        if name is None:
            continue
        addr, state = re.search(r"\bNodeAddr=(\S+)", line), re.search(r"\bState=(\S+)", line)
        reason = re.search(r"\bReason=(.*?)(?: \[[^]]*\])?(?= \w+=|$)", line)
        out[name.group(1)] = {"addr": addr.group(1) if addr else name.group(1), "state": state.group(1) if state else "",
                              "reason": reason.group(1).strip() if reason else ""}
    return out


def is_lost(node_state: str) -> bool:
    """Whether a node in ``node_state`` (scontrol's ``DOWN+NOT_RESPONDING``, ``IDLE+DRAIN``; sinfo's
    ``down*``) is gone for its jobs. Draining is not: a draining node still runs what it holds."""
    words = node_state.upper().replace("*", "+NOT_RESPONDING").split("+")
    return any(w.startswith(_NODE_LOST) for w in words)


@dataclass(frozen=True)
class NodeFailure:
    """Nodes of a run's allocation lost under it; ``job_state``: the job's state after (RUNNING: it
    goes on without them; PENDING: Slurm requeued it; FAILED, NODE_FAIL: it ended)."""

    job_id: str
    nodes: tuple[str, ...]
    job_state: str
    reasons: dict[str, str] = field(default_factory=dict)

    @property
    def ends_run(self) -> bool:
        """The allocation is gone (no node left to restart a task on)."""
        return self.job_state != "RUNNING"

    def message(self) -> str:
        """``node 127.0.0.3 failed (reason); Slurm requeued job 7``."""
        what = ", ".join(f"{n} ({self.reasons[n]})" if self.reasons.get(n) else n for n in self.nodes)
        head = f"node {what} failed" if len(self.nodes) == 1 else f"nodes {what} failed"
        if self.job_state == "RUNNING":
            return f"{head}; Slurm job {self.job_id} goes on without it"
        if self.job_state in _WAITING:
            return f"{head}; Slurm requeued job {self.job_id}"
        return f"{head}; Slurm job {self.job_id} ended ({self.job_state})"


def node_failure(job_id: str, state: str, allocated: Sequence[str], current: Sequence[str],
                 nodes: Mapping[str, Mapping[str, str]]) -> NodeFailure | None:
    """The nodes of ``allocated`` that the job lost, or None if it lost none. Pure.

    Args:
        job_id, state: the job and its state now (squeue / scontrol).
        allocated: the nodes it ran on; ``current``: its node list now (empty: not known).
        nodes: :func:`parse_nodes` of ``allocated`` (state and reason).

    A node is lost when the running job no longer lists it (``--no-kill`` drops a failed node), or its
    state says so (:func:`is_lost`). A job that ended NODE_FAIL lost a node even when none is down now.

    Example:
        >>> node_failure("7", "RUNNING", ["n1", "n2"], ["n1"], {}).message()
        'node n2 failed; Slurm job 7 goes on without it'
    """
    down = [n for n in allocated if is_lost(nodes.get(n, {}).get("state", ""))]
    if state == "RUNNING":
        gone = [n for n in allocated if current and n not in current]
        lost = list(dict.fromkeys(gone + down))
    elif down or state == "NODE_FAIL":
        lost = down or list(allocated)
    else:
        return None
    if not lost:
        return None
    return NodeFailure(job_id, tuple(lost), state, {n: nodes.get(n, {}).get("reason", "") for n in lost})


# ------------------------------------------------------------------------------------ Slurm's CLI


class SlurmCli:
    """Slurm's commands (sbatch, squeue, scontrol, sacct, scancel), each with a deadline."""

    def __init__(self, timeout_s: float = _CLI_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s

    def call(self, *argv: str) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s, stdin=subprocess.DEVNULL)
        except FileNotFoundError as e:
            raise ClusterError(f"Slurm's `{argv[0]}` is not on PATH. --backend slurm runs where Slurm's client commands "
                               "(sbatch, srun, squeue, scancel) are installed and configured (SLURM_CONF).") from e
        except subprocess.TimeoutExpired as e:
            raise ClusterError(f"`{shlex.join(argv)}` did not answer within {self.timeout_s:g} s: is slurmctld up? "
                               "(`scontrol ping`)") from e

    def submit(self, script: Path) -> str:
        r = self.call("sbatch", "--parsable", str(script))
        if r.returncode != 0:
            raise ClusterError(f"sbatch refused the job script {script}: {r.stderr.strip() or r.stdout.strip()}")
        return parse_job_id(r.stdout)

    def job(self, job_id: str) -> tuple[str, str, str]:
        """``(state, reason, nodelist)`` of ``job_id``; state ``UNKNOWN`` where Slurm no longer knows it."""
        r = self.call("squeue", "-h", "-j", job_id, "-o", "%T|%r|%N")
        if r.returncode == 0 and r.stdout.strip():
            state, reason, nodes = (r.stdout.strip().splitlines()[0].split("|") + ["", ""])[:3]
            if state != "COMPLETING":  # COMPLETING hides how it ended (CANCELLED, TIMEOUT, ...): scontrol tells
                return state, reason, nodes
        r = self.call("scontrol", "-o", "show", "job", job_id)
        if r.returncode == 0 and r.stdout.strip():
            return (*parse_scontrol_job(r.stdout), "")
        r = self.call("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State")
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.split()[0], "None", ""
        return "UNKNOWN", "None", ""

    def steps(self, job_id: str) -> dict[str, str]:
        """The job's running steps: name -> ``JOB.STEP``."""
        r = self.call("squeue", "-h", "-s", "-j", job_id, "-o", "%i|%j")
        out: dict[str, str] = {}
        for line in r.stdout.splitlines() if r.returncode == 0 else []:
            step, _, name = line.partition("|")
            out[name.strip()] = step.strip()
        return out

    def nodes(self, names: Sequence[str]) -> dict[str, dict[str, str]]:
        """:func:`parse_nodes` of ``names`` ({} where scontrol does not answer)."""
        r = self.call("scontrol", "-o", "show", "node", ",".join(names))
        return parse_nodes(r.stdout) if r.returncode == 0 else {}

    def cancel(self, target: str, sig: str | None = None) -> None:
        self.call("scancel", *([f"--signal={sig}"] if sig else []), target)


# ------------------------------------------------------------------------------------ the backend


class SlurmBackend(ProcessBackend):
    """Every task of a plan as a step of one Slurm job (see the module's docstring).

    Args:
        nodes: nodes to ask for; the tasks are spread round-robin over them.
        echo, live: the console (see :class:`psflow.launch.console.Console`).
        queue_timeout_s: the longest wait for the job to start running.
        hold_timeout_s, sbatch_args: see :class:`SlurmSettings`.
        coordinator_host: the address the nodes reach the launcher at (default: chosen from the
            allocation's nodes, :func:`psflow.launch.nodenet.coordinator_address`).
        job_check_s: how often the job's state is checked while the run goes on.
        keep_logs: logs of earlier runs into the same log dir kept per task.

    Example:
        >>> Runner(SlurmBackend(nodes=3)).run(make_plan("train.py", num_ps=1, num_workers=2)).exit_code
        0
    """

    def __init__(
        self, *, nodes: int = 1, echo: Callable[[str], None] | None = None, live: bool | None = None,
        queue_timeout_s: float = 3600.0, hold_timeout_s: float = 60.0,
        sbatch_args: Sequence[str] = (), job_check_s: float = 5.0, keep_logs: int = 5, cli: SlurmCli | None = None,
        coordinator_host: str | None = None,
    ) -> None:
        super().__init__(Console(echo, live=live), keep_logs=keep_logs)
        self.settings = SlurmSettings(nodes=nodes, hold_timeout_s=hold_timeout_s, sbatch_args=tuple(sbatch_args))
        self.queue_timeout_s = queue_timeout_s
        self.job_check_s = job_check_s
        self.cli = cli or SlurmCli()
        self.job_id: str | None = None
        self.nodes: list[str] = []  # the allocation's nodes still up: a task (re)starts on one of them
        self._coordinator_host = coordinator_host
        self._task_node: dict[str, str] = {}  # task -> the node its current attempt runs on
        self._lost: NodeFailure | None = None  # every node lost so far (job_state: the last seen)
        self._failed: tuple[str, str] | None = None  # (task blamed, why) once the allocation went with a node
        self._failed_told = False
        self._lost_at = 0.0  # when the first node loss was seen (the time of the reports it makes)
        self._steps: dict[str, str] = {}  # task -> its current attempt's step name
        self._stopping: dict[str, str] = {}  # during a stop: the job's steps, name -> JOB.STEP
        self._lock = threading.Lock()
        self._ended: str | None = None  # why the job ended under the run, until ended_by() takes it
        self._ended_told = self._closing = False
        self._beat = 0
        self._beat_at = self._checked_at = 0.0
        self._notes: list[tuple[str, dict[str, Any]]] = []  # for the run's history (take_notes)

    def script(self, plan: LaunchPlan) -> str:
        """The batch script :meth:`open` submits for ``plan`` (``psflow run --dry-run`` prints it)."""
        return batch_script(plan, self.settings)

    # -- the Backend seam ----------------------------------------------------------------------------
    def scale_refusal(self, workers: int | None = None) -> str | None:
        return None  # a task attempt is a job step of its own: an added worker is one more, round-robin on the nodes

    def replan(self, plan: LaunchPlan) -> None:
        self._plan = plan  # an added task's node is its index in the grown plan, mod the allocation's nodes

    def open(self, plan: LaunchPlan) -> None:
        super().open(plan)
        sdir = slurm_dir(plan)
        sdir.mkdir(parents=True, exist_ok=True)
        self._steps = {}
        self._ended, self._ended_told, self._closing = None, False, False
        self._task_node, self._lost, self._failed, self._failed_told, self._lost_at = {}, None, None, False, 0.0
        self._heartbeat(force=True)
        script = sdir / "job.sh"
        script.write_text(self.script(plan))
        self.job_id = self.cli.submit(script)
        self.console.echo(f"psflow: Slurm job {self.job_id} submitted ({self.settings.nodes} node(s)); script {script}")
        self._note("scheduler_submitted", job_id=self.job_id, nodes=self.settings.nodes, script=str(script))
        self.nodes = self._wait_running(plan)
        self.console.echo(f"psflow: Slurm job {self.job_id} running on {', '.join(self.nodes)}")
        self._note("scheduler_running", job_id=self.job_id, nodes=",".join(self.nodes))

    def coordinator_host(self) -> str:
        """``coordinator_host``, or this host's address on the allocation's network (asked after open)."""
        if self._coordinator_host is None:
            found = self.cli.nodes(self.nodes) if self.nodes else {}
            addrs = [resolve(found.get(n, {}).get("addr", n)) for n in self.nodes]
            self._coordinator_host = coordinator_address(addrs, local_interfaces(), route_source)
            if self._coordinator_host != "127.0.0.1":
                self.console.echo(f"psflow: the coordinator listens on {self._coordinator_host} (the nodes' network; "
                                  "--coordinator-host changes it)")
        return self._coordinator_host

    def failed_by(self) -> tuple[str, str] | None:
        """``(task, why)`` once, when a lost node took the allocation with it (see the module docstring)."""
        with self._lock:
            if self._failed is None or self._failed_told:
                return None
            self._failed_told = True
            return self._failed

    def take_notes(self) -> list[tuple[str, dict[str, Any]]]:
        with self._lock:
            out, self._notes = self._notes, []
        return out

    def _note(self, kind: str, **data: Any) -> None:
        with self._lock:
            self._notes.append((kind, data))

    def poll(self, timeout_s: float = 0.0) -> list[TaskExited]:
        self._heartbeat()
        if time.monotonic() - self._checked_at >= self.job_check_s:
            self._check_job()
        return super().poll(timeout_s)

    def ended_by(self) -> str | None:
        with self._lock:
            if self._ended is None or self._ended_told:
                return None
            self._ended_told = True
            return self._ended

    def stop(self, tasks: Sequence[str], grace_s: float) -> None:
        if self.job_id is None or not any(self.running(t) is not None for t in tasks):
            return
        try:
            self._stopping = self.cli.steps(str(self.job_id))
        except ClusterError as e:  # then the srun clients end their steps
            self.console.warn(f"cannot list the steps of Slurm job {self.job_id}: {e}")
            self._stopping = {}
        try:
            super().stop(tasks, grace_s)
        finally:
            self._stopping = {}

    # -- the steps -----------------------------------------------------------------------------------
    def _launch(self, task: TaskPlan, attempt: int, env: Mapping[str, str]) -> tuple[Any, Any]:
        plan = self._require_plan()
        index = plan.task_names().index(task.task)
        full = {k: v for k, v in os.environ.items() if not _is_job_variable(k)}
        full.pop("PSFLOW_SECRET", None)  # the launcher's own, if any: tasks read the run's secret file
        node = node_of(index, self.nodes)
        self._task_node[task.task] = node
        full.update({**TaskEnv(bind_host=node).render(), **env})  # the plan's own bind host wins
        if full.get("PSFLOW_NUM_THREADS"):  # a fresh interpreter's torch reads it at import
            full["OMP_NUM_THREADS"] = full["PSFLOW_NUM_THREADS"]
        argv = step_argv(str(self.job_id), node, task, attempt, threads=plan.threads, cwd=os.getcwd())
        p = subprocess.Popen(argv, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, text=True, bufsize=1, preexec_fn=die_with_parent)
        self._steps[task.task] = step_name(task.task, attempt)
        return p, p.stdout

    def _terminate(self, task: str, p: Any) -> None:
        step = self._stopping.get(self._steps[task])
        if step is not None:
            try:
                self.cli.cancel(step, "TERM")
                return
            except ClusterError:
                pass
        _signal_group(p, signal.SIGTERM)  # not a step yet (or no more), or scancel failed: the srun client ends it

    def _kill(self, task: str, p: Any) -> None:
        step = self._stopping.get(self._steps[task])
        if step is not None:
            with contextlib.suppress(ClusterError):
                self.cli.cancel(step, "KILL")
        _kill_client(p)

    def _reap(self, p: Any) -> None:
        _kill_client(p)

    def _ask_stacks(self, task: str, p: Any) -> bool:
        step = self._step_of(self._steps[task])
        if step is None:
            return False
        self._signal_step(step, signal.SIGUSR1)
        # A frozen task (SIGSTOP) cannot run its handler: resumed, it dumps at once, and the kill that
        # follows the dump still ends it. A running task ignores SIGCONT.
        self._signal_step(step, signal.SIGCONT)
        return True

    def _signal(self, task: str, p: Any, signum: int) -> bool:
        """``signum`` to every process of ``task``'s running attempt: ``scancel --signal`` to its step
        (see the module docstring); before Slurm lists the step, to its srun client's process group."""
        step = self._step_of(self._steps[task])
        if step is None:
            if p.poll() is not None:
                return False
            _signal_group(p, signum)
            return True
        try:
            self._signal_step(step, signum)
        except OSError:
            if p.poll() is not None:  # the step ended between the listing and the signal
                return False
            raise
        return True

    def _step_of(self, name: str) -> str | None:
        """The running step named ``name`` (``JOB.STEP``); None when Slurm does not list it."""
        try:
            return self.cli.steps(str(self.job_id)).get(name) if self.job_id else None
        except ClusterError as e:
            raise OSError(f"cannot list the steps of Slurm job {self.job_id}: {e}") from e

    def _signal_step(self, step: str, signum: int) -> None:
        argv = signal_argv(step, signum)
        try:
            r = self.cli.call(*argv)
        except ClusterError as e:
            raise OSError(f"`{shlex.join(argv)}` failed: {e}") from e
        if r.returncode != 0 and not _delivered_anyway(r.stderr, step, self._running_steps()):
            raise OSError(f"`{shlex.join(argv)}` failed (exit code {r.returncode}): {(r.stderr or r.stdout).strip()}")

    def _running_steps(self) -> set[str]:
        try:
            return set(self.cli.steps(str(self.job_id)).values()) if self.job_id else set()
        except ClusterError:
            return set()

    def error_report(self, task: str) -> dict[str, Any] | None:
        """The task's own report; for a task whose node was lost, one that says so (its process had no
        chance to write one); for the others of an allocation lost with a node, one that blames it."""
        own = super().error_report(task)
        with self._lock:
            lost, failed = self._lost, self._failed
        if lost is None:
            return own
        if self._task_node.get(task) in lost.nodes:
            return {"task": task, "exception": "NodeFailure", "message": lost.message(), "time_unix": self._lost_at}
        if own is None and failed is not None:
            return {"task": task, "exception": "NodeFailure", "message": f"stopped: {failed[1]}", "blame": failed[0],
                    "time_unix": self._lost_at}
        return own

    def close(self) -> None:
        self._closing = True  # steps end now because the run does: not "ended under the run"
        try:
            super().close()
        finally:
            if self.job_id is not None and self._plan is not None:
                self._release()

    # -- the job -------------------------------------------------------------------------------------
    def _heartbeat(self, *, force: bool = False, text: str | None = None) -> None:
        """Tell the batch script the launcher lives (every few seconds), or ``text`` (``end``)."""
        now = time.monotonic()
        if not force and text is None and now - self._beat_at < min(5.0, self.settings.hold_timeout_s / 4):
            return
        self._beat, self._beat_at = self._beat + 1, now
        path = slurm_dir(self._require_plan()) / "heartbeat"
        tmp = path.with_name("heartbeat.tmp")
        tmp.write_text(text or f"{self._beat}\n")
        os.replace(tmp, path)  # the script reads a whole beat or the last one

    def _wait_running(self, plan: LaunchPlan) -> list[str]:
        """The allocation's nodes, once the job runs; ClusterError if it ends or waits too long."""
        deadline = time.monotonic() + self.queue_timeout_s
        shown = ""
        while True:
            state, reason, nodelist = self.cli.job(str(self.job_id))
            if state in _RUNNING and nodelist:
                return expand_slurm_nodelist(nodelist)
            if state not in _WAITING:
                raise ClusterError(f"Slurm job {self.job_id} ended before it ran: {state} (reason: {reason}). "
                                   f"Its output: {slurm_dir(plan)}/batch-{self.job_id}.out")
            if f"{state} {reason}" != shown:
                shown = f"{state} {reason}"
                self.console.echo(f"psflow: Slurm job {self.job_id} is {state} (reason: {reason})")
                self._note("scheduler_waiting", job_id=self.job_id, state=state, reason=reason)
            if time.monotonic() > deadline:
                raise ClusterError(f"Slurm job {self.job_id} did not start within {self.queue_timeout_s:g} s "
                                   f"(state {state}, reason: {reason}). SlurmBackend(queue_timeout_s=...) waits longer.")
            self._heartbeat()
            time.sleep(0.2)

    def _check_job(self) -> None:
        """Whether the job still runs; if not, why (for ended_by), said once on the console."""
        self._checked_at = time.monotonic()
        if self.job_id is None or self._closing:
            return
        try:
            state, reason, nodes = self.cli.job(self.job_id)
            settle = time.monotonic() + 3.0
            while state == "COMPLETING" and time.monotonic() < settle:  # how it ended shows once its steps are gone
                time.sleep(0.2)
                state, reason, nodes = self.cli.job(self.job_id)
        except ClusterError as e:
            self.console.warn(f"cannot check Slurm job {self.job_id}: {e}")
            return
        if self._check_nodes(state, nodes) or state in _RUNNING:
            return
        with self._lock:
            if self._ended is not None or self._closing:
                return
            self._ended = f"Slurm job {self.job_id} {state}" + (f" ({reason})" if reason not in ("None", "") else "")
        self.console.warn(f"Slurm job {self.job_id} ended while the run went on: {state}; the run stops.")

    def _check_nodes(self, state: str, nodelist: str) -> bool:
        """Whether the job lost a node (said once per node); True when that ended the allocation."""
        allocated = [*self.nodes, *(self._lost.nodes if self._lost else ())]
        current = expand_slurm_nodelist(nodelist) if nodelist and state in _RUNNING else []
        if state in _RUNNING and (not current or set(current) >= set(self.nodes)):
            return False  # the usual answer, at the usual cost (one squeue)
        try:
            found = node_failure(str(self.job_id), state, allocated, current, self.cli.nodes(allocated))
        except ClusterError as e:
            self.console.warn(f"cannot check the nodes of Slurm job {self.job_id}: {e}")
            return False
        if found is None:
            return False
        with self._lock:
            new = [n for n in found.nodes if not (self._lost and n in self._lost.nodes)]
            ends = found.ends_run and self._failed is None and not self._closing
            before = self._lost.nodes if self._lost else ()
            self._lost_at = self._lost_at or time.time()
            self._lost = NodeFailure(found.job_id, (*before, *new), found.job_state,
                                     {**(self._lost.reasons if self._lost else {}), **found.reasons})
            self.nodes = [n for n in self.nodes if n not in self._lost.nodes]
            if ends:
                names = self._require_plan().task_names()
                on_lost = [t for t in names if self._task_node.get(t) in found.nodes]
                self._failed = (on_lost[0] if on_lost else names[0], found.message())
        if new or ends:
            tail = ("; the run fails" if found.ends_run else
                    f"; its tasks restart on {', '.join(self.nodes)} if the restart policy allows, else the run fails")
            self.console.warn(found.message() + tail)
            self._note("scheduler_node_failed", job_id=self.job_id, nodes=",".join(found.nodes),
                       job_state=found.job_state, message=found.message())
        return found.ends_run

    def _exited(self, task: str, attempt: int, p: Any, code: int) -> TaskExited:
        code = exit_code_of(code)
        # Was the step ended by the job's end (scancel, time limit)? Said before its exit is seen, for
        # ended_by: even a task that exits 0 on the SIGTERM does not make a cancelled run succeed.
        self._check_job()
        with self._lock:
            if code == 0 and self._lost is not None and self._task_node.get(task) in self._lost.nodes:
                code = NODE_LOST_EXIT  # its srun client may say 0; it did not finish
        return TaskExited(task, attempt, code, time.time())

    def _release(self) -> None:
        """End the job: ``end`` for the batch script (the job completes), scancel if it lingers."""
        try:
            self._heartbeat(text="end")
        except OSError:
            pass
        deadline = time.monotonic() + 5.0
        try:
            while time.monotonic() < deadline:
                if self.cli.job(str(self.job_id))[0] not in (*_WAITING, *_RUNNING):
                    return
                time.sleep(0.2)
            self.cli.cancel(str(self.job_id))
        except ClusterError as e:
            self.console.warn(f"could not end Slurm job {self.job_id} ({e}); `scancel {self.job_id}` ends it.")


def _is_job_variable(name: str) -> bool:
    """A variable of a Slurm job the launcher itself may run in (under salloc): not for the steps of
    its own job, which srun sets afresh. SLURM_CONF (where Slurm is) stays."""
    return name.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and name != "SLURM_CONF"


def _signal_group(p: subprocess.Popen[str], sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_client(p: subprocess.Popen[str]) -> None:
    """SIGKILL to an srun client (its step ends with it) and reap it."""
    if p.poll() is None:
        _signal_group(p, signal.SIGKILL)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
