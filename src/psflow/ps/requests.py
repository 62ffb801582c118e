"""What a ps accepts: one declarative schema per request op, checked once at the service boundary.

A request reaches a handler only when its sender is a task of the cluster, every required field is
there with the right type and range, a ``worker`` field names the sender itself (a training
replica reports, pushes and finishes only for itself), and a chief's duty (PS_INIT, PS_SAVE,
PS_SHUTDOWN: :data:`CHIEF_ONLY`) comes from the chief. Anything else is refused with a
:class:`~psflow.errors.ConfigError` that names the op, the field, the value received and what was
expected: the server turns it into a clean ERROR reply, with nothing in the ps log but a warning.

Unknown fields are ignored (a newer client may send more). Pure: no I/O, no state.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from psflow.cluster import ClusterSpec, TaskId
from psflow.errors import ConfigError
from psflow.wire.ops import Op

# Kinds of value a field may hold. JSON gives int, float, str, bool, list, dict and None; a bool is
# never accepted as a number.
INT, COUNT, NUMBER, SECONDS, BOOL, STR, DICT, REPLICA = (
    "int", "count", "number", "seconds", "bool", "str", "dict", "replica")
_EXPECTED = {
    NUMBER: "a finite number",
    INT: "an integer >= 0",
    COUNT: "an integer >= 1",
    SECONDS: f"a number of seconds in 0..{threading.TIMEOUT_MAX:g}",
    BOOL: "true or false",
    STR: "a string",
    DICT: "an object",
    REPLICA: "the sender's own replica index",
}


@dataclass(frozen=True)
class Field:
    name: str
    kind: str
    required: bool = False
    nullable: bool = False  # None is accepted (and means "not given")


SCHEMAS: dict[int, tuple[Field, ...]] = {
    Op.PS_INIT: (
        Field("optimizer", DICT, required=True), Field("config", DICT, required=True),
        Field("placement_digest", STR), Field("version", INT), Field("schedule", DICT, nullable=True),
        Field("ema_decay", NUMBER, nullable=True), Field("meta", DICT, nullable=True),
        Field("step_plan", DICT, nullable=True), Field("data_positions", DICT, nullable=True),
    ),
    # A training replica's readiness names it and its attempt (a restarted worker rejoins); others' do not.
    Op.PS_READY: (Field("timeout_s", SECONDS), Field("placement_digest", STR), Field("worker", REPLICA), Field("attempt", INT)),
    # compress / pull_dtype: see psflow.wire.compress (checked there, against the shard's parameters)
    Op.PS_PULL: (Field("min_version", INT), Field("timeout_s", SECONDS), Field("averages", BOOL), Field("pull_dtype", STR)),
    Op.PS_PUSH: (
        Field("worker", REPLICA, required=True), Field("version", INT, required=True), Field("pull", BOOL),
        Field("timeout_s", SECONDS), Field("position", DICT, nullable=True), Field("attempt", INT), Field("seq", INT),
        Field("compress", STR), Field("pull_dtype", STR),
    ),
    Op.PS_CLOCK: (
        Field("worker", REPLICA, required=True), Field("clock", INT, required=True), Field("timeout_s", SECONDS),
        Field("attempt", INT), Field("ahead", INT),  # ahead: the pipeline's steps past the clock (psflow.ps.rules)
    ),
    # failed: the worker stopped on this error without finishing (it is lost, not done: it may be restarted);
    # stays: its training is over, its final duties are not (the chief's final checkpoint): a PS_DONE follows
    Op.PS_DONE: (Field("worker", REPLICA, required=True), Field("attempt", INT), Field("failed", STR, nullable=True),
                 Field("stays", BOOL)),
    Op.PS_STATUS: (Field("clock_log", BOOL),),
    Op.PS_SHUTDOWN: (),
    # From a shard's primary ps to its backup (psflow.ps.replication); the service checks the sender.
    Op.PS_REPLICATE: (Field("kind", STR, required=True), Field("shard", INT, required=True), Field("last_seq", INT)),
    Op.PS_SAVE: (
        Field("root", STR, required=True), Field("step", INT, required=True), Field("num_shards", COUNT, required=True),
        Field("exact", BOOL), Field("timeout_s", SECONDS), Field("crash_after_bytes", INT, nullable=True),
    ),
}


# The chief's duties: the initial values, checkpoints, the end of the job. A worker that sends one is
# a mistake or an attack (with the job's secret): it would overwrite the model, write files, stop the ps.
CHIEF_ONLY = frozenset({Op.PS_INIT, Op.PS_SAVE, Op.PS_SHUTDOWN})


def replica_of(cluster: ClusterSpec, task: TaskId) -> int | None:
    """The training replica index of ``task`` (the chief first, then the workers), None for others."""
    chiefs = cluster.num_tasks("chief")
    if task.job == "chief":
        return 0
    if task.job == "worker":
        return chiefs + task.index
    return None


def replica_name(cluster: ClusterSpec, replica: int) -> str:
    """The task id of training replica ``replica``, as logs and errors name it."""
    chiefs = cluster.num_tasks("chief")
    return "chief:0" if replica < chiefs else f"worker:{replica - chiefs}"


@functools.lru_cache(maxsize=1024)
def _task_of(peer: str) -> TaskId:
    """``TaskId.parse(peer)``, once per peer: every request names its sender (TaskId is immutable)."""
    return TaskId.parse(peer)


def sender(cluster: ClusterSpec, peer: str, op_name: str, *, workers: int | None = None) -> TaskId:
    """The task that sent a request, checked against the cluster (``workers``: the worker tasks
    admitted, when a scale request grew the job past its cluster). Raises ConfigError."""
    try:
        task = _task_of(peer)
        if workers is not None and task.job == "worker" and task.index < workers:
            return task
        cluster.check_task(task)
    except ConfigError as e:
        raise ConfigError(
            f"{op_name} refused: the sender {peer!r} is not a task of this cluster ({e}). "
            "Only the cluster's own tasks may talk to a ps; check the cluster spec every task was started with."
        ) from None
    return task


def check(cluster: ClusterSpec, op: int, peer: str, meta: Mapping[str, Any], *, workers: int | None = None) -> None:
    """Refuse a request that its op's schema does not admit. Raises ConfigError naming what is wrong.
    ``workers``: the worker tasks admitted (a scaled job's; default: the cluster's)."""
    fields = SCHEMAS.get(op)
    op_name = Op(op).name if op in Op._value2member_map_ else f"op {op}"
    task = sender(cluster, peer, op_name, workers=workers)
    if op in CHIEF_ONLY and not cluster.is_chief(task):
        raise ConfigError(
            f"{op_name} from {task} refused: only the chief ({cluster.chief()}) sends it (the initial values, "
            "checkpoints and the end of the job are its duties). Call it from the chief's process."
        )
    for f in fields or ():
        if f.name not in meta:
            if f.required:
                raise ConfigError(
                    f"{op_name} from {task} refused: the required field {f.name!r} is missing (it must be "
                    f"{_EXPECTED[f.kind]}). Is the sender running the same psflow version as the ps?"
                )
            continue
        value = meta[f.name]
        if value is None and f.nullable:
            continue
        if f.kind == REPLICA:
            _check_replica(cluster, task, op_name, value, workers)
        elif not _admits(f.kind, value):
            raise ConfigError(
                f"{op_name} from {task} refused: field {f.name!r} must be {_EXPECTED[f.kind]}; "
                f"received {_show(value)}. Is the sender running the same psflow version as the ps?"
            )


def _check_replica(cluster: ClusterSpec, task: TaskId, op_name: str, value: Any, workers: int | None = None) -> None:
    n = cluster.num_tasks("chief") + max(cluster.num_tasks("worker"), workers or 0)
    if not _admits(INT, value) or value >= n:
        raise ConfigError(
            f"{op_name} from {task} refused: worker index {_show(value)} is not a replica of this cluster, "
            f"which has {n} (0..{n - 1}: the chief, if any, then the workers)."
        )
    own = replica_of(cluster, task)
    if own != value:
        mine = f"its own index is {own}" if own is not None else f"{task} is not a training replica"
        raise ConfigError(
            f"{op_name} from {task} refused: it names {replica_name(cluster, value)} (worker index {value}), "
            f"but {mine}. A task pushes, reports its clock and finishes only for itself."
        )


def _admits(kind: str, value: Any) -> bool:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if kind == COUNT:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if kind == NUMBER:
        return is_number and math.isfinite(value)
    if kind == SECONDS:  # past TIMEOUT_MAX a wait on a Condition overflows
        return is_number and math.isfinite(value) and 0 <= value <= threading.TIMEOUT_MAX
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == STR:
        return isinstance(value, str)
    if kind == DICT:
        return isinstance(value, dict)
    raise AssertionError(f"unknown field kind {kind!r}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
