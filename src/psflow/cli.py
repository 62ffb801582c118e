"""The ``psflow`` command: parse -> config -> call. One small function per subcommand."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from psflow.config import TrainConfig, check_launch_settings
from psflow.errors import ConfigError, PsflowError
from psflow.launch.restart import JOBS, RestartPolicy


@click.group()
@click.version_option(package_name="psflow")
def main() -> None:
    """psflow: distributed PyTorch training with parameter servers."""


def _k8s_options(f: Any) -> Any:
    """The Kubernetes options of ``psflow run --backend k8s`` and ``psflow k8s tfjob``."""
    for option in reversed([
        click.option("--image", "k8s_image", default=None, help="k8s: the container image (Python, psflow and the script)."),
        click.option("--volume-claim", "k8s_volume_claim", default=None,
                     help="k8s: a ReadWriteMany PersistentVolumeClaim mounted at /psflow in every pod (the log dir)."),
        click.option("--namespace", "k8s_namespace", default="default", show_default=True, help="k8s: the namespace."),
        click.option("--gpus-per-worker", type=click.IntRange(min=0), default=0, show_default=True,
                     help="k8s: nvidia.com/gpu for each chief and worker pod."),
        click.option("--env-secret", "k8s_env_secret", default=None,
                     help="k8s: a Secret of yours whose keys become every pod's environment (e.g. AWS_* for "
                          "--checkpoint-dir s3://...)."),
        click.option("--ttl", "k8s_ttl_s", type=click.IntRange(min=0), default=3600, show_default=True,
                     help="k8s: seconds a finished Job (pods, logs) is kept (ttlSecondsAfterFinished)."),
    ]):
        f = option(f)
    return f


# allow_interspersed_args=False: everything after SCRIPT reaches script_args as written ("--" included),
# so that run can tell its own options written after the script (refused) from the script's arguments.
@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--ps", "num_ps", default=1, show_default=True, help="Parameter-server tasks.")
@click.option("--workers", "num_workers", default=2, show_default=True, help="Worker tasks.")
@click.option("--chief/--no-chief", default=False, help="Add a separate chief task (default: worker:0 is chief).")
@click.option("--evaluator/--no-evaluator", default=False, help="Add an evaluator task that evaluates every new checkpoint.")
@click.option("--logdir", default=None, help="Where logs, errors and summary.json go (default runs/<run id>); or a URL (s3://B/P), uploaded.")
@click.option("--mode", type=click.Choice(["async", "sync", "ssp"]), default=None, help="Update mode.")
@click.option("--strategy", type=click.Choice(["ps", "allreduce"]), default=None, help="Parameter servers or all-reduce.")
@click.option("--replicas-to-aggregate", type=int, default=None, help="sync: gradients averaged per step (N).")
@click.option("--total-num-replicas", type=int, default=None, help="sync: workers taking part (M); M - N are backups.")
@click.option("--staleness", type=int, default=None, help="ssp: how many steps a worker may run ahead.")
@click.option("--sync-timeout", "sync_timeout_s", type=float, default=None, help="sync/ssp: longest wait for a step (s).")
@click.option("--lost-worker-timeout", "lost_worker_timeout_s", type=float, default=None,
              help="ps: once the other workers are done, longest wait for a lost worker to reconnect (s).")
@click.option("--ps-replicas", "ps_replicas", type=int, default=None,
              help="Copies of each ps shard: 2 keeps a backup on the next ps, which takes over if the primary dies.")
@click.option("--placement", type=click.Choice(["balanced", "round_robin", "greedy", "contiguous"]), default=None,
              help="How parameters go on ps shards (default balanced: equal bytes per shard, big tensors split; round_robin: TensorFlow's).")
@click.option("--log-placement", is_flag=True, help="Print where each parameter lives (like log_device_placement).")
@click.option("--compress", default=None, metavar="none|fp16|bf16|topk:RATIO",
              help="Gradients on the wire: half precision, or the largest RATIO of each (with error feedback).")
@click.option("--compress-pull", "compress_pull", is_flag=True, default=None,
              help="With --compress fp16|bf16: the parameters come back in that precision too.")
@click.option("--timeline", is_flag=True, default=None,
              help="Record where every step's time goes into LOGDIR/timeline.json (Perfetto, chrome://tracing).")
@click.option("--allow-unauthenticated-allreduce", is_flag=True, default=None,
              help="Let --strategy allreduce run off loopback, where its traffic (gloo) is not covered by the job secret.")
@click.option("--fail-at", default=None,
              help="Fault injection, e.g. worker:1@step=30 or worker:1@step=30:kill; fires on a task's first attempt "
                   "(add @attempt=K for its K-th restart).")
@click.option("--hang-at", default=None, metavar="TASK@step=N[@attempt=K],...",
              help="Fault injection: that task's main thread stops for ever before step N, its heartbeats go on "
                   "(needs --hang-timeout), e.g. worker:1@step=20.")
@click.option("--slow", default=None, metavar="TASK=SECONDS[s],...",
              help="Fault injection: that task sleeps this long before every step, e.g. worker:2=0.2s.")
@click.option("--hang-timeout", "hang_timeout_s", type=float, default=None,
              help="Watchdog: a chief/worker with no new step for this many seconds, or any task with no heartbeat "
                   "for as long, gets its stacks dumped into its log and is killed (then restarted per --restart). "
                   "Default: off. Give more than the longest pause between steps (evaluation, checkpoints).")
@click.option("--heartbeat-timeout", "heartbeat_timeout_s", type=float, default=None,
              help="Watchdog: the heartbeat deadline, if it should differ from --hang-timeout (s).")
@click.option("--restart", "restart", default=None, metavar="POLICY|JOB=POLICY,...",
              help="Restart tasks that exit: never (default), on-failure, always, exit-code (1-127 permanent, "
                   "128-255 and signals retried); for every job, or per job: worker=on-failure,ps=never.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=None,
              help="With --restart: restarts allowed per task (default 3).")
@click.option("--max-restarts-per-run", type=click.IntRange(min=0), default=None,
              help="With --restart: restarts allowed for all tasks together (default: no cap).")
@click.option("--restart-backoff", "backoff_base_s", type=click.FloatRange(min=0), default=None,
              help="With --restart: seconds before a task's first restart, doubled for each later one (default 1).")
@click.option("--restart-backoff-max", "backoff_max_s", type=click.FloatRange(min=0), default=None,
              help="With --restart: the longest wait before a restart, in seconds (default 60).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Torch threads per task (default: the cores shared evenly by the tasks); a script's own "
                   "torch.set_num_threads still wins.")
@click.option("--preload/--no-preload", default=True, show_default=True,
              help="Fork the tasks from one process that imported torch once (faster start), or start each afresh.")
@click.option("--live/--no-live", default=None,
              help="Show a live table of the tasks under their output (default: when printing to a terminal).")
@click.option("--backend", type=click.Choice(["local", "slurm", "k8s"]), default="local", show_default=True,
              help="Where the tasks run: processes on this machine, steps of one Slurm job, or Kubernetes pods "
                   "(or --hosts: over ssh).")
@click.option("--nodes", type=click.IntRange(min=1), default=None, help="slurm: nodes to allocate (default 1).")
@click.option("--dry-run", is_flag=True, help="slurm: print the sbatch script; k8s: print the manifests (YAML); and exit.")
@_k8s_options
@click.option("--checkpoint-dir", default=None, metavar="DIR|URL",
              help="Where the checkpoints go instead of LOGDIR/checkpoints: a directory or a URL (s3://bucket/run, "
                   "through fsspec; pip install s3fs).")
@click.option("--hosts", default=None, metavar="HOST:SLOTS,...",
              help="Run the tasks on these hosts over ssh, filled in order (horovodrun's convention), e.g. node1:1,node2:2.")
@click.option("--ssh-config", default=None, type=click.Path(dir_okay=False, exists=True),
              help="--hosts: an ssh configuration file (ssh -F): keys, users, ports.")
@click.option("--alert-webhook", default=None, metavar="URL",
              help="Tell this webhook (JSON POST) when the run fails, stalls or restarts a task, dashboard or not "
                   "(sets PSFLOW_ALERT_WEBHOOK; PSFLOW_ALERT_STALL_S: the stall, default 300 s).")
@click.argument("script", type=click.Path(dir_okay=False))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def run(num_ps: int, num_workers: int, chief: bool, evaluator: bool, logdir: str | None, script: str, script_args: tuple[str, ...],
        fail_at: str | None, log_placement: bool, preload: bool, live: bool | None, threads: int | None,
        backend: str, nodes: int | None, dry_run: bool, hang_at: str | None, slow: str | None,
        hang_timeout_s: float | None, heartbeat_timeout_s: float | None,
        restart: str | None, max_restarts: int | None, max_restarts_per_run: int | None,
        backoff_base_s: float | None, backoff_max_s: float | None, k8s_image: str | None, k8s_volume_claim: str | None,
        k8s_namespace: str, gpus_per_worker: int, k8s_ttl_s: int, k8s_env_secret: str | None, hosts: str | None,
        ssh_config: str | None, checkpoint_dir: str | None, **settings: object) -> None:
    """Start every task of SCRIPT on this machine and watch them: psflow run --ps 1 --workers 3 train.py -- --epochs 50"""
    from psflow.launch.metrics import final_line

    script_args = _script_args(click.get_current_context(), script, script_args)
    alert_webhook = settings.pop("alert_webhook", None)
    if alert_webhook is not None:
        from psflow.platform.alerts import check_webhook
        from psflow.platform.home import ALERT_WEBHOOK_ENV

        try:
            os.environ[ALERT_WEBHOOK_ENV] = check_webhook(str(alert_webhook))  # read where the launcher makes its run store
        except PsflowError as e:
            raise click.UsageError(str(e)) from e
    logdir_url = None
    try:
        if logdir is not None and "://" in logdir:  # --logdir s3://...: staged here, uploaded (launch.urllogdir)
            logdir_url, logdir, checkpoint_dir = _url_logdir(logdir, checkpoint_dir, backend=backend, hosts=hosts,
                                                             dry_run=dry_run)
        plan, policy, hangs, config = _plan(num_ps, num_workers, chief, evaluator, logdir, script, script_args, fail_at,
                                            log_placement, threads, hang_at, slow, hang_timeout_s, heartbeat_timeout_s,
                                            restart, max_restarts, max_restarts_per_run, backoff_base_s, backoff_max_s,
                                            settings, checkpoint_dir=checkpoint_dir)
        if logdir_url is not None:
            plan = dataclasses.replace(plan, logdir_url=logdir_url)
        k8s = {"image": k8s_image, "volume_claim": k8s_volume_claim, "namespace": k8s_namespace,
               "gpus_per_worker": gpus_per_worker, "ttl_s": k8s_ttl_s, "env_secret": k8s_env_secret}
        if hosts is not None or ssh_config is not None:
            runner = _ssh_backend(backend, hosts, ssh_config, dry_run=dry_run, live=live)
        else:
            runner = _backend(backend, nodes, dry_run, preload=preload, live=live, k8s=k8s)
    except PsflowError as e:
        raise click.UsageError(str(e)) from e
    if dry_run:
        try:
            click.echo(runner.script(plan), nl=False)
        except PsflowError as e:  # what the rendering checks (k8s: a claim, or checkpoints on a URL)
            raise click.UsageError(str(e)) from e
        return
    jobs = tuple(dict.fromkeys(t.split(":")[0] for t in plan.task_names()))
    restarts = f"restart={policy.describe(jobs)}; " if policy.describe(jobs) != "never" else ""
    watchdog = f"watchdog: {hangs.describe()}; " if hangs.enabled else ""
    click.echo(f"psflow: run {plan.run_id}: {', '.join(plan.task_names())}; mode={config.mode}; "
               f"threads={plan.threads} per task ({plan.cores} cores{'' if threads else ', --threads N to change'}); "
               f"{restarts}{watchdog}logs in {plan.logdir}")
    from psflow.platform.uifile import running_ui

    ui_url = running_ui()
    if ui_url:  # a psflow ui serving this PSFLOW_HOME shows the run
        click.echo(f"psflow: dashboard: {ui_url}#/run/{plan.run_id}")
    try:
        if logdir_url is not None:
            from psflow.launch.urllogdir import LogdirSyncer

            click.echo(f"psflow: logdir {logdir_url}: files staged in {plan.logdir}, uploaded every 5 s and at the end")
            with LogdirSyncer(Path(plan.logdir), logdir_url, warn=lambda m: click.echo(f"psflow: warning: {m}", err=True)):
                result = runner.run(plan)
        else:
            result = runner.run(plan)
    except PsflowError as e:
        raise click.ClickException(str(e)) from e
    click.echo(final_line(result.summary))
    where = logdir_url or plan.logdir
    click.echo(f"psflow: summary: {where}/summary.json   logs: {where}/logs/")
    sys.exit(result.exit_code)


def _url_logdir(url: str, checkpoint_dir: str | None, *, backend: str, hosts: str | None,
                dry_run: bool) -> tuple[str, str, str]:
    """``--logdir URL``: the URL (checked writable, before any task starts), the local staging
    directory the run writes into, and the checkpoint dir (default ``URL/checkpoints``).

    Raises:
        ConfigError: another backend than local, or the URL cannot be written.
    """
    from psflow.launch import urllogdir
    from psflow.platform.home import psflow_home

    if backend != "local" or hosts is not None or dry_run:
        raise ConfigError(f"--logdir {url!r}: a URL logdir works with the local backend only for now; on Slurm, ssh "
                          "hosts or Kubernetes give a directory every host mounts, and --checkpoint-dir URL.")
    urllogdir.check_url(url)
    staging = urllogdir.staging_dir(url, psflow_home())
    return url, str(staging), checkpoint_dir or urllogdir.checkpoint_url(url)


def _plan(num_ps: int, num_workers: int, chief: bool, evaluator: bool, logdir: str | None, script: str,
          script_args: tuple[str, ...], fail_at: str | None, log_placement: bool, threads: int | None, hang_at: str | None,
          slow: str | None, hang_timeout_s: float | None, heartbeat_timeout_s: float | None, restart: str | None,
          max_restarts: int | None, max_restarts_per_run: int | None, backoff_base_s: float | None,
          backoff_max_s: float | None, settings: dict[str, Any], checkpoint_dir: str | None = None,
          **config_fields: Any) -> tuple[Any, RestartPolicy, Any, TrainConfig]:
    """The launch plan of ``psflow run``'s options (``psflow chaos`` shares them), with its restart
    policy, hang policy and config; ``config_fields`` are set on the config beyond the options.

    Raises:
        ConfigError: (PsflowError) any option that is wrong, alone or with the others.
    """
    from psflow.fault import hang_spec, join_specs, slow_spec
    from psflow.launch import make_plan
    from psflow.launch.watchdog import HangPolicy

    overrides = {k: v for k, v in settings.items() if v is not None}
    if overrides.get("strategy") == "allreduce":
        overrides.setdefault("mode", "sync")  # all-reduce steps are synchronous by nature
    config = TrainConfig(**overrides, log_placement=log_placement, **config_fields)
    given = set(overrides) | ({"num_ps"} if _given(click.get_current_context(), "num_ps") else set())
    check_launch_settings(config, given, num_replicas=num_workers + int(chief), num_ps=num_ps)
    policy = _restart_policy(restart, max_restarts=max_restarts, max_restarts_per_run=max_restarts_per_run,
                             backoff_base_s=backoff_base_s, backoff_max_s=backoff_max_s)
    hangs = HangPolicy(hang_timeout_s=hang_timeout_s, heartbeat_timeout_s=heartbeat_timeout_s)
    faults = join_specs(fail_at, hang_spec(hang_at), slow_spec(slow))
    plan = make_plan(script, list(script_args), num_ps=num_ps, num_workers=num_workers,
                     chief=chief, evaluator=evaluator, logdir=logdir, config=config, fail_at=faults,
                     threads=threads, restart=policy, hangs=hangs, extra_env=_checkpoint_env(checkpoint_dir))
    return plan, policy, hangs, config


def _backend(name: str, nodes: int | None, dry_run: bool, *, preload: bool, live: bool | None,
             k8s: dict[str, Any] | None = None) -> Any:
    """The backend ``psflow run --backend NAME`` runs on (a LocalBackend, SlurmBackend or K8sBackend).

    Raises:
        ConfigError: a Slurm option (--nodes, --dry-run) for a local run; a Kubernetes option for another backend.
    """
    k8s = k8s or {}
    if name == "k8s":
        from psflow.launch.k8swatch import K8sBackend

        return K8sBackend(_k8s_settings(**k8s))
    if k8s.get("image") or k8s.get("volume_claim") or k8s.get("gpus_per_worker") or k8s.get("env_secret"):
        raise ConfigError("--image, --volume-claim, --gpus-per-worker and --env-secret are for --backend k8s; this run is " + name + ".")
    if name == "slurm":
        from psflow.launch.slurm import SlurmBackend

        return SlurmBackend(nodes=nodes or 1, live=live)
    if nodes is not None or dry_run:
        raise ConfigError(f"{'--nodes' if nodes is not None else '--dry-run'} is for --backend slurm; this run is local."
                          + ("" if nodes is not None else " (--backend k8s --dry-run prints Kubernetes manifests.)"))
    from psflow.launch import LocalBackend

    return LocalBackend(preload=preload, live=live)


def _checkpoint_env(checkpoint_dir: str | None) -> dict[str, str] | None:
    """The tasks' PSFLOW_CHECKPOINT_DIR for ``--checkpoint-dir`` (a local directory made absolute)."""
    if checkpoint_dir is None:
        return None
    from psflow.launch.contract import TaskEnv

    # a URL as given (psflow.checkpoint.is_url's rule, without importing torch into the launcher)
    where = checkpoint_dir if "://" in checkpoint_dir else str(Path(checkpoint_dir).resolve())
    return TaskEnv(checkpoint_dir=where).render()


