"""Component tests: a push's tensors are bounded by the shard's parameters before their bytes are read.

The ps is a real Server + PsService on 127.0.0.1 (tests/component/inproc.py); the hostile client
holds the job's secret and speaks the frame format by hand. What is proven (issue 23 item 5): a push
that declares 2 GiB for a 7,850-float parameter is refused at once, with an ERROR naming the key,
the bytes declared and the bytes expected, and its connection closed, before the ps receives (or
allocates memory for) its payload: the process's resident memory does not grow while the client
streams 256 MiB; nothing is applied; a tensor the shard does not have, or a wrong size, is refused
the same way; compressed pushes within their bounds and a normal worker still train.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest
import torch
from inproc import SECRET, InprocCluster

from psflow import optim
from psflow.cluster import TaskId
from psflow.config import TrainConfig
from psflow.wire.conn import Connection, connect
from psflow.wire.frame import HEADER_SIZE, encode_head
from psflow.wire.ops import Op

pytestmark = pytest.mark.timeout(90)
torch.set_num_threads(1)

WAIT_S = 30.0
KEY_FLOATS = 7850
GIB2 = 2 << 30


class Flat(torch.nn.Module):
    """One parameter of 7,850 floats (the MNIST softmax's size)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(KEY_FLOATS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w).sum(dim=1)


def rss_kib() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0])


def step(trainer) -> None:  # type: ignore[no-untyped-def]
    x = torch.ones(4, KEY_FLOATS)
    trainer.step(lambda: ((trainer.model(x) - 1.0) ** 2).mean())


def hostile(c: InprocCluster, task: str = "worker:1") -> Connection:
    return connect(c.cluster.address(TaskId("ps", 0)), secret=SECRET, task=task, peer="ps:0", deadline_s=WAIT_S)


def declare_and_stream(conn: Connection, tensors: list, meta: dict, payload_len: int,
                       stream_bytes: int, op: int = Op.PS_PUSH) -> tuple[int, float, bytes]:
    """Send a request's head (``op``: a push by default) declaring ``tensors`` and ``payload_len`` bytes, then stream zeros until
    ``stream_bytes`` went or the ps closed the connection, while a thread reads what the ps sends.
    Returns (bytes streamed, seconds from the head to the ps's first answer, what the ps sent)."""
    sock = conn.sock
    sock.settimeout(WAIT_S)
    received: list[bytes] = []
    first: list[float] = []

    def read() -> None:
        try:
            while data := sock.recv(65536):
                first.append(time.monotonic())
                received.append(data)
        except OSError:
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    t0 = time.monotonic()
    sock.sendall(encode_head(int(op), {**meta, "t": tensors}, payload_len))
    chunk, sent = memoryview(bytearray(1 << 20)), 0
    try:
        while sent < stream_bytes:
            sock.sendall(chunk[:min(len(chunk), stream_bytes - sent)])
            sent += min(len(chunk), stream_bytes - sent)
    except OSError:  # the ps closed the connection: what it should do
        pass
    reader.join(WAIT_S)
    return sent, first[0] - t0 if first else math.inf, b"".join(received)


def error_of(received: bytes) -> str:
    from psflow.wire.frame import Limits, decode_header, decode_meta

    assert len(received) >= HEADER_SIZE, f"the ps sent nothing back: {received!r}"
    op, _, meta_len, _ = decode_header(received[:HEADER_SIZE], Limits())
    meta = decode_meta(received[HEADER_SIZE:HEADER_SIZE + meta_len], 0, Limits())[0]
    assert op == Op.ERROR, (op, meta)
    return str(meta["error"])


def test_a_push_declaring_2_gib_for_a_7850_float_key_is_refused_before_its_bytes_and_training_goes_on() -> None:
    with InprocCluster(1, 2, TrainConfig()) as c:
        trainer = c.trainer(0, Flat(), optim.SGD(lr=0.01))
        trainer.prepare()
        step(trainer)
        service = c.services[0]
        applied = service.store.stats.applied_updates
        conn = hostile(c)
        try:
            before = rss_kib()
            sent, answered_s, received = declare_and_stream(
                conn, [["w", "float32", [GIB2 // 4]]], {"worker": 1, "version": 1}, GIB2, 256 << 20)
            growth_mib = (rss_kib() - before) / 1024
        finally:
            conn.close()
        print(f"refused {answered_s * 1000:.0f} ms after the head; RSS growth {growth_mib:.1f} MiB; {sent >> 20} MiB streamed")
        assert growth_mib < 100, f"the process grew by {growth_mib:.0f} MiB while the client streamed {sent >> 20} MiB"
        error = error_of(received)
        assert ("PS_PUSH from worker:1 refused before its payload was received: tensor 'w' declares "
                f"{GIB2} bytes (float32 [{GIB2 // 4}]), but its parameter on shard 0 takes {4 * KEY_FLOATS} bytes") in error
        assert service.store.stats.applied_updates == applied  # nothing applied
        step(trainer)  # the ps still serves the job
        assert service.store.stats.applied_updates == applied + 1


@pytest.mark.parametrize("tensors, meta, what", [
    ([["w", "float32", [KEY_FLOATS - 1]]], {}, f"declares {4 * (KEY_FLOATS - 1)} bytes"),
    ([["w", "float64", [KEY_FLOATS]]], {}, f"declares {8 * KEY_FLOATS} bytes"),
    ([["v", "float32", [KEY_FLOATS]]], {}, "tensor 'v' (31400 bytes) is none of shard 0's parameters (w)"),
    ([["w", "float32", [KEY_FLOATS]]], {"compress": "fp16"}, f"takes {2 * KEY_FLOATS} bytes (compress=fp16)"),
    ([["w#i", "int64", [KEY_FLOATS + 1]], ["w#v", "float32", [1]]], {"compress": "topk"},
     f"takes {8 * KEY_FLOATS} bytes at most (compress=topk)"),
])
def test_a_push_whose_tensors_do_not_fit_the_shard_is_refused_naming_them(tensors: list, meta: dict, what: str) -> None:
    with InprocCluster(1, 2, TrainConfig()) as c:
        trainer = c.trainer(0, Flat(), optim.SGD(lr=0.01))
        trainer.prepare()
        sizes = {"float32": 4, "float64": 8, "int64": 8}
        payload = sum(sizes[d] * shape[0] for _, d, shape in tensors)
        conn = hostile(c)
        try:
            _, _, received = declare_and_stream(conn, tensors, {"worker": 1, "version": 0, **meta}, payload, payload)
        finally:
            conn.close()
        assert what in error_of(received)
        assert c.services[0].store.stats.applied_updates == 0
        step(trainer)
        assert c.services[0].store.stats.applied_updates == 1


@pytest.mark.parametrize("compress", ["none", "fp16", "topk:0.1"])
def test_pushes_within_their_bounds_still_train(compress: str) -> None:
    with InprocCluster(1, 1, TrainConfig(compress=compress)) as c:
        trainer = c.trainer(0, Flat(), optim.SGD(lr=0.01))
        trainer.prepare()
        for _ in range(3):
            step(trainer)
        assert c.services[0].store.stats.applied_updates == 3
