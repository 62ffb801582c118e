"""Component tests: a wait for a silent peer ends at the task's stop request (issue 23 item 6).

A connection that watches its task's stop reason (``Connection.watch_stop``, which ``connect``
sets up from ``should_stop``) waits on its socket in slices. A peer that stays silent for
``STOP_GRACE_S`` after the stop request (a frozen ps) ends the wait with ReplyStopped, naming the
reason and the peer, and the connection is closed; a reply that comes within the grace is read as
usual, and without a stop request the slices change nothing: long waits, the request's timeout and a
send that must wait for room all behave as with a whole timeout. Real sockets (a socketpair).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from psflow.errors import TransportError
from psflow.wire.conn import STOP_GRACE_S, Connection, ReplyStopped
from psflow.wire.ops import Op

pytestmark = pytest.mark.timeout(60)


def watched_pair(reason: list[str]) -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    client, server = Connection(a, peer="ps:0"), Connection(b, peer="worker:0")
    client.watch_stop(lambda: reason[0] if reason else None)
    return client, server


def test_a_stop_request_ends_the_wait_for_a_silent_peer_and_closes_the_connection() -> None:
    reason: list[str] = []
    client, server = watched_pair(reason)
    timer = threading.Timer(0.5, lambda: reason.append("SIGTERM"))
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(ReplyStopped, match=r"Stopped \(SIGTERM\) while waiting for ps:0: nothing came within 1 s "
                                           r"of the stop request .*its connection is closed"):
        client.request(Op.PS_STATUS, {}, timeout_s=60.0)
    took_s = time.monotonic() - t0
    assert 0.5 + STOP_GRACE_S - 0.1 < took_s < 0.5 + STOP_GRACE_S + 2.0, took_s  # not at the 60 s timeout
    assert client.sock.fileno() == -1  # closed: the stream's state is unknown
    server.close()


def test_a_reply_within_the_grace_after_the_stop_is_read() -> None:
    reason: list[str] = []
    client, server = watched_pair(reason)

    def answer_late() -> None:
        frame = server.recv()
        reason.append("SIGTERM")
        time.sleep(0.4)  # the ps works on after the stop request (within the grace): not a synchronisation
        server.send(Op.PS_STATUS, {"echo": frame.meta["n"]})

    t = threading.Thread(target=answer_late)
    t.start()
    assert client.request(Op.PS_STATUS, {"n": 7}, timeout_s=60.0).meta == {"echo": 7}
    t.join(10)
    client.close()
    server.close()


def test_without_a_stop_request_slices_change_nothing() -> None:
    client, server = watched_pair([])

    def answer_after(delay_s: float) -> None:
        frame = server.recv()
        time.sleep(delay_s)  # a slow reply, longer than several slices: not a synchronisation
        server.send(Op.PS_STATUS, {"echo": frame.meta["n"]})

    t = threading.Thread(target=answer_after, args=(0.7,))
    t.start()
    assert client.request(Op.PS_STATUS, {"n": 1}, timeout_s=60.0).meta == {"echo": 1}
    t.join(10)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="Timed out waiting for ps:0") as info:
        client.request(Op.PS_STATUS, {"n": 2}, timeout_s=0.7)  # nobody answers: the request's own timeout
    assert not isinstance(info.value, ReplyStopped)
    assert 0.6 < time.monotonic() - t0 < 3.0
    client.close()
    server.close()


def test_a_send_that_waits_for_room_past_a_slice_completes() -> None:
    import torch

    client, server = watched_pair([])
    big = torch.arange(4_000_000, dtype=torch.float32)  # 16 MB: far more than the socket buffers hold
    got: list[torch.Tensor] = []

    def read_late() -> None:
        time.sleep(0.7)  # the peer reads only later: the sender waits for room over several slices
        got.append(server.recv().tensors["w"])

    t = threading.Thread(target=read_late)
    t.start()
    client.set_timeout(60.0)
    client.send(Op.PS_PUSH, {}, [("w", big)])
    t.join(30)
    assert got and torch.equal(got[0], big)
    client.close()
    server.close()


def test_a_peer_that_still_answers_otherwise_is_waited_for_past_the_grace() -> None:
    """A ps holding a sync step back for a worker that finishes its batch answers a new connection:
    its reply is waited for; one that does not (frozen) ends the wait at the next grace."""
    reason: list[str] = ["SIGTERM"]
    a, b = socket.socketpair()
    client, server = Connection(a, peer="ps:0"), Connection(b, peer="worker:0")
    probes: list[float] = []
    client.watch_stop(lambda: reason[0], alive=lambda: probes.append(time.monotonic()) is None and len(probes) < 3)

    def answer_late() -> None:
        frame = server.recv()
        time.sleep(STOP_GRACE_S * 1.5)  # past one grace, within the second: not a synchronisation
        server.send(Op.PS_STATUS, {"echo": frame.meta["n"]})

    t = threading.Thread(target=answer_late)
    t.start()
    assert client.request(Op.PS_STATUS, {"n": 3}, timeout_s=60.0).meta == {"echo": 3}
    t.join(10)
    assert len(probes) == 1, probes
    t0 = time.monotonic()
    with pytest.raises(ReplyStopped, match="nor did it answer a new connection"):
        client.request(Op.PS_STATUS, {"n": 4}, timeout_s=60.0)  # alive twice more, then not: stopped
    assert len(probes) == 3 and time.monotonic() - t0 < 3 * STOP_GRACE_S + 2.0
    server.close()
