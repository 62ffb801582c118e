"""Component tests of psflow.server.Server with psflow.wire.conn over real sockets on 127.0.0.1.

Servers run in this process on their own threads and bind port 0. What is checked is the server's
contract: nothing is served before the job's secret is proven; a malformed, oversized or
unauthenticated peer is refused with a message and only its own connection closes; an unknown op or
a failing handler gets an ERROR reply on a connection that stays usable; many clients are served
at once. Every wait here has a deadline (socket timeouts, joins with timeouts).
"""

from __future__ import annotations

import random
import re
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psflow.errors import AuthError, ClusterError, ConfigError, PsflowError, RemoteError, TransportError
from psflow.server import Reply, Request, Server
from psflow.wire.conn import Connection, _mac, connect
from psflow.wire.frame import HEADER, HEADER_SIZE, Limits, decode_header, decode_meta
from psflow.wire.ops import Op

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)

SECRET = b"job-secret"
WAIT_S = 5.0  # deadline of every single wait in this file
ECHO, DOUBLE, FAIL_PSFLOW, FAIL_BUG, KEEP = 1001, 1002, 1003, 1004, 1005

MakeServer = Callable[..., Server]


def echo(req: Request) -> Reply:
    """Send back what came in, and who sent it (the task id proven in the handshake)."""
    return Reply({"peer": req.peer, "meta": req.meta}, list(req.tensors.items()))


def double(req: Request) -> Reply:
    return Reply({"i": req.meta["i"]}, [("y", req.tensors["x"] * 2)])


def fail_psflow(req: Request) -> Reply:
    raise PsflowError(f"Parameter 'w' is not initialized. Received a pull from {req.peer}. Run the chief first.")


def fail_bug(req: Request) -> Reply:
    raise ValueError("boom from a buggy handler")


@pytest.fixture
def make_server() -> Iterator[MakeServer]:
    """Start servers with the test handlers registered; every one is stopped at teardown."""
    servers: list[Server] = []

    def make(task: str = "ps:0", *, secret: bytes = SECRET, **kwargs: object) -> Server:
        kwargs.setdefault("handshake_timeout_s", WAIT_S)
        srv = Server(task, secret=secret, **kwargs)  # type: ignore[arg-type]
        srv.register(ECHO, echo)
        srv.register(DOUBLE, double)
        srv.register(FAIL_PSFLOW, fail_psflow)
        srv.register(FAIL_BUG, fail_bug)
        servers.append(srv)
        srv.start()
        return srv

    yield make
    for srv in servers:
        srv.stop()


def client(srv: Server, task: str = "worker:0", *, secret: bytes = SECRET, **kwargs: object) -> Connection:
    return connect(
        srv.address, secret=secret, task=task, peer=srv.task, deadline_s=WAIT_S, handshake_timeout_s=WAIT_S, **kwargs  # type: ignore[arg-type]
    )


def assert_served(srv: Server, task: str = "worker:9", *, secret: bytes = SECRET) -> None:
    """A fresh, good client is still served."""
    conn = client(srv, task, secret=secret)
    try:
        assert conn.request(Op.PING, timeout_s=WAIT_S).meta == {"task": srv.task}
    finally:
        conn.close()


def raw_socket(srv: Server) -> socket.socket:
    host, _, port = srv.address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=WAIT_S)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (EOF or reset)."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def parse_frames(data: bytes) -> list[tuple[int, dict]]:
    """(op, meta) of each whole frame in ``data``; frames here carry no tensors."""
    frames = []
    while data:
        op, _, meta_len, payload_len = decode_header(data[:HEADER_SIZE], Limits())
        meta, _ = decode_meta(data[HEADER_SIZE : HEADER_SIZE + meta_len], payload_len, Limits())
        frames.append((op, meta))
        data = data[HEADER_SIZE + meta_len + payload_len :]
    return frames


