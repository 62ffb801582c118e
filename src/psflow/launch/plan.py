"""A launch plan: the tasks of a run as plain data (command, environment, restart policy).

The restart policy (:class:`psflow.launch.restart.RestartPolicy`, per job) and the hang policy
(:class:`psflow.launch.watchdog.HangPolicy`: the watchdog's deadlines) are the plan's; the runner
hands them to the run controller, which decides each restart and catches each hang.

Pure: building a plan starts nothing. Every backend (local processes today; Slurm and Kubernetes
next) carries out the same plan, and a plan can be printed, compared and rendered.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from psflow.cluster import TaskId
from psflow.config import TrainConfig, check_logdir
from psflow.errors import ConfigError
from psflow.fault import check_faults, parse_faults
from psflow.launch.restart import JOBS, RestartPolicy
from psflow.launch.watchdog import HangPolicy
from psflow.rundir import RunDir, task_stem
from psflow.taskenv import TaskEnv
from psflow.threads import host_cores, threads_per_task


@dataclass(frozen=True)
class TaskPlan:
    task: str  # "worker:1"
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    @property
    def job(self) -> str:
        return self.task.split(":")[0]

    @property
    def file_stem(self) -> str:
        return task_stem(self.task)


@dataclass(frozen=True)
class LaunchPlan:
    run_id: str
    logdir: str
    tasks: tuple[TaskPlan, ...]
    config: TrainConfig = field(default_factory=TrainConfig)
    restart: RestartPolicy = field(default_factory=RestartPolicy)  # when a task that exited is started again
    hangs: HangPolicy = field(default_factory=HangPolicy)  # when a task counts as hung (default: never)
    grace_s: float = 20.0  # how long a stopped task gets between SIGTERM and SIGKILL
    ps_exit_timeout_s: float = 60.0  # how long ps tasks get to exit by themselves once workers are done
    threads: int = 1  # torch threads per task (PSFLOW_NUM_THREADS), see threads_per_task
    cores: int = 1  # the cores of the host the threads were shared out from
    logdir_url: str | None = None  # --logdir URL: logdir is its local staging dir (psflow.launch.urllogdir)

    def task_names(self) -> list[str]:
        return [t.task for t in self.tasks]

    def to_json(self) -> str:
        d = asdict(self)
        d["config"] = self.config.to_dict()
        return json.dumps(d, indent=1)


def make_plan(
    script: str,
    script_args: Sequence[str] = (),
    *,
    num_ps: int = 1,
    num_workers: int = 2,
    chief: bool = False,
    evaluator: bool = False,
    logdir: str | None = None,
    config: TrainConfig = TrainConfig(),
    python: str = sys.executable,
    fail_at: str | None = None,
    extra_env: dict[str, str] | None = None,
    threads: int | None = None,
    cores: int | None = None,
    restart: RestartPolicy | None = None,
    hangs: HangPolicy | None = None,
) -> LaunchPlan:
    """Plan a run of ``script`` with ``num_ps`` ps and ``num_workers`` workers on this machine.

    Each task gets ``threads`` torch threads (``PSFLOW_NUM_THREADS``), by default the host's
    ``cores`` (default: :func:`host_cores`) shared out by :func:`threads_per_task`; a script's own
    ``torch.set_num_threads`` still wins, as it runs later. ``restart``: when tasks that exited are
    started again (default: never); ``fail_at`` faults fire on the attempts it allows. ``hangs``: the
    watchdog's deadlines (default: off).

    Raises:
        ConfigError: a missing script or impossible counts; a hang fault with no watchdog to catch it;
            a deadline shorter than two of the reports it watches.
    """
    if not Path(script).is_file():
        raise ConfigError(f"Training script {script!r} does not exist. Give the path of a Python file.")
    if config.strategy == "ps" and num_ps < 1:
        raise ConfigError(f"--ps must be at least 1 for parameter-server training; received {num_ps}.")
    if num_workers < (0 if chief else 1):
        raise ConfigError(f"--workers must be at least 1; received {num_workers}.")
    run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    logdir = logdir or str(Path("runs") / run_id)
    check_logdir(logdir)
    names = (["chief:0"] if chief else []) + [f"ps:{i}" for i in range(num_ps if config.strategy == "ps" else 0)]
    names += [f"worker:{i}" for i in range(num_workers)] + (["evaluator:0"] if evaluator else [])
    restart = restart or RestartPolicy()
    # here, not in every task once they have started
    faults = parse_faults(fail_at)
    check_faults(faults, names, last_attempt={job: restart.last_attempt(job) for job in JOBS})
    hangs = hangs or HangPolicy()
    hangs.check_intervals(config.progress_every_s, config.heartbeat_every_s)
    hung = [f"{f.task}@step={f.step}" for f in faults if f.action == "hang"]
    if hung and not hangs.enabled:
        raise ConfigError(f"--hang-at {','.join(hung)}: nothing would catch the hang (the watchdog is off), so the "
                          "run would wait for ever. Add --hang-timeout S (e.g. --hang-timeout 10).")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"--threads must be a positive number of threads per task; received {threads!r}.")
    cores = cores or host_cores()
    threads = threads or threads_per_task(len(names), cores)
    tasks = []
    for name in names:
        contract = TaskEnv(task=TaskId.parse(name), train_config=config, logdir=logdir, num_threads=threads,
                           error_file=str(RunDir(logdir).error_report(name)), fail_at=fail_at or None)
        env = {**contract.render(), **(extra_env or {})}
        tasks.append(TaskPlan(name, (python, "-u", script, *script_args), tuple(sorted(env.items()))))
    return LaunchPlan(run_id=run_id, logdir=logdir, tasks=tuple(tasks), config=config, restart=restart, hangs=hangs,
                      threads=threads, cores=cores)


def added_worker(plan: LaunchPlan, task: str) -> TaskPlan:
    """The plan of worker ``task`` that ``psflow scale`` adds to a running ``plan``: the script and
    arguments of the plan's first training task, its own task id and error file, and the launch's
    data shard count (``PSFLOW_DATA_SHARDS``: see :mod:`psflow.ps.membership`).

    Raises:
        ConfigError: the plan has no training task to copy.
    """
    template = next((t for t in plan.tasks if t.job == "worker"), None) or next((t for t in plan.tasks if t.job == "chief"), None)
    if template is None:
        raise ConfigError(f"Run {plan.run_id} has no worker or chief task to copy for {task}.")
    replicas = sum(1 for t in plan.tasks if t.job in ("chief", "worker"))
    env = dict(template.env)
    env.update(TaskEnv(task=TaskId.parse(task), data_shards=replicas,
                       error_file=str(RunDir(plan.logdir).error_report(task))).render())
    return TaskPlan(task, template.argv, tuple(sorted(env.items())))
