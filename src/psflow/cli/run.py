"""``psflow run``: a run's plan from its options, on the backend asked for, to its end."""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
from pathlib import Path
from typing import Any

import click

from psflow.cli.group import _k8s_options, k8s_more, main
from psflow.config import TrainConfig, check_launch_settings
from psflow.errors import ConfigError, PsflowError
from psflow.launch.restart import JOBS, RestartPolicy
from psflow.modes import Mode


# allow_interspersed_args=False: everything after SCRIPT reaches script_args as written ("--" included),
# so that run can tell its own options written after the script (refused) from the script's arguments.
@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--ps", "num_ps", default=1, show_default=True, help="Parameter-server tasks.")
@click.option("--workers", "num_workers", default=2, show_default=True, help="Worker tasks.")
@click.option("--chief/--no-chief", default=False, help="Add a separate chief task (default: worker:0 is chief).")
@click.option("--evaluator/--no-evaluator", default=False, help="Add an evaluator task that evaluates every new checkpoint.")
@click.option("--logdir", default=None, help="Where logs, errors and summary.json go (default runs/<run id>); or a URL (s3://B/P), uploaded.")
@click.option("--mode", type=click.Choice([m.value for m in Mode]), default=None, help="Update mode.")
@click.option("--strategy", type=click.Choice(["ps", "allreduce"]), default=None, help="Parameter servers or all-reduce.")
@click.option("--replicas-to-aggregate", type=int, default=None, help="sync: gradients averaged per step (N).")
@click.option("--total-num-replicas", type=int, default=None, help="sync: workers taking part (M); M - N are backups.")
@click.option("--staleness", type=int, default=None, help="ssp: how many steps a worker may run ahead.")
@click.option("--sync-timeout", "sync_timeout_s", type=float, default=None, help="sync/ssp: longest wait for a step (s).")
@click.option("--lost-worker-timeout", "lost_worker_timeout_s", type=float, default=None,
              help="ps: once the other workers are done, longest wait for a lost worker to reconnect (s).")
@click.option("--nonfinite", type=click.Choice(["refuse", "fail", "apply"]), default=None,
              help="ps: a pushed gradient holding NaN or inf is refused (default; counted and logged per worker), "
                   "fails the run (naming the worker and step), or is applied as any other.")
@click.option("--nonfinite-limit", "nonfinite_limit", type=click.IntRange(min=1), default=None,
              help="With --nonfinite refuse: a worker refused this many times in a row fails the run (default 10).")
@click.option("--ps-replicas", "ps_replicas", type=int, default=None,
              help="Copies of each ps shard: 2 keeps a backup on the next ps, which takes over if the primary dies.")
@click.option("--placement", type=click.Choice(["balanced", "round_robin", "greedy", "contiguous"]), default=None,
              help="How parameters go on ps shards (default balanced: equal bytes per shard, big tensors split; round_robin: TensorFlow's).")
@click.option("--log-placement", is_flag=True, help="Print where each parameter lives (like log_device_placement).")
@click.option("--compress", default=None, metavar="none|fp16|bf16|topk:RATIO",
              help="Gradients on the wire: half precision, or the largest RATIO of each (with error feedback).")
@click.option("--compress-pull", "compress_pull", is_flag=True, default=None,
              help="With --compress fp16|bf16: the parameters come back in that precision too.")
@click.option("--pipeline", is_flag=True, default=None,
              help="async or ssp: each worker computes its next step while this one's gradients and values travel "
                   "(its values lack its own last update; under ssp the bound counts these steps, so --staleness "
                   "must be 2 or more; docs/performance.md).")
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
              help="With --restart: seconds before a task's first restart, doubled for each later one (default 1). "
                   "Not on --backend k8s: Kubernetes' Job controller replaces a failed pod after its own back-off "
                   "(10 s, doubled per failure of the pod's index, up to 10 min).")
@click.option("--restart-backoff-max", "backoff_max_s", type=click.FloatRange(min=0), default=None,
              help="With --restart: the longest wait before a restart, in seconds (default 60; not on --backend k8s).")
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
@click.option("--coordinator-host", default=None, metavar="ADDRESS",
              help="slurm, --hosts: the address the nodes reach this launcher at (default: this host's address on "
                   "the nodes' network).")
