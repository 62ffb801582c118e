"""A framed, authenticated connection over a stream socket (TCP or Unix).

Owns: sending a frame with its tensors' bytes straight from their storage (``sendmsg`` over
memoryviews, no copy), receiving a frame with tensors read straight into their destination
(``recv_into``; header, meta and small payloads through a 64 KiB receive buffer, so that a small
frame costs one syscall), the job-secret handshake on both sides, and client-side connect retries with backoff.

Handshake (before anything else is served)::

    server -> HELLO  {"nonce": N, "task": "ps:0"}
    client -> AUTH   {"task": "worker:0", "cnonce": C, "mac": HMAC(secret, "c|" N C task)}
    server -> AUTH_OK {"mac": HMAC(secret, "s|" C N server_task)}   (or ERROR, then close)

A job without a secret uses the empty key: that proves nothing, which is why only tasks that listen
on loopback may run without one (psflow.task enforces it). The client checks the server's proof
too, and that the server is the task it meant to reach (the name in HELLO, covered by the proof).

Before the peer has proved the secret nothing it sends can cost much: handshake frames carry no
tensors and at most ``Limits.max_handshake_bytes`` of meta, and the whole handshake has one
deadline (not a timeout per read, which a peer trickling one byte at a time would renew forever).
A server that has too many handshakes under way answers ERROR {"kind": "busy"} and closes;
``connect`` retries that like a refused connection.

A peer that moves (a restarted task, on a new port): ``connect`` takes an optional ``resolve(peer)
-> address`` (the launcher's address book, see ``wire/resolve.py``) and asks it again before each
retry, so that it follows the peer to its new address; the peer's name is still checked by the
handshake. A connection whose peer went away raises :class:`PeerLostError`, which a client may
answer by reconnecting (a timeout is not that: the peer may still be working on the request).
A task's stop request (SIGTERM) ends a wait on a silent peer: see ``Connection.watch_stop``.
"""

from __future__ import annotations

import hmac
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psflow import timeline
from psflow.errors import AuthError, ClusterError, PeerGoneError, PsflowError, RemoteError, TransportError
from psflow.wire.frame import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    FrameError,
    Limits,
    TensorSpec,
    decode_handshake_meta,
    decode_header,
    decode_meta,
    decode_small_meta,
    encode_head,
    io_view,
    tensor_specs,
)
from psflow.wire.ops import Op

if TYPE_CHECKING:
    import torch

NamedTensors = Sequence[tuple[str, "torch.Tensor"]]
Allocator = Callable[[TensorSpec], "torch.Tensor | None"]
# Called with a frame's op, meta and tensors once its meta is read, before a byte of its payload is:
# raises FrameError to refuse the frame (a tensor larger than its op may carry).
Admit = Callable[[int, dict[str, Any], list[TensorSpec]], None]
_IOV_MAX = 512
_RECV_BUF = 64 * 1024
_SMALL = _RECV_BUF // 2  # a frame without payload whose meta is at most this takes recv's short path
_unpack_header = HEADER.unpack_from
_ERROR = int(Op.ERROR)
_NO_META: dict[str, Any] = {}  # never written to
# A connection that watches its task's stop reason waits on its socket this long at a time.
_STOP_SLICE_S = 0.2
# Once the task is asked to stop, how long a peer may still be silent before the wait ends: a live
# peer's reply is on its way (the step ends, the final checkpoint goes on); a frozen one's never is.
STOP_GRACE_S = 1.0


@dataclass
class Frame:
    op: int
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def _mac(secret: bytes, *parts: bytes) -> str:
    return hmac.new(secret, b"|".join(parts), "sha256").hexdigest()


Resolve = Callable[[str], str]  # a task's name -> where it listens now ("host:port")


class PeerLostError(TransportError):
    """The peer closed or reset the connection (its process may have died, or moved to a new address)."""


class ConnectStopped(TransportError):
    """``connect`` gave up because its task was asked to stop (``should_stop``), not at its deadline."""


class ReplyStopped(ConnectStopped):
    """A wait on a connection (a reply, or room to send) ended because its task was asked to stop and
    the peer stayed silent for ``STOP_GRACE_S`` after it. The connection is closed: its stream is in
    an unknown state (a reply may be half read)."""


