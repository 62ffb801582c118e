"""The ps task's service: wire requests -> :class:`ParameterStore` calls, on the task's Server.

Called by psflow.task for a ps task. ``join()`` returns when every worker has said it is done (or a
shutdown request came), which is how a psflow ps exits by itself at the end of a job, unlike
TensorFlow's ``server.join()``.

With ``ps_replicas = 2`` the service holds a copy of two shards (its own and the one before it);
which copy serves, the records between them and the states a restarted ps loads are
:class:`~psflow.ps.copies.ShardCopies`' (its base class): this module routes each request to the
copy that serves it (``store_of``) and replies once that copy may (``_acked``).

A push whose meta names ``compress`` is decoded (and checked) by :mod:`psflow.wire.compress` into
dense buffers before the store sees it; a pull or push-pull naming ``pull_dtype`` gets its values
in that precision. The store only ever sees gradients in its parameters' own dtype.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from psflow import timeline
from psflow.cluster import ClusterSpec, TaskId
from psflow.config import TrainConfig
from psflow.errors import ConfigError, PsflowError, TrainingError
from psflow.ps import bounds, requests
from psflow.ps.authority import ViewClient
from psflow.ps.copies import NO_VIEW, ShardCopies, initialize_store, ps_name
from psflow.ps.latency import LatencyBook
from psflow.ps.replication import Role
from psflow.ps.rules import Act
from psflow.ps.saveroot import SaveRoot
from psflow.ps.store import ParameterStore
from psflow.ps.views import Sync
from psflow.server import Reply, Request, Server
from psflow.wire import compress
from psflow.wire.conn import Resolve
from psflow.wire.frame import FrameError, TensorSpec
from psflow.wire.ops import Op

log = logging.getLogger("psflow.ps")

# Requests for a shard's values and rules: answered by the copy that serves the shard (refused by the others).
_ROUTED = frozenset({Op.PS_READY, Op.PS_PULL, Op.PS_PUSH, Op.PS_CLOCK, Op.PS_DONE})
# Requests whose latency the ps card shows (a push-pull counts as a push: the trainer's step).
_TIMED = {Op.PS_PUSH: "push", Op.PS_PULL: "pull"}


# The torch.optim.Optimizer methods that torch wraps in torch._disable_dynamo (see build_optimizers_without_dynamo).
_DYNAMO_DISABLED = ("add_param_group", "state_dict", "load_state_dict", "zero_grad")


def build_optimizers_without_dynamo() -> None:
    """Let this ps build, save and load its optimizers without importing ``torch._dynamo``.

    ``torch.optim.Optimizer.__init__`` calls ``add_param_group``, which torch wraps in
    ``torch._disable_dynamo``: its first call imports ``torch._dynamo`` (about 1.2 s of CPU, sympy
    included) to wrap the method in ``torch._dynamo.disable``, and caches that in the method's
    ``__dynamo_disable`` attribute. The chief's PS_INIT waited for that import: 40-45% of the softmax
    job's launch to first step, even imported ahead in a thread (which then slowed the ps's serving
    threads, the GIL being one). A ps never runs its optimizer under ``torch.compile``, the only place
    where the wrapper differs, so the cache of those methods is filled here with the methods
    themselves: the same eager call, no import. Should torch rename the attribute, this is unused
    and the import comes back on PS_INIT: slower, never wrong. The update itself
    (:class:`psflow.ps.update.DirectStep`) calls torch's functional kernels, which import nothing in
    eager mode; its fallback, ``Optimizer.step()`` (the first update of Adam or of SGD with
    momentum), still imports ``torch._dynamo``, once, as before.
    """
    import sys

    import torch

    if "torch._dynamo" in sys.modules:
        return  # imported already: the wrapper costs nothing more
    for name in _DYNAMO_DISABLED:
        method = getattr(getattr(torch.optim.Optimizer, name), "__wrapped__", None)
        if method is not None and not hasattr(method, "__dynamo_disable"):
            setattr(method, "__dynamo_disable", method)  # noqa: B010 - torch reads exactly this name


class PsService(ShardCopies):
    """Serve one ps shard.

    Args:
        server: the task's started or not-yet-started Server.
        shard: this ps task's index.
        cluster: the job's cluster: requests are accepted only from its tasks, and a worker index
            only from the replica it names (see :mod:`psflow.ps.requests`).
        default_wait_s: how long a PS_READY or PS_CLOCK request that names no ``timeout_s`` may
            wait (for the chief's initial values, for the slowest ssp worker). psflow's own
            clients always name one; a pull's or a save's default is ``sync_timeout_s``.
    """

    def __init__(self, server: Server, shard: int, cluster: ClusterSpec, *, default_wait_s: float = 60.0,
                 resolve: Resolve | None = None, failover_s: float = 5.0, attempt: int = 0, replicas: int = 1,
                 authority: ViewClient | None = None, lease_s: float = 3.0) -> None:
        self.server = server
        self.resolve = resolve  # where the backup ps listens now (a launched task's address book)
        self.failover_s = failover_s  # replication: how long a backup may not answer before the serving copy goes on alone
        self.attempt = attempt  # the task's restart count: from 1 on (with replicas=2) the ps re-syncs before serving
        self.shard = shard
        self.cluster = cluster
        self.default_wait_s = default_wait_s
        num_workers = cluster.num_tasks("chief") + cluster.num_tasks("worker")
        # Membership (psflow scale, psflow.ps.membership): the worker tasks admitted (the most there
        # ever were), and the version of the launcher's membership applied last (refresh_members).
        self.admitted_workers = cluster.num_tasks("worker")
        self.members_version = 0
        self._members_lock = threading.Lock()
        self._members_warned = False
        self.store = ParameterStore(shard, num_workers)
        self._shutdown = threading.Event()
        self._init_copies(replicas, authority, lease_s)
        self.latency = LatencyBook(time.monotonic())  # push/pull durations per report window (read by Task.join)
        # Compressed pushes are decoded into dense buffers kept per (shard, worker, attempt): one
        # worker's pushes to a shard come one at a time, and the store copies or applies them before the reply.
        self._dense: dict[tuple[int, int, int], dict[str, Any]] = {}
        server.on_peer_gone = self._peer_gone
        self.on_save: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        # Called with this ps's own shard's version after each push it applied there, before the reply (--fail-at ps:K@step=N:kill).
        self.after_push: Callable[[int], None] | None = None
        self._sizes: dict[int, tuple[dict[str, Any], dict[str, tuple[int, int]]]] = {}  # shard -> (values, their sizes)
        routes = {
            Op.PS_INIT: self._init,
            Op.PS_READY: self._ready,
            Op.PS_PULL: self._pull,
            Op.PS_PUSH: self._push,
            Op.PS_CLOCK: self._clock,
            Op.PS_DONE: self._done,
            Op.PS_STATUS: self._status,
            Op.PS_SHUTDOWN: self._stop,
            Op.PS_SAVE: self._save,
            Op.PS_REPLICATE: self._replicate,
        }
        # Requests that carry tensors are bounded by what the shard holds before their bytes are received.
        admits = {Op.PS_PUSH: self._admit_push, Op.PS_INIT: self._admit_init, Op.PS_REPLICATE: self._admit_replicate}
        for op, fn in routes.items():
            # A push's gradients are applied (async) or copied (sync) before the handler returns, so
            # the connection's receive buffers can be reused: no fresh allocation (and page faults) per step.
            server.register(op, self._checked(op, fn), reuse_buffers=op == Op.PS_PUSH, admit=admits.get(op))

    def _checked(self, op: Op, handler: Callable[[Request], Reply]) -> Callable[[Request], Reply]:
        """``handler`` behind the op's request schema: a request it does not admit gets a clean
        ERROR reply naming the field (and a warning here), and never reaches the store."""

        def serve(req: Request) -> Reply:
            if op == Op.PS_READY and self._maybe_new_member(req.peer):
                self.refresh_members()  # a worker a scale request added: the launcher's book says so
            try:
                requests.check(self.cluster, op, req.peer, req.meta, workers=self.admitted_workers)
            except ConfigError as e:
                log.warning("ps:%d: %s", self.shard, e)
                raise
            worker = self._worker_of(req.peer)
            if worker is not None and op in _ROUTED and self._store_for(req).worker_back(worker):
                log.warning("ps:%d: worker:%d is back (it sent %s); waiting for it as before.", self.shard, worker, op.name)
            reply = handler(req)
            if self.views and op in _ROUTED:  # the term this copy served in: the client sends it on (a fence)
                view = self.views.get(req.meta.get("shard", self.shard))
                if view is not None:
                    reply.meta["term"] = view.term
            return reply

        timed = _TIMED.get(op)
        if timed is None:
            return serve
        record, clock = self.latency.record, time.perf_counter

        def serve_timed(req: Request) -> Reply:
            start = clock()
            try:
                return serve(req)
            finally:
                record(timed, clock() - start)

        return serve_timed

    def _admit_push(self, peer: str, meta: dict[str, Any], specs: list[TensorSpec]) -> None:
        """A push's tensors, before their bytes are received: each must be the size the shard's
        parameter under its name takes (at most that, compressed with top-k). An uninitialized shard's
        keys are unknown yet: the frame limit bounds its push (the handler then refuses it).

        Raises:
            FrameError: a tensor larger or smaller than its parameter, or one the shard does not
                have; the server answers ERROR and closes the connection, nothing received or applied.
        """
        shard = meta.get("shard", self.shard)
        store = self._copies().get(shard) if isinstance(shard, int) else None
        if store is None or not store.initialized:
            return
        values = store.values
        cached = self._sizes.get(shard)
        if cached is None or cached[0] is not values:  # a re-sync replaces the values: measure them again
            cached = self._sizes[shard] = (values, {k: (v.numel(), v.nbytes) for k, v in values.items()})
        kind = meta.get("compress", "none")
        kind = kind if isinstance(kind, str) else "none"
        for spec in specs:
            declared = spec.nbytes
            bound = compress.push_bytes(kind, spec.name, cached[1])
            if bound is not None and (declared == bound[0] or (declared < bound[0] and not bound[1])):
                continue
            what = (f"declares {declared} bytes ({str(spec.dtype).removeprefix('torch.')} {list(spec.shape)}), but "
                    f"its parameter on shard {shard} takes {bound[0]} bytes{'' if bound[1] else ' at most'}"
                    if bound is not None else f"({declared} bytes) is none of shard {shard}'s parameters "
                    f"({', '.join(sorted(cached[1])[:5])}{', ...' if len(cached[1]) > 5 else ''})")
            raise FrameError(f"PS_PUSH from {peer} refused before its payload was received: tensor {spec.name!r} "
                             f"{what}{'' if kind == 'none' else f' (compress={kind})'}. Nothing was applied and the "
                             "connection is closed. Every worker must build the same model with the same placement.")

    def _admit_init(self, peer: str, meta: dict[str, Any], specs: list[TensorSpec]) -> None:
        """A PS_INIT's tensors, before their bytes are received: from the chief, a state of what this
        shard holds (:func:`psflow.ps.bounds.check_state`: its values once initialized, before that the
        placement the request declares).

        Raises:
            FrameError: another sender than the chief, or a tensor the shard does not hold as declared
                (or a value missing); the server answers ERROR and closes the connection, nothing
                received or changed.
        """
        try:
            requests.check(self.cluster, Op.PS_INIT, peer, meta, workers=self.admitted_workers)
            self._check_init(f"PS_INIT from {peer}", meta, bounds.declared(specs))
        except ConfigError as e:
            log.warning("ps:%d: %s", self.shard, e)
            raise FrameError(f"{e} (Refused before its payload was received; the connection is closed.)") from e

    def _check_init(self, what: str, meta: dict[str, Any], tensors: list[bounds.Declared]) -> None:
        """Raises ConfigError unless ``tensors`` are a state of what this shard holds (see :meth:`_admit_init`)."""
        if self.store.initialized:
            layout = bounds.Layout.of_values(self.shard, self.store.values)
        else:
            layout = bounds.Layout.of_request(self.shard, meta, self.cluster.num_tasks("ps"), what)
        bounds.check_state(what, layout, tensors)

    def _maybe_new_member(self, peer: str) -> bool:
        """``peer`` is a worker this ps does not count (yet): one a scale request may have added."""
        try:
            task = TaskId.parse(peer)
        except ConfigError:
            return False
        if task.job != "worker":
            return False
        return task.index >= self.admitted_workers or self.cluster.num_tasks("chief") + task.index >= self.store.rules.num_workers

    def refresh_members(self) -> bool:
        """Ask the launcher's coordinator for the job's membership (``psflow scale``) and apply a newer
        one to every copy this ps serves: ``resize`` of their rules (recorded, so a backup copy follows).
        Returns True if it changed. Without a launcher (a task started by hand) nothing changes."""
        book = getattr(self.resolve, "book", None)
        if book is None:
            return False
        try:
            members = book().get("members")
        except (PsflowError, OSError) as e:
            if not self._members_warned:  # once per outage: the ps asks again about once a second
                self._members_warned = True
                log.warning("ps:%d: could not read the job's membership from the launcher (%s); asking again later.",
                            self.shard, e)
            return False
        self._members_warned = False
        return isinstance(members, dict) and self.apply_members(members)

    def apply_members(self, members: dict[str, Any]) -> bool:
        """Apply the membership ``{"replicas", "launch_replicas", "version"}`` if newer than the last one."""
        with self._members_lock:
            version = int(members.get("version", 0))
            if version <= self.members_version:
                return False
            self.members_version = version
            replicas, launch = int(members["replicas"]), int(members["launch_replicas"])
            self.admitted_workers = max(self.admitted_workers, replicas - self.cluster.num_tasks("chief"))
            for s, store in sorted(self._copies().items()):
                store.rules.launch_workers = launch  # what the sync settings were written for (not an event: every copy knows it)
                if self.roles.get(s) is Role.SERVING:
                    before = store.rules.num_workers
                    store.resize(replicas)
                    if before != replicas:
                        log.warning("ps:%d: shard %d counts %d training replicas now (was %d): a scale request.",
                                    self.shard, s, replicas, before)
            self._maybe_finished()
            return True

    def _worker_of(self, peer: str) -> int | None:
        """The worker index ``peer`` (an admitted sender) trains as; None for a task that does not train."""
        try:
            task = requests.sender(self.cluster, peer, "lost-worker check", workers=self.admitted_workers)
        except ConfigError:  # not a task of the cluster: a connection that was refused every request
            return None
        return requests.replica_of(self.cluster, task)

    def join(self, timeout_s: float | None = None) -> bool:
        """Block until every worker is done or shutdown was requested. Returns False on timeout."""
        return self._shutdown.wait(timeout_s)

    def stop(self) -> None:
        """Make :meth:`join` return (as a PS_SHUTDOWN request does)."""
        self._shutdown.set()
        for store in self._copies().values():
            if store.forwarder is not None:
                store.forwarder.close()
        for link in self._links:
            link.close()
        for applier in self._appliers.values():
            applier.close()

    @property
    def serving(self) -> dict[int, ParameterStore]:
        """Shards other than its own that this ps serves: copies it took over from a dead ps."""
        return {s: c for s, c in self._copies().items() if s != self.shard and self.roles.get(s) is Role.SERVING}

    def _serving_copies(self) -> list[ParameterStore]:
        return [c for s, c in sorted(self._copies().items()) if self.roles.get(s) is Role.SERVING]

    def copies_report(self) -> dict[str, dict[str, Any]]:
        """replicas=2: each shard copy this ps holds, its role, version and counters (empty without replication)."""
        if not self.backups:
            return {}
        out = {}
        for s, c in sorted(self._copies().items()):
            if not c.initialized:
                continue
            if self.roles.get(s) is Role.BACKUP:
                try:
                    self._drain(s, timeout_s=10.0)  # the counters of every record it holds
                except PsflowError as e:
                    log.error("ps:%d: shard %d's backup copy: %s", self.shard, s, e)
            v = self.views.get(s, NO_VIEW)
            row = {"role": self.roles.get(s, Role.BACKUP).value, "version": c.version, "term": v.term,
                   "state": v.state.value, **c.stats.to_dict()}
            if c.forwarder is not None and c.forwarder.degraded:
                row["degraded"] = c.forwarder.degraded
            elif self.roles.get(s) is Role.SERVING and v.state is not Sync.SYNCED:
                row["degraded"] = f"term {v.term}: {v.state.value} (backup {ps_name(v.backup)})"
            out[str(s)] = row
        return out

    def _maybe_finished(self) -> None:
        """Every worker is done on each copy this ps serves (serving none: on each copy it holds)."""
        copies = self._serving_copies() or [c for c in self._copies().values() if c.initialized]
        if copies and all(c.all_done() for c in copies):
            self._shutdown.set()

    def watch_lost_workers(self, now: float) -> None:
        """Called about once a second by the ps's main loop (Task.join), ``now`` from ``time.monotonic()``.

        While any worker still trains, a lost one is not waited for (async goes on without it). Once
        every other worker is done, say once whom the ps waits for; past ``lost_worker_timeout_s`` of
        that, raise. A lost worker that sends a request again resets the wait.

        Raises:
            TrainingError: the ps waited ``lost_worker_timeout_s`` for lost workers only; names them.
        """
        if self.resync_error is not None:
            raise self.resync_error
        for store in self._serving_copies():  # a backup copy ticks with its serving copy's records only
            for decision in store.tick(now):
                if decision.act is Act.WAIT_LOST:
                    log.warning("ps:%d: %s", self.shard, decision.reason)
                elif decision.act is Act.FAIL:
                    raise TrainingError(decision.reason)

    # -- handlers --------------------------------------------------------------------------
    def _init(self, req: Request) -> Reply:
        if self.roles.get(self.shard) is not Role.SERVING:
            # A restarted ps: the shard lives on at the other ps of its pair and comes back from there;
            # a chief's (restarted chief's) initial values must not replace it.
            return Reply({"initialized": False, "version": self.store.version})
        config = TrainConfig.from_dict(req.meta["config"])
        if config.ps_replicas == 2 and not self.views:
            raise ConfigError(f"The chief asks for ps_replicas=2, but ps:{self.shard} was started with one copy per shard "
                              "(its own ps_replicas is 1). Start every task with the same TrainConfig.")
        self._check_init(f"PS_INIT from {req.peer}", req.meta, bounds.declared(req.tensors.items()))
        forwarder = None
        view = self.views.get(self.shard)
        if view is not None and view.backup is not None and view.state is Sync.SYNCED and not self.store.initialized:
            forwarder = self._forwarder(self.shard, view.backup, view.term,
                                        ({**req.meta, "kind": "init", "shard": self.shard}, list(req.tensors.items())))
        first = initialize_store(self.store, req.meta, req.tensors, forwarder)
        self._acked()
        return Reply({"initialized": first, "version": self.store.version})

    def _ready(self, req: Request) -> Reply:
        store = self._store_for(req)
        timeout_s = float(req.meta.get("timeout_s", self.default_wait_s))
        if not store.wait_initialized(timeout_s):
            raise TrainingError(
                f"ps:{self.shard} is still not initialized after {timeout_s:.1f} s: it waits for the chief to send "
                "the initial parameters. Is the chief running? Raise the wait with ready_timeout_s "
                "(psflow.init(config=TrainConfig(ready_timeout_s=...)), or in PSFLOW_TRAIN_CONFIG by hand)."
            )
        digest = str(req.meta.get("placement_digest", ""))
        if digest and digest != store.placement_digest:
            raise ConfigError(
                f"{req.peer} places the model differently from the chief on ps:{self.shard} "
                f"(placement digest {digest[:12]} vs {store.placement_digest[:12]}). "
                "Every worker must build the same model with the same --placement and number of ps."
            )
        if "worker" in req.meta:  # a training replica: a restarted one takes over from its earlier attempt
            joined = store.join(int(req.meta["worker"]), int(req.meta.get("attempt", 0)))
        else:
            joined = {"version": store.version, "data_positions": store.data_positions()}
        self._acked(store)
        return Reply({**joined, "config": store.config.to_dict(), "meta": store.meta})

    def _pull(self, req: Request) -> Reply:
        store = self._store_for(req)
        version, values = store.pull(
            min_version=int(req.meta.get("min_version", 0)),
            timeout_s=float(req.meta.get("timeout_s", store.config.sync_timeout_s)),
            averages=bool(req.meta.get("averages", False)),
        )
        self._acked(store)  # the values shown are the backup's too: a failover never goes back past them
        return Reply({"version": version}, compress.cast_values(list(values.items()), req.meta.get("pull_dtype")))

    def _peer_gone(self, peer: str) -> None:
        """The server's callback: ``peer``'s last connection closed. A worker that never said
        PS_DONE is lost (see ParameterStore.worker_lost) on every copy this ps serves (a backup copy
        learns it from its serving copy's records)."""
        worker = self._worker_of(peer)  # a worker that dies before its first push is lost all the same
        if worker is None:
            return
        lost = [c for c in self._serving_copies() if worker not in c.done_workers and worker < c.rules.num_workers]
        for store in lost:
            store.worker_lost(worker)
        if lost:
            log.warning("ps:%d: lost worker:%d: its connection closed at global step %d without PS_DONE (killed or "
                        "crashed?).", self.shard, worker, lost[0].version)

    def _push(self, req: Request) -> Reply:
        store = self._store_for(req)
        version = int(req.meta.get("version", 0))
        seq = req.meta.get("seq")
        worker, attempt = int(req.meta["worker"]), int(req.meta.get("attempt", 0))
        grads = req.tensors
        tl = timeline.ACTIVE
        start = tl.now() if tl is not None else 0.0
        if "compress" in req.meta and store.initialized:  # an uninitialized store's push raises the clearer error
            dense = self._dense.setdefault((store.shard, worker, attempt), {})
            grads = compress.decode(str(req.meta["compress"]), req.tensors, store.values, dense)
        result = store.push(worker, version, grads, position=req.meta.get("position"),
                            attempt=attempt, push_seq=None if seq is None else int(seq))
        if tl is not None:
            tl.add("apply", f"apply shard {store.shard}" if result.get("applied") else f"push shard {store.shard}",
                   start, tl.now(), peer=req.peer, version=store.version)
        if self.after_push is not None and store is self.store:
            self.after_push(store.version)
        if not req.meta.get("pull"):
            self._acked(store)  # acknowledged once the backup holds it
            return Reply(result)
        # Push-pull in one round trip: reply with the values after this update. In sync mode an
        # accepted gradient (or a duplicate of one) waits for its step to complete (a stale one gets
        # the newest values now).
        wait_for_step = store.mode.waits_for_quorum and result.get("applied")
        start = tl.now() if tl is not None else 0.0
        current, values = store.pull(
            min_version=version + 1 if wait_for_step else 0,
            timeout_s=float(req.meta.get("timeout_s", store.config.sync_timeout_s)),
        )
        if tl is not None and wait_for_step:
            tl.add("wait", f"wait for step {version + 1}", start, tl.now(), peer=req.peer)
        self._acked(store)  # acknowledged once the backup holds it (sync: the step it completed)
        return Reply({**result, "version": current}, compress.cast_values(list(values.items()), req.meta.get("pull_dtype")))

    def _clock(self, req: Request) -> Reply:
        store = self._store_for(req)
        slowest = store.clock(
            int(req.meta["worker"]), int(req.meta["clock"]), timeout_s=float(req.meta.get("timeout_s", self.default_wait_s)),
            attempt=int(req.meta.get("attempt", 0)), ahead=int(req.meta.get("ahead", 0)),
        )
        self._acked(store)
        return Reply({"slowest": slowest})

    def _done(self, req: Request) -> Reply:
        store = self._store_for(req)
        store.worker_done(int(req.meta["worker"]), int(req.meta.get("attempt", 0)), failed=req.meta.get("failed"),
                          stays=bool(req.meta.get("stays", False)))
        self._acked(store)
        self._maybe_finished()
        return Reply({"done": sorted(store.done_workers)})

    def _status(self, req: Request) -> Reply:
        s = self.store
        meta: dict[str, Any] = {
            "shard": self.shard,
            "initialized": s.initialized,
            "version": s.version,
            "done_workers": sorted(s.done_workers),
            "lost_workers": sorted(s.lost_workers),
            "num_workers": s.rules.num_workers,
            "stats": s.stats.to_dict(),
        }
        if req.meta.get("clock_log"):
            meta["clock_log"] = s.stats.clock_log
        if s.forwarder is not None or self.backups:  # ps_replicas = 2
            fwd = s.forwarder
            meta["replication"] = {
                "roles": {str(k): r.value for k, r in sorted(self.roles.items())},
                "acked_seq": fwd.outbox.acked_seq if fwd else None, "seq": s.seq,
                "degraded": fwd.degraded if fwd else None,
                "views": {str(k): v.to_dict() for k, v in sorted(self.views.items())},
                "backups": {str(k): {"version": b.version, "seq": b.seq, "applied_updates": b.stats.applied_updates}
                            for k, b in sorted(self.backups.items())},
                "serving": sorted(self.serving),
            }
        return Reply(meta)

    def _stop(self, req: Request) -> Reply:
        self._shutdown.set()
        return Reply({})

    def _save(self, req: Request) -> Reply:
        if self.on_save is None:
            raise ConfigError(f"ps:{self.shard} cannot save checkpoints: no checkpoint writer is attached.")
        return Reply(self.on_save(req.meta))


def default_save(service: PsService, where: SaveRoot | None = None) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The PS_SAVE handler: this shard writes its own checkpoint file (no parameter leaves the ps),
    under a root inside ``where`` only (default: the first root a PS_SAVE names; see
    :mod:`psflow.ps.saveroot`); a root outside it is refused with a ConfigError, nothing written."""
    from psflow import checkpoint

    where = where or SaveRoot(f"ps:{service.shard}")

    def save(meta: dict[str, Any]) -> dict[str, Any]:
        root = where.check(str(meta["root"]))
        exact = int(meta["step"]) if meta.get("exact") else None
        shard = int(meta.get("shard", service.shard))
        version, tensors, positions = service.store_of(shard).checkpoint_state(
            exact, timeout_s=float(meta.get("timeout_s", service.store.config.sync_timeout_s)))
        record = checkpoint.write_shard(
            root,  # a directory, or a URL (Path would fold its //)
            int(meta["step"]),
            shard,
            int(meta["num_shards"]),
            tensors,
            _crash_after_bytes=meta.get("crash_after_bytes"),
        )
        return {"record": record.to_dict(), "version": version, "data_positions": positions}

    return save