def join_all(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a client thread did not finish in time"


# --- requests and tensors -----------------------------------------------------------------------


def test_tensors_round_trip_through_a_handler_with_values_and_dtypes_kept(make_server: MakeServer) -> None:
    srv = make_server()
    big = torch.arange(4 << 20, dtype=torch.float32)  # 16 MiB
    sent = [
        ("scalar", torch.tensor(-2.5, dtype=torch.float64)),
        ("empty", torch.zeros(0, 3, dtype=torch.int32)),
        ("bf16", torch.linspace(-1, 1, 7).to(torch.bfloat16)),
        ("mask", torch.tensor([[True, False], [False, True]])),
        ("i8", torch.tensor([-128, 0, 127], dtype=torch.int8)),
        ("big", big),
    ]
    conn = client(srv, "worker:3")
    try:
        reply = conn.request(ECHO, {"step": 7, "note": "ünïcode"}, sent, timeout_s=WAIT_S)
    finally:
        conn.close()
    assert reply.op == Op.OK
    assert reply.meta == {"peer": "worker:3", "meta": {"step": 7, "note": "ünïcode"}}
    assert list(reply.tensors) == [name for name, _ in sent]
    for name, original in sent:
        got = reply.tensors[name]
        assert got.dtype == original.dtype and got.shape == original.shape, name
        assert torch.equal(got, original), name
    assert reply.tensors["scalar"].dim() == 0


def test_receiving_into_a_provided_tensor_writes_into_its_storage(make_server: MakeServer) -> None:
    srv = make_server()
    dest = torch.full((5, 4), -1.0)
    wrong_shape = torch.zeros(3)
    x = torch.arange(20.0).reshape(5, 4)
    conn = client(srv)
    try:
        reply = conn.request(
            ECHO,
            tensors=[("x", x), ("z", torch.ones(2))],
            alloc=lambda spec: {"x": dest, "z": wrong_shape}[spec.name],
            timeout_s=WAIT_S,
        )
    finally:
        conn.close()
    assert reply.tensors["x"].data_ptr() == dest.data_ptr()
    assert torch.equal(dest, x)
    # A destination of the wrong shape is not written into; a fresh tensor takes the data.
    assert reply.tensors["z"].data_ptr() != wrong_shape.data_ptr()
    assert torch.equal(wrong_shape, torch.zeros(3)) and torch.equal(reply.tensors["z"], torch.ones(2))


def test_reuse_buffers_route_receives_into_the_same_storage_each_request(make_server: MakeServer) -> None:
    srv = make_server()
    ptrs: list[int] = []

    def keep(req: Request) -> Reply:
        ptrs.append(req.tensors["g"].data_ptr())
        return Reply({"sum": float(req.tensors["g"].sum())})

    srv.register(KEEP, keep, reuse_buffers=True)
    conn = client(srv)
    try:
        sums = [conn.request(KEEP, tensors=[("g", torch.full((64,), float(i)))], timeout_s=WAIT_S).meta["sum"] for i in range(3)]
    finally:
        conn.close()
    assert sums == [0.0, 64.0, 128.0]
    assert len(set(ptrs)) == 1


# --- authentication -----------------------------------------------------------------------------


def test_wrong_secret_is_refused_naming_the_task_and_others_are_still_served(make_server: MakeServer) -> None:
    srv = make_server()
    before = client(srv, "worker:0")
    try:
        with pytest.raises(AuthError, match=r"ps:0 refused this task: Task worker:7 from .* did not prove the job's secret"):
            client(srv, "worker:7", secret=b"not-the-secret")
        assert srv.refused == 1
        assert before.request(Op.PING, timeout_s=WAIT_S).meta == {"task": "ps:0"}
    finally:
        before.close()
    assert_served(srv)


def test_server_without_secret_accepts_a_client_without_one(make_server: MakeServer) -> None:
    srv = make_server(secret=b"")
    assert_served(srv, secret=b"")
    assert srv.refused == 0


def test_server_with_secret_refuses_a_client_without_one(make_server: MakeServer) -> None:
    srv = make_server(secret=SECRET)
    with pytest.raises(AuthError, match=r"Task worker:1 .* did not prove the job's secret"):
        client(srv, "worker:1", secret=b"")
    assert srv.refused == 1


def test_client_detects_a_server_that_does_not_hold_the_secret() -> None:
    """Mutual proof: a listener that answers AUTH_OK without knowing the secret is not trusted."""
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.settimeout(WAIT_S)
    port = lsock.getsockname()[1]

    def impostor() -> None:
        sock, _ = lsock.accept()
        conn = Connection(sock, peer="client")
        sock.settimeout(WAIT_S)
        try:
            conn.send(Op.HELLO, {"nonce": "n", "v": 1, "task": "ps:0"})  # it claims the right name
            auth = conn.recv()
            conn.send(Op.AUTH_OK, {"mac": _mac(b"guessed", b"s", auth.meta["cnonce"].encode(), b"n", b"ps:0")})
            conn.recv()  # until the client hangs up
        except TransportError:
            pass
        finally:
            conn.close()

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    try:
        with pytest.raises(AuthError, match=r"ps:0 does not hold this job's secret"):
            connect(f"127.0.0.1:{port}", secret=SECRET, task="worker:0", peer="ps:0", deadline_s=WAIT_S, handshake_timeout_s=WAIT_S)
    finally:
        thread.join(timeout=WAIT_S)
        lsock.close()
    assert not thread.is_alive()


def test_silent_client_does_not_block_others_and_is_dropped_after_the_handshake_timeout(make_server: MakeServer) -> None:
    srv = make_server(handshake_timeout_s=0.5)
    silent = raw_socket(srv)
    try:
        assert_served(srv, "worker:1")
        assert_served(srv, "worker:2")
        frames = parse_frames(read_until_closed(silent))
    finally:
        silent.close()
    assert [op for op, _ in frames] == [Op.HELLO]


# --- refusing bad frames ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("garbage", "pattern"),
    [
        pytest.param(b"\x00\x13" + random.Random(7).randbytes(22), r"Not a psflow frame: magic b'\\x00\\x13", id="random"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n\r\n", r"Not a psflow frame: magic b'GET '", id="http"),
    ],
)
def test_garbage_closes_only_that_socket_with_an_error_frame(make_server: MakeServer, garbage: bytes, pattern: str) -> None:
    srv = make_server()
    good = client(srv, "worker:0")
    raw = raw_socket(srv)
    try:
        raw.sendall(garbage)
        frames = parse_frames(read_until_closed(raw))
        assert [op for op, _ in frames] == [Op.HELLO, Op.ERROR]
        assert frames[1][1]["kind"] == "refused"
        assert re.search(pattern, frames[1][1]["error"]), frames[1][1]["error"]
        assert srv.refused == 1
        assert good.request(Op.PING, timeout_s=WAIT_S).meta == {"task": "ps:0"}
    finally:
        raw.close()
        good.close()
    assert_served(srv)


def test_oversized_frame_is_refused_naming_the_limit_and_others_are_served(make_server: MakeServer) -> None:
    srv = make_server(limits=Limits(max_payload_bytes=1024))
    other = client(srv, "worker:0")
    offender = client(srv, "worker:1")
    try:
        assert other.request(ECHO, tensors=[("x", torch.zeros(256))], timeout_s=WAIT_S).tensors["x"].numel() == 256  # 1024 bytes: allowed
        with pytest.raises(RemoteError, match=r"payload of 2048 bytes exceeds the limit of 1024 bytes \(Limits.max_payload_bytes\)"):
            offender.request(ECHO, tensors=[("x", torch.zeros(512))], timeout_s=WAIT_S)
        assert srv.refused == 1
        with pytest.raises(TransportError):  # the offender's connection is closed
            offender.request(Op.PING, timeout_s=WAIT_S)
        assert other.request(Op.PING, timeout_s=WAIT_S).meta == {"task": "ps:0"}
    finally:
        offender.close()
        other.close()
    assert_served(srv)


def test_malformed_meta_after_the_handshake_is_refused_and_the_connection_closed(make_server: MakeServer) -> None:
    srv = make_server()
    conn = client(srv)
    try:
        meta = b'{"t": [["w", "float32", [-3]]]}'
        conn.sock.sendall(HEADER.pack(b"PSF1", ECHO, 0, len(meta), 0) + meta)
        conn.sock.settimeout(WAIT_S)
        frames = parse_frames(read_until_closed(conn.sock))
    finally:
        conn.close()
    assert [op for op, _ in frames] == [Op.ERROR]
    assert "Tensor 'w' has a bad shape [-3]" in frames[0][1]["error"]
    assert_served(srv)


# --- a service registered after start (a launched ps) ----------------------------------------------


def test_a_request_that_arrives_before_its_service_registered_waits_for_it_not_refused() -> None:
    """A launched ps listens (and registers its address) before its service exists; a worker that
    asks at once must be answered once the service is there, not refused as an unknown op."""
    srv = Server("ps:0", secret=SECRET, handshake_timeout_s=WAIT_S)
    srv.expect_routes(WAIT_S)
    srv.start()
    conn = client(srv)
    try:
        replies: list[object] = []
        asking = threading.Thread(target=lambda: replies.append(conn.request(ECHO, {"x": 1}, timeout_s=WAIT_S).meta))
        asking.start()
        asking.join(0.3)
        assert asking.is_alive() and not replies  # waiting for the service, not refused
        srv.register(ECHO, echo)
        srv.routes_ready()
        asking.join(WAIT_S)
        assert replies == [{"peer": "worker:0", "meta": {"x": 1}}]
        with pytest.raises(RemoteError, match="Unknown op 999"):  # once ready, an unknown op is refused at once
            conn.request(999, timeout_s=0.5)
    finally:
        conn.close()
        srv.stop()


def test_a_service_that_never_registers_leaves_its_ops_refused_after_the_wait() -> None:
    srv = Server("ps:0", secret=SECRET, handshake_timeout_s=WAIT_S)
    srv.expect_routes(0.2)
    srv.start()
    conn = client(srv)
    try:
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match="Unknown op 24"):
            conn.request(Op.PS_STATUS, timeout_s=WAIT_S)
        assert time.monotonic() - t0 >= 0.2
    finally:
        conn.close()
        srv.stop()