class ServerBusyError(TransportError):
    """The server turned this connection away: too many handshakes were under way (retried by connect)."""


BUSY = "busy"  # the ERROR kind of a connection turned away before its handshake


class Connection:
    """One framed connection. One thread sends and one receives at a time (they may be two: a
    pipelined client sends its next request while it reads the reply to the last)."""

    def __init__(self, sock: socket.socket, *, peer: str = "?", limits: Limits = Limits()) -> None:
        self.sock = sock
        self.peer = peer
        self.limits = limits
        self._small_meta = min(_SMALL, limits.max_meta_bytes)  # recv's short path takes metas up to this
        # Receive buffer: one recv usually brings a small frame whole (header, meta and a small
        # payload), so a request costs one syscall, not three. Large payloads bypass it.
        self._rbuf = memoryview(bytearray(_RECV_BUF))
        self._rpos = self._rend = 0
        self._timeout: float | None | bool = False  # False: unknown; settimeout costs a syscall, so skip repeats
        # The task's stop reason (see ``watch_stop``); None: the socket waits whole timeouts.
        self._should_stop: Callable[[], str | None] | None = None
        self._alive: Callable[[], bool] | None = None  # whether the peer still answers (see ``watch_stop``)
        self._deadline: float | None = None  # monotonic time the handshake must be done by (None: no deadline)
        self.bytes_sent = self.bytes_received = 0  # frames' bytes, handshake included (what a link carries)
        # psflow run --timeline: when the last frame's header arrived (timeline clock), what the
        # reader waited for until then is not the frame's transfer. Off: one branch per frame.
        self._timeline = timeline.ACTIVE
        self.header_us = 0.0
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def set_timeout(self, timeout_s: float | None) -> None:
        """The longest wait of each next send or receive (None: no limit). A no-op when unchanged."""
        if timeout_s != self._timeout or self._timeout is False:
            self._timeout = timeout_s
            if self._should_stop is not None:  # waits in slices (``_waiting`` goes on after the first)
                timeout_s = _STOP_SLICE_S if timeout_s is None else min(timeout_s, _STOP_SLICE_S)
            self.sock.settimeout(timeout_s)

    def watch_stop(self, should_stop: Callable[[], str | None] | None, alive: Callable[[], bool] | None = None) -> None:
        """From now on, end a wait on the peer with ReplyStopped once ``should_stop()`` names a reason
        (a flag that a signal handler sets) and the peer has stayed silent for ``STOP_GRACE_S`` since,
        unless ``alive()`` (asked then, and after each further grace) says the peer still answers
        otherwise: a ps holding a sync step for a worker that is finishing its batch, not a frozen one.
        The socket then waits in slices of ``_STOP_SLICE_S``: a wait within one costs nothing more."""
        timeout, self._timeout = self._timeout, False
        self._should_stop, self._alive = should_stop, alive
        self.set_timeout(None if timeout is False else timeout)  # type: ignore[arg-type]

    def _waiting(self, io: Callable[[], int], what: str) -> int:
        """Go on with a send or receive whose first slice passed without progress: in slices, until
        it completes (its result), the wait's limit passes (TimeoutError), or the task was asked to
        stop and ``STOP_GRACE_S`` passed since (ReplyStopped, the connection closed)."""
        assert self._should_stop is not None
        start = time.monotonic() - _STOP_SLICE_S  # the first slice is spent
        stop_at: float | None = None
        while True:
            now = time.monotonic()
            reason = self._should_stop() if stop_at is None else None
            if reason:
                stop_at, why = now + STOP_GRACE_S, reason
            if stop_at is not None and now >= stop_at:
                if self._alive is not None and self._alive():
                    stop_at = time.monotonic() + STOP_GRACE_S  # it works on: its reply may still come
                    continue
                self.close()
                raise ReplyStopped(f"Stopped ({why}) while {what} {self.peer}: nothing came within {STOP_GRACE_S:g} s "
                                   f"of the stop request{', nor did it answer a new connection' if self._alive else ''} "
                                   "(is it frozen?); its connection is closed.")
            limit = None if self._timeout is False else self._timeout
            if limit is not None and now - start >= limit:
                raise TimeoutError(f"no progress within {limit:g} s")
            try:
                return io()
            except TimeoutError:
                continue

    # -- sending ---------------------------------------------------------------------------
    def send(self, op: int, meta: dict[str, Any] | None = None, tensors: NamedTensors = ()) -> None:
        if not tensors:  # the common small request or reply: one buffer, one syscall
            self.send_encoded(encode_head(int(op), meta or _NO_META, 0))
            return
        meta = {**(meta or {}), "t": tensor_specs(tensors)}
        bufs = [io_view(t) for _, t in tensors]  # ``tensors`` holds them until sent
        payload_len = sum(b.nbytes for b in bufs)
        head = encode_head(int(op), meta, payload_len)
        self._sendall([memoryview(head), *[b for b in bufs if b.nbytes]])

    def send_encoded(self, frame: bytes) -> None:
        """Send a whole frame without tensors that :func:`~psflow.wire.frame.encode_head` made
        (earlier, or just now): one buffer, and ``sendall``'s loop is C's."""
        if self._should_stop is not None:  # a send that waits past a slice goes on where it stopped (_sendall)
            try:
                sent = self.sock.send(frame)
            except TimeoutError:
                sent = 0
            except OSError as e:
                raise PeerLostError(f"Lost the connection to {self.peer} while sending: {e}.") from e
            self.bytes_sent += sent
            if sent < len(frame):
                self._sendall([memoryview(frame)[sent:]])
            return
        try:
            self.sock.sendall(frame)
        except TimeoutError as e:
            raise TransportError(f"Timed out sending to {self.peer}.") from e
        except OSError as e:
            raise PeerLostError(f"Lost the connection to {self.peer} while sending: {e}.") from e
        self.bytes_sent += len(frame)

    def _sendall(self, bufs: list[memoryview]) -> None:
        try:
            self.bytes_sent += sum(b.nbytes for b in bufs)
            while bufs:
                try:
                    sent = self.sock.sendmsg(bufs[:_IOV_MAX])
                except TimeoutError:  # nothing sent in one slice: wait on, watching the stop reason
                    if self._should_stop is None:
                        raise
                    sent = self._waiting(lambda b=bufs[:_IOV_MAX]: self.sock.sendmsg(b), "sending to")
                while sent:
                    n = bufs[0].nbytes
                    if sent >= n:
                        sent -= n
                        bufs.pop(0)
                    else:
                        bufs[0] = bufs[0][sent:]
                        sent = 0
        except TimeoutError as e:
            raise TransportError(f"Timed out sending to {self.peer}.") from e
        except OSError as e:
            raise PeerLostError(f"Lost the connection to {self.peer} while sending: {e}.") from e

    # -- receiving -------------------------------------------------------------------------
    def _recv_exact(self, view: memoryview) -> None:
        """Fill ``view``: first from the receive buffer, then from the socket."""
        n = view.nbytes
        got = min(self._rend - self._rpos, n)
        if got:
            view[:got] = self._rbuf[self._rpos:self._rpos + got]
            self._rpos += got
        if got == n:
            return
        if n - got >= _RECV_BUF // 2:  # large: straight into the destination, no copy
            while got < n:
                k = self._recv_into(view[got:], n - got)
                if k == 0:
                    raise PeerLostError(f"{self.peer} closed the connection.")
                got += k
            return
        need = n - got  # small: refill the (now empty) buffer with whatever has arrived
        self._rpos = self._rend = 0
        while self._rend < need:
            k = self._recv_into(self._rbuf[self._rend:])
            if k == 0:
                raise PeerLostError(f"{self.peer} closed the connection.")
            self._rend += k
        view[got:] = self._rbuf[:need]
        self._rpos = need

    def _recv_into(self, view: memoryview, n: int = 0) -> int:
        if self._deadline is not None:
            # One deadline for the whole handshake: each read gets only the time that is left.
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("handshake deadline passed")
            self.sock.settimeout(left)
            self._timeout = left
            return self.sock.recv_into(view, n)
        try:
            return self.sock.recv_into(view, n)
        except TimeoutError:
            if self._should_stop is None:
                raise
            return self._waiting(lambda: self.sock.recv_into(view, n), "waiting for")

    def _fill(self, n: int) -> None:
        """Make the next ``n`` bytes (at most half the buffer) wait in the receive buffer: one
        syscall usually brings them and whatever else has arrived."""
        have = self._rend - self._rpos
        if self._rpos + n > _RECV_BUF:  # no room behind: move what is left to the front
            self._rbuf[:have] = self._rbuf[self._rpos:self._rend]
            self._rpos, self._rend = 0, have
        while self._rend - self._rpos < n:
            k = self._recv_into(self._rbuf[self._rend:])
            if k == 0:
                raise PeerLostError(f"{self.peer} closed the connection.")
            self._rend += k

    def _take(self, n: int) -> bytes:
        """The next ``n`` bytes (``n`` at most half the buffer), usually without a syscall."""
        if self._rend - self._rpos < n:
            self._fill(n)
        out = bytes(self._rbuf[self._rpos:self._rpos + n])
        self._rpos += n
        return out

    def recv(self, alloc: Allocator | None = None, admit: Admit | None = None) -> Frame:
        """Receive one frame. ``alloc(spec)`` may return a destination tensor (same dtype and
        shape) to receive into; otherwise a fresh tensor is allocated. ``admit(op, meta, specs)``
        sees a frame that carries a payload before any of it is received or allocated for, and
        refuses it by raising FrameError (the stream is then out of step: close the connection)."""
        try:
            rbuf, pos, end = self._rbuf, self._rpos, self._rend
            if end - pos < HEADER_SIZE:
                if pos == end and self._deadline is None:  # empty: one read, at the front
                    pos = self._rpos = 0
                    try:
                        end = self._rend = self.sock.recv_into(rbuf)
                    except TimeoutError:  # the reply is slow: wait on, watching the stop reason
                        if self._should_stop is None:
                            raise
                        end = self._rend = self._waiting(lambda: self.sock.recv_into(rbuf), "waiting for")
                    if not end:
                        raise PeerLostError(f"{self.peer} closed the connection.")
                if end - pos < HEADER_SIZE:
                    self._fill(HEADER_SIZE)
                    pos, end = self._rpos, self._rend
            # The short path: a small frame without tensors (every request and reply but the
            # tensors' own), checked exactly as below, in as few Python steps as possible: after a
            # context switch each step runs on cold caches, and a small round trip is mostly them.
            magic, op, _flags, meta_len, payload_len = _unpack_header(rbuf, pos)
            if not payload_len and magic == MAGIC and meta_len <= self._small_meta and self._timeline is None:
                start = pos + HEADER_SIZE
                stop = start + meta_len
                if stop > end:
                    self._rpos = start
                    self._fill(meta_len)
                    start = self._rpos
                    stop = start + meta_len
                meta, specs = decode_small_meta(rbuf[start:stop], self.limits)
                self._rpos = stop
                self.bytes_received += HEADER_SIZE + meta_len
                if specs:  # empty tensors only (no payload)
                    return Frame(op, meta, self._receive_tensors(specs, alloc))
                return Frame(op, meta, {})
            op, _flags, meta_len, payload_len = decode_header(self._rbuf[pos:pos + HEADER_SIZE], self.limits)
            self._rpos = pos + HEADER_SIZE
            self.bytes_received += HEADER_SIZE + meta_len + payload_len
            if self._timeline is not None:
                self.header_us = self._timeline.now()
            if meta_len <= _RECV_BUF // 2:
                meta_raw = self._take(meta_len)
            else:
                buf = bytearray(meta_len)
                self._recv_exact(memoryview(buf))
                meta_raw = bytes(buf)
            meta, specs = decode_meta(meta_raw, payload_len, self.limits)
            if admit is not None and payload_len:
                admit(op, meta, specs)
            tensors = self._receive_tensors(specs, alloc)
            meta.pop("t", None)
            return Frame(op, meta, tensors)
        except TimeoutError as e:
            raise TransportError(f"Timed out waiting for {self.peer}.") from e
        except (ConnectionError, OSError) as e:
            if isinstance(e, TransportError):
                raise
            raise PeerLostError(f"Lost the connection to {self.peer}: {e}.") from e

    def _receive_tensors(self, specs: list[TensorSpec], alloc: Allocator | None) -> dict[str, torch.Tensor]:
        """The payload's tensors, each read straight into ``alloc``'s destination or a fresh tensor."""
        tensors: dict[str, torch.Tensor] = {}
        for spec in specs:
            dest = alloc(spec) if alloc else None
            if dest is None or dest.dtype != spec.dtype or tuple(dest.shape) != spec.shape or not dest.is_contiguous():
                import torch  # already loaded: the specs' dtypes are torch's

                dest = torch.empty(spec.shape, dtype=spec.dtype)
            if spec.nbytes:
                self._recv_exact(io_view(dest))  # ``dest`` holds it
            tensors[spec.name] = dest
        return tensors

    # -- request/reply (client side) -------------------------------------------------------
    def request(
        self,
        op: int,
        meta: dict[str, Any] | None = None,
        tensors: NamedTensors = (),
        *,
        alloc: Allocator | None = None,
        timeout_s: float | None = None,
    ) -> Frame:
        if timeout_s != self._timeout:
            self.set_timeout(timeout_s)
        self.send(op, meta, tensors)
        reply = self.recv(alloc)
        if reply.op == _ERROR:
            kind = reply.meta.get("kind")
            raise RemoteError(f"{self.peer}: {reply.meta.get('error', 'unknown error')}",
                              kind if isinstance(kind, str) else None)
        return reply

    def drain_and_close(self, timeout_s: float) -> None:
        """Close after a refusal that left the peer's frame unread: stop sending, then read and drop
        what the peer still sends (into the fixed receive buffer) until it closes or ``timeout_s``
        passed. Closing with unread bytes would reset the connection, and the peer would lose the
        ERROR frame sent before instead of reading it once its own send is done."""
        end = time.monotonic() + timeout_s
        try:
            self.sock.shutdown(socket.SHUT_WR)
            while (left := end - time.monotonic()) > 0:
                self.sock.settimeout(left)
                if not self.sock.recv_into(self._rbuf):
                    break
        except OSError:  # reset, timed out, or closed by stop()
            pass
        self.close()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def shutdown(self) -> None:
        """End both directions without releasing the socket: another thread blocked sending or
        receiving on it returns with an error now, and its descriptor cannot be reused under it
        (as :meth:`close` from another thread could let happen)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- handshake -------------------------------------------------------------------------
    def _recv_handshake(self, timeout_s: float) -> Frame:
        """A handshake frame: JSON meta only, small, and within the handshake's deadline."""
        try:
            op, _flags, meta_len, _ = decode_header(self._take(HEADER_SIZE), self.limits, handshake=True)
            meta = decode_handshake_meta(self._take(meta_len))
        except TimeoutError as e:
            raise TransportError(
                f"{self.peer} did not complete the psflow handshake within {timeout_s:g} s (handshake_timeout_s)."
            ) from e
        except OSError as e:
            raise TransportError(f"Lost the connection to {self.peer} during the handshake: {e}.") from e
        return Frame(op, meta, {})

    def _send_handshake(self, op: int, meta: dict[str, Any]) -> None:
        assert self._deadline is not None
        self.set_timeout(max(0.001, self._deadline - time.monotonic()))
        self.send(op, meta)

    def server_handshake(self, secret: bytes, timeout_s: float, *, task: str = "?") -> str:
        """Run the server side of the handshake as ``task``; all of it within ``timeout_s``.

        Returns the client's task id. Raises AuthError/FrameError, or TransportError (deadline, lost peer).
        """
        self._deadline = time.monotonic() + timeout_s
        try:
            nonce = os.urandom(16).hex()
            self._send_handshake(Op.HELLO, {"nonce": nonce, "v": 1, "task": task})
            frame = self._recv_handshake(timeout_s)
            if frame.op != Op.AUTH:
                raise AuthError(
                    f"Expected an AUTH frame first, received op {frame.op}. Every connection must prove the job's secret first."
                )
            client, cnonce, mac = (str(frame.meta.get(k, "")) for k in ("task", "cnonce", "mac"))
            expected = _mac(secret, b"c", nonce.encode(), cnonce.encode(), client.encode())
            if not hmac.compare_digest(mac, expected):
                raise AuthError(
                    f"Task {client or '?'} from {self.peer} did not prove the job's secret. "
                    "Give every task the same secret (PSFLOW_SECRET or --secret-file)."
                )
            self._send_handshake(Op.AUTH_OK, {"mac": _mac(secret, b"s", cnonce.encode(), nonce.encode(), task.encode())})
        finally:
            self._deadline = None
        self.set_timeout(None)
        self.peer = client
        return client

    def client_handshake(self, secret: bytes, task: str, timeout_s: float, *, expect: str | None = None) -> None:
        """Run the client side as ``task``; all of it within ``timeout_s``.

        Args:
            expect: the task the server must be (e.g. "ps:0"); None accepts any.

        Raises:
            ServerBusyError: the server turned the connection away before the handshake.
            ClusterError: the server is another task than ``expect``.
            AuthError: either side failed to prove the job's secret.
        """
        self._deadline = time.monotonic() + timeout_s
        try:
            hello = self._recv_handshake(timeout_s)
            if hello.op == Op.ERROR and hello.meta.get("kind") == BUSY:
                raise ServerBusyError(f"{self.peer} turned the connection away: {hello.meta.get('error')}")
            if hello.op != Op.HELLO:
                raise AuthError(f"{self.peer} did not greet with HELLO (op {hello.op}); is it a psflow task?")
            server = str(hello.meta.get("task", ""))
            if expect is not None and server != expect:
                raise ClusterError(self._wrong_task(expect, server, task))
            nonce = str(hello.meta.get("nonce", ""))
            cnonce = os.urandom(16).hex()
            mac = _mac(secret, b"c", nonce.encode(), cnonce.encode(), task.encode())
            self._send_handshake(Op.AUTH, {"task": task, "cnonce": cnonce, "mac": mac})
            reply = self._recv_handshake(timeout_s)
        finally:
            self._deadline = None
        if reply.op == Op.ERROR:
            raise AuthError(f"{self.peer} refused this task: {reply.meta.get('error')}")
        expected = _mac(secret, b"s", cnonce.encode(), nonce.encode(), server.encode())
        if reply.op != Op.AUTH_OK or not hmac.compare_digest(str(reply.meta.get("mac", "")), expected):
            raise AuthError(
                f"{self.peer} does not hold this job's secret (its proof did not match). "
                "Check that every task was given the same secret."
            )

    def _wrong_task(self, expect: str, server: str, me: str) -> str:
        reached = server or "a server that does not name its task"
        where = f"Connected to {self.address} expecting {expect} but reached {reached}"
        if server == me:
            return (f"{where}, that is, this task itself: {expect}'s address in the cluster spec is this task's own "
                    "address. Give every task its own host:port.")
        return (f"{where}. Check the cluster spec: {expect}'s address is wrong there, or {reached} listens on the "
                f"address meant for {expect}.")

    @property
    def address(self) -> str:
        """The remote end of the socket as host:port (a Unix socket as unix:path)."""
        try:
            addr = self.sock.getpeername()
        except OSError:
            return "?"
        if isinstance(addr, tuple):
            return f"[{addr[0]}]:{addr[1]}" if ":" in addr[0] else f"{addr[0]}:{addr[1]}"
        return f"unix:{addr}"


