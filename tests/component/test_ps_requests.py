"""Component tests: a ps checks every request against the cluster and its op's schema, over real sockets.

The ps is a real Server + PsService on 127.0.0.1 (tests/component/inproc.py); requests are sent
over authenticated connections as a chosen task id. What is proven: a worker index outside the
cluster, or another replica's index, is refused and does not end the ps; a sender that is not a
task of the cluster is refused; a missing or mistyped field gets a clean ERROR reply naming the
field (kind ConfigError, no traceback in the ps log), and the connection keeps working.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from inproc import SECRET, InprocCluster

from psflow import optim
from psflow.config import TrainConfig
from psflow.ps.requests import SCHEMAS
from psflow.wire.conn import Connection, connect
from psflow.wire.ops import Op

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)

WAIT_S = 5.0

# A request each op admits, from worker:0 (replica 0); each test breaks one thing in it.
VALID: dict[int, dict[str, Any]] = {
    Op.PS_INIT: {"optimizer": optim.SGD(lr=0.1).to_dict(), "config": TrainConfig().to_dict()},
    Op.PS_READY: {"timeout_s": 1.0},
    Op.PS_PULL: {"min_version": 0, "timeout_s": 1.0},
    Op.PS_PUSH: {"worker": 0, "version": 0},
    Op.PS_CLOCK: {"worker": 0, "clock": 1, "timeout_s": 1.0},
    Op.PS_DONE: {"worker": 0},
    Op.PS_STATUS: {},
    Op.PS_SHUTDOWN: {},
    Op.PS_SAVE: {"root": "/nonexistent", "step": 1, "num_shards": 1},
    Op.PS_REPLICATE: {"kind": "batch", "shard": 0},
}


@pytest.fixture
def cluster() -> InprocCluster:
    with InprocCluster(1, 2, TrainConfig()) as c:
        yield c


def as_task(c: InprocCluster, task: str) -> Connection:
    return connect(c.cluster.address(c.cluster.tasks()[0]), secret=SECRET, task=task, peer="ps:0", deadline_s=WAIT_S)


def ask(conn: Connection, op: int, meta: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Send one request; return the reply's op and meta (ERROR replies included)."""
    conn.set_timeout(WAIT_S)
    conn.send(op, meta)
    frame = conn.recv()
    return frame.op, frame.meta


def refused(conn: Connection, op: int, meta: dict[str, Any]) -> str:
    code, reply = ask(conn, op, meta)
    assert code == Op.ERROR, f"{Op(op).name} {meta} was accepted: {reply}"
    assert reply["kind"] == "ConfigError", reply
    return reply["error"]


@pytest.mark.parametrize("index", [99, -5, 2, "1", True, 1.0])
def test_ps_done_naming_a_worker_outside_the_cluster_is_refused_and_does_not_end_the_ps(
    cluster: InprocCluster, index: object
) -> None:
    conn = as_task(cluster, "worker:0")
    try:
        error = refused(conn, Op.PS_DONE, {"worker": index})
        assert f"worker index {index!r}" in error and "2 (0..1" in error, error
        # Both real workers finishing still ends the ps: nothing was counted for the bad index.
        assert ask(conn, Op.PS_STATUS, {})[1]["done_workers"] == []
        assert not cluster.services[0].join(0.0)
    finally:
        conn.close()


def test_a_task_cannot_finish_or_push_for_another_replica(cluster: InprocCluster) -> None:
    conn = as_task(cluster, "worker:0")
    try:
        error = refused(conn, Op.PS_DONE, {"worker": 1})
        assert "names worker:1 (worker index 1), but its own index is 0" in error, error
        assert "worker:0" in refused(conn, Op.PS_CLOCK, {"worker": 1, "clock": 3})
        evaluator = as_task(cluster, "evaluator:0")
        try:
            assert "evaluator:0 is not a training replica" in refused(evaluator, Op.PS_DONE, {"worker": 0})
        finally:
            evaluator.close()
        assert ask(conn, Op.PS_DONE, {"worker": 0})[0] == Op.OK  # its own index is accepted
        worker1 = as_task(cluster, "worker:1")
        try:
            assert ask(worker1, Op.PS_DONE, {"worker": 1})[0] == Op.OK
        finally:
            worker1.close()
        assert cluster.services[0].join(WAIT_S)  # every replica said it is done: the ps ends
    finally:
        conn.close()


