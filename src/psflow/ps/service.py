"""The ps task's service: wire requests -> :class:`ParameterStore` calls, on the task's Server.

Called by psflow.task for a ps task. ``join()`` returns when every worker has said it is done (or a
shutdown request came), which is how a psflow ps exits by itself at the end of a job, unlike
TensorFlow's ``server.join()``.

With ``ps_replicas = 2`` (in the chief's PS_INIT) the service holds a copy of two shards (its own
and the one before it), each with a :class:`~psflow.ps.replication.Role` (``roles``): a serving
copy's store forwards every recorded event to the other ps of the shard's pair and answers a request
only once that backup holds the state the reply shows; a backup copy (``backups``, or the own shard
of a restarted ps) is fed by the serving one (PS_REPLICATE). A restarted ps (``attempt >= 1``)
refuses every request until :meth:`PsService.resync` has brought both its copies back from the other
ps (see :mod:`psflow.ps.replication` for the states and transitions).

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
from psflow.checkpoint.keys import split_state
from psflow.cluster import ClusterSpec, TaskId
from psflow.config import TrainConfig
from psflow.errors import ConfigError, NotServingError, PsflowError, RemoteError, StaleTermError, TrainingError, TransportError
from psflow.ps import requests
from psflow.ps.authority import ViewClient
from psflow.ps.latency import LatencyBook
from psflow.ps.progress import StepPlan
from psflow.ps.replication import Batch, Forwarder, Role, Send, backup_of, not_serving, pair_other, shards_held
from psflow.ps.rules import Act
from psflow.ps.store import ParameterStore
from psflow.ps.views import Lease, ShardView, Sync, Verdict, accepts_records, initial_views, keeps_serving, takes_over
from psflow.server import Reply, Request, Server
from psflow.wire import compress
from psflow.wire.conn import Connection, Resolve, connect
from psflow.wire.ops import Op

log = logging.getLogger("psflow.ps")

# Requests for a shard's values and rules: answered by the copy that serves the shard (refused by the others).
_ROUTED = frozenset({Op.PS_READY, Op.PS_PULL, Op.PS_PUSH, Op.PS_CLOCK, Op.PS_DONE})
# Requests whose latency the ps card shows (a push-pull counts as a push: the trainer's step).
_TIMED = {Op.PS_PUSH: "push", Op.PS_PULL: "pull"}


def warm_up() -> None:
    """Start, in a daemon thread, the imports a ps needs once the chief initializes it.

    Building the first ``torch.optim`` optimizer imports ``torch._dynamo`` (about 1.2 s of CPU);
    done on PS_INIT, that delay sits between the chief's start and everyone's first step. Done
    here, it overlaps the tasks' registration and the workers' data loading.
    """

    def build() -> None:
        import torch

        try:
            torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        except Exception as e:  # a warm-up only: the real optimizer, built on PS_INIT, reports real problems
            logging.getLogger("psflow.ps").debug("optimizer warm-up failed: %r", e)

    threading.Thread(target=build, name="psflow-warm-up", daemon=True).start()


class PsService:
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
        self.backups: dict[int, ParameterStore] = {}  # shard -> its copy here (the shard before this ps's own)
        self.roles: dict[int, Role] = {shard: Role.SERVING}  # shard -> what this ps does with its copy
        self._links: list[_Link] = []  # connections to other ps, one per forwarder
        self._takeover_lock = threading.RLock()  # roles and views change under it
        self.authority = authority  # who decides which copy serves each shard (ps_replicas=2): the launcher
        self.views: dict[int, ShardView] = {}  # shard -> the newest view of it this ps knows (replicated shards only)
        self.waits: dict[int, bool] = {}  # a serving copy's replies wait for its backup (synced, or catch-up done)
        self.lease = Lease(lease_s)  # acknowledgements need a recent word from the authority
        self._ask_lock = threading.Lock()
        self._asked_at = float("-inf")
        self._fetching: set[int] = set()  # shards whose state this ps is asking the serving copy for
        self.partitioned = False  # psflow chaos: this ps's links to the other ps are cut (see partition())
        self.resync_error: PsflowError | None = None  # why the re-sync failed (raised by watch_lost_workers)
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
        if replicas == 2 and cluster.num_tasks("ps") >= 2:
            if authority is None:
                raise ConfigError(f"ps:{shard} keeps a second copy of each shard (ps_replicas=2), which needs one authority "
                                  "over the copies: the launcher's (psflow run --ps-replicas 2). A ps started by hand has "
                                  "none; run by hand with ps_replicas=1, or launch the job with psflow run.")
            views = initial_views(cluster.num_tasks("ps"))
            for s in shards_held(shard, cluster.num_tasks("ps")):
                self.views[s] = views[s]
                if attempt >= 1:  # a restarted ps: its copies died with its last attempt; both come back from the other ps
                    self.views[s] = ShardView(s, 0, None, None, Sync.LOST)
                    self.roles[s] = Role.RESYNCING
                    if s != shard:
                        self.backups[s] = ParameterStore(s, num_workers)
            self.waits = {s: attempt == 0 and s == shard for s in self.views}
            threading.Thread(target=self._poll_views, name=f"psflow-views-{shard}", daemon=True).start()
        self.latency = LatencyBook(time.monotonic())  # push/pull durations per report window (read by Task.join)
        # Compressed pushes are decoded into dense buffers kept per (shard, worker, attempt): one
        # worker's pushes to a shard come one at a time, and the store copies or applies them before the reply.
        self._dense: dict[tuple[int, int, int], dict[str, Any]] = {}
        server.on_peer_gone = self._peer_gone
        self.on_save: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        # Called with this ps's own shard's version after each push it applied there, before the reply (--fail-at ps:K@step=N:kill).
        self.after_push: Callable[[int], None] | None = None
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
        for op, fn in routes.items():
            # A push's gradients are applied (async) or copied (sync) before the handler returns, so
            # the connection's receive buffers can be reused: no fresh allocation (and page faults) per step.
            server.register(op, self._checked(op, fn), reuse_buffers=op == Op.PS_PUSH)

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
            return handler(req)

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

    @property
    def serving(self) -> dict[int, ParameterStore]:
        """Shards other than its own that this ps serves: copies it took over from a dead ps."""
        return {s: c for s, c in self._copies().items() if s != self.shard and self.roles.get(s) is Role.SERVING}

    def _copies(self) -> dict[int, ParameterStore]:
        return {self.shard: self.store, **self.backups}

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
            v = self.views.get(s, _NO_VIEW)
            row = {"role": self.roles.get(s, Role.BACKUP).value, "version": c.version, "term": v.term,
                   "state": v.state.value, **c.stats.to_dict()}
            if c.forwarder is not None and c.forwarder.degraded:
                row["degraded"] = c.forwarder.degraded
            elif self.roles.get(s) is Role.SERVING and v.state is not Sync.SYNCED:
                row["degraded"] = f"term {v.term}: {v.state.value} (backup {_name(v.backup)})"
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
        forwarder = None
        view = self.views.get(self.shard)
        if view is not None and view.backup is not None and view.state is Sync.SYNCED and not self.store.initialized:
            forwarder = self._forwarder(self.shard, view.backup, view.term,
                                        ({**req.meta, "kind": "init", "shard": self.shard}, list(req.tensors.items())))
        first = _initialize(self.store, req.meta, req.tensors, forwarder)
        self._acked()
        return Reply({"initialized": first, "version": self.store.version})

    # -- replication: the views ------------------------------------------------------------
    def _forwarder(self, shard: int, backup: int, term: int,
                   init: tuple[dict[str, Any], list[tuple[str, Any]]] | None = None) -> Forwarder:
        return Forwarder(shard, backup, self._sender(backup), init, term=term, failover_s=self.failover_s,
                         on_unreachable=lambda why: self._report_unreachable(shard, term, why),
                         on_stale=lambda: self._ask_quietly("get"))

    def _poll_views(self) -> None:
        """Ask the authority for the views every quarter of the lease (the lease's renewal); a copy
        the views leave out asks to be taken back (``up``)."""
        while not self._shutdown.is_set():
            kind = "up" if self._left_out() else "get"
            self._ask_quietly(kind)
            self._shutdown.wait(self.lease.lease_s / 4)

    def _left_out(self) -> bool:
        with self._takeover_lock:
            return any(self.roles.get(s) is Role.RESYNCING and v.backup != self.shard and v.serving != self.shard
                       for s, v in self.views.items())

    def _ask(self, kind: str, **meta: Any) -> None:
        """One question to the authority; then every view it answered is carried out here.

        Raises:
            PsflowError: the authority could not be asked (TransportError, RemoteError).
        """
        assert self.authority is not None
        with self._ask_lock:
            sent = time.monotonic()
            views = self.authority.ask(kind, **meta)
            self.lease.renewed(sent)  # from when it was asked: the authority's answer is at least that fresh
            self._asked_at = sent
        self._apply_views(views)

    def _ask_quietly(self, kind: str, **meta: Any) -> bool:
        try:
            self._ask(kind, **meta)
            return True
        except (PsflowError, OSError) as e:
            log.debug("ps:%d: could not ask the authority (%s): %s", self.shard, kind, e)
            return False

    def _report_unreachable(self, shard: int, term: int, why: str) -> None:
        if not self._ask_quietly("unreachable", shard=shard, term=term, why=why):
            log.warning("ps:%d: cannot tell the launcher that shard %d's backup does not answer: this copy acknowledges "
                        "nothing until one of them answers.", self.shard, shard)

    def _apply_views(self, views: dict[int, ShardView]) -> None:
        fetch = []
        with self._takeover_lock:
            for s in sorted(self.views):
                if s in views and self._apply_view(views[s]):
                    fetch.append(s)
        for s in fetch:
            self._fetch_state(s)

    def _apply_view(self, v: ShardView) -> bool:
        """Under the takeover lock: carry out the view ``v`` of a shard this ps holds a copy of.
        Returns True when this copy must ask the serving one for the shard's state."""
        s, me = v.shard, self.shard
        known, role = self.views[s], self.roles.get(s, Role.BACKUP)
        if v.term < known.term:
            return False
        self.views[s] = v
        if v.term == known.term:
            if v.state is Sync.SYNCED and role is Role.SERVING:
                self.waits[s] = True
            return False
        store = self._copies().get(s)
        if v.serving == me:
            if role is Role.SERVING and keeps_serving(known, v, me):
                if store is not None and store.forwarder is not None and store.forwarder.backup != v.backup:
                    store.stop_forwarding(f"term {v.term}: shard {s}'s backup is {_name(v.backup)} now ({v.state.value})")
            elif store is not None and store.initialized and takes_over(known, v, me, role is Role.BACKUP):
                store.take_over()
                role = Role.SERVING
                log.warning("ps:%d: takes over shard %d at step %d (term %d): the launcher recorded ps:%d down.",
                            me, s, store.version, v.term, known.serving)
            else:
                role = Role.RESYNCING
                log.error("ps:%d: the launcher names it serving shard %d in term %d (since term %d), but its copy is not "
                          "the synced backup it promoted (it knew term %d): it cannot serve the shard.", me, s, v.term,
                          v.since, known.term)
            self.waits[s] = v.state is Sync.SYNCED
            self.roles[s] = role
            return False
        if role is Role.SERVING and store is not None:
            store.stop_forwarding(f"term {v.term}: ps:{me} no longer serves shard {s}")
            log.warning("ps:%d: stops serving shard %d: term %d names %s serving.", me, s, v.term, _name(v.serving))
        self.roles[s] = Role.RESYNCING
        self.waits[s] = False
        return v.backup == me

    def _fetch_state(self, shard: int) -> None:
        """Ask the serving copy for the shard's state, on a thread of its own (once per shard at a time)."""
        with self._takeover_lock:
            if shard in self._fetching:
                return
            self._fetching.add(shard)
        threading.Thread(target=self._fetch_loop, args=(shard,), name=f"psflow-fetch-{shard}", daemon=True).start()

    def _fetch_loop(self, shard: int) -> None:
        last: Exception | None = None
        try:
            while not self._shutdown.is_set():
                with self._takeover_lock:
                    v, role = self.views[shard], self.roles.get(shard)
                if v.backup != self.shard or v.serving is None or role is not Role.RESYNCING:
                    return
                try:
                    link = _Link(self, v.serving)
                    try:
                        link.send({"kind": "resync", "shard": shard, "term": v.term}, [], timeout_s=self.failover_s + 60.0)
                    finally:
                        link.close()
                except (TransportError, RemoteError) as e:
                    if str(e) != str(last):
                        log.warning("ps:%d: cannot load shard %d's state from ps:%d yet (%s); asking again.",
                                    self.shard, shard, v.serving, e)
                    last = e
                    self._shutdown.wait(0.2)
        finally:
            with self._takeover_lock:
                self._fetching.discard(shard)

    def _acked(self, store: ParameterStore | None = None) -> None:
        """Return once this reply may be sent: the backup holds the state this shard is in now
        (when acknowledgements wait for it), and this copy still serves the shard under a fresh lease.

        Raises:
            NotServingError: the view moved on, or the authority could not confirm it within the
                lease: nothing is acknowledged (the client sends the request again).
        """
        store = store or self.store
        if not self.views:
            return
        s = store.shard
        seq = store.seq
        while self.waits.get(s):
            forwarder = store.forwarder
            if forwarder is None:
                break
            forwarder.wait_acked(seq, self.failover_s + 60.0)
            if not forwarder.replaced:
                break
        if not self.lease.valid(time.monotonic()):
            self._ask_quietly("get")
        if self.roles.get(s) is not Role.SERVING or self._copies().get(s) is not store:
            raise not_serving(self.shard, s, self.roles.get(s, Role.RESYNCING), self.cluster.num_tasks("ps"),
                              self.views[s].serving)
        if not self.lease.valid(time.monotonic()):
            raise NotServingError(f"ps:{self.shard} could not confirm with the launcher within {self.lease.lease_s:g} s "
                                  f"that it still serves shard {s}: nothing is acknowledged until it can (the client "
                                  "sends the request again).")

    def _store_for(self, req: Request) -> ParameterStore:
        return self.store_of(req.meta.get("shard"))

    def store_of(self, shard: Any) -> ParameterStore:
        """The copy serving ``shard`` here (None: this ps's own). A copy that does not serve asks the
        authority first (the view may have moved: a client failed over here), then refuses with a
        NotServingError (the client routes to the other ps).

        Raises:
            ConfigError: this ps holds no copy of ``shard``.
            NotServingError: the views do not name this ps serving the shard.
        """
        s = self.shard if shard is None else shard
        store = self._copies().get(s) if isinstance(s, int) else None
        if store is None:
            raise ConfigError(f"ps:{self.shard} was asked to serve shard {shard!r}, but holds no copy of it (it serves "
                              f"shard {self.shard} and the backups of {sorted(self.backups)}). Is the job running with "
                              "ps_replicas=2 on every task?")
        if self.roles.get(s) is Role.SERVING:
            return store  # the hot path; a view change is caught before the reply (_acked)
        if self.views and time.monotonic() - self._asked_at > 0.05:
            self._ask_quietly("get")
        store = self._copies()[s]
        role = self.roles.get(s, Role.BACKUP)
        if role is not Role.SERVING:
            raise not_serving(self.shard, s, role, self.cluster.num_tasks("ps"), self.views.get(s, _NO_VIEW).serving)
        return store

    def _sender(self, target: int) -> Send:
        """One PS_REPLICATE request to ps ``target`` on a connection of this forwarder's own (made
        again where the target listens now after a loss). Called by that forwarder's thread only."""
        link = _Link(self, target)
        self._links.append(link)

        def send(meta: dict[str, Any], tensors: Any) -> dict[str, Any]:
            # A batch unanswered for failover_s is a backup to report; a whole state may take longer to cross.
            whole = meta.get("kind") in ("init", "state")
            return link.send(meta, tensors, timeout_s=self.failover_s + 60.0 if whole else self.failover_s)

        return send

    # -- replication: PS_REPLICATE -----------------------------------------------------------
    def partition(self) -> bool:
        """psflow chaos (PSFLOW_CHAOS, on SIGUSR2): cut this ps's links to the other ps, or heal them.
        While cut, nothing it sends to a ps leaves and nothing a ps sends it is answered: a partition
        between shard copies, with the workers and the launcher still reachable. Returns the new state."""
        self.partitioned = not self.partitioned
        log.warning("ps:%d: psflow chaos: links to the other ps %s.", self.shard, "cut" if self.partitioned else "healed")
        return self.partitioned

    def _replicate(self, req: Request) -> Reply:
        """PS_REPLICATE: a serving copy's init, full state or records for this ps's copy of the
        shard (``init``, ``state``, ``batch``), or a backup asking for the shard's state (``resync``),
        each of the term it names, checked against this ps's view of the shard."""
        while self.partitioned and not self._shutdown.is_set():  # psflow chaos: a cut link answers nothing
            time.sleep(0.05)
        shard, kind = int(req.meta["shard"]), req.meta["kind"]
        num_ps = self.cluster.num_tasks("ps")
        held = shard < num_ps and shard in shards_held(self.shard, num_ps) and shard in self.views
        other = pair_other(shard, self.shard, num_ps) if held else None
        if other is None or req.peer != f"ps:{other}" or (kind == "init" and backup_of(shard, num_ps) != self.shard):
            raise ConfigError(f"PS_REPLICATE {kind!r} from {req.peer} for shard {shard} refused: ps:{self.shard} holds "
                              f"copies of shards {shards_held(self.shard, num_ps)} only, each shared with the other ps "
                              "of its pair, and only that ps sends its records.")
        term = int(req.meta.get("term", 0))
        if kind == "resync":
            return self._resync_peer(shard, other, term)
        verdict = accepts_records(self.views[shard], self.shard, other, term)
        if verdict is Verdict.ASK:
            self._ask_quietly("get")
            verdict = accepts_records(self.views[shard], self.shard, other, term)
        if verdict is not Verdict.ACCEPT:
            v = self.views[shard]
            raise StaleTermError(f"ps:{self.shard} refuses ps:{other}'s {kind} of shard {shard} in term {term}: its view "
                                 f"of the shard is term {v.term}, serving {_name(v.serving)}, backup {_name(v.backup)}. "
                                 f"ps:{other} must ask the launcher for the shard's view.")
        if kind == "init":
            with self._takeover_lock:
                return self._backup_init(shard, req)
        if kind == "state":
            return self._load_state(shard, other, term, req)
        role = self.roles.get(shard)
        store = self.backups.get(shard) if shard != self.shard else self.store
        if store is None or not store.initialized or role is not Role.BACKUP:
            raise TrainingError(f"ps:{self.shard} received records of shard {shard} before its init or state: the "
                                "serving copy must send that first (it re-syncs this backup).")
        seq = store.follow(Batch.from_wire(req.meta, req.tensors))
        self._maybe_finished()
        return Reply({"seq": seq})

    def _backup_init(self, shard: int, req: Request) -> Reply:
        """The primary's forwarded PS_INIT: this ps holds the shard's backup from its start."""
        store = self.backups.get(shard)
        if store is None or not store.initialized:
            store = store or ParameterStore(shard, self.store.num_workers, launch_workers=self.store.rules.launch_workers)
            _initialize(store, req.meta, req.tensors, None)
            self.backups[shard] = store
            self.roles[shard] = Role.BACKUP
            log.info("ps:%d: holds the backup of shard %d (from step %d).", self.shard, shard, store.version)
        return Reply({"seq": store.seq})

    def _load_state(self, shard: int, source: int, term: int, req: Request) -> Reply:
        """A full state of the shard, of the view's term: this ps's copy becomes it, as the backup.
        Built outside the takeover lock (a big state takes a while; the other shard's records must
        not wait for it), swapped in under it if the view is still the one the state was sent in."""
        store = self._copies().get(shard)
        if self.roles.get(shard) is Role.BACKUP and store is not None and store.initialized:
            return Reply({"seq": store.seq})  # the same state again (its reply was lost): held already
        store = ParameterStore(shard, self.store.num_workers, launch_workers=self.store.rules.launch_workers)
        store.load_state(req.meta, req.tensors)
        with self._takeover_lock:
            if self.views[shard].term != term or self.roles.get(shard) is not Role.RESYNCING:
                raise StaleTermError(f"ps:{self.shard} refuses shard {shard}'s state of term {term}: its view moved on "
                                     f"(term {self.views[shard].term}, role {self.roles.get(shard, Role.RESYNCING).value}).")
            if shard == self.shard:
                self.store = store
            else:
                self.backups[shard] = store
            self.roles[shard] = Role.BACKUP
        log.warning("ps:%d: loaded shard %d's state from ps:%d at step %d (record %d, term %d); holds its backup.",
                    self.shard, shard, source, store.version, store.seq, term)
        return Reply({"seq": store.seq})

    def _resync_peer(self, shard: int, asker: int, term: int) -> Reply:
        """The view's backup ``asker`` asks for ``shard``'s state: forward to it from a full state,
        acknowledging alone meanwhile (catching-up); once it holds the state and the records since,
        replies wait for it again and the authority is told (synced). Answered once it holds the state."""
        if term > self.views[shard].term:
            self._ask_quietly("get")
        store = self._copies()[shard]
        with self._takeover_lock:
            v = self.views[shard]
            if v.term != term or v.serving != self.shard or v.backup != asker or self.roles.get(shard) is not Role.SERVING:
                raise StaleTermError(f"ps:{self.shard} does not send shard {shard}'s state to ps:{asker} in term {term}: its "
                                     f"view is term {v.term}, serving {_name(v.serving)}, backup {_name(v.backup)}.")
            if not store.initialized:
                raise not_serving(self.shard, shard, Role.RESYNCING, self.cluster.num_tasks("ps"), v.serving)
            forwarder = self._forwarder(shard, asker, term)
            seq = store.replicate_to(forwarder, {"kind": "state", "shard": shard})
        forwarder.wait_acked(seq, self.failover_s + 60.0)
        if forwarder.replaced:
            raise TrainingError(f"ps:{self.shard} could not send shard {shard}'s state to ps:{asker}: "
                                f"{forwarder.degraded or 'the view moved on'}.")
        with self._takeover_lock:
            if self.views[shard].term != term:
                raise StaleTermError(f"shard {shard}'s view moved past term {term} while ps:{asker} loaded its state.")
            self.waits[shard] = True  # from here on replies wait for the backup; what was acknowledged alone reaches it first
            caught = store.seq
        forwarder.wait_acked(caught, self.failover_s + 60.0)
        if not forwarder.replaced:
            self._ask_quietly("caught_up", shard=shard, term=term)
            log.warning("ps:%d: ps:%d holds shard %d's backup again (state at step %d, record %d; caught up at record %d, "
                        "term %d).", self.shard, asker, shard, store.version, seq, caught, term)
        return Reply({"seq": seq, "version": store.version})

    def resync(self, timeout_s: float) -> None:
        """A restarted ps (``attempt >= 1``, replicas=2): tell the authority it is up (it becomes the
        backup of each shard of its pairs that is alone), load each shard's state from its serving copy,
        and return once every copy here is a backup again (see :mod:`psflow.ps.views`).

        Raises:
            TrainingError: a shard was lost (both copies died) or could not be loaded within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while not self._shutdown.is_set():
            asked = self._ask_quietly("up") if self._left_out() else self._ask_quietly("get")
            with self._takeover_lock:
                lost = [s for s, v in self.views.items() if v.state is Sync.LOST and v.term > 0]
                waiting = [s for s in self.views if self.roles.get(s) is Role.RESYNCING]
            if lost:
                raise TrainingError(
                    f"ps:{self.shard} (attempt {self.attempt}) cannot re-sync shard {lost[0]}: the launcher recorded it "
                    "lost (its serving copy died while no synced copy existed), so its acknowledged updates are gone. "
                    "Restart the run from its newest checkpoint (psflow restart).")
            if not waiting:
                return
            if time.monotonic() >= deadline:
                raise TrainingError(
                    f"ps:{self.shard} (attempt {self.attempt}) could not re-sync shards {waiting} within {timeout_s:g} s "
                    f"({'their serving copies did not send the state' if asked else 'the launcher did not answer'}). "
                    "Raise ready_timeout_s if the serving ps is only slow.")
            self._shutdown.wait(0.1)

    def start_resync(self, timeout_s: float) -> threading.Thread:
        """:meth:`resync` on a thread of its own (the server answers meanwhile: refusals, and the
        states the other ps sends); a failure is kept in ``resync_error``, raised by the ps's loop."""

        def run() -> None:
            try:
                self.resync(timeout_s)
            except PsflowError as e:
                log.error("ps:%d: %s", self.shard, e)
                self.resync_error = e

        thread = threading.Thread(target=run, name=f"psflow-resync-{self.shard}", daemon=True)
        thread.start()
        return thread

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
        wait_for_step = store.config.mode == "sync" and result.get("applied")
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
            attempt=int(req.meta.get("attempt", 0)),
        )
        self._acked(store)
        return Reply({"slowest": slowest})

    def _done(self, req: Request) -> Reply:
        store = self._store_for(req)
        store.worker_done(int(req.meta["worker"]), int(req.meta.get("attempt", 0)), failed=req.meta.get("failed"))
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


