"""``psflow k8s``: a run's Kubernetes manifests for clusters that run them their own way."""

from __future__ import annotations

import click

from psflow.cli.group import _k8s_options, k8s_more, main
from psflow.cli.run import _checkpoint_env
from psflow.config import TrainConfig
from psflow.errors import PsflowError
from psflow.launch.restart import RestartPolicy
from psflow.modes import Mode


@main.group()
def k8s() -> None:
    """Kubernetes manifests of a run, for clusters that run them their own way."""


@k8s.command(context_settings={"ignore_unknown_options": True})
@click.option("--ps", "num_ps", default=1, show_default=True, help="Parameter-server tasks.")
@click.option("--workers", "num_workers", default=2, show_default=True, help="Worker tasks.")
@click.option("--chief/--no-chief", default=False, help="Add a separate chief task (default: worker:0 is chief).")
@click.option("--logdir", default=None, help="The log dir, relative to the volume claim (default runs/<run id>).")
@click.option("--mode", type=click.Choice([m.value for m in Mode]), default=None, help="Update mode.")
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
          checkpoint_dir: str | None, **more: object) -> None:
    """Print SCRIPT's run as a Kubeflow TFJob (kubeflow.org/v1) and its Secret, for `kubectl apply -f -` on a
    cluster with the training operator, which injects TF_CONFIG (pf.init() reads it)."""
    import secrets

    from psflow.launch import make_plan
    from psflow.launch.assemble import k8s_settings
    from psflow.launch.k8s import render_tfjob, to_yaml

    try:
        settings = k8s_settings(image=k8s_image, volume_claim=k8s_volume_claim, namespace=k8s_namespace,
                                gpus_per_worker=gpus_per_worker, ttl_s=k8s_ttl_s, env_secret=k8s_env_secret,
                                **k8s_more(more))
        config = TrainConfig(**({"mode": mode} if mode else {}))
        plan = make_plan(script, [a for a in script_args if a != "--"], num_ps=num_ps, num_workers=num_workers,
                         chief=chief, logdir=logdir, config=config, restart=RestartPolicy.parse(restart),
                         extra_env=_checkpoint_env(checkpoint_dir))
        click.echo(to_yaml(render_tfjob(plan, settings, secrets.token_hex(32))), nl=False)
    except PsflowError as e:
        raise click.UsageError(str(e)) from e