def _ssh_backend(backend: str, hosts: str | None, ssh_config: str | None, *, dry_run: bool, live: bool | None) -> Any:
    """The SshBackend of ``psflow run --hosts H:N,... [--ssh-config FILE]``.

    Raises:
        ConfigError: --hosts with another --backend or --dry-run; --ssh-config without --hosts; a bad --hosts.
    """
    from psflow.launch.ssh import SshBackend

    if hosts is None:
        raise ConfigError("--ssh-config is for --hosts (tasks started over ssh); give --hosts HOST:SLOTS,...")
    if backend != "local" or dry_run:
        raise ConfigError(f"--hosts starts the tasks over ssh; it does not go with {'--dry-run' if dry_run else '--backend ' + backend}.")
    return SshBackend(hosts, ssh_config=ssh_config, live=live)


def _k8s_settings(*, image: str | None, volume_claim: str | None, **rest: Any) -> Any:
    """The Kubernetes settings of ``--image``, ``--volume-claim`` and the other k8s options.

    Raises:
        ConfigError: --image or --volume-claim missing, or a bad value (see K8sSettings).
    """
    from psflow.launch.k8s import K8sSettings

    if not image:
        raise ConfigError("--backend k8s needs --image IMAGE: a container image with Python, psflow and the script.")
    return K8sSettings(image=image, volume_claim=volume_claim, **rest)  # no claim: checked with the plan


