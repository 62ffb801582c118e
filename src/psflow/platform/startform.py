"""The start form's backend fields: which backend needs which, and what they become in a launch.

Each backend takes its own fields (the rest of the form is every backend's): ``local`` GPUs per
worker; ``slurm`` nodes, the coordinator's address and more ``#SBATCH`` options (one text field,
split as a shell would: ``--partition=gpu --time=02:00:00``); ``ssh`` hosts (``HOST:SLOTS,...``, required)
and the coordinator's address; ``k8s`` an image (required), a namespace, a volume claim and GPUs per
worker pod. A field given for another backend, a required one missing, or a host name that is not
one (a name starting with ``-`` would reach ssh as an option) is refused naming the field; what
the backend itself refuses is checked after (:func:`psflow.platform.launching.plan_of`).

No ssh configuration file is taken from the form: its ``ProxyCommand`` would run any command, and
the form runs only scripts under the allowed directories.

Pure: :func:`launch_fields`, :func:`restart_overrides`, :func:`field_of`. Used by
:func:`psflow.platform.api.start_run` and ``restart_run``.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from typing import Any

# each backend field: the backends it is for
FIELDS: dict[str, tuple[str, ...]] = {
    "nodes": ("slurm",), "coordinator_host": ("slurm", "ssh"), "hosts": ("ssh",), "sbatch_args": ("slurm",),
    "image": ("k8s",), "namespace": ("k8s",), "volume_claim": ("k8s",),
}
REQUIRED = {"ssh": ("hosts", "HOST:SLOTS,... (e.g. node1:2,node2:2): the hosts the tasks are started on over ssh"),
            "k8s": ("image", "a container image with Python, psflow and the script (e.g. registry.example/train:1)")}
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,252})")
_K8S_NAME = re.compile(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?")


class FormError(ValueError):
    """A backend field that does not fit: ``field`` names it (the form shows the message beside it)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def launch_fields(backend: str, given: Mapping[str, Any], gpus_per_worker: int) -> dict[str, Any]:
    """The :class:`psflow.platform.launching.LaunchSpec` fields of ``backend``'s form fields ``given``.

    Raises:
        FormError: a field for another backend, a required field missing, a host or name that is not one.

    Example:
        >>> launch_fields("ssh", {"hosts": "node1:2,node2"}, 0)
        {'hosts': 'node1:2,node2', 'coordinator_host': None, 'nodes': None, 'k8s': {}, 'gpus_per_worker': 0}
    """
    set_ = _checked(backend, given)
    if backend in REQUIRED and REQUIRED[backend][0] not in set_:
        field, what = REQUIRED[backend]
        raise FormError(field, f"The {backend} backend needs {field}: {what}.")
    k8s = {k: set_[k] for k in ("image", "namespace", "volume_claim") if k in set_}
    if backend == "k8s":
        k8s["gpus_per_worker"] = gpus_per_worker  # a pod's nvidia.com/gpu: Kubernetes places them
    return {"hosts": set_.get("hosts"), "coordinator_host": set_.get("coordinator_host"), "nodes": set_.get("nodes"),
            "k8s": k8s, "gpus_per_worker": 0 if backend == "k8s" else gpus_per_worker,
            **({"sbatch_args": set_["sbatch_args"]} if "sbatch_args" in set_ else {})}


def restart_overrides(backend: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """The backend settings a restart request gives in place of the recorded ones
    (:func:`psflow.platform.launching.spec_of_run`'s ``overrides``): only those set, checked as the form's.

    Raises:
        FormError: as :func:`launch_fields` (a required one may be left out: the recorded one stands).

    Example:
        >>> restart_overrides("slurm", {"nodes": 4, "hosts": None})
        {'nodes': 4}
    """
    set_ = _checked(backend, given)
    out = {k: set_[k] for k in ("hosts", "coordinator_host", "nodes", "sbatch_args") if k in set_}
    k8s = {k: set_[k] for k in ("image", "namespace", "volume_claim") if k in set_}
    return {**out, "k8s": k8s} if k8s else out


def _checked(backend: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """The backend fields of ``given`` that are set, each checked (see :func:`launch_fields`)."""
    set_ = {k: v for k, v in given.items() if k in FIELDS and v not in (None, "")}
    for name in set_:
        if backend not in FIELDS[name]:
            raise FormError(name, f"{name} is for the {' and '.join(FIELDS[name])} backend; this run's backend is "
                                  f"{backend}. Clear it, or choose that backend.")
    if "hosts" in set_:
        _check_hosts(str(set_["hosts"]))
    if "coordinator_host" in set_ and not _HOST.fullmatch(str(set_["coordinator_host"])):
        raise FormError("coordinator_host", f"coordinator_host {set_['coordinator_host']!r} is not a host name or "
                                            "address: letters, digits, '.', '-' and '_', not starting with '-'.")
    if "sbatch_args" in set_:
        set_["sbatch_args"] = _sbatch_args(str(set_["sbatch_args"]))
    for name in ("namespace", "volume_claim"):
        if name in set_ and not _K8S_NAME.fullmatch(str(set_[name])):
            raise FormError(name, f"{name} {set_[name]!r} is not a Kubernetes name: lowercase letters, digits, '-' "
                                  "and '.', starting and ending with a letter or digit.")
    return set_


def _sbatch_args(text: str) -> tuple[str, ...]:
    """The sbatch options of the form's text field (``--partition=gpu --time=02:00:00``), each checked
    as ``psflow run --sbatch-arg`` checks it (:func:`psflow.launch.slurm.check_sbatch_args`)."""
    from psflow.errors import ConfigError
    from psflow.launch.slurm import check_sbatch_args

    try:
        args = shlex.split(text)
    except ValueError as e:  # an unclosed quote
        raise FormError("sbatch_args", f"sbatch_args {text!r}: {e}; write the options as on sbatch's command line, "
                                       "e.g. --partition=gpu --time=02:00:00.") from e
    try:
        return check_sbatch_args(args)
    except ConfigError as e:
        raise FormError("sbatch_args", str(e)) from e


def _check_hosts(hosts: str) -> None:
    for item in (i.strip() for i in hosts.split(",")):
        name, _, slots = item.partition(":")
        if not _HOST.fullmatch(name) or (slots and not slots.isdigit()):
            raise FormError("hosts", f"hosts {hosts!r}: {item!r} is not HOST or HOST:SLOTS (a host name or address: "
                                     "letters, digits, '.', '-' and '_', not starting with '-'; SLOTS a positive "
                                     "integer). Example: node1:2,node2:2.")


def field_of(message: str) -> str:
    """The form field a launch check's message is about (its ``psflow run`` option), else ``form``."""
    for option, field in (("--hosts", "hosts"), ("hosts:", "hosts"), ("--image", "image"), ("--nodes", "nodes"),
                          ("--coordinator-host", "coordinator_host"), ("--volume-claim", "volume_claim"),
                          ("--namespace", "namespace"), ("--sbatch-arg", "sbatch_args")):
        if option in message:
            return field
    return "form"
