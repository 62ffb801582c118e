"""The worker side of the parameter servers: one authenticated connection per ps shard.

Requests to several shards are pipelined: sent to every shard first, then the replies are read,
so shards work in parallel without a thread per shard. Pulled values are received straight into
the destination tensors (the model's own parameters); pushed gradients are sent straight from
their storage.

Shards that move: given ``resolve(task) -> address`` (a task started by the launcher; see
``wire/resolve.py``), a connection to a shard that is lost is closed and forgotten, after every
other shard's reply of that exchange has been read (so that no connection is left out of step); the
next request to that shard reconnects wherever the shard listens now. A request that is safe to
repeat (``_REPEATABLE``: reads, waits, PS_DONE) is sent again at once on the fresh connection. A
push is resent only when it carries a sequence number (``seq``): the ps then recognises a push it
has already decided and does not apply it again (see :mod:`psflow.ps.rules`, DUPLICATE); a push
without one raises the loss to the caller (its gradient may have been applied). Without
``resolve`` (cluster from flags or TF_CONFIG) a lost connection raises, as it always did.

Pushes in flight: a shard's pushes not answered yet are kept in order (the async pipeline has two
per connection: one thread sends the next while another reads the reply to the last). The ps
serves a connection's requests one after the other, so their replies come in that order. A
connection made again, by whichever thread finds it lost, first carries every push still
unanswered, oldest first, each once (the ps answers those it had as DUPLICATEs); both happen
under the shard's lock, which a send holds too. A thread that finds a connection lost shuts it
down (the other thread's blocked send or receive returns) and only then closes it under the lock,
so a socket is never closed while another thread uses it.

The whole design note: ``docs/design/ps-client.md``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from psflow import timeline
from psflow.cluster import ClusterSpec, TaskId
from psflow.errors import PsflowError, RemoteError, TransportError
from psflow.ps.replication import pair_other
from psflow.wire.compress import NONE, Compression, GradientEncoder
from psflow.wire.conn import Connection, ConnectStopped, Frame, PeerLostError, Resolve, connect
from psflow.wire.frame import Limits
from psflow.wire.ops import Op

log = logging.getLogger("psflow")

# Requests a shard may receive twice without harm: sent again after a lost connection (with a resolver).
_REPEATABLE = frozenset({Op.PS_PULL, Op.PS_STATUS, Op.PS_READY, Op.PS_CLOCK, Op.PS_DONE})
_NOT_SERVING = "NotServingError"  # the ERROR kind of a ps that does not serve the shard now (retry at the other)


@dataclass
class _Unanswered:
    """A push sent and not answered yet: what resends it on a fresh connection (``resendable``:
    it carries a ``seq`` the ps deduplicates, and the client reconnects)."""

    meta: dict[str, Any]
    grads: Sequence[tuple[str, torch.Tensor]]
    resendable: bool
    sent_on: Connection | None = None  # the connection it was last sent on


class PsClient:
    """Connections from one task to every ps shard of the cluster.

    Args:
        connect_timeout_s: the longest wait for each shard to accept the connection and handshake.
        request_timeout_s: the longest wait for a reply, beyond the server-side wait a request asks for.
        reply_margin_s: added to a socket's timeout beyond the server-side wait, so that the server's
            clearer error (it names what it waited for) arrives before the socket gives up.
        resolve: where a ps shard listens now (the launcher's address book); None: the cluster's
            addresses never change and a lost connection is an error.
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        task: TaskId,
        secret: bytes,
        *,
        connect_timeout_s: float = 60.0,
        request_timeout_s: float = 120.0,
        reply_margin_s: float = 15.0,
        limits: Limits = Limits(),
        resolve: Resolve | None = None,
        replicas: int = 1,
        failover_s: float = 2.0,
        compression: Compression = NONE,
        compress_pull: bool = False,
    ) -> None:
        self.task = task
        # Pushes' gradients are encoded here (top-k keeps its residuals per key); pulls ask for
        # values in the gradients' precision with compress_pull (psflow.wire.compress).
        self.encoder = GradientEncoder(compression)
        self.pull_dtype = compression.pull_dtype() if compress_pull else None
        self._retired_bytes = [0, 0]  # sent, received over connections closed since
        self.waiting_for = "ps reply"  # what a push's reply waits for, as the timeline names it (sync: the quorum)
        self._awaited: dict[int, int] = {}  # thread -> the shard it is blocked on now (see ``awaiting``)
        self.replicas = replicas  # 2: each shard has a backup on the next ps (failover)
        self.failover_s = failover_s  # replicas=2: how long a lost primary may not answer before its backup serves
        self.routes: dict[int, int] = {}  # shard -> the ps serving it in place of its dead primary
        self.terms: dict[int, int] = {}  # replicas=2: shard -> the newest term a reply showed (sent on: a fence)
        self.num_shards = cluster.num_tasks("ps")
        self.request_timeout_s = request_timeout_s
        self.reply_margin_s = reply_margin_s
        self.connect_timeout_s = connect_timeout_s
        self.addresses = [cluster.address(TaskId("ps", i)) for i in range(self.num_shards)]
        self._secret, self._limits, self._resolve = secret, limits, resolve
        self._cluster = cluster
        # Why this task is stopping (SIGTERM), set by its Supervisor's signal handler: a plain attribute,
        # read by each reconnect's backoff, which then gives up at once (ConnectStopped) instead of
        # retrying for connect_timeout_s past the launcher's grace.
        self.stop_reason: str | None = None
        # Shards a stop request already ended a wait for (a reply, a reconnect): shard -> that error. The
        # task is stopping and the ps did not answer: no later request waits for it again (each would
        # cost a handshake's timeout), so what the task still does without it is done within its grace.
        self._given_up: dict[int, ConnectStopped] = {}
        # Pushes sent and not answered yet, oldest first (a pipelined worker has up to two per shard
        # in flight): shard -> its pushes, resent in order on a fresh connection if the connection
        # drops before their replies (those that carry ``seq``, which the ps deduplicates).
        self._unanswered: dict[int, deque[_Unanswered]] = {}
        # A shard's connection is made again, and its pushes sent, under the shard's lock: a push may
        # be sent on one thread while the reply to the push before is read on another, and the one
        # that makes the connection again resends every push still unanswered, exactly once there.
        self._locks = [threading.RLock() for _ in range(self.num_shards)]
        self.conns: list[Connection | None] = []
        try:
            for i in range(self.num_shards):
                self.conns.append(self._connect(i, self.addresses[i]))
        except BaseException:
            self.close()
            raise

    # -- connections -----------------------------------------------------------------------
    @property
    def awaiting(self) -> str | None:
        """The ps the caller is blocked on now (``"ps:1"``: the ps serving that shard), None between
        requests. Read by the task's heartbeat thread (:meth:`psflow.task.Task.heartbeat_payload`)."""
        shard = next(iter(self._awaited.values()), None)
        return None if shard is None else f"ps:{self.routes.get(shard, shard)}"

    @contextlib.contextmanager
    def _awaiting(self, shard: int) -> Iterator[None]:
        me = threading.get_ident()
        previous = self._awaited.get(me)
        self._awaited[me] = shard
        try:
            yield
        finally:
            if previous is None:
                self._awaited.pop(me, None)
            else:
                self._awaited[me] = previous

    def traffic(self) -> tuple[int, int]:
        """Bytes sent and received to and from the ps over this client's life (frames, handshakes)."""
        live = [c for c in self.conns if c is not None]
        return (self._retired_bytes[0] + sum(c.bytes_sent for c in live),
                self._retired_bytes[1] + sum(c.bytes_received for c in live))

    def _retire(self, conn: Connection) -> None:
        self._retired_bytes[0] += conn.bytes_sent
        self._retired_bytes[1] += conn.bytes_received
        conn.close()

    @property
    def reconnects(self) -> bool:
        """Whether a lost connection is forgotten and made again (a resolver was given): after a
        failed exchange the other connections are still in step and the client stays usable."""
        return self._resolve is not None or self.replicas == 2

    def _connect(self, shard: int, address: str) -> Connection:
        return self._watched(connect(address, secret=self._secret, task=str(self.task), peer=f"ps:{shard}",
                                     deadline_s=self.connect_timeout_s, limits=self._limits, resolve=self._resolve,
                                     should_stop=self._stopping))

    def _watched(self, conn: Connection) -> Connection:
        """``conn``, whose waits end at a stop request once its ps is silent and answers no new connection."""
        conn.watch_stop(self._stopping, alive=lambda a=conn.address, p=conn.peer: self._answers(a, p))
        return conn

    def _answers(self, address: str, peer: str) -> bool:
        """Whether the ps at ``address`` completes a new connection's handshake within 1 s: one that
        holds a reply back (a sync step waiting for a worker) does, a frozen one does not."""
        try:
            connect(address, secret=self._secret, task=str(self.task), peer=peer, deadline_s=1.0,
                    handshake_timeout_s=1.0, limits=self._limits).close()
        except PsflowError:
            return False
        return True

    def _stopping(self) -> str | None:
        return self.stop_reason

    def _conn(self, shard: int) -> Connection:
        """The shard's connection; reconnected (where the shard listens now) if it was lost."""
        conn = self.conns[shard]
        if conn is None and self.replicas == 2:
            conn = self.conns[shard] = self._connect_serving(shard)
        if conn is None:
            assert self._resolve is not None  # only a client with a resolver forgets connections
            if shard in self._given_up:
                raise ConnectStopped(f"Not waiting for ps:{shard} again: {self._given_up[shard]}")
            address = self.addresses[shard]
            try:
                address = self._resolve(f"ps:{shard}")
            except PsflowError as e:
                log.warning("%s: cannot ask where ps:%d listens now (%s); trying its last address %s.",
                            self.task, shard, e, address)
            log.warning("%s: reconnecting to ps:%d at %s (retrying for up to %g s; a stop request ends it).",
                        self.task, shard, address, self.connect_timeout_s)
            try:
                conn = self._connect(shard, address)
            except ConnectStopped as e:
                self._given_up[shard] = e
                raise
            self.conns[shard] = conn
            self.addresses[shard] = conn.address
            log.warning("%s: reconnected to ps:%d at %s.", self.task, shard, conn.address)
        return conn

    def _where(self, ps: int) -> str:
        address = self._cluster.address(TaskId("ps", ps))
        if self._resolve is not None:
            try:
                return self._resolve(f"ps:{ps}")
            except PsflowError as e:
                log.warning("%s: cannot ask where ps:%d listens now (%s); trying %s.", self.task, ps, e, address)
        return address

    def _connect_serving(self, shard: int) -> Connection:
        """replicas=2: a connection to the ps that serves ``shard`` now: the one it is routed to (at
        first its primary) if it answers within ``failover_s``, else the other ps of the shard's pair
        (whose copy takes over; later requests go there)."""
        serving = self.routes.get(shard, shard)
        try:
            # A refused connection (nothing listens: the ps died) fails over at once, not after failover_s.
            return self._watched(connect(
                self._where(serving), secret=self._secret, task=str(self.task), peer=f"ps:{serving}",
                deadline_s=self.failover_s, limits=self._limits, resolve=self._resolve, refused_is_gone=True,
                should_stop=self._stopping))
        except TransportError as e:
            other = self._reroute(shard)
            log.warning("%s: ps:%d did not answer within %g s (%s); ps:%d serves shard %d now.",
                        self.task, serving, self.failover_s, e, other, shard)
        return self._watched(connect(self._where(other), secret=self._secret, task=str(self.task), peer=f"ps:{other}",
                                     deadline_s=self.connect_timeout_s, limits=self._limits, resolve=self._resolve,
                                     should_stop=self._stopping))

    def _reroute(self, shard: int) -> int:
        """Route ``shard`` to the other ps of its pair; returns it. Its connection is made again there."""
        other = pair_other(shard, self.routes.get(shard, shard), self.num_shards)
        conn = self.conns[shard] if shard < len(self.conns) else None
        if conn is not None:
            conn.shutdown()  # a send blocked on it (another thread, holding the lock) returns now
        with self._locks[shard]:
            self.routes[shard] = other
            if conn is not None and self.conns[shard] is conn:
                self._retire(conn)
                self.conns[shard] = None
        return other

    def _refused(self, frame: Frame) -> bool:
        """Whether ``frame`` says its ps does not serve the shard now (retryable at the other ps)."""
        return self.replicas == 2 and frame.op == Op.ERROR and frame.meta.get("kind") == _NOT_SERVING

    def _routed(self, shard: int, meta: dict[str, Any]) -> dict[str, Any]:
        """A request's meta, naming the shard where its backup serves it, and the newest term of the
        shard's view a reply showed (a copy that knows an older one asks the launcher before serving)."""
        if shard in self.terms:
            meta = {**meta, "term": self.terms[shard]}
        return {**meta, "shard": shard} if shard in self.routes else meta

    def _saw(self, shard: int, frame_meta: Mapping[str, Any]) -> None:
        term = frame_meta.get("term")
        if isinstance(term, int) and term > self.terms.get(shard, 0):
            self.terms[shard] = term

    def _lost(self, shard: int, error: TransportError, conn: Connection | None = None) -> None:
        """Forget the shard's connection (``conn``, by default the one it has now: it is out of step
        or dead): the next request reconnects."""
        conn = conn if conn is not None else self.conns[shard]
        if conn is None:
            return
        conn.shutdown()  # a send blocked on it (another thread, holding the lock) returns now
        with self._locks[shard]:
            if self.conns[shard] is conn:
                self._retire(conn)
                self.conns[shard] = None
                log.warning("%s: lost its connection for shard %d (%s); the next request reconnects.",
                            self.task, shard, error)

    def _all(
        self,
        op: Op,
        metas: Sequence[dict[str, Any]],
        tensors: Sequence[Sequence[tuple[str, torch.Tensor]]] | None = None,
        dests: Sequence[Mapping[str, torch.Tensor]] | None = None,
        wait_s: float = 0.0,
        shards: Sequence[int] | None = None,
    ) -> list[Frame]:
        shards = list(range(self.num_shards)) if shards is None else list(shards)
        try:
            frames = self._exchange(op, metas, tensors, dests, wait_s, shards)
        except PeerLostError:
            if not self.reconnects or op not in _REPEATABLE:
                raise
            # A shard went away before answering: ask again where it listens now (it may have restarted).
            frames = self._exchange(op, metas, tensors, dests, wait_s, shards)
        return self._resend_refused(op, metas, tensors, dests, wait_s, shards, frames)

    def _resend_refused(self, op: Op, metas: Sequence[dict[str, Any]],
                        tensors: Sequence[Sequence[tuple[str, torch.Tensor]]] | None,
                        dests: Sequence[Mapping[str, torch.Tensor]] | None, wait_s: float, shards: list[int],
                        frames: list[Frame]) -> list[Frame]:
        """Send each request a ps refused as not serving its shard to the other ps of the pair (the
        refusing ps decided nothing), until each is answered or ``connect_timeout_s`` has passed."""
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            refused = [j for j, f in enumerate(frames) if self._refused(f)]
            if not refused:
                break
            if time.monotonic() >= deadline:
                f = frames[refused[0]]
                raise RemoteError(f"ps:{self.routes.get(shards[refused[0]], shards[refused[0]])}: "
                                  f"{f.meta.get('error')} (still refused after {self.connect_timeout_s:g} s)")
            for j in refused:
                other = self._reroute(shards[j])
                log.warning("%s: refused: %s Sending it to ps:%d.", self.task, frames[j].meta.get("error"), other)
            again = self._exchange(op, [metas[j] for j in refused], [tensors[j] for j in refused] if tensors else None,
                                   [dests[j] for j in refused] if dests else None, wait_s, [shards[j] for j in refused])
            for j, f in zip(refused, again):
                frames[j] = f
            if any(self._refused(f) for f in again):
                time.sleep(0.1)  # both copies refuse (one re-syncing): give the re-sync a moment
        for f, i in zip(frames, shards):
            if f.op == Op.ERROR:
                raise RemoteError(f"ps:{i}: {f.meta.get('error', 'unknown error')}")
        return frames

    def _exchange(
        self,
        op: Op,
        metas: Sequence[dict[str, Any]],
        tensors: Sequence[Sequence[tuple[str, torch.Tensor]]] | None,
        dests: Sequence[Mapping[str, torch.Tensor]] | None,
        wait_s: float,
        shards: Sequence[int],
    ) -> list[Frame]:
        """One request to each of ``shards``, all sent before any reply is read."""
        timeout = self.request_timeout_s + wait_s + self.reply_margin_s
        conns: list[Connection] = []
        for i in shards:  # reconnect lost shards before anything is sent
            with self._awaiting(i):
                conns.append(self._conn(i))
        sent: list[int] = []
        lost: TransportError | None = None
        for j, i in enumerate(shards):
            try:
                conns[j].set_timeout(timeout)
                with self._awaiting(i):
                    conns[j].send(op, self._routed(i, metas[j]), tensors[j] if tensors else ())
                sent.append(j)
            except TransportError as e:
                lost = self._on_error(i, e, lost)
        frames: list[Frame] = []
        first_error: PsflowError | None = None
        for j in sent:
            i, dest = shards[j], dests[j] if dests else None
            try:
                with self._awaiting(i):
                    frame = conns[j].recv(alloc=(lambda spec, d=dest: d.get(spec.name)) if dest else None)
            except TransportError as e:
                lost = self._on_error(i, e, lost)
                continue
            if frame.op == Op.ERROR and first_error is None and not self._refused(frame):
                first_error = RemoteError(f"ps:{i}: {frame.meta.get('error', 'unknown error')}")
            if self.replicas == 2:
                self._saw(i, frame.meta)
            frames.append(frame)
        if lost is not None:
            raise lost
        if first_error is not None:
            raise first_error
        return frames

    def _on_error(self, shard: int, error: TransportError, first: TransportError | None) -> TransportError:
        """A shard's exchange failed. Without a resolver, raise at once (as always); with one,
        forget the connection and go on with the other shards. Returns the first error."""
        if isinstance(error, ConnectStopped):  # a stop request ended the wait: the connection is closed
            self._given_up.setdefault(shard, error)
        if not self.reconnects:
            raise error
        self._lost(shard, error)
        return first or error

    # -- the operations --------------------------------------------------------------------
    def initialize(self, per_shard: Sequence[Mapping[str, torch.Tensor]], meta: dict[str, Any]) -> list[bool]:
        frames = self._all(Op.PS_INIT, [meta] * self.num_shards, [list(v.items()) for v in per_shard])
        return [bool(f.meta.get("initialized")) for f in frames]

    def wait_ready(self, placement_digest: str, timeout_s: float, *, worker: int | None = None,
                   attempt: int = 0) -> dict[str, Any]:
        """Wait until every shard is initialized; returns shard 0's reply (version, settings, data
        positions; ssp: ``clock``, where this worker resumes). A training replica names itself
        (``worker``) and its ``attempt``: a restarted one takes over from its earlier attempt."""
        meta: dict[str, Any] = {"timeout_s": timeout_s, "placement_digest": placement_digest}
        if worker is not None:
            meta.update(worker=worker, attempt=attempt)
        frames = self._all(Op.PS_READY, [meta] * self.num_shards, wait_s=timeout_s)
        return frames[0].meta

    def pull(
        self,
        dests: Sequence[Mapping[str, torch.Tensor]],
        *,
        min_versions: Sequence[int] | None = None,
        wait_s: float = 0.0,
        averages: bool = False,
    ) -> list[int]:
        """Receive every shard's values into ``dests[shard][key]``. Returns each shard's version.

        ``min_versions[shard]`` makes the shard answer only once it reached that version (sync mode),
        waiting at most ``wait_s``."""
        mins = list(min_versions) if min_versions is not None else [0] * self.num_shards
        metas: list[dict[str, Any]] = [{"min_version": v, "timeout_s": wait_s, "averages": averages} for v in mins]
        if self.pull_dtype is not None and not averages:
            for m in metas:
                m["pull_dtype"] = self.pull_dtype
        frames = self._all(Op.PS_PULL, metas, dests=dests, wait_s=wait_s)
        _land(frames, dests)
        return [int(f.meta["version"]) for f in frames]

    def push(
        self, worker: int, versions: Sequence[int], per_shard: Sequence[Sequence[tuple[str, torch.Tensor]]]
    ) -> list[dict[str, Any]]:
        """Send one worker's gradients; ``versions[shard]`` is the version they were computed from."""
        metas = [self._compressed({"worker": worker, "version": v}) for v in versions]
        return [f.meta for f in self._all(Op.PS_PUSH, metas, [self.encoder.encode(g) for g in per_shard])]

    def _compressed(self, meta: dict[str, Any]) -> dict[str, Any]:
        """A push's meta naming how its gradients (and the values it asks back) are encoded."""
        if self.encoder.compression.enabled:
            meta["compress"] = self.encoder.compression.kind
        if self.pull_dtype is not None:
            meta["pull_dtype"] = self.pull_dtype
        return meta

    def push_pull(
        self,
        worker: int,
        versions: Sequence[int],
        per_shard: Sequence[Sequence[tuple[str, torch.Tensor]]],
        dests: Sequence[Mapping[str, torch.Tensor]],
        *,
        wait_s: float,
    ) -> list[dict[str, Any]]:
        """Push gradients and receive the values after the update, one round trip per shard.

        In sync mode each shard answers once the step this gradient belongs to is applied (at most
        ``wait_s``). Returns each shard's reply meta; ``version`` is the version of the values received."""
        for shard in range(self.num_shards):
            self.send_push(shard, worker, versions[shard], per_shard[shard], wait_s=wait_s)
        return self.recv_push_replies(range(self.num_shards), dests)

    def send_push(
        self, shard: int, worker: int, version: int, grads: Sequence[tuple[str, torch.Tensor]], *, wait_s: float,
        position: dict[str, Any] | None = None, attempt: int = 0, seq: int | None = None,
    ) -> None:
        """Send one shard's push-pull request without waiting for the reply (the trainer sends each
        shard's gradients as soon as backward has produced them). ``position``: the worker's data
        position after this batch, which the shard keeps for checkpoints. ``attempt`` and ``seq``
        (the push's number within the attempt) let the ps drop a push of an earlier attempt and
        recognise this one if it is resent: with ``seq`` and a resolver, a connection lost before
        the reply is made again and the push resent once (by :meth:`recv_push_replies`)."""
        meta: dict[str, Any] = self._compressed(
            {"worker": worker, "version": version, "pull": True, "timeout_s": wait_s, "attempt": attempt})
        if position is not None:
            meta["position"] = position
        grads = self.encoder.encode(grads)  # once: a resent push carries the same bytes (top-k's residuals moved on)
        if seq is not None:
            meta["seq"] = seq
        push = _Unanswered(meta, grads, resendable=seq is not None and self.reconnects)
        with self._locks[shard]:
            pending = self._unanswered.setdefault(shard, deque())
            pending.append(push)
            try:
                self._send_push_now(shard)
            except PeerLostError as e:
                if push.resendable:
                    return  # whoever reads its reply finds the connection lost, makes it again and resends
                pending.remove(push)
                self._on_error(shard, e, None)
                raise  # the caller learns of the loss now
            except BaseException:
                if push in pending:  # not sent, and its reply is not read: not resent either
                    pending.remove(push)
                raise

    def _send_push_now(self, shard: int) -> Connection:
        """Send the shard's unanswered pushes that its connection has not carried yet, oldest first
        (the shard's lock held): the newest one, or on a connection made again every one of them, so
        that each push is sent once per connection and in order. Returns the connection."""
        pending = self._unanswered.get(shard, ())
        with self._awaiting(shard):
            conn = self._conn(shard)
            todo = [p for p in pending if p.sent_on is not conn]
            again = [p for p in todo if p.sent_on is not None]
            if again:
                if not all(p.resendable for p in again):
                    raise PeerLostError(f"ps:{shard}: the connection was lost before the reply to a push that "
                                        "cannot be resent (it carries no seq).")
                log.warning("%s: resending push %s to ps:%d on a fresh connection (the ps drops what it had).",
                            self.task, ", ".join(str(p.meta.get("seq")) for p in again), self.routes.get(shard, shard))
            try:
                for p in todo:
                    conn.set_timeout(self.request_timeout_s + float(p.meta["timeout_s"]) + self.reply_margin_s)
                    conn.send(Op.PS_PUSH, self._routed(shard, p.meta), p.grads)
                    p.sent_on = conn
            except TransportError as e:
                if not isinstance(e, PeerLostError):
                    self._on_error(shard, e, None)
                else:
                    conn.shutdown()  # the reader of its replies finds it lost
                raise
        return conn

    def recv_push_replies(self, shards: Iterable[int], dests: Sequence[Mapping[str, torch.Tensor]]) -> list[dict[str, Any]]:
        """Receive the replies of requests sent with :meth:`send_push`, values straight into ``dests``.
        With the timeline on, each shard's wait until its reply's first byte (named ``waiting_for``) and
        the reply's transfer are spans of their own."""
        metas, first_error = [], None
        lost: TransportError | None = None
        tl = timeline.ACTIVE
        for shard in shards:
            dest = dests[shard]
            pending = self._unanswered.get(shard)
            unanswered = pending[0] if pending else None
            start = tl.now() if tl is not None else 0.0
            try:
                with self._awaiting(shard):
                    frame = self._recv_push_reply(shard, dest, unanswered)
            except TransportError as e:
                self._answered(shard, unanswered)
                lost = self._on_error(shard, e, lost)
                continue
            self._answered(shard, unanswered)
            if tl is not None:
                conn = self.conns[shard]
                arrived = max(start, conn.header_us) if conn is not None else start
                tl.add("wait", f"wait ps:{shard} ({self.waiting_for})", start, arrived)
                tl.add("pull", f"pull ps:{shard}", arrived, tl.now())
            if frame.op == Op.ERROR and first_error is None:
                first_error = RemoteError(f"ps:{shard}: {frame.meta.get('error', 'unknown error')}")
            _land([frame], [dest])
            if self.replicas == 2:
                self._saw(shard, frame.meta)
            metas.append(frame.meta)
        if lost is not None:
            raise lost
        if first_error is not None:
            raise first_error
        return metas

    def _answered(self, shard: int, push: _Unanswered | None) -> None:
        """``push`` (the shard's oldest unanswered) got its reply, or its loss was raised."""
        if push is None:
            return
        with self._locks[shard]:
            pending = self._unanswered.get(shard)
            if pending and pending[0] is push:
                pending.popleft()

    def _recv_push_reply(self, shard: int, dest: Mapping[str, torch.Tensor], unanswered: _Unanswered | None) -> Frame:
        """The reply to the shard's oldest unanswered push (``unanswered``); a push the ps
        deduplicates is resent on a fresh connection if the connection was lost before the reply
        (with the pushes sent after it), and to the other ps of the shard's pair while a ps refuses
        it as not serving the shard."""
        frame = self._recv_push_reply_once(shard, dest, unanswered)
        deadline = time.monotonic() + self.connect_timeout_s
        while unanswered is not None and unanswered.resendable and self._refused(frame) and time.monotonic() < deadline:
            other = self._reroute(shard)
            log.warning("%s: refused: %s Resending push %s to ps:%d.", self.task, frame.meta.get("error"),
                        unanswered.meta.get("seq"), other)
            with self._locks[shard]:
                conn = self._send_push_now(shard)
            frame = self._recv_on(conn, dest)
            if self._refused(frame):
                time.sleep(0.1)  # both copies refuse (one re-syncing): give the re-sync a moment
        return frame

    def _recv_push_reply_once(self, shard: int, dest: Mapping[str, torch.Tensor], unanswered: _Unanswered | None) -> Frame:
        conn = self.conns[shard]
        try:
            if conn is None:  # lost while sending (with a resolver): there is no reply to read
                raise PeerLostError(f"ps:{shard}: the connection was lost before its reply.")
            return self._recv_on(conn, dest)
        except PeerLostError as e:
            if unanswered is None or not unanswered.resendable:
                raise
            if conn is not None:
                self._lost(shard, e, conn)
            with self._locks[shard]:  # made again (here, or by a send since), carrying this push and those after it
                conn = self._send_push_now(shard)
            return self._recv_on(conn, dest)

    @staticmethod
    def _recv_on(conn: Connection, dest: Mapping[str, torch.Tensor]) -> Frame:
        return conn.recv(alloc=lambda spec: dest.get(spec.name))

    def clock(self, worker: int, clock: int, timeout_s: float, *, attempt: int = 0, ahead: int = 0) -> int:
        """Ssp: every step before ``clock`` is applied; wait (on shard 0) until ``clock + ahead`` is
        within staleness of the slowest worker. Returns the slowest clock."""
        meta = {"worker": worker, "clock": clock, "timeout_s": timeout_s, "attempt": attempt}
        if ahead:
            meta["ahead"] = ahead
        return int(self._all(Op.PS_CLOCK, [meta], wait_s=timeout_s, shards=[0])[0].meta["slowest"])

    def done(self, worker: int, *, attempt: int = 0, failed: str | None = None, stays: bool = False) -> None:
        """PS_DONE: this worker finished; with ``failed`` (its error), it stopped without finishing;
        with ``stays``, its training is over but not its final duties (another PS_DONE follows)."""
        meta: dict[str, Any] = {"worker": worker, "attempt": attempt}
        if failed is not None:
            meta["failed"] = failed
        if stays:
            meta["stays"] = True
        self._all(Op.PS_DONE, [meta] * self.num_shards)

    def status(self, *, clock_log: bool = False) -> list[dict[str, Any]]:
        return [f.meta for f in self._all(Op.PS_STATUS, [{"clock_log": clock_log}] * self.num_shards)]

    def save(self, meta: dict[str, Any]) -> list[dict[str, Any]]:
        wait_s = float(meta.get("timeout_s", 0.0))  # a shard may wait that long to reach an exact step
        return [f.meta for f in self._all(Op.PS_SAVE, [meta] * self.num_shards, wait_s=wait_s)]

    def close(self) -> None:
        for c in self.conns:
            if c is not None:
                self._retire(c)
        self.conns = []
        self._unanswered.clear()


def _land(frames: Sequence[Frame], dests: Sequence[Mapping[str, torch.Tensor]]) -> None:
    """Copy received values into their destinations where they could not be received in place."""
    for f, dest in zip(frames, dests):
        for k, t in f.tensors.items():
            d = dest.get(k)
            if d is not None and d.data_ptr() != t.data_ptr():
                d.copy_(t)
