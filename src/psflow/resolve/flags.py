"""The seeds' flags: ``--ps_hosts --worker_hosts --chief_hosts --evaluator_hosts --job_name --task_index``.

:func:`parse_cluster_flags` takes them out of a script's arguments (the rest are the script's own);
:func:`resolve` turns what it found into this source's answer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from psflow.cluster import ClusterSpec, TaskId
from psflow.errors import ConfigError
from psflow.resolve import Resolved

_HOSTS_FLAGS = {"chief_hosts": "chief", "ps_hosts": "ps", "worker_hosts": "worker", "evaluator_hosts": "evaluator"}
_FLAGS = (*_HOSTS_FLAGS, "job_name", "task_index")


@dataclass(frozen=True)
class FlagConfig:
    """What :func:`parse_cluster_flags` found: the spec, this task, and the untouched arguments."""

    cluster: ClusterSpec | None
    task: TaskId | None
    rest: list[str]


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1].strip()
    return value


def parse_cluster_flags(argv: Sequence[str], *, require_ps: bool = True) -> FlagConfig:
    """Extracts the seed's flags from ``argv``; every other argument stays in ``rest``, in order.

    Reads ``--ps_hosts --worker_hosts --chief_hosts --evaluator_hosts`` (comma-separated
    ``host:port``), ``--job_name`` and ``--task_index`` (default 0), as ``--flag=value`` or
    ``--flag value``, hyphens or underscores, quotes around a value stripped. An empty hosts flag
    means no such job. Arguments after ``--`` are left alone.

    Example:
        >>> cfg = parse_cluster_flags(["--ps_hosts=h:1", "--worker_hosts=h:2", "--job_name=worker", "--lr=1"])
        >>> str(cfg.task), cfg.rest
        ('worker:0', ['--lr=1'])

    Raises:
        ConfigError: a flag without value, a role without hosts flags, a job not in the spec, a
            task index not an integer, negative or out of range, or an invalid spec.
    """
    values: dict[str, str] = {}
    rest: list[str] = []
    args, i = list(argv), 0
    while i < len(args):
        arg, i = args[i], i + 1
        if arg == "--":
            rest.extend(args[i - 1 :])
            break
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        name = name.replace("-", "_")
        if name not in _FLAGS:
            rest.append(arg)
            continue
        if not eq:
            if i >= len(args) or args[i].startswith("--"):
                raise ConfigError(f"Flag {arg} needs a value. Write {arg}=VALUE or {arg} VALUE.")
            value, i = args[i], i + 1
        values[name] = _unquote(value)
    role = {k: values[k] for k in ("job_name", "task_index") if k in values}
    if not any(f in values for f in _HOSTS_FLAGS):
        if role:
            raise ConfigError(
                f"{' '.join(f'--{k}={v}' for k, v in role.items())} given without hosts flags. "
                "Add --ps_hosts and --worker_hosts (comma-separated host:port)."
            )
        return FlagConfig(None, None, rest)
    hosts = {job: values[flag] for flag, job in _HOSTS_FLAGS.items() if values.get(flag)}
    spec = ClusterSpec.from_dict(hosts, require_ps=require_ps)
    if "job_name" not in values:
        if "task_index" in values:
            raise ConfigError(f"--task_index={values['task_index']} given without --job_name (one of {', '.join(spec.jobs)}).")
        return FlagConfig(spec, None, rest)
    index = values.get("task_index", "0")
    if not re.fullmatch(r"-?[0-9]+", index):
        raise ConfigError(f"--task_index must be an integer. Received: {index!r}.")
    return FlagConfig(spec, spec.named_task(values["job_name"], int(index), "--job_name/--task_index"), rest)


def resolve(flags: FlagConfig) -> Resolved | None:
    """The spec and task the flags gave; None when they gave no hosts flags."""
    if flags.cluster is None:
        return None
    return Resolved(flags.cluster, flags.task, "the seeds' flags")
