"""The parameter store of one ps shard: values, optimizer, and the waits around its rules. No I/O.

Called by the ps service's connection threads (one per worker), so every state change happens
under one condition variable. What the shard does with each push, clock, finished or lost worker
is decided by :class:`psflow.ps.rules.ShardRules` (a pure state machine: see its docstring for
the three modes, the sync quorum with backup workers, stale gradients, lost workers and the ssp
bound); the store carries its decisions out:

- APPLY: one optimizer step (async/ssp: the pushed gradients; sync: the held gradients of the
  step's workers summed in worker order, so the result does not depend on arrival order, and
  divided by their number);
- HOLD (sync): the received gradients are copied into a buffer this store owns until the step;
- HOLD (ssp): the worker's clock request waits, at most its ``timeout_s``, for RELEASE;
- DROP_STALE, STOPPED, DUPLICATE: the reply says so; FAIL: the reason is raised as a TrainingError;
- REJOINED (a restarted worker's readiness, :meth:`join`): its earlier attempt's held sync position
  is forgotten with its gradient; SUPERSEDED: a request of that earlier attempt is refused with a
  TrainingError, and a clock wait of it still held ends with one.

A push holding NaN or inf never reaches the rules (``TrainConfig.nonfinite``, :mod:`psflow.ps.finite`):
checked before it is applied or held, outside the lock, it is refused (the reply says ``refused``)
or fails the run; it is not recorded, so a backup never sees it. The chief's initial values are
checked the same way.

The whole design note: ``docs/design/ps-store.md``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from psflow.checkpoint.keys import ema_key, opt_key_of
from psflow.config import TrainConfig
from psflow.errors import ConfigError, TrainingError
from psflow.modes import PsMode
from psflow.optim import MovingAverage, OptimizerSpec, Schedule, set_lr
from psflow.ps.finite import NonfiniteBook, describe, nonfinite_keys
from psflow.ps.progress import Progress, StepPlan
from psflow.ps.rules import Act, Decision, Event, On, RuleSettings, ShardRules
from psflow.ps.update import DirectStep

if TYPE_CHECKING:
    from psflow.ps.replication import Batch, Forwarder

log = logging.getLogger("psflow.ps")


@dataclass
class StoreStats:
    pushes: int = 0
    applied_updates: int = 0
    stale_dropped: int = 0
    stale_by_worker: dict[int, int] = field(default_factory=dict)
    steps_without_all: int = 0  # sync steps applied before every one of the M workers had pushed
    duplicates: int = 0  # pushes resent after a reconnect, decided already: not applied again
    superseded: int = 0  # requests of an attempt older than its worker's newest: dropped
    init_requests: int = 0  # PS_INIT received; only the first initializes (a restarted chief sends none)
    wait_s: float = 0.0  # time workers spent blocked in sync/ssp waits on this shard
    # ssp: (worker, the last step its release lets it compute: clock + ahead, the slowest clock) at each release
    clock_log: list[tuple[int, int, int]] = field(default_factory=list)
    # The ledger's ps side: worker -> attempt -> pushes of that attempt this shard applied (sync: held
    # gradients that went into a step). Compared by `psflow chaos` with what each attempt was acknowledged.
    applied_by: dict[int, dict[int, int]] = field(default_factory=dict)
    # worker -> its pushes refused for holding NaN or inf (TrainConfig.nonfinite = refuse); never applied
    nonfinite_by_worker: dict[int, int] = field(default_factory=dict)

    def count_applied(self, worker: int, attempt: int) -> None:
        by_attempt = self.applied_by.setdefault(worker, {})
        by_attempt[attempt] = by_attempt.get(attempt, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "pushes": self.pushes,
            "applied_updates": self.applied_updates,
            "stale_dropped": self.stale_dropped,
            "stale_by_worker": {str(k): v for k, v in sorted(self.stale_by_worker.items())},
            "steps_without_all": self.steps_without_all,
            "duplicates": self.duplicates,
            "superseded": self.superseded,
            "init_requests": self.init_requests,
            "wait_s": round(self.wait_s, 3),
            "applied_by": {str(w): {str(a): n for a, n in sorted(by.items())} for w, by in sorted(self.applied_by.items())},
            "nonfinite_by_worker": {str(k): v for k, v in sorted(self.nonfinite_by_worker.items())},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StoreStats:
        """The counters :meth:`to_dict` wrote (a full state transfer carries them; not the clock log)."""
        return cls(pushes=int(d["pushes"]), applied_updates=int(d["applied_updates"]), stale_dropped=int(d["stale_dropped"]),
                   stale_by_worker={int(k): int(v) for k, v in d["stale_by_worker"].items()},
                   steps_without_all=int(d["steps_without_all"]), duplicates=int(d["duplicates"]),
                   superseded=int(d["superseded"]), init_requests=int(d.get("init_requests", 0)), wait_s=float(d["wait_s"]),
                   applied_by={int(w): {int(a): int(n) for a, n in by.items()} for w, by in d.get("applied_by", {}).items()},
                   nonfinite_by_worker={int(k): int(v) for k, v in d.get("nonfinite_by_worker", {}).items()})


class ParameterStore:
    """Values and update rule of one ps shard."""

    def __init__(self, shard: int, num_workers: int, *, launch_workers: int | None = None) -> None:
        self.shard = shard
        self.num_workers = num_workers
        self.values: dict[str, torch.Tensor] = {}
        self.config = TrainConfig()
        self.placement_digest = ""
        self.meta: dict[str, Any] = {}
        self.stats = StoreStats()
        self.rules = ShardRules(shard, num_workers, launch_workers=launch_workers)  # version, done and lost workers, the sync step, ssp clocks
        self._optimizer: torch.optim.Optimizer | None = None
        self._step: DirectStep | None = None  # applies an update as self._optimizer.step() would
        self._keys: list[str] = []
        self._base_lr = 0.0
        self._schedule: Schedule | None = None
        self._ema: MovingAverage | None = None
        self._buffers: dict[int, dict[str, torch.Tensor]] = {}  # sync: each worker's held gradients
        self._released: dict[tuple[int, int, int], int] = {}  # ssp: (worker, clock, attempt) released -> the slowest clock
        self._superseded: set[tuple[int, int, int]] = set()  # ssp: (worker, clock, attempt) waits a newer attempt ended
        self.progress = Progress()  # exact stop and checkpoint steps, workers' data positions
        self._cond = threading.Condition()
        self._initialized = False
        self._forwarder: Forwarder | None = None  # a primary with a backup: where recorded events go
        self._ship_position: Mapping[str, Any] | None = None  # the data position of the push being decided
        self._ship_updates: dict[int, dict[str, torch.Tensor]] = {}  # APPLY's new version -> the update applied
        self._init_settings: dict[str, Any] = {}  # the PS_INIT's optimizer, schedule, ema_decay (a full state repeats them)
        self._nonfinite = NonfiniteBook(shard)  # refused pushes in a row per worker; the failure they led to
        self._started_at: float | None = None  # the first tick's time: never-connected workers are counted from it

    # -- the rules' state, read --------------------------------------------------------------
    @property
    def mode(self) -> PsMode:
        """What this shard does in the job's update mode (when a push is applied, how a pull reads)."""
        return self.config.mode.ps

    @property
    def version(self) -> int:
        """Updates applied (async/ssp: pushes; sync: steps); shard 0's is the job's global step."""
        return self.rules.version

    @property
    def done_workers(self) -> set[int]:
        """Workers that sent PS_DONE: finished, or stopped on an error (those are lost too, see
        :meth:`worker_done`): a closed connection of theirs is no news."""
        return self.rules.done | self.rules.failed

    @property
    def lost_workers(self) -> set[int]:
        """Workers whose connections closed without PS_DONE (killed, crashed): not waited for where
        backups allow it; a sync step without backups fails at once, naming them. A request clears it."""
        return self.rules.lost

    # -- initialization --------------------------------------------------------------------
    @property
    def initialized(self) -> bool:
        return self._initialized

    def initialize(
        self,
        values: Mapping[str, torch.Tensor],
        *,
        optimizer: dict[str, Any],
        config: TrainConfig,
        placement_digest: str,
        version: int = 0,
        schedule: dict[str, Any] | None = None,
        ema_decay: float | None = None,
        meta: dict[str, Any] | None = None,
        optimizer_state: Mapping[str, torch.Tensor] | None = None,
        ema_state: Mapping[str, torch.Tensor] | None = None,
        step_plan: StepPlan | None = None,
        data_positions: Mapping[str, Any] | None = None,
        forwarder: Forwarder | None = None,
        check_values: bool = True,
    ) -> bool:
        """Set the shard's values once. Returns False (and changes nothing) if already initialized.
        ``forwarder``: replicate to a backup from here on (started here, with the state after init).
        ``check_values``: refuse values holding NaN or inf unless ``config.nonfinite`` is ``apply``
        (off for a copy of a serving shard's state, which is what it is).

        Raises:
            TrainingError: a value holds NaN or inf (names the keys); nothing is set.
        """
        with self._cond:
            self.stats.init_requests += 1
            if self._initialized:
                return False
            if check_values and config.nonfinite != "apply":
                bad = nonfinite_keys(values)
                if bad:
                    raise TrainingError(
                        f"ps shard {self.shard} refused the initial values from the chief: NaN or inf in {describe(bad)} "
                        f"(nonfinite = {config.nonfinite}). Check the model's initialization or the checkpoint it "
                        "was restored from; nonfinite = apply takes them as they are.")
            self.values = {k: v.detach().clone().contiguous() for k, v in values.items()}
            self._keys = list(self.values)
            spec = OptimizerSpec.from_dict(optimizer)
            self._optimizer = spec.build(list(self.values.values())) if self.values else None
            self._step = DirectStep(self._optimizer) if self._optimizer is not None else None
            self._base_lr = spec.lr
            self._schedule = Schedule.from_dict(schedule) if schedule else None
            if optimizer_state and self._optimizer is not None:
                from psflow.optim import load_optimizer_state_tensors

                load_optimizer_state_tensors(self._optimizer, self._keys, optimizer_state)
            if ema_decay is not None:
                self._ema = MovingAverage(ema_decay)
                self._ema.register({k: ema_state.get(k, v) for k, v in self.values.items()} if ema_state else self.values)
            self.config = config
            self.placement_digest = placement_digest
            self.meta = dict(meta or {})
            self._init_settings = {"optimizer": optimizer, "schedule": schedule, "ema_decay": ema_decay}
            self._nonfinite = NonfiniteBook(self.shard, config.nonfinite, config.nonfinite_limit)
            plan = step_plan or StepPlan()
            self.progress.configure(plan, data_positions)
            self._act(self.rules.configure(RuleSettings.of(config, plan.stop_at), version))
            if forwarder is not None:
                self.rules.log = []  # records from here on are shipped (the init itself travels whole)
                self._forwarder = forwarder
                forwarder.start(self.rules.seq)
            self._initialized = True
            self._cond.notify_all()
            return True

    def wait_initialized(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._initialized, timeout=timeout_s)

    # -- reads -----------------------------------------------------------------------------
    def pull(self, *, min_version: int = 0, timeout_s: float = 60.0, averages: bool = False) -> tuple[int, dict[str, torch.Tensor]]:
        """Values at ``version >= min_version`` (waits for it in sync mode)."""
        self._require_init()
        with self._cond:
            if self.version < min_version:
                rules = self.rules
                # Held for a lost worker too (sync without backups): until it comes back or the deadline.
                self._wait(lambda: rules.version >= min_version, timeout_s,
                           lambda: TrainingError(rules.sync_wait_message(min_version, timeout_s)))
            src = self._ema.shadow() if (averages and self._ema) else self.values
            if self.mode.reads_in_place and not averages:
                # Hogwild reads, as TensorFlow's default (use_locking=False): no copy on the hot path.
                return self.version, src
            return self.version, {k: v.clone() for k, v in src.items()}

    # -- updates ---------------------------------------------------------------------------
    def push(
        self, worker: int, version: int, grads: Mapping[str, torch.Tensor], *, position: Mapping[str, Any] | None = None,
        attempt: int = 0, push_seq: int | None = None,
    ) -> dict[str, Any]:
        """Apply (async, ssp) or aggregate (sync) one worker's gradients for this shard.

        ``position`` is the worker's data position after the batch these gradients come from; it
        is recorded when the batch is consumed. Past the step plan's stop nothing is applied and the
        reply says ``stopped``. ``attempt`` and ``push_seq`` fence a restarted worker's earlier
        attempt (TrainingError) and make a resent push a ``duplicate`` (see :mod:`psflow.ps.rules`).
        Gradients holding NaN or inf are refused (the reply says ``refused``) or fail the run, as
        ``config.nonfinite`` says (:mod:`psflow.ps.finite`); the rules never see them.

        Raises:
            TrainingError: as above; or a non-finite push under ``nonfinite = fail``, or the
                ``nonfinite_limit``-th refused push of the worker in a row (names the worker and step).
        """
        self._require_init()
        self._check_grads(grads)
        # Outside the lock: the tensors are this connection's own, and the check is the push's only
        # pass over them before the optimizer's (sync: before they are copied and summed).
        bad = nonfinite_keys(grads) if self.config.nonfinite != "apply" else []
        with self._cond:
            if bad:
                return self._refuse(worker, version, attempt, bad)
            self._nonfinite.accepted(worker)
            self._ship_position = position
            try:
                return self._push(worker, version, grads, position, attempt, push_seq)
            finally:
                self._ship()

    def _refuse(self, worker: int, version: int, attempt: int, keys: list[str]) -> dict[str, Any]:
        """A push holding NaN or inf in ``keys``: counted, never applied (under the lock)."""
        by = self.stats.nonfinite_by_worker
        by[worker] = by.get(worker, 0) + 1
        failure = self._nonfinite.refused(worker, attempt, version, keys, first=by[worker] == 1)
        if failure is not None:
            raise TrainingError(failure)
        return {"version": self.version, "applied": False, "refused": "nonfinite", "nonfinite_keys": keys[:5]}

    def _push(self, worker: int, version: int, grads: Mapping[str, torch.Tensor], position: Mapping[str, Any] | None,
              attempt: int, push_seq: int | None) -> dict[str, Any]:
        """The push's decisions, carried out (under the lock)."""
        self.stats.pushes += 1
        reply: dict[str, Any] = {"applied": True}
        redone = self.mode.applies_each_push and self.progress.applied_already(worker, position, attempt)
        for d in self.rules.push(worker, version, attempt, push_seq, redone):
            if d.act is Act.SUPERSEDED and d.clock is None:
                self.stats.superseded += 1
                raise TrainingError(d.reason)
            if d.act is Act.RETIRED:
                raise TrainingError(d.reason)
            if d.act is Act.DUPLICATE:
                self.stats.duplicates += 1
                reply = {"applied": d.outcome in (Act.APPLY, Act.HOLD), "duplicate": True}
                if d.outcome is Act.DROP_STALE:
                    reply["stale"] = True
                elif d.outcome is Act.STOPPED:
                    reply["stopped"] = True
            elif d.act is Act.STOPPED:
                reply = {"applied": False, "stopped": True}
            elif d.act is Act.DROP_STALE:
                self.progress.consumed(worker, position, attempt)  # a dropped batch is not trained again
                self._act([d])
                reply = {"applied": False, "stale": True}
            elif d.act is Act.FAIL:
                raise TrainingError(d.reason)
            elif d.act is Act.HOLD:
                # The received tensors are the connection's reusable buffers: keep a copy in buffers
                # this store owns (allocated once per worker, reused every step).
                own = self._buffers.setdefault(worker, {})
                for k, g in grads.items():
                    if k not in own:
                        own[k] = torch.empty_like(g)
                    own[k].copy_(g)
                self.progress.pending(worker, position)
            elif d.act is Act.APPLY and self.mode.applies_each_push:
                self.progress.consumed(worker, position, attempt)  # before _apply: a snapshot it takes includes it
                self._apply(grads, d)
            else:
                self._act([d])
        return {"version": self.version, **reply}

    def _act(self, decisions: list[Decision]) -> None:
        """Carry out the decisions of an event that brought no gradients (and a push's sync step),
        and wake the waiters: the event may have changed what they wait for."""
        for d in decisions:
            if d.act is Act.APPLY:
                self._apply_step(d)
            elif d.act is Act.DROP_STALE:
                w = d.workers[0]
                self.stats.stale_dropped += 1
                self.stats.stale_by_worker[w] = self.stats.stale_by_worker.get(w, 0) + 1
            elif d.act is Act.RELEASE:
                w = d.workers[0]
                self._released[(w, d.clock or 0, self.rules.attempts.get(w, 0))] = d.slowest or 0
            elif d.act is Act.REJOINED:
                self.progress.discard_pending(d.workers[0])  # its held gradient left: the batch is redone
            elif d.act is Act.SUPERSEDED and d.clock is not None:
                self._superseded.add((d.workers[0], d.clock, d.attempt or 0))
            elif d.act is Act.RETIRED and d.clock is not None:
                w = d.workers[0]
                self._superseded.add((w, d.clock, self.rules.attempts.get(w, 0)))
            elif d.act is Act.RETIRED and not d.reason:  # a resize retired them: their held batches are not trained
                for w in d.workers:
                    self.progress.discard_pending(w)
                    self._buffers.pop(w, None)
        self._cond.notify_all()

    def _apply_step(self, d: Decision) -> None:
        """Sync: average the held gradients of the step's workers, in worker order (deterministic)."""
        total: dict[str, torch.Tensor] = {}
        for w in d.workers:
            for k, g in self._buffers[w].items():
                total[k] = g.clone() if k not in total else total[k].add_(g)
        for g in total.values():
            g.div_(len(d.workers))
        if d.without_all:
            self.stats.steps_without_all += 1
        self.progress.step_applied()
        self._apply(total, d)

    def _apply(self, grads: Mapping[str, torch.Tensor], d: Decision) -> None:
        """The update that takes the values from version ``d.version - 1`` to ``d.version``."""
        if self._optimizer is not None and self._step is not None:
            if self._schedule is not None:
                set_lr(self._optimizer, self._schedule.lr_at(self._base_lr, d.version - 1))
            self._step([grads[k] for k in self._keys])  # = optimizer.step(), without its per-call wrapper
        self.stats.applied_updates += 1
        for w in d.workers:  # a newer attempt's push supersedes the older's (rules): the newest is the sender
            self.stats.count_applied(w, self.rules.attempts.get(w, 0))
        if self._forwarder is not None:  # a push arrives in its connection's buffers, reused: copied; a step's average is a fresh sum
            self._ship_updates[d.version] = (dict(grads) if self.mode.waits_for_quorum
                                             else {k: g.clone() for k, g in grads.items()})
        if self._ema is not None:
            self._ema.update(self.values, num_updates=d.version)
        if self.progress.wants_snapshot(d.version):
            self.progress.hold(d.version, self.snapshot()[1])
        self._cond.notify_all()

    # -- bounded staleness -----------------------------------------------------------------
    def clock(self, worker: int, clock: int, *, timeout_s: float, attempt: int = 0, ahead: int = 0) -> int:
        """Record ``worker`` at ``clock``; wait until ``clock + ahead`` (the last step it computes from
        the values it reads next: ``ahead`` > 0 with the pipeline) is within staleness of the slowest
        live worker. Returns the slowest live clock when it was released.

        Raises:
            TrainingError: the wait ran out; or ``attempt`` is older than the worker's newest
                (before or while it waits: a restarted worker joined).
        """
        key = (worker, clock, attempt)
        with self._cond, self._recorded():
            decisions = self.rules.clock(worker, clock, attempt, ahead)
            self._raise_superseded(decisions)
            self._act(decisions)

            def expired() -> TrainingError:
                (fail,) = self.rules.clock_expired(worker, clock, timeout_s)
                return TrainingError(fail.reason)

            self._wait(lambda: key in self._released or key in self._superseded, timeout_s, expired)
            if key in self._superseded:
                self._superseded.discard(key)
                self.stats.superseded += 1
                raise TrainingError(f"worker:{worker} attempt {attempt} was waiting at clock {clock} on ps shard "
                                    f"{self.shard} when a newer attempt of it joined: this attempt is superseded.")
            slowest = self._released.pop(key)
            self.stats.clock_log.append((worker, clock + ahead, slowest))
            return slowest

    # -- lifecycle -------------------------------------------------------------------------
    def expect(self, config: TrainConfig, *, by_hand: bool) -> None:
        """Before the chief's PS_INIT (which brings the job's settings): wait for lost and
        never-connected workers as the ps's own ``config`` says (``lost_worker_timeout_s``), and
        know whether a launcher restarts failed workers (``by_hand``: none does)."""
        with self._cond:
            self.rules.by_hand = by_hand
            if not self.rules.configured:
                self.rules.settings = dataclasses.replace(self.rules.settings,
                                                          lost_worker_timeout_s=config.lost_worker_timeout_s)

    def worker_done(self, worker: int, attempt: int = 0, *, failed: str | None = None, stays: bool = False) -> None:
        """PS_DONE of ``worker``: it finished; with ``stays``, its training only (the chief in sync
        and ssp, before its final checkpoint: it counts in no step any more, and the shard serves on
        until its last PS_DONE); with ``failed`` (its error), it stopped without finishing, and is
        lost, not done (a launcher may restart it: see :meth:`ShardRules.worker_failed`)."""
        with self._cond, self._recorded():
            if failed is not None:
                held = worker in self.rules.pending
                decisions = self.rules.worker_failed(worker, attempt, failed)
                if held and worker not in self.rules.pending:
                    self.progress.discard_pending(worker)
                self._raise_superseded(decisions)
                self._act(decisions)
                if worker in self.rules.failed:
                    log.warning("ps shard %d: worker:%d stopped on an error at global step %d: %s", self.shard, worker,
                                self.version, failed)
                return
            decisions = self.rules.worker_done(worker, attempt, stays)
            self._raise_superseded(decisions)
            self._act(decisions)

    def worker_lost(self, worker: int) -> None:
        """``worker``'s connections closed without PS_DONE: stop waiting for it where the mode allows
        (see :meth:`ShardRules.worker_lost`)."""
        with self._cond, self._recorded():
            held = worker in self.rules.pending
            decisions = self.rules.worker_lost(worker)
            if held and worker not in self.rules.pending:
                self.progress.discard_pending(worker)  # before a step its loss completes is applied
            self._act(decisions)

    def join(self, worker: int, attempt: int = 0) -> dict[str, Any]:
        """Training replica ``worker``'s attempt ``attempt`` is ready to train (PS_READY): a newer
        attempt takes over from the earlier one (see :meth:`ShardRules.join`). Returns, read at once
        under the lock, the version, every worker's data position and (ssp) the clock it resumes at.

        Raises:
            TrainingError: ``attempt`` is older than the worker's newest.
        """
        with self._cond, self._recorded():
            decisions = self.rules.join(worker, attempt)
            self._raise_superseded(decisions)
            self._act(decisions)
            out: dict[str, Any] = {"version": self.version, "data_positions": self.progress.positions_now()}
            if self.mode.keeps_clocks:
                out["clock"] = self.rules.clocks.get(worker, 0)
            return out

    def _raise_superseded(self, decisions: list[Decision]) -> None:
        for d in decisions:
            if d.act is Act.SUPERSEDED and d.clock is None:
                self.stats.superseded += 1
                raise TrainingError(d.reason)
            if d.act is Act.RETIRED and d.reason and d.clock is None:
                raise TrainingError(d.reason)

    def resize(self, num_workers: int) -> None:
        """The job's training replicas are now ``0 .. num_workers-1`` (``psflow scale``; see
        :meth:`ShardRules.resize` and :mod:`psflow.ps.membership`)."""
        with self._cond, self._recorded():
            self._act(self.rules.resize(num_workers))
            self.num_workers = num_workers

    def worker_back(self, worker: int) -> bool:
        """A lost ``worker`` sent a request again (restarted): wait for it as before. True if it was lost."""
        # Every request calls this: no lock and no wake-up when nothing changes. Reading the set
        # unlocked is safe: a worker turns lost only once all its connections closed, and this runs
        # while one of them is serving its request.
        if worker not in self.rules.lost:
            return False
        with self._cond, self._recorded():
            decisions = self.rules.worker_back(worker)
            self._act(decisions)
            return bool(decisions)

    def waiting_only_for_lost(self) -> dict[int, int]:
        """Lost worker -> the global step it was lost at, when every other worker is done (the ps
        then serves nobody and only waits for them); else empty."""
        with self._cond:
            return self.rules.waiting_only_for_lost()

    def tick(self, now: float) -> list[Decision]:
        """Time passed (``now`` from ``time.monotonic()``): the lost-worker wait's WAIT_LOST and FAIL
        decisions, for the caller to log or raise; and, once a non-finite push failed the run, a FAIL
        with its reason (the store's own: not a record of the rules, so nothing is shipped for it)."""
        with self._cond, self._recorded():
            decisions = self._never_connected(now) + list(self.rules.tick(now))
            if self._nonfinite.failure is not None:
                decisions.append(Decision(self.rules.seq, Act.FAIL, self.rules.seq, self.version,
                                          reason=self._nonfinite.failure))
            return decisions

    def _never_connected(self, now: float) -> list[Decision]:
        """Members that sent nothing in ``lost_worker_timeout_s`` since the first tick (the ps's
        start) are lost from now on (under the lock). Their decisions are carried out here."""
        if self._started_at is None:
            self._started_at = now
        waited_s = now - self._started_at
        if waited_s < self.rules.settings.lost_worker_timeout_s:
            return []
        out: list[Decision] = []
        for worker in self.rules.unheard():
            decisions = self.rules.never_connected(worker, waited_s)
            self._act(decisions)
            out += decisions
            log.warning("ps shard %d: worker:%d has sent nothing in the %.1f s since the ps started "
                        "(lost_worker_timeout_s=%g): counted lost (never connected).", self.shard, worker, waited_s,
                        self.rules.settings.lost_worker_timeout_s)
        return out

    def all_done(self) -> bool:
        """Every worker finished, none stays for its final duties (one that stopped on an error is
        not done: see :meth:`worker_done`)."""
        return self.rules.is_finished()

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        """A consistent copy of values, optimizer state (``opt/...``) and averages (``ema/...``)."""
        from psflow.optim import optimizer_state_tensors

        with self._cond:
            out = {k: v.detach().clone() for k, v in self.values.items()}
            if self._optimizer is not None:
                for k, v in optimizer_state_tensors(self._optimizer, self._keys).items():
                    out[opt_key_of(k)] = v.detach().clone()
            if self._ema is not None:
                for k, v in self._ema.shadow().items():
                    out[ema_key(k)] = v.detach().clone()
            return self.version, out

    def checkpoint_state(
        self, step: int | None, *, timeout_s: float
    ) -> tuple[int, dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
        """(version, snapshot, workers' data positions) for a checkpoint.

        Args:
            step: the exact step asked for (a step-based checkpoint): the state held when this shard
                reached it, waiting up to ``timeout_s`` for a shard that is behind; None: the state now.
                A step no longer held (asked for very late) gives the state now, whose version says so.
        """
        with self._cond:
            if step is not None:
                self._wait(lambda: self.version >= step, timeout_s, lambda: TrainingError(
                    f"ps shard {self.shard} is at step {self.version} and did not reach step {step}, which the chief "
                    f"asked to checkpoint, within {timeout_s:.1f} s. A worker is stalled; raise sync_timeout_s."))
                held = self.progress.held(step)
                if held is not None:
                    return step, held[0], held[1]
            version, tensors = self.snapshot()
            return version, tensors, self.progress.positions_now()

    def data_positions(self) -> dict[str, dict[str, Any]]:
        """Every worker's data position now (by replica index), for readiness replies."""
        with self._cond:
            return self.progress.positions_now()

    # -- replication -----------------------------------------------------------------------
    @property
    def seq(self) -> int:
        """The last sequence number the shard's rules took (a reply shows the state up to it)."""
        with self._cond:
            return self.rules.seq

    @property
    def forwarder(self) -> Forwarder | None:
        return self._forwarder

    @contextmanager
    def _recorded(self) -> Iterator[None]:
        """Under the lock: whatever the block records goes to the backup, even when it raises."""
        try:
            yield
        finally:
            self._ship()

    def _ship(self) -> None:
        """Hand the events recorded since the last call to the forwarder (under the lock: in order)."""
        if self._forwarder is None:
            return
        log = self.rules.log or []
        events = [r for r in log if isinstance(r, Event)]
        positions = {e.seq: self._ship_position for e in events if e.on is On.PUSH and self._ship_position is not None}
        self._forwarder.add(events, self.rules.seq, positions, self._ship_updates)
        log.clear()
        self._ship_position = None
        self._ship_updates = {}

    def transfer_state(self) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
        """The shard's whole state now, for a re-syncing backup (:meth:`load_state` there), as a
        PS_INIT's fields plus the rules' bookkeeping, pending and held positions, held snapshots and
        counters. Call under the lock (:meth:`replicate_to` does) so that no record slips between."""
        _, tensors = self.snapshot()
        progress_meta, held = self.progress.export()
        meta = {**self._init_settings, "config": self.config.to_dict(), "placement_digest": self.placement_digest,
                "version": self.version, "meta": self.meta, "step_plan": self.progress.plan.to_dict(),
                "data_positions": self.progress.positions_now(), "rules": self.rules.export(),
                "progress": progress_meta, "stats": self.stats.to_dict()}
        return meta, list(tensors.items()) + [(k, t.clone()) for k, t in held.items()]

    def replicate_to(self, forwarder: Forwarder, meta: Mapping[str, Any]) -> int:
        """Forward from now on to a backup that starts from this shard's full state (a re-sync), in
        place of the forwarder there was (replaced: its waiters move to this one). ``meta`` is added
        to the state's. Returns the sequence number the state is at."""
        with self._cond:
            self._require_init()
            state, tensors = self.transfer_state()
            old = self._forwarder
            self.rules.log = []  # every record after the state goes to the new backup
            self._ship_updates = {}
            self._forwarder = forwarder
            forwarder.start(self.rules.seq, ({**state, **meta}, tensors))
            if old is not None:
                old.replace()
            self._cond.notify_all()
            return self.rules.seq

    def stop_forwarding(self, why: str) -> None:
        """The shard's view no longer has the backup this copy forwards to: stop forwarding (its
        waiters are released and see the new view); records are kept no more."""
        with self._cond:
            forwarder, self._forwarder = self._forwarder, None
            self.rules.log = None
            self._ship_updates = {}
            self._cond.notify_all()
        if forwarder is not None:
            forwarder.drop(why)

    def load_state(self, meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
        """A re-syncing backup: become the copy :meth:`transfer_state` captured (this store must be
        new: a restarted ps's). Then :meth:`follow` the records after it.

        Raises:
            TrainingError: this store is initialized already.
        """
        from psflow.checkpoint.keys import split_state

        held = {k: t for k, t in tensors.items() if k.startswith("held/")}
        values, opt_state, ema_state = split_state({k: t for k, t in tensors.items() if not k.startswith("held/")})
        if not self.initialize(
                values, optimizer=meta["optimizer"], config=TrainConfig.from_dict(meta["config"]),
                placement_digest=str(meta.get("placement_digest", "")), version=int(meta["version"]),
                schedule=meta.get("schedule"), ema_decay=meta.get("ema_decay"), meta=meta.get("meta"),
                optimizer_state=opt_state or None, ema_state=ema_state or None,
                step_plan=StepPlan.from_dict(meta.get("step_plan")), data_positions=meta.get("data_positions"),
                check_values=False):
            raise TrainingError(f"ps shard {self.shard}'s copy here is initialized already: a full state is loaded only "
                                "into the empty copy of a restarted ps.")
        with self._cond:
            self.rules = ShardRules.restore(self.shard, self.num_workers, meta["rules"])
            self.num_workers = self.rules.num_workers
            self.progress.restore(meta.get("progress") or {}, held)
            self.stats = StoreStats.from_dict(meta["stats"])
            self._cond.notify_all()

    def take_over(self) -> None:
        """This backup copy serves the shard now (see :meth:`ShardRules.take_over`): the held sync
        gradients' data positions leave with them (their batches are resent and taken again)."""
        with self._cond, self._recorded():
            for worker in sorted(self.rules.pending):
                self.progress.discard_pending(worker)
            self.rules.take_over()
            self._cond.notify_all()

    def follow(self, batch: Batch) -> int:
        """A backup's store: step the rules with the primary's events, in order, and carry their
        decisions out with the shipped updates. Returns the last sequence number held.

        Raises:
            TrainingError: an event skips a number, or the rules decided differently from the
                primary (no update for an APPLY, or a different sequence number after the batch).
        """
        from psflow.ps.replication import check_next

        self._require_init()
        with self._cond:
            applied = False
            for ev in batch.events:
                if not check_next(self.shard, ev.seq, self.rules.seq):
                    continue  # held already: a batch resent after a reconnect
                applied = True
                held = ev.on is On.LOST and ev.worker in self.rules.pending
                decisions = self.rules.step(ev)
                if held and ev.worker not in self.rules.pending:
                    self.progress.discard_pending(ev.worker)
                self._follow(ev, decisions, batch)
            if applied and self.rules.seq != batch.last_seq:
                raise TrainingError(
                    f"The backup of ps shard {self.shard} is at record {self.rules.seq} after a batch the primary "
                    f"ended at {batch.last_seq}: its rules decided differently. The copies diverged; re-sync it.")
            self._cond.notify_all()
            return self.rules.seq

    def _follow(self, ev: Event, decisions: list[Decision], batch: Batch) -> None:
        position = batch.positions.get(ev.seq)
        worker = ev.worker if ev.worker is not None else -1
        if ev.on is On.PUSH:
            self.stats.pushes += 1
        for d in decisions:
            if d.act is Act.APPLY:
                update = batch.updates.get(d.version)
                if update is None:
                    raise TrainingError(
                        f"The backup of ps shard {self.shard} decided to apply version {d.version} (event {ev.seq}), "
                        "but the primary sent no update for it: the copies diverged; re-sync it.")
                if self.mode.waits_for_quorum:
                    if d.without_all:
                        self.stats.steps_without_all += 1
                    self.progress.step_applied()
                else:
                    self.progress.consumed(worker, position, ev.attempt)
                self._apply(update, d)
            elif d.act is Act.HOLD and ev.on is On.PUSH:
                self.progress.pending(worker, position)  # the gradient itself stays on the primary
            elif d.act is Act.DROP_STALE:
                self.progress.consumed(worker, position, ev.attempt)
                self._act([d])
            elif d.act is Act.DUPLICATE:
                self.stats.duplicates += 1
            elif d.act is Act.SUPERSEDED and d.clock is None:
                self.stats.superseded += 1
            elif d.act not in (Act.FAIL, Act.STOPPED):
                self._act([d])

    # -- helpers ---------------------------------------------------------------------------
    def _require_init(self) -> None:
        if not self._initialized:
            raise TrainingError(
                f"ps shard {self.shard} is not initialized yet: the chief has not sent the initial values. "
                "Wait for readiness (the trainer does) or check that the chief is running."
            )

    def _check_grads(self, grads: Mapping[str, torch.Tensor]) -> None:
        if grads.keys() != self.values.keys():
            missing = sorted(set(self.values) - set(grads))[:5]
            extra = sorted(set(grads) - set(self.values))[:5]
            raise ConfigError(
                f"Gradients for ps shard {self.shard} do not match its parameters (missing {missing}, unexpected {extra}). "
                "Every worker must build the same model with the same placement."
            )
        for k, g in grads.items():
            v = self.values[k]
            if g.shape != v.shape or g.dtype != v.dtype:
                raise ConfigError(
                    f"Gradient {k!r} has shape {tuple(g.shape)} {g.dtype}; the parameter is {tuple(v.shape)} {v.dtype}."
                )

    def _wait(self, pred, timeout_s: float, error) -> None:
        t0 = time.monotonic()
        ok = self._cond.wait_for(pred, timeout=timeout_s)
        self.stats.wait_s += time.monotonic() - t0
        if not ok:
            raise error()
