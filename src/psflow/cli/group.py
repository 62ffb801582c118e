"""The ``psflow`` click group, and the options that more than one command shares."""

from __future__ import annotations

from typing import Any

import click


@click.group()
@click.version_option(package_name="psflow")
def main() -> None:
    """psflow: distributed PyTorch training with parameter servers."""


# The pods' scheduling and identity: named k8s_* so ``psflow run`` passes them on as they are (K8sSettings' fields).
K8S_MORE = [
    click.option("--memory", "k8s_memory", default=None, metavar="QUANTITY",
                 help="k8s: each pod's memory request and limit (e.g. 4Gi)."),
    click.option("--image-pull-secret", "k8s_image_pull_secrets", multiple=True, metavar="SECRET",
                 help="k8s: a registry Secret to pull the image with (repeatable)."),
    click.option("--service-account", "k8s_service_account", default=None, metavar="NAME",
                 help="k8s: the pods' ServiceAccount (default: the namespace's, with no token mounted)."),
    click.option("--toleration", "k8s_tolerations", multiple=True, metavar="KEY[=VALUE][:EFFECT]",
                 help="k8s: a taint the pods tolerate, e.g. nvidia.com/gpu:NoSchedule (repeatable)."),
    click.option("--node-selector", "k8s_node_selector", multiple=True, metavar="KEY=VALUE",
                 help="k8s: a node label every pod needs, e.g. pool=gpu (repeatable)."),
    click.option("--run-as-user", "k8s_run_as_user", type=click.IntRange(min=1), default=None, metavar="UID",
                 help="k8s: the uid (and gid, fsGroup) the pods run as (default 10001, the Dockerfile's user)."),
]


def k8s_more(options: dict[str, Any]) -> dict[str, Any]:
    """The K8S_MORE options given, popped from ``options``, as K8sSettings' fields."""
    popped = {k[4:]: options.pop(k) for k in [k for k in options if k.startswith("k8s_")]}
    return {k: v for k, v in popped.items() if v not in (None, ())}


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
        *K8S_MORE,
    ]):
        f = option(f)
    return f
