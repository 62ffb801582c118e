"""The task's endpoint (TensorFlow's ``tf.train.Server``): binds, authenticates, routes requests.

One Server per task. It accepts connections on a background thread and serves each connection on
its own thread, so a slow or blocked request (a sync step waiting for gradients) never stalls the
others. Services (the parameter store, the launcher's coordinator) register one handler per op.

Invariants:
- nothing is served before the peer proves the job's secret (``Connection.server_handshake``);
- an unauthenticated peer costs little and not for long: its handshake frames are small and carry no
  tensors, the whole handshake has one deadline (``handshake_timeout_s``), and at most
  ``max_handshaking`` connections are in their handshake at once; a connection past that cap is
  answered ERROR {"kind": "busy"} and closed at once, without a thread (clients retry it);
- a malformed, oversized or unauthenticated frame closes only that connection, with an ERROR frame
  saying why when the stream still allows it; so does a request whose tensors its route does not
  admit (``register(admit=...)``), refused before their bytes are received or allocated for; an
  unknown op or a failing handler gets an ERROR reply and the connection stays usable;
- ``stop()`` closes the listener and every connection; handler threads are daemons.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from psflow import timeline
from psflow.errors import AuthError, ConfigError, PsflowError, TransportError
from psflow.wire.conn import BUSY, Connection
from psflow.wire.frame import FrameError, Limits, TensorSpec, encode_head
from psflow.wire.ops import Op

if TYPE_CHECKING:
    import torch

log = logging.getLogger("psflow.server")
_DRAIN_S = 1.0  # how long a refused frame's peer may go on sending before its connection is reset


@dataclass
class Request:
    peer: str
    op: int
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]


@dataclass
class Reply:
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)


Handler = Callable[[Request], Reply]


# Checks a request's tensors (its sender, meta and tensor list) before their bytes are received:
# raises FrameError to refuse the request and close its connection.
Admit = Callable[[str, dict[str, Any], list[TensorSpec]], None]


@dataclass
class _Route:
    handler: Handler
    reuse_buffers: bool
    frame: bytes | None = None  # a constant reply, encoded once (register_constant): sent as it is
    admit: Admit | None = None


class Server:
    """Serve registered handlers on ``host:port`` (port 0 picks a free port; see ``address``).

    Args:
        task: this task's id; the server names itself so in the handshake, so clients know whom they reached.
        secret: the job's secret (b"": none, only for tasks that listen on loopback).
        limits: bounds on what a peer may send.
        handshake_timeout_s: the longest a connection may take to prove the secret, in total.
        max_handshaking: how many connections may be in their handshake at once.

    Example:
        >>> srv = Server("ps:0", secret=b"s3cret")
        >>> srv.register(Op.PING, lambda req: Reply({"pong": True}))
        >>> addr = srv.start()   # "127.0.0.1:54321"
        >>> srv.stop()
    """

    def __init__(
        self,
        task: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes = b"",
        limits: Limits = Limits(),
        handshake_timeout_s: float = 10.0,
        max_handshaking: int = 64,
    ) -> None:
        if not handshake_timeout_s > 0:
            raise ConfigError(f"handshake_timeout_s must be a positive number of seconds; received {handshake_timeout_s!r}.")
        if isinstance(max_handshaking, bool) or not isinstance(max_handshaking, int) or max_handshaking < 1:
            raise ConfigError(f"max_handshaking must be a positive integer; received {max_handshaking!r}.")
        self.task = task
        self.host, self.port = host, port
        self.secret = secret
        self.limits = limits
        self.handshake_timeout_s = handshake_timeout_s
        self.max_handshaking = max_handshaking
        self.turned_away = 0  # connections closed at once because max_handshaking were in their handshake
        self._handshaking = 0
        self.routes: dict[int, _Route] = {}
        self.refused = 0  # connections or frames refused (auth, malformed, unknown op)
        self._lsock: socket.socket | None = None
        self._conns: set[Connection] = set()
        self._peer_conns: dict[str, int] = {}  # authenticated task id -> its open connections
        # Called (from a connection thread) with a task id when its last connection closes.
        self.on_peer_gone: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        # expect_routes(): the services' routes come after start(); a request for one waits for them.
        self._routes_pending: threading.Event | None = None
        self._routes_wait_s = 0.0
        self.register_constant(Op.PING, {"task": self.task})
        self.register(Op.CLOCK, lambda req: Reply({"now_us": timeline.clock_us()}))

    def expect_routes(self, timeout_s: float) -> None:
        """Before :meth:`start`: this server's services register their routes after it listens (a
        launched ps learns the cluster, which its service needs, only once its address is
        registered). Until :meth:`routes_ready`, a request for an op not registered yet waits for
        them (at most ``timeout_s``) instead of being refused as unknown: a peer that is quick to
        ask is not failed by a service still being made."""
        self._routes_pending = threading.Event()
        self._routes_wait_s = timeout_s

    def routes_ready(self) -> None:
        """Every service has registered its routes (see :meth:`expect_routes`)."""
        if self._routes_pending is not None:
            self._routes_pending.set()

    def register(self, op: int, handler: Handler, *, reuse_buffers: bool = False, admit: Admit | None = None) -> None:
        """Route ``op`` to ``handler``. With ``reuse_buffers`` the received tensors are reused
        between requests of one connection, so the handler must not keep references to them.
        ``admit(peer, meta, specs)`` sees a request that carries tensors before their bytes are
        received (or memory allocated for them), and refuses it by raising FrameError: the request
        is answered ERROR and its connection closed, as a malformed frame's."""
        self.routes[int(op)] = _Route(handler, reuse_buffers, admit=admit)

    def register_constant(self, op: int, meta: dict[str, Any]) -> None:
        """Answer ``op`` with the same OK reply every time, encoded once: no handler, no meta to encode
        on the request path (PING, the small round trip clients and benchmarks measure)."""
        reply = Reply(dict(meta))
        self.routes[int(op)] = _Route(lambda req: reply, False, encode_head(int(Op.OK), reply.meta, 0))

    @property
    def address(self) -> str:
        if self._lsock is None:
            raise PsflowError(f"Server of {self.task} is not started; call start() first.")
        host, port = self._lsock.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def num_connections(self) -> int:
        """Connections open now (authenticated or still in the handshake)."""
        with self._lock:
            return len(self._conns)

    def start(self) -> str:
        """Bind and start accepting. Returns the bound address. Raises ConfigError on a busy port."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        lsock = socket.socket(family, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            lsock.bind((self.host, self.port))
        except OSError as e:
            lsock.close()
            raise ConfigError(
                f"Task {self.task} cannot listen on {self.host}:{self.port}: {e.strerror}. "
                "Another process holds that port, or the host is not this machine's address. "
                "Pick a free port in the cluster spec, or stop the process that uses it."
            ) from e
        lsock.listen(128)
        self._lsock = lsock
        threading.Thread(target=self._accept_loop, name=f"{self.task}-accept", daemon=True).start()
        return self.address

    def stop(self) -> None:
        self._stopped.set()
        if self._lsock is not None:
            try:
                self._lsock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._lsock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept_loop(self) -> None:
        assert self._lsock is not None
        while not self._stopped.is_set():
            try:
                sock, addr = self._lsock.accept()
            except OSError:
                return
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            with self._lock:
                admit = self._handshaking < self.max_handshaking
                self._handshaking += admit
            if not admit:
                self._turn_away(sock, peer)
                continue
            try:
                conn = Connection(sock, peer=peer, limits=self.limits)
            except OSError:  # the peer is already gone
                sock.close()
                self._handshake_done()
                continue
            threading.Thread(target=self._serve, args=(conn,), name=f"{self.task}-conn", daemon=True).start()

    def _turn_away(self, sock: socket.socket, peer: str) -> None:
        """Close a connection past the handshake cap at once, saying why if the socket takes it now."""
        self.turned_away += 1
        n = self.turned_away
        if n & (n - 1) == 0:  # 1, 2, 4, 8...: a flood must not flood the log too
            log.warning("%s turned away %s (%d so far): %d connections are in their handshake (max_handshaking)",
                        self.task, peer, n, self.max_handshaking)
        message = (f"{self.task} has {self.max_handshaking} connections in their handshake already "
                   "(max_handshaking); try again shortly.")
        try:
            sock.setblocking(False)  # never wait on a peer that was not admitted
            sock.send(encode_head(int(Op.ERROR), {"error": message, "kind": BUSY}, 0))
        except OSError:
            pass
        sock.close()

    def _handshake_done(self) -> None:
        with self._lock:
            self._handshaking -= 1

    def _refuse(self, conn: Connection, message: str, kind: str = "refused") -> None:
        self.refused += 1
        log.warning("%s refused %s: %s", self.task, conn.peer, message)
        try:
            conn.set_timeout(1.0)
            conn.send(Op.ERROR, {"error": message, "kind": kind})
        except (TransportError, OSError):
            pass

    def _serve(self, conn: Connection) -> None:
        with self._lock:
            self._conns.add(conn)
        try:
            try:
                conn.server_handshake(self.secret, self.handshake_timeout_s, task=self.task)
            except (AuthError, FrameError) as e:
                self._refuse(conn, str(e))
                return
            except (TransportError, OSError):  # the deadline passed, the peer left, or stop() closed the socket
                return
            finally:
                self._handshake_done()
            with self._lock:
                self._peer_conns[conn.peer] = self._peer_conns.get(conn.peer, 0) + 1
            try:
                cache: dict[str, torch.Tensor] = {}

                def alloc(spec: TensorSpec) -> torch.Tensor:
                    return _cached(cache, spec)

                def admit(op: int, meta: dict[str, Any], specs: list[TensorSpec]) -> None:
                    route = self.routes.get(op)
                    if route is not None and route.admit is not None:
                        route.admit(conn.peer, meta, specs)

                while not self._stopped.is_set():
                    if not self._serve_one(conn, cache, alloc, admit):
                        return
            except OSError:  # stop() closed the socket under a request (settimeout on a closed fd)
                return
            finally:
                with self._lock:
                    self._peer_conns[conn.peer] -= 1
                    gone = self._peer_conns[conn.peer] == 0
                    if gone:
                        del self._peer_conns[conn.peer]
                if gone and self.on_peer_gone is not None:
                    self.on_peer_gone(conn.peer)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _serve_one(self, conn: Connection, cache: dict[str, torch.Tensor],
                   alloc: Callable[[TensorSpec], torch.Tensor],
                   admit: Callable[[int, dict[str, Any], list[TensorSpec]], None]) -> bool:
        """Serve one request. Returns False when the connection should close."""
        tl = timeline.ACTIVE  # psflow run --timeline: receive and send spans (off: this branch only)
        try:
            frame = conn.recv(alloc=alloc, admit=admit)
            if tl is not None:
                tl.add("receive", f"receive {_op_name(frame.op)}", conn.header_us, tl.now(), peer=conn.peer)
        except FrameError as e:
            self._refuse(conn, str(e), e.kind)
            conn.drain_and_close(_DRAIN_S)  # the peer may still be sending the payload: let it read why
            return False
        except TransportError:
            return False
        route = self.routes.get(frame.op)
        if route is None and self._routes_pending is not None and not self._routes_pending.is_set():
            self._routes_pending.wait(self._routes_wait_s)  # its service is still being made (expect_routes)
            route = self.routes.get(frame.op)
        if route is None:
            self._refuse(conn, f"Unknown op {frame.op}; this server ({self.task}) serves ops {sorted(self.routes)}.")
            # _refuse bounded its send with a timeout; the connection stays open, so an idle client
            # must not be dropped by it when the next recv waits.
            conn.set_timeout(None)
            return True
        if route.frame is not None and tl is None:  # a constant reply: its bytes as they are
            try:
                conn.set_timeout(None)
                conn.send_encoded(route.frame)
                return True
            except (TransportError, OSError):
                return False
        if frame.tensors and not route.reuse_buffers:
            cache.clear()  # the handler may keep what it received: never hand those buffers out again
        try:
            reply = route.handler(Request(conn.peer, frame.op, frame.meta, frame.tensors))
        except PsflowError as e:
            return self._send(conn, Op.ERROR, {"error": str(e), "kind": type(e).__name__})
        except Exception as e:  # a handler bug must not take the server down
            log.exception("%s: handler for op %s failed", self.task, frame.op)
            return self._send(conn, Op.ERROR, {"error": f"internal error in {self.task}: {e!r}", "kind": "internal"})
        if tl is None:
            return self._send(conn, Op.OK, reply.meta, reply.tensors)
        start = tl.now()
        sent = self._send(conn, Op.OK, reply.meta, reply.tensors)
        tl.add("send", f"send {_op_name(frame.op)}", start, tl.now(), peer=conn.peer)
        return sent

    @staticmethod
    def _send(conn: Connection, op: int, meta: dict[str, Any], tensors: list[tuple[str, torch.Tensor]] = ()) -> bool:
        try:
            conn.set_timeout(None)
            conn.send(op, meta, tensors)
            return True
        except (TransportError, OSError):
            return False


def _op_name(op: int) -> str:
    return Op(op).name if op in Op._value2member_map_ else f"op {op}"


def _cached(cache: dict[str, torch.Tensor], spec: TensorSpec) -> torch.Tensor:
    t = cache.get(spec.name)
    if t is None or t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
        import torch  # already loaded: the spec's dtype is torch's

        t = torch.empty(spec.shape, dtype=spec.dtype)
        cache[spec.name] = t
    return t