def _restart_policy(spec: str | None, **budgets: int | float | None) -> RestartPolicy:
    """The restart policy of ``--restart SPEC`` and its budget and backoff options.

    Raises:
        ConfigError: a bad SPEC (see :meth:`RestartPolicy.parse`), or a budget or backoff option given
            without a ``--restart`` that restarts anything (it would do nothing).
    """
    given = {k: v for k, v in budgets.items() if v is not None}
    policy = RestartPolicy.parse(spec, **given)
    if given and not any(policy.kind_for(job) != "never" for job in JOBS):
        options = {"max_restarts": "--max-restarts", "max_restarts_per_run": "--max-restarts-per-run",
                   "backoff_base_s": "--restart-backoff", "backoff_max_s": "--restart-backoff-max"}
        named = ", ".join(f"{options[k]} {v:g}" for k, v in given.items())
        raise ConfigError(f"{named} has no effect: no task is restarted (--restart {spec or 'never'}). Add --restart "
                          "on-failure (or per job: --restart worker=on-failure).")
    return policy


def _script_args(ctx: click.Context, script: str, script_args: tuple[str, ...]) -> tuple[str, ...]:
    """The script's arguments: those after SCRIPT, less the first ``--``.

    Raises:
        click.NoSuchOption: SCRIPT is an option run does not know (a misspelled flag: ``--worker 2``).
        click.UsageError: one of run's own options is written after SCRIPT but before ``--``, where it
            would not configure the run (ambiguous: refused, with both fixes).
    """
    own = {o: p for p in ctx.command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")}
    if script.startswith("-"):
        name = script.split("=", 1)[0]
        raise click.NoSuchOption(name, possibilities=difflib.get_close_matches(name, sorted(own), n=3, cutoff=0.7), ctx=ctx)
    cut = script_args.index("--") if "--" in script_args else len(script_args)
    before, after = script_args[:cut], script_args[cut + 1:]
    for i, arg in enumerate(before):
        name = arg.split("=", 1)[0]
        if name in own:
            takes_value = not getattr(own[name], "is_flag", False) and "=" not in arg and i + 1 < len(before)
            arg = f"{arg} {before[i + 1]}" if takes_value else arg
            raise click.UsageError(
                f"{name} is written after the script ({script}), where psflow run does not read its own options. "
                f"Put it before the script to configure the run (psflow run {arg} ... {script}), or after -- to pass "
                f"it to the script (psflow run ... {script} -- {arg}).", ctx=ctx)
    return (*before, *after)


def _given(ctx: click.Context, name: str) -> bool:
    """Whether the user wrote the option (not its default)."""
    return ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)