@click.option("--sbatch-arg", "sbatch_args", multiple=True, metavar="--OPTION=VALUE",
              help="slurm: one more #SBATCH option for the job, in sbatch's long form; repeat it for each: "
                   "--sbatch-arg=--partition=gpu --sbatch-arg=--time=02:00:00 (--account, --qos, --gres ...). "
                   "Kept in the run's record: psflow restart submits with the same.")
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
    script_args = _script_args(click.get_current_context(), script, script_args)
    alert_webhook = settings.pop("alert_webhook", None)
    k8s_given = k8s_more(settings)  # --memory, --toleration, ...: K8sSettings' fields
    coordinator_host = settings.pop("coordinator_host", None)
    sbatch_args = tuple(settings.pop("sbatch_args", ()))
    if alert_webhook is not None:
        from psflow.home import ALERT_WEBHOOK_ENV
        from psflow.platform.alerts import check_webhook

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
               "gpus_per_worker": gpus_per_worker, "ttl_s": k8s_ttl_s, "env_secret": k8s_env_secret, **k8s_given}
        from psflow.launch.assemble import BackendOptions, assemble_run
        from psflow.platform.recording import backend_settings, recording

        options = BackendOptions(name=backend, hosts=hosts, ssh_config=ssh_config, nodes=nodes,
                                 coordinator_host=coordinator_host, preload=preload, live=live, dry_run=dry_run, k8s=k8s,
                                 sbatch_args=sbatch_args)
        assembled = assemble_run(plan, options, store=lambda b: recording(b, settings=backend_settings(options)))
    except PsflowError as e:
        raise click.UsageError(str(e)) from e
    if dry_run:
        try:
            click.echo(assembled.backend.script(plan), nl=False)
        except PsflowError as e:  # what the rendering checks (k8s: a claim, or checkpoints on a URL)
            raise click.UsageError(str(e)) from e
        return
    from psflow.logdirlock import hold_run

    try:  # one live run per logdir: refused here, before anything is said or started; held until the command ends
        click.get_current_context().with_resource(hold_run(plan.logdir, logdir_url, plan.run_id))
    except PsflowError as e:
        raise click.ClickException(str(e)) from e
    jobs = tuple(dict.fromkeys(t.split(":")[0] for t in plan.task_names()))
    described = policy.describe(jobs, assembled.backend.restart_backoff(policy))  # Kubernetes': its own backoff
    restarts = f"restart={described}; " if described != "never" else ""
    watchdog = f"watchdog: {hangs.describe()}; " if hangs.enabled else ""
    click.echo(f"psflow: run {plan.run_id}: {', '.join(plan.task_names())}; mode={config.mode}; "
               f"threads={plan.threads} per task ({plan.cores} cores{'' if threads else ', --threads N to change'}); "
               f"{restarts}{watchdog}logs in {plan.logdir}")
    from psflow.platform.uifile import running_ui

    ui_url = running_ui()
    if ui_url:  # a psflow ui serving this PSFLOW_HOME shows the run
        click.echo(f"psflow: dashboard: {ui_url}#/run/{plan.run_id}")
    try:
        result = _run_to_end(assembled, logdir_url)
    except PsflowError as e:
        raise click.ClickException(str(e)) from e
    sys.exit(result.exit_code)  # the run's end, its final line and where its logs are: said by the runner's console


def _run_to_end(assembled: Any, logdir_url: str | None) -> Any:
    """Run the assembled plan to its end; a URL logdir's files are uploaded as they are written.
    Returns the RunResult."""
    plan = assembled.plan
    if logdir_url is None:
        return assembled.runner.run(plan)
    from psflow.launch.urllogdir import LogdirSyncer

    click.echo(f"psflow: logdir {logdir_url}: files staged in {plan.logdir}, uploaded every 5 s and at the end")
    with LogdirSyncer(Path(plan.logdir), logdir_url, warn=lambda m: click.echo(f"psflow: warning: {m}", err=True)):
        return assembled.runner.run(plan)


def _url_logdir(url: str, checkpoint_dir: str | None, *, backend: str, hosts: str | None,
                dry_run: bool) -> tuple[str, str, str]:
    """``--logdir URL``: the URL (checked writable, before any task starts), the local staging
    directory the run writes into, and the checkpoint dir (default ``URL/checkpoints``).

    Raises:
        ConfigError: another backend than local, or the URL cannot be written.
    """
    from psflow.home import psflow_home
    from psflow.launch import urllogdir

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


def _checkpoint_env(checkpoint_dir: str | None) -> dict[str, str] | None:
    """The tasks' PSFLOW_CHECKPOINT_DIR for ``--checkpoint-dir`` (a local directory made absolute)."""
    if checkpoint_dir is None:
        return None
    from psflow.taskenv import TaskEnv

    # a URL as given (psflow.checkpoint.is_url's rule, without importing torch into the launcher)
    where = checkpoint_dir if "://" in checkpoint_dir else str(Path(checkpoint_dir).resolve())
    return TaskEnv(checkpoint_dir=where).render()


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
