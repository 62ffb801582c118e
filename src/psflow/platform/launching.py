"""Launching a run from a value: what the HTTP API's "start a run" and ``psflow restart`` carry out.

A :class:`LaunchSpec` is a run's launch as plain data (script, arguments, cluster shape, mode,
strategy, backend, restart policy, training settings). :func:`plan_of` checks it and turns it into
the launch plan (:func:`psflow.launch.make_plan`, the same as ``psflow run``; pure, starts nothing),
so a bad spec is refused before anything runs. Then either

- :func:`run_here` runs it in this process, in the foreground (``psflow restart``), or
- :func:`start_detached` starts a launcher process of its own session (``python -m
  psflow.platform.launching SPEC``), whose output goes to ``LOGDIR/launcher.log``: the HTTP API's
  way, so the run survives the dashboard going down. Nothing goes through a shell: the script and
  its arguments are an argv list.

Restart (``psflow restart RUN``, ``POST /api/runs/{id}/restart``) is what users of Kubeflow (delete
and re-create the TFJob) and Ray (resubmit the job) do by hand: stop the run if it still runs, then
launch the same plan again (:func:`spec_of_run`: from what the job store recorded) as a new run, in
the same log directory, so the chief restores the newest checkpoint and training goes on from
there. The new run names the old one (``restarted_from``). Fault injection (``--fail-at``) is not
part of the plan that is restarted: it tested the run it was given to. One logdir, one live run
(:mod:`psflow.logdirlock`): a restart holds the logdir's queue place while the old run stops,
then its lock, so of two quick restarts of one run the second is refused.

"Restore here" (``POST /api/runs/{id}/checkpoints/{name}/restore``) launches the same plan as a new
run in a new log directory seeded with that one checkpoint (:func:`restore_spec`,
:func:`seed_checkpoint`): the chief restores it, with the workers' data positions it holds.

Called by :mod:`psflow.cli` (restart) and :mod:`psflow.platform.api`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from psflow.errors import ConfigError, PsflowError
from psflow.launch.backend import RunResult
from psflow.launch.plan import LaunchPlan
from psflow.launch.restart import RestartPolicy
from psflow.logdirlock import LogdirLock
from psflow.rundir import RunDir
from psflow.validation import checked

BACKENDS = ("local", "slurm", "ssh", "k8s")
LAUNCHER_LOG = "launcher.log"


# Not strict: a spec is also read back from JSON (a restart's launcher), where a tuple is a list.
@checked
@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class LaunchSpec:
    """One run's launch as data (``psflow run``'s options, one field each).

    Args:
        script: the training script (a ``.py`` file).
        args: the script's own arguments, as a list (never a shell line).
        num_ps, num_workers, chief, evaluator: the cluster's shape.
        mode, strategy: ``async|sync|ssp`` and ``ps|allreduce``.
        backend: ``local``, ``slurm``, ``ssh`` (``hosts``) or ``k8s`` (``k8s``: its settings, ``image`` first).
        restart_policy: :class:`psflow.launch.restart.RestartPolicy`'s fields (``kind``, ``max_restarts``, ...).
        config: other :class:`psflow.config.TrainConfig` fields (``staleness``, ``ps_replicas``, ...).
        hangs: :class:`psflow.launch.watchdog.HangPolicy`'s fields.
        threads: torch threads per task (None: the cores shared out).
        logdir: the run's directory (None: ``runs/<run id>`` under ``runs_root``).
        run_id: the new run's id (None: a fresh one).
        restarted_from: the run this one restarts.
        gpus_per_worker: GPUs each chief and worker sees (local: :mod:`psflow.launch.gpus`; 0: none asked).
        logdir_url: ``psflow run --logdir URL``: ``logdir`` is its staging directory; the files are
            uploaded there and the checkpoints are read and written at ``URL/checkpoints``.
        hosts: ssh: ``HOST:SLOTS,...``, the hosts the tasks go to (``psflow run --hosts``).
        nodes: slurm: the nodes to allocate.
        sbatch_args: slurm: more ``#SBATCH`` options (``--partition=gpu``; ``psflow run --sbatch-arg``).
        coordinator_host: slurm, ssh: the address the nodes reach the launcher at.
        k8s: k8s: :class:`psflow.launch.k8s.K8sSettings`' fields (``image``, ``namespace``, ``volume_claim``, ...).
        after_run, after_request, after_timeout_s: a restart's launcher waits up to ``after_timeout_s``
            for run ``after_run`` to end (its stop request ``after_request``) before it starts: the
            wait lives in the launcher's own process, so a restart asked of the dashboard goes on
            if the dashboard goes down between the stop and the launch.
    """

    script: str
    args: tuple[str, ...] = ()
    num_ps: int = Field(1, ge=0)
    num_workers: int = Field(2, ge=0)
    chief: bool = False
    evaluator: bool = False
    mode: str = "async"  # checked by TrainConfig
    strategy: str = "ps"  # checked by TrainConfig
    backend: Literal[BACKENDS] = "local"  # type: ignore[valid-type]
    restart_policy: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    hangs: dict[str, Any] = field(default_factory=dict)
    threads: int | None = Field(None, ge=1)
    logdir: str | None = None
    run_id: str | None = None
    restarted_from: str | None = None
    gpus_per_worker: int = Field(0, ge=0)
    logdir_url: str | None = None
    after_run: str | None = None
    after_request: int | None = None
    after_timeout_s: float = 120.0
    hosts: str | None = None
    nodes: int | None = None
    coordinator_host: str | None = None
    k8s: dict[str, Any] = field(default_factory=dict)
    sbatch_args: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LaunchSpec:
        return cls(**json.loads(text))


def new_run_id() -> str:
    """A run id in :func:`psflow.launch.make_plan`'s form: ``20250101-120000-ab12cd``."""
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def spec_of_run(run: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> LaunchSpec:
    """The launch of a recorded run (a job store record, :meth:`JobStore.run`), to launch it again:
    same script, arguments, shape, settings, backend settings (hosts, nodes, Kubernetes image, ...),
    logdir; a new id, naming the old one. ``overrides``: backend settings that replace the recorded
    ones (``hosts``, ``nodes``, ``coordinator_host``, ``sbatch_args``: the whole list; ``k8s``: merged, key by key).

    Raises:
        ConfigError: the record lacks what a launch needs (a run recorded before psflow kept it), or
            an override is not a backend setting.
    """
    cluster = run.get("cluster") or {}
    launch = run.get("launch") or {}
    if not run.get("script") or not cluster:
        raise ConfigError(f"Run {run.get('id')} has no recorded script or cluster; start it again with psflow run.")
    config = dict(launch.get("config") or {})
    mode, strategy = config.pop("mode", run.get("mode") or "async"), config.pop("strategy", run.get("strategy") or "ps")
    script = Path(str(run["script"]))
    if not script.is_absolute() and launch.get("cwd"):  # relative to where the run was launched, not to here
        script = Path(str(launch["cwd"])) / script
    return LaunchSpec(
        script=str(script), args=tuple(run.get("args") or ()), num_ps=len(cluster.get("ps", [])),
        num_workers=len(cluster.get("worker", [])), chief=bool(cluster.get("chief")), evaluator=bool(cluster.get("evaluator")),
        mode=mode, strategy=strategy, backend=str(run.get("backend") or "local"),
        restart_policy=dict(run.get("restart_policy") or {}), config=config, hangs=dict(launch.get("hangs") or {}),
        threads=launch.get("threads"), logdir=str(run["logdir"]), run_id=new_run_id(), restarted_from=str(run["id"]),
        gpus_per_worker=int(launch.get("gpus_per_worker") or 0),
        logdir_url=launch.get("logdir_url"), **_backend_settings(launch.get("backend_settings") or {}, overrides or {}))


def _backend_settings(recorded: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A restart's backend settings: the recorded ones, with ``overrides`` in their place (``k8s``: key by key)."""
    from psflow.platform.sqlrunstore import BACKEND_SETTINGS

    unknown = sorted(set(overrides) - set(BACKEND_SETTINGS))
    if unknown:
        raise ConfigError(f"Unknown backend setting(s) {unknown} for a restart; known: {list(BACKEND_SETTINGS)}.")
    out = {k: recorded.get(k) for k in BACKEND_SETTINGS if k != "k8s"}
    out.update({k: v for k, v in overrides.items() if k != "k8s" and v is not None})
    out["k8s"] = {**dict(recorded.get("k8s") or {}), **dict(overrides.get("k8s") or {})}
    out["sbatch_args"] = tuple(out.get("sbatch_args") or ())  # a run recorded without any: none
    return out


def restore_spec(run: Mapping[str, Any], runs_root: Path) -> LaunchSpec:
    """The launch of ``run``'s plan again as a new run in a new log directory (``runs_root/<new id>``),
    to be seeded with one of its checkpoints (:func:`seed_checkpoint`): "restore here".

    Raises:
        ConfigError: as :func:`spec_of_run`.
    """
    spec = spec_of_run(run)
    return dataclasses.replace(spec, logdir=str(runs_root / str(spec.run_id)), logdir_url=None)  # here: a local run


def seed_checkpoint(checkpoint_dir: Path, logdir: Path) -> Path:
    """Copy one checkpoint into ``logdir/checkpoints`` (a new run's only one, so its chief restores it),
    under a temporary name first: a copy cut short never looks whole."""
    import shutil

    root = RunDir(logdir).checkpoints
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_dir.name
    temp = root / f"{checkpoint_dir.name}.partial"
    shutil.copytree(checkpoint_dir, temp)
    temp.rename(final)
    return final


_POLICY_FIX = ("A restarted run's policy is the one its job store record holds: start the run again with psflow run "
               "--restart SPEC instead, or give restart_policy as RestartPolicy's fields, e.g. "
               '{"kind": "on-failure", "max_restarts": 3}.')


def plan_of(spec: LaunchSpec, *, runs_root: Path | None = None) -> LaunchPlan:
    """The launch plan of ``spec``, checked as ``psflow run`` checks its options (pure).

    Raises:
        ConfigError: what ``psflow run`` would refuse (a missing script, impossible counts, settings
            that do not go together), an unknown backend or restart policy.
    """
    from psflow.config import TrainConfig, check_launch_settings
    from psflow.launch import make_plan
    from psflow.launch.watchdog import HangPolicy

    run_id = spec.run_id or new_run_id()
    logdir = spec.logdir or str((runs_root or Path("runs")) / run_id)
    config = TrainConfig.from_dict({**spec.config, "mode": spec.mode, "strategy": spec.strategy})
    defaults = TrainConfig().to_dict()  # a recorded run holds every setting: only those off their default count as given
    given = {k for k, v in spec.config.items() if defaults.get(k) != v} | {"num_ps"}
    check_launch_settings(config, given, num_replicas=spec.num_workers + int(spec.chief), num_ps=spec.num_ps)
    policy = RestartPolicy.from_dict(spec.restart_policy, what="The launch's restart_policy", fix=_POLICY_FIX)
    plan = make_plan(spec.script, list(spec.args), num_ps=spec.num_ps, num_workers=spec.num_workers, chief=spec.chief,
                     evaluator=spec.evaluator, logdir=logdir, config=config, threads=spec.threads, restart=policy,
                     hangs=HangPolicy(**spec.hangs), extra_env=_url_env(spec.logdir_url))
    plan = _with_gpus(dataclasses.replace(plan, run_id=run_id, logdir_url=spec.logdir_url), spec)
    _check_backend(spec, plan)
    return plan


def backend_options(spec: LaunchSpec, *, live: bool | None = None) -> Any:
    """The :class:`psflow.launch.assemble.BackendOptions` of ``spec`` (ssh: the local backend's name with ``hosts``)."""
    from psflow.launch.assemble import BackendOptions

    ssh = spec.backend == "ssh"
    return BackendOptions(name="local" if ssh else spec.backend, hosts=spec.hosts if ssh else None, nodes=spec.nodes,
                          coordinator_host=spec.coordinator_host, live=live, k8s=dict(spec.k8s),
                          sbatch_args=tuple(spec.sbatch_args))


def _check_backend(spec: LaunchSpec, plan: LaunchPlan) -> None:
    """Refuse now what the launcher's backend would refuse (nothing is started, nothing is reached).

    Raises:
        ConfigError: ssh without hosts or with too few slots for the plan's tasks; options another
            backend's (nodes for a local run, ...); Kubernetes settings without an image or out of bounds.
    """
    from psflow.launch.assemble import make_backend

    if spec.backend == "ssh":
        from psflow.launch.ssh import parse_hosts, place

        if not spec.hosts:
            raise ConfigError("The ssh backend needs hosts: HOST:SLOTS,... (e.g. node1:2,node2:2), the hosts the tasks "
                              "are started on over ssh, filled in order.")
        place(plan.task_names(), parse_hosts(spec.hosts))
    make_backend(backend_options(spec))


def _with_gpus(plan: LaunchPlan, spec: LaunchSpec) -> LaunchPlan:
    """``plan`` with each training task's ``CUDA_VISIBLE_DEVICES`` (``spec.gpus_per_worker`` each).

    Raises:
        GpuRequestError: GPUs asked of a backend that cannot place them here, or more than this machine has.
    """
    from psflow.launch.gpus import VISIBLE, GpuRequestError, assign_gpus, gpu_count

    if not spec.gpus_per_worker:
        return plan
    if spec.backend != "local":
        raise GpuRequestError(f"GPUs per worker ({spec.gpus_per_worker}) are placed by psflow on local runs only; for "
                          f"backend {spec.backend!r} ask the scheduler (Slurm: --gres=gpu:N in its options; Kubernetes: "
                          "psflow run --backend k8s --gpus-per-worker N), or set 0.")
    visible = assign_gpus(plan.task_names(), spec.gpus_per_worker, gpu_count())
    tasks = tuple(dataclasses.replace(t, env=tuple(sorted({**dict(t.env), VISIBLE: visible[t.task]}.items())))
                  if t.task in visible else t for t in plan.tasks)
    return dataclasses.replace(plan, tasks=tasks)


def _url_env(logdir_url: str | None) -> dict[str, str] | None:
    """A URL logdir's tasks keep their checkpoints at ``URL/checkpoints`` (as ``psflow run`` set them)."""
    if logdir_url is None:
        return None
    from psflow.launch.urllogdir import checkpoint_url
    from psflow.taskenv import TaskEnv

    return TaskEnv(checkpoint_dir=checkpoint_url(logdir_url)).render()


def run_here(spec: LaunchSpec, *, live: bool | None = None, runs_root: Path | None = None,
             queued: LogdirLock | None = None) -> tuple[LaunchPlan, RunResult]:
    """Run ``spec`` in this process, to its end (the foreground ``psflow restart``), holding its logdir
    (:mod:`psflow.logdirlock`). A restart waits up to ``after_timeout_s`` for the run it
    restarts to let the logdir go; ``queued``: the lock that held the queue place meanwhile.

    Raises:
        LogdirInUseError: another live run holds the logdir; nothing was started.
    """
    from psflow.logdirlock import hold_run

    plan = plan_of(spec, runs_root=runs_root)
    with hold_run(plan.logdir, plan.logdir_url, plan.run_id, wait_for_run=spec.restarted_from,
                  wait_s=spec.after_timeout_s if spec.restarted_from else 0.0, queued=queued):
        if plan.logdir_url is None:
            run = _assembled(spec, plan, live=live)
            return run.plan, run.runner.run(run.plan)
        from psflow.launch.urllogdir import LogdirSyncer, check_url

        check_url(plan.logdir_url)  # before any task starts
        Path(plan.logdir).mkdir(parents=True, exist_ok=True)
        with LogdirSyncer(Path(plan.logdir), plan.logdir_url, warn=lambda m: print(f"psflow: warning: {m}", file=sys.stderr)):
            run = _assembled(spec, plan, live=live)
            return run.plan, run.runner.run(run.plan)


def queue_restart(spec: LaunchSpec) -> LogdirLock:
    """A restart's claim on its logdir while the run it restarts (``spec.after_run``) stops: the queue
    place (:meth:`LogdirLock.queue_behind`), handed to :func:`run_here`.

    Raises:
        LogdirInUseError: another restart of the logdir waits already, or another run holds it.
    """
    from psflow.logdirlock import run_lock

    assert spec.after_run is not None and spec.run_id is not None and spec.logdir is not None
    lock = run_lock(spec.logdir, spec.logdir_url, spec.run_id)
    lock.queue_behind(spec.after_run)
    return lock


def _assembled(spec: LaunchSpec, plan: LaunchPlan, *, live: bool | None) -> Any:
    """``plan`` on the spec's backend, recorded in the job store: the runner, and the plan as it runs there
    (the one to run: on Kubernetes without the hang watchdog, see :func:`psflow.launch.assemble.assemble_run`)."""
    from psflow.launch.assemble import assemble_run
    from psflow.platform.recording import backend_settings, recording

    options = backend_options(spec, live=live)
    return assemble_run(plan, options, store=lambda b: recording(b, restarted_from=spec.restarted_from,
                                                                 settings=backend_settings(options)))


def start_detached(spec: LaunchSpec, *, runs_root: Path | None = None, env: Mapping[str, str] | None = None,
                   python: str = sys.executable) -> tuple[LaunchPlan, subprocess.Popen[bytes]]:
    """Check ``spec`` and start its launcher as a process of its own session (it outlives the caller),
    writing to ``LOGDIR/launcher.log``. Returns the plan (its ``run_id`` is the new run's) and the process.

    Raises:
        ConfigError: a spec :func:`plan_of` refuses (nothing is started).
    """
    from psflow.logdirlock import run_lock

    plan = plan_of(spec, runs_root=runs_root)
    fixed = dataclasses.replace(spec, run_id=plan.run_id, logdir=os.path.abspath(plan.logdir))
    Path(fixed.logdir or ".").mkdir(parents=True, exist_ok=True)
    # Refused here, not in the background where only launcher.log would say so (the launcher checks again).
    run_lock(str(fixed.logdir), fixed.logdir_url, str(fixed.run_id)).check(after_run=fixed.restarted_from)
    with open(Path(fixed.logdir or ".") / LAUNCHER_LOG, "ab") as out:
        proc = subprocess.Popen([python, "-m", "psflow.platform.launching", fixed.to_json()], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ if env is None else env))
    return plan, proc


def record_starting(db_path: Path, plan: LaunchPlan, spec: LaunchSpec, launcher_pid: int) -> None:
    """Record ``plan``'s run as ``pending`` in the job store at once, with a ``launch_requested`` event,
    so that its page exists while its launcher (``launcher_pid``, :func:`start_detached`) starts; the
    launcher's own record takes the row over (:meth:`JobStore.add_run`).

    Until then the run's process of record is this one (the dashboard, which waits for the launcher
    and records its failure: :func:`record_launch_failure`): a read while the launcher's failure is
    being recorded does not call the run abandoned, and one after this process is gone does."""
    from psflow.launch.liveness import process_identity
    from psflow.platform.jobstore import JobStore
    from psflow.platform.recording import backend_settings
    from psflow.platform.sqlrunstore import run_record

    record = run_record(plan, backend=spec.backend, restart_policy=plan.restart,
                        settings=backend_settings(backend_options(spec)))
    record["launcher"] = process_identity(os.getpid())
    if spec.restarted_from:
        record["restarted_from"] = spec.restarted_from
    with JobStore(db_path) as db, db.transaction():
        db.add_run(record, plan.task_names())
        db.add_event(plan.run_id, "launch_requested", time.time(), {"launcher_pid": launcher_pid,
                                                                    "after_run": spec.after_run})


def record_launch_failure(db_path: Path, run_id: str, logdir: str, exit_code: int) -> bool:
    """If run ``run_id``'s launcher ended (``exit_code``) before it recorded the run (no ``run_started``
    event), record the run ``failed``, its root cause the launcher's last words (``LOGDIR/launcher.log``).
    Returns whether it did."""
    from psflow.platform.jobstore import JobStore

    with JobStore(db_path) as db, db.transaction():
        run = db.run(run_id, metrics=False)
        # "abandoned": a read saw the launcher gone first (jobstore's liveness verdict); it is this failure
        if run is None or run["state"] not in ("pending", "abandoned") or \
                any(e["kind"] == "run_started" for e in db.events(run_id)):
            return False
        said = _last_words(Path(logdir) / LAUNCHER_LOG)
        cause = f"its launcher ended with exit code {exit_code} before the run started" + (f": {said}" if said else
                                                                                         f" (see {logdir}/{LAUNCHER_LOG})")
        now = time.time()
        db.add_event(run_id, "launch_failed", now, {"exit_code": exit_code, "output": said})
        db.set_summary(run_id, {"run_id": run_id, "status": "failed", "root_cause": cause})
        db.finish_run(run_id, "failed", now)
        return True


def _last_words(log: Path, max_chars: int = 1500) -> str:
    """A launcher's last words: from its last traceback, else its last ``psflow:`` line, else its last
    20 lines; at most ``max_chars``."""
    try:
        lines = log.read_text(errors="replace")[-20_000:].strip().splitlines()
    except OSError:
        return ""
    starts = ([i for i, line in enumerate(lines) if line.startswith("Traceback")] or
              [i for i, line in enumerate(lines) if line.startswith("psflow: ")] or [max(0, len(lines) - 20)])
    return "\n".join(lines[starts[-1]:])[-max_chars:]


def _wait_for_stop(spec: LaunchSpec) -> None:
    """A restart's launcher: wait for the run it restarts to end (see :class:`LaunchSpec`'s ``after_run``)."""
    from psflow.home import jobs_db_path
    from psflow.platform.runcontrol import wait_until_over

    assert spec.after_run is not None
    print(f"psflow: run {spec.run_id} waits for run {spec.after_run} to stop before it starts.", flush=True)
    wait_until_over(jobs_db_path(), spec.after_run, timeout_s=spec.after_timeout_s, request_id=spec.after_request)


def main(argv: Sequence[str] | None = None) -> int:
    """The detached launcher: ``python -m psflow.platform.launching SPEC_JSON``; returns the run's exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m psflow.platform.launching SPEC_JSON (a LaunchSpec as JSON)", file=sys.stderr)
        return 2
    spec = LaunchSpec.from_json(args[0])
    queued = None
    try:
        if spec.after_run is not None:
            queued = queue_restart(spec)  # a second restart of this logdir is refused meanwhile
            _wait_for_stop(spec)
        plan, result = run_here(spec, live=False, queued=queued)
    except PsflowError as e:
        print(f"psflow: {e}", file=sys.stderr)
        return 2
    finally:
        if queued is not None:
            queued.release_queue_place()
    print(f"psflow: run {plan.run_id} ended with exit code {result.exit_code}", flush=True)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