@main.command()
@click.argument("run")
def status(run: str) -> None:
    """Show a run's tasks and progress. RUN is a run id from `psflow runs` (or a prefix only it has),
    or a run's LOGDIR (its status.json: live while the run goes on). A run whose launcher died reads
    "abandoned", with the tasks whose processes are gone."""
    from rich.console import Console

    from psflow.launch.status import render
    from psflow.platform import views

    with _store_errors():
        Console().print(render(views.status_of(views.find(run))))


@main.command()
@click.option("--state", type=click.Choice(["pending", "running", "succeeded", "failed", "stopped", "abandoned"]),
              default=None, help="Only the runs in this state.")
@click.option("--json", "as_json", is_flag=True, help="Print the runs as JSON (each with its tasks and metrics).")
def runs(state: str | None, as_json: bool) -> None:
    """List the runs recorded in the job store ($PSFLOW_HOME/jobs.db, default ~/.psflow), newest first."""
    from rich.console import Console

    from psflow.platform import views

    with _store_errors():
        found = views.list_runs(state=state)
    if as_json:
        click.echo(json.dumps(views.runs_json(found), indent=1, default=str))
    elif not found:
        click.echo("psflow: no runs recorded" + (f" in state {state}" if state else "") + ".")
    else:  # piped: wide enough for whole rows (a terminal's own width otherwise)
        Console(width=None if sys.stdout.isatty() else 200).print(views.runs_table(found))