# --- errors that keep the connection ------------------------------------------------------------


def test_unknown_op_is_named_and_the_same_connection_keeps_working_when_idle(make_server: MakeServer) -> None:
    srv = make_server()
    conn = client(srv)
    try:
        with pytest.raises(RemoteError, match=r"ps:0: Unknown op 999; this server \(ps:0\) serves ops \[6, 7, 1001"):
            conn.request(999, {"x": 1}, [("t", torch.ones(3))], timeout_s=WAIT_S)
        # A worker may sit idle between requests (a long forward pass): the refusal must not have
        # left a short timeout on the server's side of the socket.
        time.sleep(1.5)
        assert conn.request(Op.PING, timeout_s=WAIT_S).meta == {"task": "ps:0"}
        assert conn.request(DOUBLE, {"i": 1}, [("x", torch.ones(2))], timeout_s=WAIT_S).tensors["y"].tolist() == [2.0, 2.0]
    finally:
        conn.close()


def test_failing_handlers_become_remote_errors_and_the_server_keeps_serving(make_server: MakeServer) -> None:
    srv = make_server()
    conn = client(srv, "worker:4")
    try:
        with pytest.raises(RemoteError, match=r"ps:0: Parameter 'w' is not initialized\. Received a pull from worker:4\. Run the chief first\."):
            conn.request(FAIL_PSFLOW, timeout_s=WAIT_S)
        with pytest.raises(RemoteError, match=r"internal error in ps:0: ValueError\('boom from a buggy handler'\)"):
            conn.request(FAIL_BUG, tensors=[("x", torch.ones(4))], timeout_s=WAIT_S)
        assert conn.request(DOUBLE, {"i": 0}, [("x", torch.tensor([3]))], timeout_s=WAIT_S).tensors["y"].tolist() == [6]
    finally:
        conn.close()
    assert srv.refused == 0
    assert_served(srv)


