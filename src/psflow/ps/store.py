"""The parameter store of one ps shard: values, optimizer, update rules. No I/O.

Called by the ps service's connection threads (one per worker), so every state change happens
under one condition variable. The store applies updates in one of three modes (TrainConfig):

- async: a push is applied at once; ``version`` counts applied pushes.
- sync:  a push carries the version its gradients were computed from. Gradients of the current
  version are held until N workers have sent theirs; then they are summed in worker order (so the
  result does not depend on arrival order), divided by N and applied once, and ``version`` grows by
  one. A gradient of an older version is stale: dropped and counted. A worker that waits for the
  next version waits at most ``sync_timeout_s``; the error names the workers still missing.
- ssp:   async updates, plus worker clocks: a worker at clock c waits until every live worker's
  clock is at least c - staleness.

``version`` of shard 0 is the job's ``global_step``: every worker push reaches every shard.
Exact stop and checkpoint steps, and the workers' data positions, are kept in ``progress``
(:mod:`psflow.ps.progress`), updated under the same lock as the values.
State changes are also kept as an ordered count (``version``) so a later primary-backup replica can
replay them in order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from psflow.checkpoint.keys import ema_key, opt_key_of
from psflow.config import TrainConfig
from psflow.errors import ConfigError, TrainingError
from psflow.optim import MovingAverage, OptimizerSpec, Schedule, set_lr
from psflow.ps.progress import Progress, StepPlan


@dataclass
class StoreStats:
    pushes: int = 0
    applied_updates: int = 0
    stale_dropped: int = 0
    stale_by_worker: dict[int, int] = field(default_factory=dict)
    steps_without_all: int = 0  # sync steps applied before every one of the M workers had pushed
    wait_s: float = 0.0  # time workers spent blocked in sync/ssp waits on this shard
    clock_log: list[tuple[int, int, int]] = field(default_factory=list)  # ssp: (worker, clock, slowest clock) at release

    def to_dict(self) -> dict[str, Any]:
        return {
            "pushes": self.pushes,
            "applied_updates": self.applied_updates,
            "stale_dropped": self.stale_dropped,
            "stale_by_worker": {str(k): v for k, v in sorted(self.stale_by_worker.items())},
            "steps_without_all": self.steps_without_all,
            "wait_s": round(self.wait_s, 3),
        }


class ParameterStore:
    """Values and update rule of one ps shard."""

    def __init__(self, shard: int, num_workers: int) -> None:
        self.shard = shard
        self.num_workers = num_workers
        self.values: dict[str, torch.Tensor] = {}
        self.version = 0
        self.config = TrainConfig()
        self.placement_digest = ""
        self.meta: dict[str, Any] = {}
        self.stats = StoreStats()
        self.done_workers: set[int] = set()
        # Workers whose connections closed without PS_DONE (killed, crashed): not waited for where
        # backups allow it; a sync step without backups fails at once, naming them. A push clears it.
        self.lost_workers: set[int] = set()
        self.lost_at: dict[int, int] = {}  # lost worker -> the version (global step) when its connection closed
        self._optimizer: torch.optim.Optimizer | None = None
        self._keys: list[str] = []
        self._base_lr = 0.0
        self._schedule: Schedule | None = None
        self._ema: MovingAverage | None = None
        self._pending: dict[int, dict[str, torch.Tensor]] = {}
        self._buffers: dict[int, dict[str, torch.Tensor]] = {}
        self._clocks: dict[int, int] = {}
        self.progress = Progress()  # exact stop and checkpoint steps, workers' data positions
        self._cond = threading.Condition()
        self._initialized = False

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
    ) -> bool:
        """Set the shard's values once. Returns False (and changes nothing) if already initialized."""
        with self._cond:
            if self._initialized:
                return False
            self.values = {k: v.detach().clone().contiguous() for k, v in values.items()}
            self._keys = list(self.values)
            spec = OptimizerSpec.from_dict(optimizer)
            self._optimizer = spec.build(list(self.values.values())) if self.values else None
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
            self.version = version
            self.meta = dict(meta or {})
            self.progress.configure(step_plan or StepPlan(), data_positions)
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
                fatal = lambda: self.config.mode == "sync" and bool(self.lost_workers) and not self._has_backups()  # noqa: E731
                self._wait(lambda: self.version >= min_version or fatal(), timeout_s,
                           lambda: self._sync_wait_error(min_version, timeout_s))
                if self.version < min_version:
                    raise self._lost_error()
            src = self._ema.shadow() if (averages and self._ema) else self.values
            if self.config.mode == "async" and not averages:
                # Hogwild reads, as TensorFlow's default (use_locking=False): no copy on the hot path.
                return self.version, src
            return self.version, {k: v.clone() for k, v in src.items()}

    # -- updates ---------------------------------------------------------------------------
    def push(
        self, worker: int, version: int, grads: Mapping[str, torch.Tensor], *, position: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Apply (async, ssp) or aggregate (sync) one worker's gradients for this shard.

        ``position`` is the worker's data position after the batch these gradients come from; it
        is recorded when the batch is consumed. Past the step plan's stop nothing is applied and the
        reply says ``stopped``.
        """
        self._require_init()
        self._check_grads(grads)
        with self._cond:
            self.stats.pushes += 1
            self._back(worker)  # a restarted worker
            if self.progress.is_stopped(self.version):
                return {"version": self.version, "applied": False, "stopped": True}
            if self.config.mode != "sync":
                self.progress.consumed(worker, position)  # before _apply: a snapshot it takes includes it
                self._apply(grads)
                return {"version": self.version, "applied": True}
            if version < self.version or worker in self._pending:
                self.progress.consumed(worker, position)  # a dropped batch is not trained again
                self.stats.stale_dropped += 1
                self.stats.stale_by_worker[worker] = self.stats.stale_by_worker.get(worker, 0) + 1
                return {"version": self.version, "applied": False, "stale": True}
            if version > self.version:
                raise TrainingError(
                    f"worker:{worker} pushed gradients for version {version}, but ps shard {self.shard} is at "
                    f"version {self.version}. The worker pulled from a different job or a restarted ps; restart the worker."
                )
            # The received tensors are the connection's reusable buffers: keep a copy in buffers this
            # store owns (allocated once per worker, reused every step).
            own = self._buffers.setdefault(worker, {})
            for k, g in grads.items():
                if k not in own:
                    own[k] = torch.empty_like(g)
                own[k].copy_(g)
            self._pending[worker] = own
            self.progress.pending(worker, position)
            self._maybe_complete_step()
            return {"version": self.version, "applied": True}

    def _needed(self) -> int:
        n = self.config.replicas_to_aggregate or self.num_workers
        # Finished workers lower the quorum; lost ones only where backups stand in for them (without
        # backups a step never goes on without a worker that did not finish: it fails, naming it).
        gone = self.done_workers | self.lost_workers if self._has_backups() else self.done_workers
        return max(1, min(n, self.num_workers - len(gone)))

    def _has_backups(self) -> bool:
        return (self.config.replicas_to_aggregate or self.num_workers) < (self.config.total_num_replicas or self.num_workers)

    def _lost_error(self) -> TrainingError:
        names = ", ".join(f"worker:{w}" for w in sorted(self.lost_workers))
        n = self.config.replicas_to_aggregate or self.num_workers
        return TrainingError(
            f"{names} lost its connection to ps shard {self.shard} without finishing (killed or crashed?), and sync "
            f"training without backup workers (replicas_to_aggregate = total_num_replicas = {n}) cannot take a step "
            "without it. Restart the run (it resumes from the last checkpoint under a Supervisor), or give it backup "
            "workers (total_num_replicas > replicas_to_aggregate) so that steps go on without a lost worker."
        )

    def _maybe_complete_step(self) -> None:
        if not self._pending or len(self._pending) < self._needed():
            return
        workers = sorted(self._pending)
        n = len(workers)
        total: dict[str, torch.Tensor] = {}
        for w in workers:  # reduce in worker order, not arrival order: deterministic
            for k, g in self._pending[w].items():
                total[k] = g.clone() if k not in total else total[k].add_(g)
        for g in total.values():
            g.div_(n)
        m = self.config.total_num_replicas or self.num_workers
        if n < m - len(self.done_workers):  # lost workers count as missing here
            self.stats.steps_without_all += 1
        self._pending.clear()
        self.progress.step_applied()
        self._apply(total)

    def _apply(self, grads: Mapping[str, torch.Tensor]) -> None:
        if self._optimizer is not None:
            for k, p in self.values.items():
                p.grad = grads[k]
            if self._schedule is not None:
                set_lr(self._optimizer, self._schedule.lr_at(self._base_lr, self.version))
            self._optimizer.step()
            for p in self.values.values():
                p.grad = None
        self.version += 1
        self.stats.applied_updates += 1
        if self._ema is not None:
            self._ema.update(self.values, num_updates=self.version)
        if self.progress.wants_snapshot(self.version):
            self.progress.hold(self.version, self.snapshot()[1])
        self._cond.notify_all()

    # -- bounded staleness -----------------------------------------------------------------
    def clock(self, worker: int, clock: int, *, timeout_s: float) -> int:
        """Record ``worker`` at ``clock``; wait until the slowest live worker is within staleness."""
        s = self.config.staleness
        with self._cond:
            self._clocks[worker] = clock
            self._cond.notify_all()

            def slowest() -> int:
                gone = self.done_workers | self.lost_workers
                live = [c for w, c in self._clocks.items() if w not in gone]
                missing = self.num_workers - len(gone) - len(live)
                return 0 if missing > 0 else min(live, default=clock)

            self._wait(
                lambda: clock - slowest() <= s,
                timeout_s,
                lambda: TrainingError(
                    f"worker:{worker} at clock {clock} waited {timeout_s:.1f} s for the slowest worker "
                    f"(clocks {dict(sorted(self._clocks.items()))}, staleness {s}). A worker is stalled or dead; "
                    "raise sync_timeout_s or restart it."
                ),
            )
            self.stats.clock_log.append((worker, clock, slowest()))
            return slowest()

    # -- lifecycle -------------------------------------------------------------------------
    def worker_done(self, worker: int) -> None:
        with self._cond:
            self.done_workers.add(worker)
            self._clocks.pop(worker, None)
            if self.config.mode == "sync":
                # Fewer live workers lower the number a step needs; the step may now be complete.
                self._maybe_complete_step()
            self._cond.notify_all()

    def worker_lost(self, worker: int) -> None:
        """``worker``'s connections closed without PS_DONE: stop waiting for it where the mode allows
        (async: nothing to do; ssp: it no longer holds the others back; sync with backups: steps
        need one gradient fewer; sync without backups: waiting steps fail, naming it)."""
        with self._cond:
            if worker in self.done_workers:
                return
            self.lost_workers.add(worker)
            self.lost_at.setdefault(worker, self.version)
            self._clocks.pop(worker, None)
            if self.config.mode == "sync" and self._initialized:
                self._pending.pop(worker, None)
                self._maybe_complete_step()
            self._cond.notify_all()

    def worker_back(self, worker: int) -> bool:
        """A lost ``worker`` sent a request again (restarted): wait for it as before. True if it was lost."""
        # Every request calls this: no lock and no wake-up when nothing changes. Reading the set
        # unlocked is safe: a worker turns lost only once all its connections closed, and this runs
        # while one of them is serving its request.
        if worker not in self.lost_workers:
            return False
        with self._cond:
            was_lost = self._back(worker)
            self._cond.notify_all()
            return was_lost

    def _back(self, worker: int) -> bool:
        self.lost_at.pop(worker, None)
        if worker not in self.lost_workers:
            return False
        self.lost_workers.discard(worker)
        return True

    def waiting_only_for_lost(self) -> dict[int, int]:
        """Lost worker -> the global step it was lost at, when every other worker is done (the ps
        then serves nobody and only waits for them); else empty."""
        with self._cond:
            if not self.lost_workers or len(self.done_workers | self.lost_workers) < self.num_workers:
                return {}
            return {w: self.lost_at.get(w, self.version) for w in sorted(self.lost_workers)}

    def all_done(self) -> bool:
        return len(self.done_workers) >= self.num_workers

    def wait_all_done(self, timeout_s: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(self.all_done, timeout=timeout_s)

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

    def _sync_wait_error(self, min_version: int, timeout_s: float) -> TrainingError:
        expected = set(range(self.config.total_num_replicas or self.num_workers)) - self.done_workers - self.lost_workers
        missing = sorted(expected - set(self._pending))
        names = ", ".join(f"worker:{w}" for w in missing) or "none"
        n = self._needed()
        m = self.config.total_num_replicas or self.num_workers
        return TrainingError(
            f"Sync step {self.version} on ps shard {self.shard} waited {timeout_s:.1f} s for version {min_version}: "
            f"has {len(self._pending)} of {n} gradients; missing {names}. "
            + ("There are no backup workers (replicas_to_aggregate == total_num_replicas). " if n >= m else "")
            + "A worker is dead or stalled: restart it, add backup workers, or raise sync_timeout_s."
        )