@main.command()
@click.argument("run")
@click.option("--task", default=None, help="Only this task's log, e.g. worker:1 (default: every task's).")
@click.option("-f", "--follow", is_flag=True, help="Keep printing what the tasks write until the run ends.")
def logs(run: str, task: str | None, follow: bool) -> None:
    """Print a run's task logs. RUN is a run id from `psflow runs` or a run's LOGDIR."""
    from psflow.platform import views

    with _store_errors():
        ref = views.find(run)
        files = views.log_files(ref, task)
    over = views.is_over(ref) if follow else (lambda: True)
    try:
        views.follow(files, over, click.echo, prefix=len(files) > 1)
    except KeyboardInterrupt:
        sys.exit(130)


@main.command()
@click.argument("run")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait until the run has ended.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0), default=120.0, show_default=True,
              help="With --wait: the longest wait, in seconds.")
def stop(run: str, wait: bool, timeout_s: float) -> None:
    """Stop a running run: every task gets SIGTERM (then SIGKILL after the grace period) and the run
    ends "stopped", as Ctrl-C on its launcher does. RUN is a run id from `psflow runs` (or a unique
    part of one). The request goes through the job store, so it works whichever machine the launcher is on."""
    from psflow.platform import views
    from psflow.platform.jobstore import JobStore
    from psflow.platform.runcontrol import ask_stop, wait_until_over

    with _store_errors():
        ref = _stored_run(views.find(run), "stop")
        with JobStore(ref.db_path) as db:
            asked = ask_stop(db, ref.run["id"], source="cli")
        if asked.request_id is None:
            click.echo(f"psflow: run {asked.run_id} has already ended ({asked.state}); nothing to stop.")
            return
        click.echo(f"psflow: asked run {asked.run_id} to stop (request {asked.request_id}).")
        if wait:
            ended = wait_until_over(ref.db_path, asked.run_id, timeout_s=timeout_s, request_id=asked.request_id)
            click.echo(f"psflow: run {asked.run_id} is {ended['state']}.")


@main.command()
@click.argument("run")
@click.option("--workers", "workers", type=int, required=True, help="The number of workers the run should have (the chief not counted).")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until the added workers run and the retired ones have exited.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0), default=120.0, show_default=True,
              help="With --wait: the longest wait, in seconds.")
def scale(run: str, workers: int, wait: bool, timeout_s: float) -> None:
    """Add or retire workers of a running run: workers join and leave while it trains. RUN is a run id
    from `psflow runs` (or a unique part of one) or the run's log directory. Added workers pull the
    current parameters and train; the highest-numbered ones retire (SIGTERM, then SIGKILL after the
    grace period) and are recorded as retired, not failed. Sync quorums and ssp bounds follow the
    membership (README: "Scaling a running job"). Local runs only: Slurm, Kubernetes and ssh runs refuse."""
    from psflow.platform import views
    from psflow.platform.jobstore import JobStore
    from psflow.platform.runcontrol import ask_scale, wait_scaled

    with _store_errors():
        ref = _scalable_run(views.find(run))
        run_id = ref.run["id"]
        with JobStore(ref.db_path) as db:
            request_id = ask_scale(db, run_id, workers, source="cli")
        click.echo(f"psflow: asked run {run_id} to scale to {workers} workers (request {request_id}).")
        if wait:
            asked = wait_scaled(ref.db_path, run_id, request_id, timeout_s=timeout_s)
            if asked["state"] == "refused":
                raise ConfigError(f"run {run_id} refused to scale: {asked['answer']}.")
            click.echo(f"psflow: run {run_id}: {asked['answer'] or asked['state']}.")


def _scalable_run(ref: Any) -> Any:
    """``ref`` with its job-store record; a run named by its log directory is looked up by the run id in its status.json."""
    if ref.run is None:
        from psflow.launch.status import read_status
        from psflow.platform import views

        try:
            run_id = read_status(ref.logdir).get("run_id")
        except (OSError, ValueError) as e:
            raise ConfigError(f"{ref.logdir} has no readable status.json ({e}): is a run starting there? "
                              "Give its run id from `psflow runs` instead.") from None
        if run_id:
            ref = views.find(str(run_id))
    return _stored_run(ref, "scale")


@main.command()
@click.argument("run")
@click.option("--detach", is_flag=True, help="Start the new run in the background and return (its output goes to LOGDIR/launcher.log).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0), default=120.0, show_default=True,
              help="The longest wait for a running run to stop before it is launched again, in seconds.")