# --- connecting and binding ---------------------------------------------------------------------


def test_connect_to_a_port_nobody_listens_on_fails_within_the_deadline() -> None:
    holder = socket.socket()  # bound but not listening: the port stays ours and refuses connections
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    try:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=rf"Cannot reach ps:3 at 127\.0\.0\.1:{port} after 0\.5 s.*connect_timeout_s"):
            connect(f"127.0.0.1:{port}", secret=SECRET, task="worker:0", peer="ps:3", deadline_s=0.5)
        assert time.monotonic() - t0 < 3.0  # the deadline (0.5 s) plus generous slack for busy CI cores
    finally:
        holder.close()


def test_server_on_a_busy_port_raises_config_error_naming_the_port(make_server: MakeServer) -> None:
    first = make_server("ps:0")
    port = int(first.address.rpartition(":")[2])
    second = Server("ps:1", port=port)
    try:
        with pytest.raises(ConfigError, match=rf"Task ps:1 cannot listen on 127\.0\.0\.1:{port}.*Pick a free port"):
            second.start()
    finally:
        second.stop()
    assert_served(first)


def test_stop_closes_open_connections(make_server: MakeServer) -> None:
    srv = make_server()
    conn = client(srv)
    try:
        assert conn.request(Op.PING, timeout_s=WAIT_S).meta == {"task": "ps:0"}
        srv.stop()
        with pytest.raises(TransportError):
            conn.request(Op.PING, timeout_s=WAIT_S)
    finally:
        conn.close()


