"""A ps's copies of shards under replication (``ps_replicas = 2``): the views it carries out, the
records it sends and takes, and the states it loads.

:class:`ShardCopies` is the part of :class:`~psflow.ps.service.PsService` that owns, per shard this
ps holds a copy of: its :class:`~psflow.ps.replication.Role`, the newest
:class:`~psflow.ps.views.ShardView` it knows (asked of the authority, the launcher, every quarter of
its lease and whenever a message names a newer term), whether replies wait for the backup, and the
lease under which it may reply at all. It carries each new view out (:meth:`ShardCopies._apply_view`:
keep serving, take over as the promoted backup, or drop the copy and load the state again), answers
PS_REPLICATE (the serving copy's init, state and record batches, each checked against the view's
term; a backup's request for the state) and, for a restarted ps, brings its copies back
(:meth:`ShardCopies.resync`). The rules themselves are pure, in :mod:`psflow.ps.views`; the record
stream is :mod:`psflow.ps.replication`. The service (the request handler) calls :meth:`store_of`
for every routed request and :meth:`_acked` before every reply.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from psflow.checkpoint.keys import split_state
from psflow.cluster import ClusterSpec, TaskId
from psflow.config import TrainConfig
from psflow.errors import ConfigError, NotServingError, PsflowError, RemoteError, StaleTermError, TrainingError, TransportError
from psflow.ps import bounds, requests
from psflow.ps.authority import ViewClient
from psflow.ps.progress import StepPlan
from psflow.ps.replication import Applier, Batch, Forwarder, Role, Send, backup_of, not_serving, pair_other, shards_held
from psflow.ps.store import ParameterStore
from psflow.ps.views import Lease, ShardView, Sync, Verdict, accepts_records, initial_views, keeps_serving, takes_over
from psflow.server import Reply, Request, Server
from psflow.wire.conn import Connection, Resolve, connect
from psflow.wire.frame import FrameError, TensorSpec
from psflow.wire.ops import Op

log = logging.getLogger("psflow.ps")


class ShardCopies:
    """The replication half of a ps's service (see the module docstring); set up by :meth:`_init_copies`."""

    server: Server
    shard: int
    cluster: ClusterSpec
    store: ParameterStore
    resolve: Resolve | None
    failover_s: float
    attempt: int
    _shutdown: threading.Event
    _maybe_finished: Callable[[], None]  # the service's: every worker is done on the copies it serves

    def _init_copies(self, replicas: int, authority: ViewClient | None, lease_s: float) -> None:
        shard, cluster = self.shard, self.cluster
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
        self._appliers: dict[int, Applier] = {}  # shard -> the thread applying this backup copy's held records
        self._catching: dict[int, tuple[int, int]] = {}  # shard -> (term, record): its backup caught up there
        self.partitioned = False  # psflow chaos: this ps's links to the other ps are cut (see partition())
        self.resync_error: PsflowError | None = None  # why the re-sync failed (raised by watch_lost_workers)
        if replicas != 2 or cluster.num_tasks("ps") < 2:
            return
        if authority is None:
            raise ConfigError(f"ps:{shard} keeps a second copy of each shard (ps_replicas=2), which needs one authority "
                              "over the copies: the launcher's (psflow run --ps-replicas 2). A ps started by hand has "
                              "none; run by hand with ps_replicas=1, or launch the job with psflow run.")
        views = initial_views(cluster.num_tasks("ps"))
        for s in shards_held(shard, cluster.num_tasks("ps")):
            self.views[s] = views[s]
            if self.attempt >= 1:  # a restarted ps: its copies died with its last attempt; both come back from the other ps
                self.views[s] = ShardView(s, 0, None, None, Sync.LOST)
                self.roles[s] = Role.RESYNCING
                if s != shard:
                    self.backups[s] = ParameterStore(s, self.store.num_workers)
        self.waits = {s: self.attempt == 0 and s == shard for s in self.views}
        threading.Thread(target=self._poll_views, name=f"psflow-views-{shard}", daemon=True).start()

    def _copies(self) -> dict[int, ParameterStore]:
        return {self.shard: self.store, **self.backups}

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
            for shard, term in self._caught_up_unrecorded():
                self._ask_quietly("caught_up", shard=shard, term=term)
            self._shutdown.wait(self.lease.lease_s / 4)

    def _caught_up_unrecorded(self) -> list[tuple[int, int]]:
        """Shards whose backup caught up here in a term the launcher still records as catching-up (the
        report was lost): (shard, term) to report again."""
        out = []
        with self._takeover_lock:
            for shard, (term, seq) in list(self._catching.items()):
                v, store = self.views[shard], self._copies().get(shard)
                if v.term != term or v.state is not Sync.CATCHING_UP:
                    del self._catching[shard]
                elif store is not None and store.forwarder is not None and store.forwarder.outbox.acked_seq >= seq:
                    out.append((shard, term))
        return out

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
                if store is not None and store.forwarder is not None:  # no new term keeps a record stream valid
                    store.stop_forwarding(f"term {v.term}: shard {s}'s backup is {ps_name(v.backup)} now ({v.state.value})")
            elif store is not None and store.initialized and takes_over(known, v, me, role is Role.BACKUP) \
                    and self._drained(s):
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
            log.warning("ps:%d: stops serving shard %d: term %d names %s serving.", me, s, v.term, ps_name(v.serving))
        self.roles[s] = Role.RESYNCING
        self.waits[s] = False
        return v.backup == me

    def _drained(self, shard: int) -> bool:
        """A takeover first applies every record the backup holds; False: it could not (the copies diverged)."""
        try:
            self._drain(shard)
            return True
        except PsflowError as e:
            log.error("ps:%d: cannot serve shard %d: %s", self.shard, shard, e)
            return False

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
        term = req.meta.get("term")
        if isinstance(term, int) and self.views and term > self.views.get(self._shard_of(req), NO_VIEW).term:
            self._ask_quietly("get")  # the worker saw a newer term than this copy knows: its view may have moved
        return self.store_of(req.meta.get("shard"))

    def _shard_of(self, req: Request) -> int:
        shard = req.meta.get("shard")
        return shard if isinstance(shard, int) else self.shard

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
            raise not_serving(self.shard, s, role, self.cluster.num_tasks("ps"), self.views.get(s, NO_VIEW).serving)
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
        other = self._replicator(shard, kind, req.peer)
        term = int(req.meta.get("term", 0))
        if kind == "resync":
            return self._resync_peer(shard, other, term)
        refusal = self._term_refusal(shard, other, term, kind)
        if refusal is not None:
            raise StaleTermError(refusal)
        what = f"PS_REPLICATE {kind!r} from {req.peer} for shard {shard}"
        if kind in ("init", "state"):
            self._check_tensors(what, req.meta, bounds.declared(req.tensors.items()))
        if kind == "init":
            with self._takeover_lock:
                return self._backup_init(shard, req)
        if kind == "state":
            return self._load_state(shard, other, term, req)
        with self._takeover_lock:  # held with the view: a takeover drains every batch held before it
            if accepts_records(self.views[shard], self.shard, other, term) is not Verdict.ACCEPT:
                raise StaleTermError(f"ps:{self.shard} refuses ps:{other}'s records of shard {shard} in term {term}: its "
                                     f"view moved to term {self.views[shard].term} meanwhile.")
            role = self.roles.get(shard)
            store = self.backups.get(shard) if shard != self.shard else self.store
            if store is None or not store.initialized or role is not Role.BACKUP:
                raise TrainingError(f"ps:{self.shard} received records of shard {shard} before its init or state: the "
                                    "serving copy must send that first (it re-syncs this backup).")
            self._check_tensors(what, req.meta, bounds.declared(req.tensors.items()))
            return Reply({"seq": self._applier(shard, store).hold(Batch.from_wire(req.meta, req.tensors))})

    def _replicator(self, shard: int, kind: str, peer: str) -> int:
        """The ps that may send ``shard``'s records to this one: ``peer``, if it is the other ps of the
        shard's pair (and, for an ``init``, this ps holds the shard's backup).

        Raises:
            ConfigError: another sender, or a shard this ps holds no copy of.
        """
        num_ps = self.cluster.num_tasks("ps")
        held = 0 <= shard < num_ps and shard in shards_held(self.shard, num_ps) and shard in self.views
        other = pair_other(shard, self.shard, num_ps) if held else None
        if other is None or peer != f"ps:{other}" or (kind == "init" and backup_of(shard, num_ps) != self.shard):
            raise ConfigError(f"PS_REPLICATE {kind!r} from {peer} for shard {shard} refused: ps:{self.shard} holds "
                              f"copies of shards {shards_held(self.shard, num_ps)} only, each shared with the other ps "
                              "of its pair, and only that ps sends its records.")
        return other

    def _admit_replicate(self, peer: str, meta: dict[str, Any], specs: list[TensorSpec]) -> None:
        """A PS_REPLICATE's tensors, before their bytes are received: from the other ps of the shard's
        pair, each a tensor this ps's copy of the shard holds (:mod:`psflow.ps.bounds`): an ``init`` or
        ``state`` a state of it (its values once initialized, before that the placement the request
        declares), a ``batch`` updates of its values. A batch for a copy not initialized yet is refused
        whatever it holds; of an older term as stale (kind StaleTermError, as the handler answers it:
        the sender then asks for the new view).

        Raises:
            FrameError: what is refused; the server answers ERROR and closes the connection, nothing
                received or changed.
        """
        try:
            requests.check(self.cluster, Op.PS_REPLICATE, peer, meta)
            shard, kind = meta["shard"], meta["kind"]
            other = self._replicator(shard, kind, peer)
            store = self._copies().get(shard)
            if kind == "batch" and (store is None or not store.initialized):
                self._admit_records_term(shard, other, meta.get("term", 0))
                raise ConfigError(f"PS_REPLICATE 'batch' from {peer} for shard {shard} refused: ps:{self.shard}'s copy "
                                  "of the shard is not initialized: the serving copy must send its init or state first.")
            self._check_tensors(f"PS_REPLICATE {kind!r} from {peer} for shard {shard}", meta, bounds.declared(specs))
        except ConfigError as e:
            log.warning("ps:%d: %s", self.shard, e)
            raise FrameError(f"{e} (Refused before its payload was received; the connection is closed.)") from e

    def _admit_records_term(self, shard: int, other: int, term: object) -> None:
        """Refuse a batch of an older term than this ps's view of ``shard`` as the handler would
        (StaleTermError: the sender asks for the new view at once), asking the authority first for a newer term.

        Raises:
            ConfigError: ``term`` is not an integer.
            FrameError: of kind StaleTermError, the term is not the view's.
        """
        if not isinstance(term, int) or isinstance(term, bool):
            raise ConfigError(f"PS_REPLICATE 'batch' from ps:{other} refused: field 'term' must be an integer; received {term!r}.")
        refusal = self._term_refusal(shard, other, term, "batch")
        if refusal is not None:
            raise _StaleRecords(refusal)

    def _term_refusal(self, shard: int, other: int, term: int, what: str) -> str | None:
        """None where the shard's view accepts ``other``'s records of ``term`` (asking the launcher
        for the view once where it cannot tell), else why it refuses them."""
        verdict = accepts_records(self.views[shard], self.shard, other, term)
        if verdict is Verdict.ASK:
            self._ask_quietly("get")
            verdict = accepts_records(self.views[shard], self.shard, other, term)
        if verdict is Verdict.ACCEPT:
            return None
        v = self.views[shard]
        return (f"ps:{self.shard} refuses ps:{other}'s {what} of shard {shard} in term {term}: its view of the shard is "
                f"term {v.term}, serving {ps_name(v.serving)}, backup {ps_name(v.backup)}. "
                f"ps:{other} must ask the launcher for the shard's view.")

    def _check_tensors(self, what: str, meta: dict[str, Any], tensors: list[bounds.Declared]) -> None:
        """Raises ConfigError unless ``tensors`` fit this ps's copy of the shard (see :meth:`_admit_replicate`)."""
        shard, kind = int(meta["shard"]), meta["kind"]
        store = self._copies().get(shard)
        if store is not None and store.initialized:
            layout = bounds.Layout.of_values(shard, store.values)
        elif kind in ("init", "state"):
            layout = bounds.Layout.of_request(shard, meta, self.cluster.num_tasks("ps"), what)
        else:
            layout = bounds.Layout(shard, {}, "now")
        if kind == "batch":
            events = meta.get("events")
            bounds.check_updates(what, layout, tensors, len(events) if isinstance(events, list) else 0)
        elif kind == "state":
            progress = meta.get("progress")
            held = progress.get("held") if isinstance(progress, dict) else None
            bounds.check_state(what, layout, bounds.check_held(what, layout, tensors, held))
        elif kind == "init":
            bounds.check_state(what, layout, tensors)
        elif tensors:
            raise ConfigError(f"{what} refused: a {kind!r} request carries no tensors; this one declares {len(tensors)}.")

    def _applier(self, shard: int, store: ParameterStore) -> Applier:
        """The thread that applies ``store``'s held records (one per copy: a loaded state starts a new one)."""
        with self._takeover_lock:
            applier = self._appliers.get(shard)
            if applier is None or applier.store is not store:
                if applier is not None:
                    applier.close()
                applier = self._appliers[shard] = Applier(shard, store.follow, store.seq, self._maybe_finished)
                applier.store = store
            return applier

    def holds(self, shard: int) -> int:
        """The last record of ``shard`` this ps's copy holds (applied, or held to be applied)."""
        applier = self._appliers.get(shard)
        store = self._copies()[shard]
        return applier.held_seq if applier is not None and applier.store is store else store.seq

    def _drain(self, shard: int, timeout_s: float = 60.0) -> None:
        """Every record this backup copy holds, applied (before it serves, or reports its counters)."""
        applier = self._appliers.get(shard)
        if applier is not None and applier.store is self._copies().get(shard):
            applier.drain(timeout_s)

    def _backup_init(self, shard: int, req: Request) -> Reply:
        """The primary's forwarded PS_INIT: this ps holds the shard's backup from its start."""
        store = self.backups.get(shard)
        if store is None or not store.initialized:
            store = store or ParameterStore(shard, self.store.num_workers, launch_workers=self.store.rules.launch_workers)
            initialize_store(store, req.meta, req.tensors, None)
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
                                     f"view is term {v.term}, serving {ps_name(v.serving)}, backup {ps_name(v.backup)}.")
            if not store.initialized:
                raise not_serving(self.shard, shard, Role.RESYNCING, self.cluster.num_tasks("ps"), v.serving)
            forwarder = self._forwarder(shard, asker, term)
            seq = store.replicate_to(forwarder, {"kind": "state", "shard": shard})
        forwarder.wait_acked(seq, self.failover_s + 60.0)
        if forwarder.replaced:
            raise TrainingError(f"ps:{self.shard} could not send shard {shard}'s state to ps:{asker}: "
                                f"{forwarder.degraded or 'the view moved on'}.")
        self._ship_backlog(store, forwarder)
        with self._takeover_lock:
            if self.views[shard].term != term:
                raise StaleTermError(f"shard {shard}'s view moved past term {term} while ps:{asker} loaded its state.")
            self.waits[shard] = True  # from here on replies wait for the backup; what was acknowledged alone reaches it first
            caught = store.seq
            self._catching[shard] = (term, caught)  # the poll says it again until the launcher has recorded it
        forwarder.wait_acked(caught, self.failover_s + 60.0)
        if not forwarder.replaced:
            self._ask_quietly("caught_up", shard=shard, term=term)
            log.warning("ps:%d: ps:%d holds shard %d's backup again (state at step %d, record %d; caught up at record %d, "
                        "term %d).", self.shard, asker, shard, store.version, seq, caught, term)
        return Reply({"seq": seq, "version": store.version})

    def _ship_backlog(self, store: ParameterStore, forwarder: Forwarder, *, small: int = 64, rounds: int = 20) -> None:
        """Before replies wait for a new backup: ship the records acknowledged alone while it loaded the
        state (the backlog, megabytes of gradients), round after round, until what is left is small,
        so that the first replies that wait do not wait for the whole backlog to cross."""
        for _ in range(rounds):
            target = store.seq
            if target - forwarder.outbox.acked_seq <= small:
                return
            forwarder.wait_acked(target, self.failover_s + 60.0)  # ships what is queued itself
            if forwarder.replaced:
                return

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


NO_VIEW = ShardView(-1, 0, None, None, Sync.LOST)


class _StaleRecords(FrameError):
    """A batch of an older term, refused on its head as the handler refuses it (its tensors unread)."""

    kind = "StaleTermError"


def ps_name(ps: int | None) -> str:
    return "none" if ps is None else f"ps:{ps}"


class _Link:
    """One connection from this ps to another ps, for PS_REPLICATE requests (a forwarder's, or a
    re-sync request); made again where the other ps listens now after a loss."""

    def __init__(self, service: ShardCopies, target: int, *, deadline_s: float | None = None) -> None:
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


def initialize_store(store: ParameterStore, m: dict[str, Any], tensors: Any, forwarder: Forwarder | None) -> bool:
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
