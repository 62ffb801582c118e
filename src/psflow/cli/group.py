"""The ``psflow`` click group, and the options that more than one command shares."""

from __future__ import annotations

from typing import Any

import click


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
