"""The ps task's service: wire requests -> :class:`ParameterStore` calls, on the task's Server.

Called by psflow.task for a ps task. ``join()`` returns when every worker has said it is done (or a
shutdown request came), which is how a psflow ps exits by itself at the end of a job, unlike
TensorFlow's ``server.join()``.

With ``ps_replicas = 2`` (in the chief's PS_INIT) the service is also its shard's primary, whose
store forwards every recorded event to the backup ps (:mod:`psflow.ps.replication`) and answers a
request only once the backup holds the state the reply shows; and it is the backup of the shard
before it, kept in ``backups`` and fed by that shard's primary (PS_REPLICATE).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from psflow.checkpoint.keys import split_state
from psflow.cluster import ClusterSpec, TaskId
from psflow.config import TrainConfig
from psflow.errors import ConfigError, RemoteError, TrainingError, TransportError
from psflow.ps import requests
from psflow.ps.progress import StepPlan
from psflow.ps.replication import Batch, Forwarder, backup_of
from psflow.ps.rules import Act
from psflow.ps.store import ParameterStore
from psflow.server import Reply, Request, Server
from psflow.wire.conn import Connection, Resolve, connect
from psflow.wire.ops import Op

log = logging.getLogger("psflow.ps")


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
                 resolve: Resolve | None = None, failover_s: float = 5.0) -> None:
        self.server = server
        self.resolve = resolve  # where the backup ps listens now (a launched task's address book)
        self.failover_s = failover_s  # replication: how long the backup may not answer before the primary goes on alone
        self.backups: dict[int, ParameterStore] = {}  # shard -> its copy here (this ps is that shard's backup)
        self._backup_conn: Connection | None = None
        self.serving: dict[int, ParameterStore] = {}  # shard -> the backup copy that took over from its dead primary
        self._takeover_lock = threading.Lock()
        self.shard = shard
        self.cluster = cluster
        self.default_wait_s = default_wait_s
        self.store = ParameterStore(shard, cluster.num_tasks("chief") + cluster.num_tasks("worker"))
        self._shutdown = threading.Event()
        server.on_peer_gone = self._peer_gone
        self.on_save: Callable[[dict[str, Any]], dict[str, Any]] | None = None
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
            try:
                requests.check(self.cluster, op, req.peer, req.meta)
            except ConfigError as e:
                log.warning("ps:%d: %s", self.shard, e)
                raise
            worker = self._worker_of(req.peer)
            if worker is not None and self._store_for(req).worker_back(worker):
                log.warning("ps:%d: worker:%d is back (it sent %s); waiting for it as before.", self.shard, worker, op.name)
            return handler(req)

        return serve

    def _worker_of(self, peer: str) -> int | None:
        """The worker index ``peer`` (an admitted sender) trains as; None for a task that does not train."""
        try:
            task = requests.sender(self.cluster, peer, "lost-worker check")
        except ConfigError:  # not a task of the cluster: a connection that was refused every request
            return None
        return requests.replica_of(self.cluster, task)

    def join(self, timeout_s: float | None = None) -> bool:
        """Block until every worker is done or shutdown was requested. Returns False on timeout."""
        return self._shutdown.wait(timeout_s)

    def stop(self) -> None:
        """Make :meth:`join` return (as a PS_SHUTDOWN request does)."""
        self._shutdown.set()
        if self.store.forwarder is not None:
            self.store.forwarder.close()
        if self._backup_conn is not None:
            self._backup_conn.close()

    def watch_lost_workers(self, now: float) -> None:
        """Called about once a second by the ps's main loop (Task.join), ``now`` from ``time.monotonic()``.

        While any worker still trains, a lost one is not waited for (async goes on without it). Once
        every other worker is done, say once whom the ps waits for; past ``lost_worker_timeout_s`` of
        that, raise. A lost worker that sends a request again resets the wait.

        Raises:
            TrainingError: the ps waited ``lost_worker_timeout_s`` for lost workers only; names them.
        """
        for decision in self.store.tick(now):
            if decision.act is Act.WAIT_LOST:
                log.warning("ps:%d: %s", self.shard, decision.reason)
            elif decision.act is Act.FAIL:
                raise TrainingError(decision.reason)

    # -- handlers --------------------------------------------------------------------------
    def _init(self, req: Request) -> Reply:
        config = TrainConfig.from_dict(req.meta["config"])
        forwarder = None
        if config.ps_replicas == 2 and not self.store.initialized:
            num_ps = self.cluster.num_tasks("ps")
            forwarder = Forwarder(self.shard, backup_of(self.shard, num_ps), self._send_to_backup,
                                  ({**req.meta, "kind": "init", "shard": self.shard}, list(req.tensors.items())),
                                  failover_s=self.failover_s)
        first = _initialize(self.store, req.meta, req.tensors, forwarder)
        self._acked()
        return Reply({"initialized": first, "version": self.store.version})

    # -- replication -----------------------------------------------------------------------
    def _acked(self, store: ParameterStore | None = None) -> None:
        """A primary with a backup: return once the backup holds the state this shard is in now."""
        store = store or self.store
        forwarder = store.forwarder
        if forwarder is not None:
            forwarder.wait_acked(store.seq, self.failover_s + 60.0)

    def _store_for(self, req: Request) -> ParameterStore:
        return self.store_of(req.meta.get("shard"))

    def store_of(self, shard: Any) -> ParameterStore:
        """The store serving ``shard`` here: this ps's own, or (a request that names another shard,
        sent once its primary died) the backup copy, which takes over on the first such request."""
        if shard is None or shard == self.shard:
            return self.store
        store = self.backups.get(shard) if isinstance(shard, int) else None
        if store is None:
            raise ConfigError(f"ps:{self.shard} was asked to serve shard {shard!r}, but holds no copy of it (it serves "
                              f"shard {self.shard} and the backups of {sorted(self.backups)}). Is the job running with "
                              "ps_replicas=2 on every task?")
        with self._takeover_lock:
            if shard not in self.serving:
                store.take_over()
                self.serving[shard] = store
                log.warning("ps:%d: takes over shard %d at step %d: its primary ps:%d is gone.", self.shard, shard,
                            store.version, shard)
        return store

    def _send_to_backup(self, meta: dict[str, Any], tensors: list[tuple[str, Any]]) -> dict[str, Any]:
        """One PS_REPLICATE request to the backup ps, on this primary's own connection (made again
        where the backup listens now after a loss). Called by the forwarder's thread only."""
        backup = backup_of(self.shard, self.cluster.num_tasks("ps"))
        if self._backup_conn is None:
            address = self.cluster.address(TaskId("ps", backup))
            self._backup_conn = connect(address, secret=self.server.secret, task=f"ps:{self.shard}", peer=f"ps:{backup}",
                                        deadline_s=self.failover_s, resolve=self.resolve)
        try:
            return self._backup_conn.request(Op.PS_REPLICATE, meta, tensors, timeout_s=self.failover_s + 60.0).meta
        except (TransportError, RemoteError):
            self._backup_conn.close()
            self._backup_conn = None
            raise

    def _replicate(self, req: Request) -> Reply:
        """This ps as the backup of shard ``shard``: its primary's init, then its events in order."""
        shard = int(req.meta["shard"])
        num_ps = self.cluster.num_tasks("ps")
        if req.peer != f"ps:{shard}" or shard >= num_ps or backup_of(shard, num_ps) != self.shard:
            raise ConfigError(f"PS_REPLICATE from {req.peer} for shard {shard} refused: ps:{self.shard} is the backup "
                              f"of shard {(self.shard - 1) % num_ps} only, and only its primary ps sends its records.")
        store = self.backups.get(shard)
        if req.meta["kind"] == "init":
            if store is None:
                store = ParameterStore(shard, self.store.num_workers)
                _initialize(store, req.meta, req.tensors, None)
                self.backups[shard] = store
                log.info("ps:%d: holds the backup of shard %d (from step %d).", self.shard, shard, store.version)
            return Reply({"seq": store.seq})
        if store is None:
            raise TrainingError(f"ps:{self.shard} received records of shard {shard} before its init: the primary "
                                "must send the init first (it re-syncs this backup).")
        return Reply({"seq": store.follow(Batch.from_wire(req.meta, req.tensors))})

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
        return Reply({"version": version}, list(values.items()))

    def _peer_gone(self, peer: str) -> None:
        """The server's callback: ``peer``'s last connection closed. A worker that never said
        PS_DONE is lost (see ParameterStore.worker_lost)."""
        worker = self._worker_of(peer)  # a worker that dies before its first push is lost all the same
        if worker is None or worker in self.store.done_workers:
            return
        for store in self.serving.values():  # shards taken over from a dead primary
            if worker not in store.done_workers:
                store.worker_lost(worker)
        self.store.worker_lost(worker)
        log.warning("ps:%d: lost worker:%d: its connection closed at global step %d without PS_DONE (killed or crashed?).",
                    self.shard, worker, self.store.version)

    def _push(self, req: Request) -> Reply:
        store = self._store_for(req)
        version = int(req.meta.get("version", 0))
        seq = req.meta.get("seq")
        result = store.push(int(req.meta["worker"]), version, req.tensors, position=req.meta.get("position"),
                                 attempt=int(req.meta.get("attempt", 0)), push_seq=None if seq is None else int(seq))
        if not req.meta.get("pull"):
            self._acked(store)  # acknowledged once the backup holds it
            return Reply(result)
        # Push-pull in one round trip: reply with the values after this update. In sync mode an
        # accepted gradient (or a duplicate of one) waits for its step to complete (a stale one gets
        # the newest values now).
        wait_for_step = store.config.mode == "sync" and result.get("applied")
        current, values = store.pull(
            min_version=version + 1 if wait_for_step else 0,
            timeout_s=float(req.meta.get("timeout_s", store.config.sync_timeout_s)),
        )
        self._acked(store)  # acknowledged once the backup holds it (sync: the step it completed)
        return Reply({**result, "version": current}, list(values.items()))

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
        store.worker_done(int(req.meta["worker"]), int(req.meta.get("attempt", 0)))
        self._acked(store)
        if all(s.all_done() for s in (self.store, *self.serving.values())):
            self._shutdown.set()
        return Reply({"done": sorted(store.done_workers)})

    def _status(self, req: Request) -> Reply:
        s = self.store
        meta: dict[str, Any] = {
            "shard": self.shard,
            "initialized": s.initialized,
            "version": s.version,
            "done_workers": sorted(s.done_workers),
            "lost_workers": sorted(s.lost_workers),
            "stats": s.stats.to_dict(),
        }
        if req.meta.get("clock_log"):
            meta["clock_log"] = s.stats.clock_log
        if s.forwarder is not None or self.backups:  # ps_replicas = 2
            fwd = s.forwarder
            meta["replication"] = {
                "acked_seq": fwd.outbox.acked_seq if fwd else None, "seq": s.seq,
                "degraded": fwd.degraded if fwd else None,
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
            Path(meta["root"]),
            int(meta["step"]),
            shard,
            int(meta["num_shards"]),
            tensors,
            _crash_after_bytes=meta.get("crash_after_bytes"),
        )
        return {"record": record.to_dict(), "version": version, "data_positions": positions}

    return save