@click.option("--live/--no-live", default=None, help="Show the live table of the tasks (default: on a terminal).")
def restart(run: str, detach: bool, timeout_s: float, live: bool | None) -> None:
    """Stop RUN if it still runs, then launch the same plan again as a new run in the same log
    directory, so training resumes from the newest checkpoint (what Kubeflow users do by deleting and
    re-creating a TFJob). Script, arguments, cluster shape, mode and policies are the recorded ones;
    fault injection (--fail-at) is not repeated. The new run names the old one (restarted_from)."""
    from psflow.launch.metrics import final_line
    from psflow.platform import views
    from psflow.platform.jobstore import JobStore
    from psflow.platform.launching import run_here, spec_of_run, start_detached
    from psflow.platform.runcontrol import ask_stop, wait_until_over

    with _store_errors():
        ref = _stored_run(views.find(run), "restart")
        spec = spec_of_run(ref.run)
        with JobStore(ref.db_path) as db:
            asked = ask_stop(db, ref.run["id"], source="cli")
        if asked.request_id is not None:
            click.echo(f"psflow: stopping run {asked.run_id} (request {asked.request_id}) before it starts again.")
        if detach:  # the new run's launcher waits for the old run's end itself (as the API's restart)
            if asked.request_id is not None:
                spec = dataclasses.replace(spec, after_run=asked.run_id, after_request=asked.request_id,
                                           after_timeout_s=timeout_s)
            plan, proc = start_detached(spec)
            click.echo(f"psflow: run {plan.run_id} restarts {asked.run_id} (launcher pid {proc.pid}); "
                       f"logs in {plan.logdir}, launcher output in {plan.logdir}/launcher.log")
            return
        if asked.request_id is not None:
            wait_until_over(ref.db_path, asked.run_id, timeout_s=timeout_s, request_id=asked.request_id)
        click.echo(f"psflow: run {spec.run_id} restarts {asked.run_id}; logs in {spec.logdir}")
        plan, result = run_here(spec, live=live)
    click.echo(final_line(result.summary))
    sys.exit(result.exit_code)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (another than loopback needs --allow-remote).")
@click.option("--port", type=click.IntRange(0, 65535), default=8265, show_default=True, help="Port (0: any free one).")
@click.option("--allow-remote", is_flag=True, help="Allow a --host other machines can reach (needs PSFLOW_UI_TOKEN).")
@click.option("--scripts", "scripts", multiple=True, type=click.Path(file_okay=False, path_type=Path),
              help="A directory whose .py files the start form may run (repeatable; default: the current directory).")
@click.option("--runs-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where runs started from the dashboard keep their logdirs (default $PSFLOW_HOME/runs).")
@click.option("--alert-webhook", default=None, metavar="URL",
              help="POST a JSON alert (with a 'text' line) here when a run fails, stalls or has a task restarted.")
@click.option("--alert-stall", "alert_stall_s", type=float, default=300.0, show_default=True,
              help="With --alert-webhook: seconds without a new global step before a running run counts as stalled.")
def ui(host: str, port: int, allow_remote: bool, scripts: tuple[Path, ...], runs_dir: Path | None,
       alert_webhook: str | None, alert_stall_s: float) -> None:
    """Serve the dashboard and its HTTP API over the job store: runs, tasks, live charts and logs; start,
    stop and restart runs. Runs go on when it stops: it only reads the store and writes requests."""
    from psflow.platform.uiserver import serve, settings_for

    try:
        settings = settings_for(host, allow_remote=allow_remote, scripts=scripts, runs_dir=runs_dir,
                                alert_webhook=alert_webhook, alert_stall_s=alert_stall_s)
    except PsflowError as e:
        raise click.UsageError(str(e)) from e
    serve(settings, host, port, echo=click.echo)


def _stored_run(ref: Any, verb: str) -> Any:
    """``ref`` (a :class:`psflow.platform.views.RunRef`) if it names a run in the job store.

    Raises:
        ConfigError: a log directory without a job-store record (its launcher cannot be reached).
    """
    if ref.run is None or ref.db_path is None:
        raise ConfigError(f"psflow {verb} needs a run id from the job store (`psflow runs` lists them); "
                          f"{ref.logdir} was named by its log directory. Give its run id instead.")
    return ref


@contextlib.contextmanager
def _store_errors() -> Iterator[None]:
    """A bad run name or an unreadable job store: one clear line, exit 1."""
    try:
        yield
    except PsflowError as e:
        raise click.ClickException(str(e)) from e


def _live_status(logdir: str) -> dict:
    """LOGDIR/status.json as it stands now (see psflow.launch.liveness), or a ClickException."""
    import time

    from psflow.launch.liveness import assess
    from psflow.launch.status import STATUS_FILE, headline, read_status

    try:
        state = read_status(logdir)
    except (OSError, ValueError) as e:
        raise click.ClickException(
            f"Cannot read {logdir}/{STATUS_FILE}: {e}. Give the --logdir of a `psflow run` (it writes that file)."
        ) from e
    state.update(headline(state))
    return assess(state, now_unix=time.time())


@main.command()
@click.argument("summary", type=click.Path(exists=True, dir_okay=True))
def summary(summary: str) -> None:
    """Print a run's summary (LOGDIR or LOGDIR/summary.json). A run still going (or abandoned) has
    no summary yet: its live status is shown instead."""
    from pathlib import Path

    p = Path(summary)
    p = p / "summary.json" if p.is_dir() else p
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        _no_summary(p, "the launcher writes it when the run ends")
        return
    except (OSError, ValueError) as e:
        _no_summary(p, f"it cannot be read ({e}); the run's logs are in {p.parent / 'logs'}")
        return
    if not isinstance(data, dict):
        _no_summary(p, f"it holds a JSON {type(data).__name__}, not the launcher's summary")
        return
    for k in ("run_id", "status", "mode", "global_step", "examples_per_sec", "wall_s"):
        click.echo(f"{k:>18}: {data.get(k)}")
    for k, v in (data.get("metrics") or {}).items():  # the script's own, as it named them
        click.echo(f"{k:>18}: {v}")
    step = (data.get("timeline") or {}).get("step") if isinstance(data.get("timeline"), dict) else None
    if isinstance(step, dict) and step:  # psflow run --timeline: where the workers' step time went
        click.echo(f"{'step time':>18}: " + ", ".join(f"{p} {v:.0%}" for p, v in step.items() if isinstance(v, (int, float))))
        click.echo(f"{'timeline':>18}: {p.parent / 'timeline.json'} (open in ui.perfetto.dev or chrome://tracing)")
    for t in data.get("tasks") or []:  # what the watchdog caught, and where the stacks are
        for x in t.get("exits") or [] if isinstance(t, dict) else []:
            if isinstance(x, dict) and isinstance(x.get("hang"), dict):
                then = "restarted" if x.get("restarted") else "not restarted"
                click.echo(f"{'hang':>18}: {t.get('task')} attempt {x.get('attempt')}: {x['hang'].get('cause')}; {then}")