def _open_socket(address: str, timeout_s: float) -> socket.socket:
    if address.startswith("unix:"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout_s)
        s.connect(address[5:])
        return s
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    return socket.create_connection((host, int(port)), timeout=timeout_s)


def connect(
    address: str,
    *,
    secret: bytes,
    task: str,
    peer: str | None = None,
    deadline_s: float = 60.0,
    handshake_timeout_s: float = 10.0,
    limits: Limits = Limits(),
    resolve: Resolve | None = None,
    refused_is_gone: bool = False,
    should_stop: Callable[[], str | None] | None = None,
) -> Connection:
    """Connect to a psflow server, retrying with backoff until ``deadline_s``, and authenticate.

    Args:
        address: "host:port" or "unix:/path".
        secret: the job's secret (b"" for an unauthenticated loopback job).
        task: this task's id, e.g. "worker:0".
        peer: the remote task's id, e.g. "ps:0": the server must name itself so in its HELLO.
            None accepts any server (messages then name the address).
        deadline_s: how long to keep retrying a refused, unreachable or busy address.
        handshake_timeout_s: the longest the whole handshake may take, per attempt.
        resolve: asked for ``peer``'s current address before each retry (needs ``peer``): the peer
            may have restarted elsewhere. Then a server that is another task than ``peer`` (a stale
            address, taken over) is retried too. An error of ``resolve`` keeps the last address.
        refused_is_gone: a refused connection is not retried (once re-resolved, if ``resolve`` gives
            another address, that one is tried at once): PeerGoneError. For a failover, where the
            peer's copy elsewhere serves as soon as this one is known dead; a task's first connection
            (its peer may not listen yet) keeps retrying.
        should_stop: the task's stop reason (SIGTERM), or None: a stop ends the retries within ~50 ms once
            one attempt was made (handshakes of 1 s at most then), and the connection's waits (watch_stop).

    Raises:
        ConnectStopped: ``should_stop`` named a reason and the last attempt failed.
        TransportError: the address stayed unreachable (or busy) until the deadline.
        PeerGoneError: with ``refused_is_gone``, the address refused the connection.
        ClusterError: the server is another task than ``peer`` (not retried without ``resolve``).
        AuthError: either side failed to prove the job's secret (not retried).
    """
    if resolve is not None and peer is None:
        raise ValueError("connect(resolve=...) needs peer: the name of the task to resolve.")
    name = peer or address
    t_end = time.monotonic() + deadline_s
    delay, last = 0.02, None
    while True:
        # A task that is stopping has a grace to end in: an attempt must not outlast it.
        handshake_s = handshake_timeout_s if should_stop is None or not should_stop() else min(handshake_timeout_s, 1.0)
        try:
            conn = _attempt(address, name, secret, task, peer, handshake_s, limits,
                            min(handshake_s, max(0.05, t_end - time.monotonic())))
            conn.set_timeout(None)
            conn.watch_stop(should_stop)
            return conn
        except (OSError, ServerBusyError) as e:  # refused, unreachable, or flooded with handshakes: wait and retry
            last = e
            if refused_is_gone and isinstance(e, ConnectionRefusedError):
                moved = _resolved(resolve, peer, address) if resolve is not None and peer is not None else address
                if moved != address and time.monotonic() < t_end:
                    address = moved  # it restarted elsewhere: try there at once
                    continue
                raise PeerGoneError(f"Nothing listens at {name}'s address {address} (connection refused): "
                                    "its process is gone.") from e
        except ClusterError as e:
            if resolve is None or isinstance(e, TransportError):
                raise
            last = e  # another task answers at the old address: the peer moved, ask where to
        if time.monotonic() + delay > t_end:
            _backoff(0.0, name, address, last, should_stop)  # a stop request is the reason to name, not the deadline
            where = " (the address the launcher's coordinator gave last)" if resolve is not None else ""
            raise TransportError(
                f"Cannot reach {name} at {address}{where} after {deadline_s:.1f} s (last error: {last}). "
                "Is that task running and is the address right? Raise the wait with connect_timeout_s "
                "(PSFLOW_CONNECT_TIMEOUT_S)."
            ) from last
        _backoff(delay, name, address, last, should_stop)
        delay = min(delay * 2, 1.0)
        if resolve is not None:
            assert peer is not None
            address = _resolved(resolve, peer, address)