# --- concurrency --------------------------------------------------------------------------------


def test_eight_clients_with_fifty_requests_each_all_get_their_own_answers(make_server: MakeServer) -> None:
    srv = make_server()
    errors: list[BaseException] = []
    done = [0] * 8

    def worker(k: int) -> None:
        try:
            conn = client(srv, f"worker:{k}")
            try:
                for i in range(50):
                    x = torch.full((16,), float(k * 1000 + i))
                    reply = conn.request(DOUBLE, {"i": i}, [("x", x)], timeout_s=WAIT_S)
                    assert reply.meta == {"i": i}
                    assert torch.equal(reply.tensors["y"], x * 2), (k, i)
                    done[k] += 1
            finally:
                conn.close()
        except BaseException as e:  # surfaced in the main thread below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(8)]
    for t in threads:
        t.start()
    join_all(threads)
    assert errors == []
    assert done == [50] * 8


class _Capture:
    """A socket that keeps what is sent on it (a connection's framing, without a peer)."""

    family = socket.AF_UNIX

    def __init__(self, into: bytearray) -> None:
        self.into = into

    def sendall(self, data: bytes) -> None:
        self.into.extend(data)

    def sendmsg(self, bufs: list[memoryview]) -> int:
        for b in bufs:
            self.into.extend(b)
        return sum(memoryview(b).nbytes for b in bufs)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.sampled_from([-1, 0, 1, 7, 1000, 16_000, 40_000, 70_000]), min_size=1, max_size=6),
    chunk=st.integers(1, 100_000),
    seed=st.integers(0, 2**31 - 1),
)
def test_back_to_back_frames_cut_anywhere_arrive_whole_and_in_order(sizes: list[int], chunk: int, seed: int) -> None:
    """The receive buffer (small frames in one recv, large payloads straight into the tensor) must
    give every frame back whole, whatever the segmentation: frames sent back to back, delivered in
    pieces of any size, straddling the buffer and its large-payload threshold. Size -1: a frame
    listing an empty tensor (no payload: the short path for small frames must still make it)."""
    g = torch.Generator().manual_seed(seed)
    frames = [(Op.PING, {"i": i, "pad": "x" * (i * 37)},
               [("v", torch.randn(max(n, 0) // 4, generator=g))] if n else [])
              for i, n in enumerate(sizes)]
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(WAIT_S)
        wire = bytearray()
        encoder = Connection(_Capture(wire), peer="encoder")  # type: ignore[arg-type]  # only its framing is used
        for op, meta, tensors in frames:
            encoder.send(op, meta, tensors)

        def feed() -> None:
            for i in range(0, len(wire), chunk):
                a.sendall(wire[i:i + chunk])

        sender = threading.Thread(target=feed, daemon=True)
        sender.start()
        conn = Connection(b, peer="sender")
        for op, meta, tensors in frames:
            got = conn.recv()
            assert (got.op, got.meta) == (op, meta)
            assert list(got.tensors) == [n for n, _ in tensors]
            for name, t in tensors:
                assert torch.equal(got.tensors[name], t)
        sender.join(WAIT_S)
        assert not sender.is_alive()


def test_a_small_frame_without_payload_past_the_meta_limit_is_refused_by_a_connection_with_a_lower_limit() -> None:
    """The short path for small frames keeps the connection's own limit on the meta, not only its buffer's."""
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(WAIT_S)
        meta = b'{"pad":"' + b"x" * 100 + b'"}'
        a.sendall(HEADER.pack(b"PSF1", int(Op.PING), 0, len(meta), 0) + meta)
        with pytest.raises(TransportError, match=f"meta of {len(meta)} bytes exceeds the limit of 64 bytes"):
            Connection(b, peer="sender", limits=Limits(max_meta_bytes=64)).recv()


def test_a_frame_without_payload_that_lists_a_nonempty_tensor_is_refused_as_a_size_mismatch() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(WAIT_S)
        meta = b'{"t":[["v","float32",[3]]]}'
        a.sendall(HEADER.pack(b"PSF1", int(Op.PING), 0, len(meta), 0) + meta)
        with pytest.raises(TransportError, match="tensors of 12 bytes but a payload of 0 bytes"):
            Connection(b, peer="sender").recv()


def test_peer_gone_fires_once_per_task_after_its_last_connection_closes(make_server: MakeServer) -> None:
    srv = make_server()
    gone: list[str] = []
    event = threading.Event()
    srv.on_peer_gone = lambda peer: (gone.append(peer), event.set())
    a1, a2, b = client(srv, "worker:1"), client(srv, "worker:1"), client(srv, "worker:2")
    for c in (a1, a2, b):
        c.request(ECHO, timeout_s=WAIT_S)  # each connection is past its handshake and served
    a1.close()
    b.close()
    assert event.wait(WAIT_S)
    a2.request(ECHO, timeout_s=WAIT_S)  # worker:1 still has a connection: not gone
    assert gone == ["worker:2"]
    event.clear()
    a2.close()
    assert event.wait(WAIT_S)
    assert gone == ["worker:2", "worker:1"]


# --- before the secret is proven: small frames, one deadline, a cap --------------------------------


def hello_then(srv: Server, data: bytes) -> list[tuple[int, dict]]:
    """Open a raw connection, send ``data`` after the HELLO, and return the frames until the server closes."""
    with raw_socket(srv) as sock:
        sock.sendall(data)
        return parse_frames(read_until_closed(sock))


def auth_frame(task: str = "worker:0", cnonce: str = "c") -> bytes:
    """An AUTH frame with a wrong proof."""
    meta = b'{"task":"%s","cnonce":"%s","mac":"%s"}' % (task.encode(), cnonce.encode(), b"0" * 64)
    return HEADER.pack(b"PSF1", Op.AUTH, 0, len(meta), 0) + meta


@pytest.mark.parametrize("host_of", ["server", "coordinator"])
def test_a_handshake_frame_declaring_a_gib_tensor_is_refused_before_anything_is_received(
    make_server: MakeServer, host_of: str
) -> None:
    """The launcher's coordinator is served by the same Server class: it is covered the same way."""
    from psflow.launch.coordinator import Coordinator

    srv = make_server("launcher" if host_of == "coordinator" else "ps:0")
    if host_of == "coordinator":
        Coordinator(srv, ["worker:0"], require_ps=False)
    meta = b'{"task":"worker:0","cnonce":"c","mac":"m","t":[["x","float32",[1073741824]]]}'
    frames = hello_then(srv, HEADER.pack(b"PSF1", Op.AUTH, 0, len(meta), 4 << 30) + meta + b"\0" * 65536)
    assert [op for op, _ in frames] == [Op.HELLO, Op.ERROR]
    assert "A handshake frame carries no tensors; this one declares a payload of 4294967296 bytes" in frames[1][1]["error"]
    big_meta = HEADER.pack(b"PSF1", Op.AUTH, 0, 1 << 20, 0) + b"{" * 4096
    frames = hello_then(srv, big_meta)
    assert "Handshake frame meta of 1048576 bytes exceeds the limit of 4096 bytes (Limits.max_handshake_bytes)" in frames[1][1]["error"]
    assert srv.refused == 2
    assert_served(srv, "worker:0")


def test_a_client_trickling_its_handshake_is_dropped_at_the_deadline_not_renewed_per_byte(make_server: MakeServer) -> None:
    """The handshake has one deadline in total: one byte every 0.1 s, well within a per-read timeout,
    must not keep an unauthenticated connection open."""
    srv = make_server(handshake_timeout_s=1.0)
    frame = auth_frame(cnonce="c" * 200)  # one frame of about 300 bytes: 30 s at one byte per 0.1 s
    sent = 0
    with raw_socket(srv) as sock:
        t0 = time.monotonic()
        closed = False
        while sent < len(frame) and not closed:
            readable, _, _ = select.select([sock], [], [], 0.1)  # also paces the trickle
            if readable:
                try:
                    closed = sock.recv(65536) == b""
                except ConnectionResetError:
                    closed = True
            if not closed:
                try:
                    sent += sock.send(frame[sent:sent + 1])
                except OSError:
                    closed = True
        held_s = time.monotonic() - t0
    assert closed and sent < len(frame), f"still open after {sent} of {len(frame)} bytes"
    assert held_s < 10 * srv.handshake_timeout_s, held_s  # the frame alone would take 30 s
    assert_served(srv)


def test_connections_past_the_handshake_cap_are_turned_away_at_once_and_a_client_waits_them_out(
    make_server: MakeServer,
) -> None:
    srv = make_server(max_handshaking=3, handshake_timeout_s=3.0)  # the idle ones hold their slots that long
    idle = [raw_socket(srv) for _ in range(3)]
    try:
        for sock in idle:  # each is admitted: it got its HELLO and now holds a handshake slot
            sock.settimeout(WAIT_S)
            assert sock.recv(HEADER_SIZE)[:4] == b"PSF1"
        with raw_socket(srv) as extra:  # the fourth is answered and closed at once, before the idle ones' deadline
            frames = parse_frames(read_until_closed(extra))
        assert [op for op, _ in frames] == [Op.ERROR]
        assert frames[0][1]["kind"] == "busy"
        assert "ps:0 has 3 connections in their handshake already (max_handshaking)" in frames[0][1]["error"]
        assert srv.turned_away == 1
        # A real client retries a busy server until the idle connections reach their deadline.
        conn = client(srv, "worker:5")
        try:
            assert conn.request(Op.PING, timeout_s=WAIT_S).meta == {"task": "ps:0"}
        finally:
            conn.close()
        assert srv.turned_away > 1
    finally:
        for sock in idle:
            sock.close()


# --- knowing whom a client reached --------------------------------------------------------------


def test_a_client_that_reached_another_task_says_whom_it_expected_and_whom_it_reached(make_server: MakeServer) -> None:
    srv = make_server("worker:0")
    with pytest.raises(ClusterError, match=rf"Connected to {re.escape(srv.address)} expecting ps:0 but reached worker:0\. "
                                           r"Check the cluster spec"):
        connect(srv.address, secret=SECRET, task="worker:1", peer="ps:0", deadline_s=WAIT_S, handshake_timeout_s=WAIT_S)
    assert_served(srv)


def test_a_worker_whose_ps_address_is_its_own_is_told_so_not_unknown_op(make_server: MakeServer) -> None:
    """E.g. worker:0 bound 0.0.0.0:P (PSFLOW_BIND_HOST) and ps:0 is written 127.0.0.1:P: it reaches itself."""
    from psflow.cluster import ClusterSpec, TaskId
    from psflow.ps.client import PsClient

    me = make_server("worker:0")
    port = int(me.address.rpartition(":")[2])
    cluster = ClusterSpec.from_dict({"ps": [f"127.0.0.1:{port}"], "worker": [f"127.0.0.2:{port}"]})
    with pytest.raises(ClusterError, match=r"expecting ps:0 but reached worker:0, that is, this task itself"):
        PsClient(cluster, TaskId("worker", 0), SECRET, connect_timeout_s=WAIT_S)


def test_every_server_answers_clock_with_its_wall_clock_and_ping_with_its_name(make_server: MakeServer) -> None:
    """CLOCK is what a task's timeline measures its offset to the launcher with; PING is a constant reply."""
    srv = make_server()
    conn = client(srv)
    try:
        for _ in range(3):
            before = time.time() * 1e6
            now_us = conn.request(Op.CLOCK, timeout_s=WAIT_S).meta["now_us"]
            after = time.time() * 1e6
            assert before <= now_us <= after
            assert conn.request(Op.PING, timeout_s=WAIT_S).meta == {"task": "ps:0"}
    finally:
        conn.close()
