"""The job store's commands: ``psflow runs``, ``status``, ``logs``, ``stop``, ``scale``, ``restart``, ``ui``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from psflow.cli.group import main
from psflow.errors import ConfigError, PsflowError


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
    import shutil

    from psflow.platform import views

    with _store_errors():
        found = views.list_runs(state=state, metrics=as_json,  # the table shows no metrics: not read for it
                                note=lambda m: click.echo(f"psflow: note: {m}", err=True))
    if as_json:
        click.echo(json.dumps(views.runs_json(found), indent=1, default=str))
    elif not found:
        click.echo("psflow: no runs recorded" + (f" in state {state}" if state else "") + ".")
    else:  # piped: whole rows (a terminal's own width otherwise)
        click.echo(views.runs_text(found, shutil.get_terminal_size().columns if sys.stdout.isatty() else None))


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
    membership (docs/reference.md, "Scaling a running job"). Local runs only: Slurm, Kubernetes and ssh runs refuse."""
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
@click.option("--hosts", default=None, metavar="HOST:SLOTS,...", help="ssh: other hosts than the recorded ones.")
@click.option("--nodes", type=click.IntRange(min=1), default=None, help="Slurm: another node count than the recorded one.")
@click.option("--coordinator-host", default=None, help="Slurm, ssh: another address the nodes reach the launcher at.")
@click.option("--sbatch-arg", "sbatch_args", multiple=True, metavar="--OPTION=VALUE",
              help="Slurm: #SBATCH options in place of the recorded ones (repeatable; given once, none is kept).")
def restart(run: str, detach: bool, timeout_s: float, live: bool | None, hosts: str | None, nodes: int | None,
            coordinator_host: str | None, sbatch_args: tuple[str, ...]) -> None:
    """Stop RUN if it still runs, then launch the same plan again as a new run in the same log
    directory, so training resumes from the newest checkpoint (what Kubeflow users do by deleting and
    re-creating a TFJob). Script, arguments, cluster shape, mode, policies and backend settings (ssh
    hosts, Slurm nodes and sbatch options, Kubernetes image, ...) are the recorded ones, less what
    --hosts, --nodes, --coordinator-host or --sbatch-arg give; fault injection (--fail-at) is not repeated. The new run names the old
    one (restarted_from)."""
    from psflow.logdirlock import run_lock
    from psflow.platform import views
    from psflow.platform.jobstore import JobStore
    from psflow.platform.launching import queue_restart, run_here, spec_of_run, start_detached
    from psflow.platform.runcontrol import ask_stop, wait_until_over

    with _store_errors():
        ref = _stored_run(views.find(run), "restart")
        spec = spec_of_run(ref.run, {"hosts": hosts, "nodes": nodes, "coordinator_host": coordinator_host,
                                     "sbatch_args": sbatch_args or None})
        # refused before the run is asked to stop: a run other than it holds the logdir, or another restart waits
        run_lock(str(spec.logdir), spec.logdir_url, str(spec.run_id)).check(after_run=spec.restarted_from)
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
        queued = None
        try:
            if asked.request_id is not None:  # waits in the logdir's queue place: a second restart is refused
                queued = queue_restart(dataclasses.replace(spec, after_run=asked.run_id))
                wait_until_over(ref.db_path, asked.run_id, timeout_s=timeout_s, request_id=asked.request_id)
            click.echo(f"psflow: run {spec.run_id} restarts {asked.run_id}; logs in {spec.logdir}")
            plan, result = run_here(dataclasses.replace(spec, after_timeout_s=timeout_s), live=live, queued=queued)
        finally:
            if queued is not None:
                queued.release_queue_place()
    sys.exit(result.exit_code)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (another than loopback needs --allow-remote).")
@click.option("--port", type=click.IntRange(0, 65535), default=8265, show_default=True, help="Port (0: any free one).")
@click.option("--allow-remote", is_flag=True, help="Allow a --host other machines can reach (needs PSFLOW_UI_TOKEN).")
@click.option("--scripts", "scripts", multiple=True, type=click.Path(file_okay=False, path_type=Path),
              help="A directory whose .py files the start form may run (repeatable; default: the current directory).")
@click.option("--runs-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where runs started from the dashboard keep their logdirs (default ./runs, as psflow run's runs/<run id>).")
@click.option("--alert-webhook", default=None, metavar="URL",
              help="POST a JSON alert (with a 'text' line) here when a run fails, stalls or has a task restarted.")
@click.option("--alert-stall", "alert_stall_s", type=float, default=300.0, show_default=True,
              help="With --alert-webhook: seconds without a new global step before a running run counts as stalled.")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="A name requests may reach the dashboard by, besides localhost, 127.0.0.1, [::1] and the bound "
                   "address (repeatable; *.example.org: its subdomains). Others get a 400 (DNS rebinding).")
def ui(host: str, port: int, allow_remote: bool, scripts: tuple[Path, ...], runs_dir: Path | None,
       alert_webhook: str | None, alert_stall_s: float, allowed_hosts: tuple[str, ...]) -> None:
    """Serve the dashboard and its HTTP API over the job store: runs, tasks, live charts and logs; start,
    stop and restart runs. Runs go on when it stops: it only reads the store and writes requests."""
    from psflow.platform.uiserver import serve, settings_for

    try:
        settings = settings_for(host, allow_remote=allow_remote, scripts=scripts, runs_dir=runs_dir,
                                alert_webhook=alert_webhook, alert_stall_s=alert_stall_s, allowed_hosts=allowed_hosts)
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
