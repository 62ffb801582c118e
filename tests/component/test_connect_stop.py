"""Component tests: a connection's retries end at the task's stop request, not at their deadline (issue 23 item 6).

``connect`` retries a refused address with backoff for ``deadline_s``; given ``should_stop`` (a
task's stop reason, set by its SIGTERM handler), it gives up within about 50 ms of the request with
a ConnectStopped that names the reason and the peer. Real sockets on 127.0.0.1.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from psflow.errors import TransportError
from psflow.wire.conn import ConnectStopped, connect

pytestmark = pytest.mark.timeout(60)


def refused_address() -> str:
    """An address on loopback where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_stop_request_ends_the_retries_at_once() -> None:
    reason: list[str] = []
    timer = threading.Timer(0.5, lambda: reason.append("SIGTERM"))
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(ConnectStopped, match=r"Stopped \(SIGTERM\) while reconnecting to ps:0 at 127\.0\.0\.1:\d+: it "
                                             r"was still unreachable \(last error: .*refused"):
        connect(refused_address(), secret=b"", task="worker:0", peer="ps:0", deadline_s=30.0,
                should_stop=lambda: reason[0] if reason else None)
    took_s = time.monotonic() - t0
    assert 0.4 < took_s < 3.0, took_s  # not at the 30 s deadline


def test_a_task_already_stopping_makes_one_attempt_then_gives_up() -> None:
    t0 = time.monotonic()
    with pytest.raises(ConnectStopped):
        connect(refused_address(), secret=b"", task="worker:0", peer="ps:0", deadline_s=30.0, should_stop=lambda: "SIGTERM")
    assert time.monotonic() - t0 < 2.0


def test_without_a_stop_request_the_deadline_still_applies() -> None:
    with pytest.raises(TransportError, match="Cannot reach ps:0") as info:
        connect(refused_address(), secret=b"", task="worker:0", peer="ps:0", deadline_s=0.5, should_stop=lambda: None)
    assert not isinstance(info.value, ConnectStopped)