def _backoff(delay_s: float, name: str, address: str, last: BaseException | None,
             should_stop: Callable[[], str | None] | None) -> None:
    """Wait ``delay_s`` between connection attempts (not a synchronisation), in slices that look at
    ``should_stop``: a stop request (set by a signal handler: a flag, no lock) ends the wait."""
    end = time.monotonic() + delay_s
    while True:
        reason = should_stop() if should_stop is not None else None
        if reason:
            raise ConnectStopped(f"Stopped ({reason}) while reconnecting to {name} at {address}: it was still "
                                 f"unreachable (last error: {last}).") from last
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.05))


def _resolved(resolve: Resolve, peer: str, address: str) -> str:
    """``peer``'s current address, or ``address`` if it cannot be resolved now (the retry goes on)."""
    try:
        return resolve(peer) or address
    except (PsflowError, OSError):
        return address


def _attempt(
    address: str, name: str, secret: bytes, task: str, peer: str | None, handshake_timeout_s: float, limits: Limits,
    open_timeout_s: float,
) -> Connection:
    """One connection attempt and its handshake. Raises OSError or ServerBusyError when worth retrying."""
    conn = Connection(_open_socket(address, open_timeout_s), peer=name, limits=limits)
    try:
        conn.client_handshake(secret, task, handshake_timeout_s, expect=peer)
    except FrameError as e:
        conn.close()
        raise TransportError(f"{name} at {address} does not speak the psflow protocol: {e}") from e
    except BaseException:
        conn.close()
        raise
    return conn
