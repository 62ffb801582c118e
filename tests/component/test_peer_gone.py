"""connect(refused_is_gone=True): a refused address is a dead peer at once (PeerGoneError), unless
the resolver knows where the peer listens now, which is tried at once; without the flag a refused
address is retried until the deadline, as before (a task's first connection to a peer not up yet)."""

from __future__ import annotations

import socket

import pytest

from psflow.errors import PeerGoneError, TransportError
from psflow.server import Reply, Server
from psflow.wire.conn import connect
from psflow.wire.ops import Op

SECRET = b"s" * 32


def closed_address() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()  # nothing listens there now
    return address


def test_a_refused_address_is_a_gone_peer_at_once_only_when_asked() -> None:
    dead = closed_address()
    with pytest.raises(PeerGoneError, match=r"Nothing listens at ps:0's address .* \(connection refused\)"):
        connect(dead, secret=SECRET, task="worker:0", peer="ps:0", deadline_s=60.0, refused_is_gone=True)
    with pytest.raises(TransportError) as caught:  # the flag off: retried until the (short) deadline
        connect(dead, secret=SECRET, task="worker:0", peer="ps:0", deadline_s=0.3)
    assert not isinstance(caught.value, PeerGoneError) and "after 0.3 s" in str(caught.value)


def test_a_refused_address_is_resolved_once_and_the_new_one_tried_at_once() -> None:
    server = Server("ps:0", secret=SECRET)
    server.register(Op.PS_STATUS, lambda req: Reply({"ok": True}))
    address = server.start()
    try:
        conn = connect(closed_address(), secret=SECRET, task="worker:0", peer="ps:0", deadline_s=60.0,
                       resolve=lambda task: address, refused_is_gone=True)
        assert conn.request(Op.PS_STATUS, {}).meta["ok"] is True
        conn.close()
    finally:
        server.stop()