def _no_summary(path: Path, why: str) -> None:
    """No usable summary.json: say so, show the live status if there is one, exit 1."""
    from rich.console import Console

    from psflow.launch.status import render

    click.echo(f"psflow: no summary at {path}: {why}.", err=True)
    try:
        state = _live_status(str(path.parent))
    except click.ClickException:
        sys.exit(1)
    click.echo(f"psflow: the run is {state.get('state')}; its status (psflow status {path.parent}):", err=True)
    Console().print(render(state))
    sys.exit(1)


class _LogdirOrUrl(click.Path):
    """An existing directory, or a URL (``s3://bucket/run``: checkpoints written with --checkpoint-dir)."""

    def __init__(self) -> None:
        super().__init__(exists=True, file_okay=False)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and "://" in value:
            return value
        return super().convert(value, param, ctx)


@main.command()
@click.argument("logdir", type=_LogdirOrUrl())
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--averages/--values", default=None,
              help="Export the moving averages (or the values); default: what the run chose (ema_for_export).")
def export(logdir: str, out: str, averages: bool | None) -> None:
    """Write the newest checkpoint of LOGDIR as OUT.safetensors: a plain PyTorch state dict.

    LOGDIR may also be a checkpoints/ directory or one ckpt-<step> directory. Load it with
    torch + safetensors alone: model.load_state_dict(safetensors.torch.load_file(OUT)).
    """
    from psflow.checkpoint import export_checkpoint

    try:
        path, ckpt, used_averages = export_checkpoint(logdir, out, averages=averages,
                                                      warn=lambda m: click.echo(f"psflow: warning: {m}", err=True))
    except PsflowError as e:
        raise click.ClickException(str(e)) from e
    names = [p["name"] for p in ckpt.meta["placement"]["params"]]
    click.echo(f"psflow: exported {len(names)} tensors ({'moving averages' if used_averages else 'values'}) "
               f"of step {ckpt.step} from {ckpt.path} to {path}")


@main.command()
@click.argument("logdir", type=_LogdirOrUrl())
def checkpoints(logdir: str) -> None:
    """List the checkpoints of LOGDIR (or of a checkpoints/ directory, or a --checkpoint-dir URL), newest
    first, verified."""
    from pathlib import Path

    from psflow import checkpoint

    if "://" in logdir:
        root: Any = logdir
    else:
        root = Path(logdir) / "checkpoints" if (Path(logdir) / "checkpoints").is_dir() else Path(logdir)
    found = checkpoint.list_checkpoints(root)
    if not found:
        click.echo(f"psflow: no checkpoints under {root}")
        return
    for path in found:
        try:
            ckpt = checkpoint.read_checkpoint(path)
        except PsflowError as e:
            click.echo(f"{path.name}  CORRUPT: {e}")
            continue
        size = sum(r.size_bytes for r in ckpt.shards)
        click.echo(f"{path.name}  step={ckpt.step}  shards={ckpt.num_shards}  {size / 1e6:.2f} MB  ok")


# psflow chaos: run's options (less those of other backends) and its own.
@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--every", "every_s", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Seconds between faults.")
@click.option("--for", "duration", default="60s", show_default=True, metavar="DURATION",
              help="How long faults are injected, from the job's first step: 90, 90s, 5m.")
@click.option("--seed", type=int, default=0, show_default=True, help="Fixes the faults' times, kinds and targets.")
@click.option("--kinds", "kinds_text", default="kill=3,stop=1", show_default=True,
              help="Fault kinds and weights: kill (SIGKILL), stop (SIGSTOP, SIGCONT --stall seconds later).")
@click.option("--targets", default=None, metavar="JOB,...",
              help="Jobs whose tasks are hit (default chief,worker, and ps with --ps-replicas 2).")