@pytest.mark.parametrize("op", [Op.PS_INIT, Op.PS_SAVE, Op.PS_SHUTDOWN])
@pytest.mark.parametrize("task", ["worker:1", "evaluator:0", "ps:0"])
def test_the_chiefs_duties_are_refused_from_any_other_task(cluster: InprocCluster, task: str, op: int) -> None:
    """Issue 23 item 5: any task with the secret could initialize the ps over the model, make it write a
    checkpoint wherever it named, or stop it."""
    conn = as_task(cluster, task)
    try:
        error = refused(conn, op, VALID[op])
        assert f"{Op(op).name} from {task} refused: only the chief (worker:0) sends it" in error, error
        assert not cluster.services[0].join(0.0) and not cluster.services[0].store.initialized  # nothing happened
    finally:
        conn.close()


@pytest.mark.parametrize("task", ["worker:7", "ps:3", "chief:0", "launcher"])
def test_a_sender_that_is_not_a_task_of_the_cluster_is_refused(cluster: InprocCluster, task: str) -> None:
    conn = as_task(cluster, task)
    try:
        error = refused(conn, Op.PS_STATUS, {})
        assert f"the sender {task!r} is not a task of this cluster" in error, error
    finally:
        conn.close()


@pytest.mark.parametrize("op,field", [(op, f.name) for op, fs in SCHEMAS.items() for f in fs if f.required])
def test_a_request_missing_a_required_field_gets_a_clean_error_naming_it(
    cluster: InprocCluster, op: int, field: str, caplog: pytest.LogCaptureFixture
) -> None:
    conn = as_task(cluster, "worker:0")
    try:
        with caplog.at_level(logging.WARNING):
            meta = {k: v for k, v in VALID[op].items() if k != field}
            error = refused(conn, op, meta)
        assert f"required field {field!r} is missing" in error and Op(op).name in error, error
        assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], "a traceback in the ps log"
        assert ask(conn, Op.PS_STATUS, {})[0] == Op.OK  # the connection keeps working
    finally:
        conn.close()


@pytest.mark.parametrize("op,field,value,expected", [
    (Op.PS_CLOCK, "clock", "3", "an integer >= 0"),
    (Op.PS_PUSH, "version", -1, "an integer >= 0"),
    (Op.PS_PULL, "timeout_s", float("inf"), "a number of seconds in 0.."),
    (Op.PS_PULL, "timeout_s", 1e300, "a number of seconds in 0.."),
    (Op.PS_PULL, "averages", "yes", "true or false"),
    (Op.PS_INIT, "config", [], "an object"),
    (Op.PS_SAVE, "num_shards", 0, "an integer >= 1"),
])
def test_a_field_of_the_wrong_type_gets_a_clean_error_naming_it_and_the_value(
    cluster: InprocCluster, op: int, field: str, value: object, expected: str
) -> None:
    conn = as_task(cluster, "worker:0")
    try:
        error = refused(conn, op, {**VALID[op], field: value})
        assert f"field {field!r} must be {expected}" in error and f"received {value!r}" in error, error
    finally:
        conn.close()


@pytest.mark.parametrize("setting,value", [("staleness", "x"), ("split_bytes", "big")])
def test_init_with_a_mistyped_setting_names_it_instead_of_an_internal_error(
    cluster: InprocCluster, setting: str, value: object, caplog: pytest.LogCaptureFixture
) -> None:
    conn = as_task(cluster, "worker:0")
    try:
        with caplog.at_level(logging.WARNING):
            config = {**TrainConfig().to_dict(), setting: value}
            error = refused(conn, Op.PS_INIT, {**VALID[Op.PS_INIT], "config": config})
        assert f"{setting} must be a valid integer" in error and repr(value) in error, error
        assert not [r for r in caplog.records if r.exc_info], "a traceback in the ps log"
    finally:
        conn.close()