_NO_VIEW = ShardView(-1, 0, None, None, Sync.LOST)


def _name(ps: int | None) -> str:
    return "none" if ps is None else f"ps:{ps}"


class _Link:
    """One connection from this ps to another ps, for PS_REPLICATE requests (a forwarder's, or a
    re-sync request); made again where the other ps listens now after a loss."""

    def __init__(self, service: PsService, target: int, *, deadline_s: float | None = None) -> None:
        self.service, self.target = service, target
        self.deadline_s = service.failover_s if deadline_s is None else deadline_s
        self.conn: Connection | None = None

    def send(self, meta: dict[str, Any], tensors: Any, *, timeout_s: float | None = None) -> dict[str, Any]:
        svc = self.service
        if svc.partitioned:  # psflow chaos: nothing leaves for the other ps while cut
            self.close()
            time.sleep(min(1.0, svc.failover_s if timeout_s is None else timeout_s))
            raise TransportError(f"ps:{svc.shard} cannot reach ps:{self.target}: its links to the other ps are cut "
                                 "(psflow chaos partition).")
        if self.conn is None:
            address = svc.cluster.address(TaskId("ps", self.target))
            self.conn = connect(address, secret=svc.server.secret, task=f"ps:{svc.shard}", peer=f"ps:{self.target}",
                                deadline_s=self.deadline_s, resolve=svc.resolve, refused_is_gone=True)
        try:
            return self.conn.request(Op.PS_REPLICATE, meta, tensors,
                                     timeout_s=svc.failover_s + 60.0 if timeout_s is None else timeout_s).meta
        except (TransportError, RemoteError):
            self.close()
            raise

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _initialize(store: ParameterStore, m: dict[str, Any], tensors: Any, forwarder: Forwarder | None) -> bool:
    """A PS_INIT request (the chief's, or its copy forwarded to a backup) carried out on ``store``."""
    values, opt_state, ema_state = split_state(tensors)
    return store.initialize(
        values,
        optimizer=m["optimizer"],
        config=TrainConfig.from_dict(m["config"]),
        placement_digest=str(m.get("placement_digest", "")),
        version=int(m.get("version", 0)),
        schedule=m.get("schedule"),
        ema_decay=m.get("ema_decay"),
        meta=m.get("meta"),
        optimizer_state=opt_state or None,
        ema_state=ema_state or None,
        step_plan=StepPlan.from_dict(m.get("step_plan")),
        data_positions=m.get("data_positions"),
        forwarder=forwarder,
    )


def default_save(service: PsService) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The PS_SAVE handler: this shard writes its own checkpoint file (no parameter leaves the ps)."""
    from psflow import checkpoint

    def save(meta: dict[str, Any]) -> dict[str, Any]:
        exact = int(meta["step"]) if meta.get("exact") else None
        shard = int(meta.get("shard", service.shard))
        version, tensors, positions = service.store_of(shard).checkpoint_state(
            exact, timeout_s=float(meta.get("timeout_s", service.store.config.sync_timeout_s)))
        record = checkpoint.write_shard(
            str(meta["root"]),  # a directory, or a URL (Path would fold its //)
            int(meta["step"]),
            shard,
            int(meta["num_shards"]),
            tensors,
            _crash_after_bytes=meta.get("crash_after_bytes"),
        )
        return {"record": record.to_dict(), "version": version, "data_positions": positions}

    return save