@click.option("--stall", "stall_s", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Seconds a stopped task stays stopped.")
@click.option("--max-faults", type=click.IntRange(min=1), default=None, help="At most this many faults.")
@click.option("--baseline/--no-baseline", default=False,
              help="First run the same job without faults (into LOGDIR-baseline) and compare accuracy, batches and goodput.")
def chaos(every_s: float, duration: str, seed: int, kinds_text: str, targets: str | None, stall_s: float,
          max_faults: int | None, baseline: bool, **opts: Any) -> None:
    """Run SCRIPT while killing and stopping random tasks; report what it survived and lost:
    psflow chaos --ps 2 --ps-replicas 2 --workers 2 --every 5 --for 60 --baseline train.py -- --epochs 5

    The run's restart policy brings killed tasks back (default here: --restart on-failure, a budget of
    one restart per fault, --restart-backoff 0.5). Writes LOGDIR/chaos.json; exits 1 if the run failed
    or lost an acknowledged update.
    """
    from dataclasses import replace

    from psflow.chaos.harness import passed, run_chaos
    from psflow.chaos.schedule import ChaosSchedule, ChaosSettings, parse_kinds
    from psflow.launch import LocalBackend

    ctx = click.get_current_context()
    opts["script_args"] = _script_args(ctx, opts["script"], opts["script_args"])
    run_opts = {k: opts.pop(k) for k in list(opts) if k in _PLAN_OPTIONS}
    preload, live = opts.pop("preload"), opts.pop("live")
    try:
        duration_s = _seconds(duration, "--for")
        ps_replicas = opts.get("ps_replicas") or 1
        jobs = tuple(j.strip() for j in targets.split(",")) if targets else (
            ("chief", "worker", "ps") if ps_replicas == 2 else ("chief", "worker"))
        settings = ChaosSettings(every_s=every_s, duration_s=duration_s, seed=seed, kinds=parse_kinds(kinds_text),
                                 targets=jobs, stall_s=stall_s, max_faults=max_faults)
        faults = len(ChaosSchedule(settings).slots())
        run_opts["restart"] = run_opts["restart"] or "on-failure"
        run_opts["max_restarts"] = run_opts["max_restarts"] if run_opts["max_restarts"] is not None else max(3, faults)
        if run_opts["backoff_base_s"] is None:
            run_opts["backoff_base_s"] = 0.5
        plan, _policy, _hangs, _config = _plan(**run_opts, settings=opts, push_ledger=True)
        base = None
        if baseline:
            # the same job (its --slow too), without the faults: --fail-at and --hang-at are chaos of their own
            base_plan, *_ = _plan(**{**run_opts, "fail_at": None, "hang_at": None, "logdir": f"{plan.logdir}-baseline"},
                                  settings=opts, push_ledger=True)
            base = replace(base_plan, run_id=f"{plan.run_id}-baseline")
    except PsflowError as e:
        raise click.UsageError(str(e)) from e
    try:
        report = run_chaos(plan, settings, baseline=base, make_backend=lambda: LocalBackend(preload=preload, live=live),
                           echo=click.echo)
    except PsflowError as e:
        raise click.ClickException(str(e)) from e
    sys.exit(0 if passed(report) else 1)


_PLAN_OPTIONS = ("num_ps", "num_workers", "chief", "evaluator", "logdir", "script", "script_args", "fail_at", "log_placement",
                 "threads", "hang_at", "slow", "hang_timeout_s", "heartbeat_timeout_s", "restart", "max_restarts",
                 "max_restarts_per_run", "backoff_base_s", "backoff_max_s", "checkpoint_dir")
# Chaos runs on this machine: the options of other backends are not its.
_OTHER_BACKENDS = ("backend", "nodes", "dry_run", "k8s_image", "k8s_volume_claim", "k8s_namespace", "gpus_per_worker",
                   "k8s_ttl_s", "hosts", "ssh_config")
chaos.params.extend(p for p in run.params if p.name not in (*_OTHER_BACKENDS, "alert_webhook"))  # no alerts in chaos


def _seconds(text: str, option: str) -> float:
    """``"90"``, ``"90s"``, ``"5m"``, ``"1h"`` in seconds.

    Raises:
        ConfigError: anything else (names the option and the value).
    """
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    t = text.strip().lower()
    scale = units.get(t[-1:], None)
    number = t[:-1] if scale is not None else t
    try:
        value = float(number) * (scale or 1.0)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{option} {text!r}: give a positive duration such as 90, 90s or 5m.")
    return value


@main.group()
def k8s() -> None:
    """Kubernetes manifests of a run, for clusters that run them their own way."""


@k8s.command(context_settings={"ignore_unknown_options": True})
@click.option("--ps", "num_ps", default=1, show_default=True, help="Parameter-server tasks.")
@click.option("--workers", "num_workers", default=2, show_default=True, help="Worker tasks.")
@click.option("--chief/--no-chief", default=False, help="Add a separate chief task (default: worker:0 is chief).")
@click.option("--logdir", default=None, help="The log dir, relative to the volume claim (default runs/<run id>).")
@click.option("--mode", type=click.Choice(["async", "sync", "ssp"]), default=None, help="Update mode.")
@click.option("--restart", "restart", default=None, metavar="POLICY|JOB=POLICY,...",
              help="never (default), on-failure, always, exit-code: the TFJob's restartPolicy per replica type.")
@_k8s_options
@click.option("--checkpoint-dir", default=None, metavar="URL",
              help="Checkpoints in an object store (s3://bucket/run) instead of the volume claim.")
@click.argument("script", type=click.Path(dir_okay=False))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def tfjob(num_ps: int, num_workers: int, chief: bool, logdir: str | None, mode: str | None, restart: str | None,
          script: str, script_args: tuple[str, ...], k8s_image: str | None, k8s_volume_claim: str | None,
          k8s_namespace: str, gpus_per_worker: int, k8s_ttl_s: int, k8s_env_secret: str | None,
          checkpoint_dir: str | None) -> None:
    """Print SCRIPT's run as a Kubeflow TFJob (kubeflow.org/v1) and its Secret, for `kubectl apply -f -` on a
    cluster with the training operator, which injects TF_CONFIG (pf.init() reads it)."""
    import secrets

    from psflow.launch import make_plan
    from psflow.launch.k8s import render_tfjob, to_yaml

    try:
        settings = _k8s_settings(image=k8s_image, volume_claim=k8s_volume_claim, namespace=k8s_namespace,
                                 gpus_per_worker=gpus_per_worker, ttl_s=k8s_ttl_s, env_secret=k8s_env_secret)
        config = TrainConfig(**({"mode": mode} if mode else {}))
        plan = make_plan(script, [a for a in script_args if a != "--"], num_ps=num_ps, num_workers=num_workers,
                         chief=chief, logdir=logdir, config=config, restart=RestartPolicy.parse(restart),
                         extra_env=_checkpoint_env(checkpoint_dir))
        click.echo(to_yaml(render_tfjob(plan, settings, secrets.token_hex(32))), nl=False)
    except PsflowError as e:
        raise click.UsageError(str(e)) from e
