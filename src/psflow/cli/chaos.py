"""``psflow chaos``: ``psflow run``'s job under a seeded schedule of faults, and its report."""

from __future__ import annotations

import sys
from typing import Any

import click

from psflow.cli.group import main
from psflow.cli.run import _plan, _script_args, run
from psflow.errors import ConfigError, PsflowError


# psflow chaos: run's options (less those of other backends) and its own.
@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--every", "every_s", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Seconds between faults.")
@click.option("--for", "duration", default="60s", show_default=True, metavar="DURATION",
              help="How long faults are injected, from the job's first step: 90, 90s, 5m.")
@click.option("--seed", type=int, default=0, show_default=True, help="Fixes the faults' times, kinds and targets.")
@click.option("--kinds", "kinds_text", default="kill=3,stop=1", show_default=True,
              help="Fault kinds and weights: kill (SIGKILL), stop (SIGSTOP, SIGCONT --stall seconds later), "
                   "partition (a ps cut off from the other ps for --stall seconds).")
@click.option("--targets", default=None, metavar="JOB,...",
              help="Jobs whose tasks are hit (default chief,worker, and ps with --ps-replicas 2).")
@click.option("--stall", "stall_text", default="1", show_default=True, metavar="S|A-B",
              help="Seconds a stopped task stays stopped (and a partition lasts); A-B: each fault's drawn between A and B.")
@click.option("--max-faults", type=click.IntRange(min=1), default=None, help="At most this many faults.")
@click.option("--baseline/--no-baseline", default=False,
              help="First run the same job without faults (into LOGDIR-baseline) and compare accuracy, batches and goodput.")
def chaos(every_s: float, duration: str, seed: int, kinds_text: str, targets: str | None, stall_text: str,
          max_faults: int | None, baseline: bool, **opts: Any) -> None:
    """Run SCRIPT while killing and stopping random tasks; report what it survived and lost:
    psflow chaos --ps 2 --ps-replicas 2 --workers 2 --every 5 --for 60 --baseline train.py -- --epochs 5

    The run's restart policy brings killed tasks back (default here: --restart on-failure, a budget of
    one restart per fault, --restart-backoff 0.5). Writes LOGDIR/chaos.json; exits 1 if the run failed
    or lost an acknowledged update.
    """
    from dataclasses import replace

    from psflow.chaos.harness import passed, run_chaos
    from psflow.chaos.schedule import ChaosSchedule, ChaosSettings, parse_kinds, parse_stall
    from psflow.launch.assemble import BackendOptions

    ctx = click.get_current_context()
    opts["script_args"] = _script_args(ctx, opts["script"], opts["script_args"])
    run_opts = {k: opts.pop(k) for k in list(opts) if k in _PLAN_OPTIONS}
    preload, live = opts.pop("preload"), opts.pop("live")
    try:
        duration_s = _seconds(duration, "--for")
        ps_replicas = opts.get("ps_replicas") or 1
        jobs = tuple(j.strip() for j in targets.split(",")) if targets else (
            ("chief", "worker", "ps") if ps_replicas == 2 else ("chief", "worker"))
        stall_s, stall_max_s = parse_stall(stall_text)
        settings = ChaosSettings(every_s=every_s, duration_s=duration_s, seed=seed, kinds=parse_kinds(kinds_text),
                                 targets=jobs, stall_s=stall_s, stall_max_s=stall_max_s, max_faults=max_faults)
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
        report = run_chaos(plan, settings, baseline=base, options=BackendOptions(preload=preload, live=live),
                           echo=click.echo)
    except PsflowError as e:
        raise click.ClickException(str(e)) from e
    sys.exit(0 if passed(report) else 1)


_PLAN_OPTIONS = ("num_ps", "num_workers", "chief", "evaluator", "logdir", "script", "script_args", "fail_at", "log_placement",
                 "threads", "hang_at", "slow", "hang_timeout_s", "heartbeat_timeout_s", "restart", "max_restarts",
                 "max_restarts_per_run", "backoff_base_s", "backoff_max_s", "checkpoint_dir")
# Chaos runs on this machine: the options of other backends are not its.
_OTHER_BACKENDS = ("backend", "nodes", "dry_run", "k8s_image", "k8s_volume_claim", "k8s_namespace", "gpus_per_worker",
                   "k8s_ttl_s", "hosts", "ssh_config", "sbatch_args")
chaos.params.extend(p for p in run.params if p.name not in (*_OTHER_BACKENDS, "alert_webhook")  # no alerts in chaos
                     and not (p.name or "").startswith("k8s_"))


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
