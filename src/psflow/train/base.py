"""What every trainer shares, whatever carries its gradients (parameter servers or all-reduce).

``TrainerBase`` owns the construction (the task, the training settings, the optimizer spec, towers
for multi-device replicas), the counters and their reports (``stats``, the launcher's live progress),
the checkpoint a restart starts from (``restore_from``), fault injection at a step, and the
lifecycle. ``Trainer`` (ps, :mod:`psflow.train.trainer`) and ``AllReduceTrainer``
(:mod:`psflow.train.allreduce`) add their transport in ``_init_strategy`` and implement the
surface the training loop calls (``prepare``, ``step``, ``pull``, ``_release``) and what the
Supervisor uses (:class:`SupervisedTrainer`: ``save_shards``, ``job_step``, ...).

States and transitions::

    built --prepare() (or the first step/pull)--> ready --close()--> closed
    built --close()--> closed            (close runs once; later calls do nothing)

``close(failed=...)`` says the task stopped on that error without finishing (the ps count it lost,
not done, so they wait for its restart; :mod:`psflow.ps.rules`).

Invariants: ``global_step`` is the job's step as of this task's last step, pull or prepare;
``local_step`` and ``examples`` count only the steps this task took that the job applied;
``train_time_s`` is the time inside those steps (getting ready excluded), ``wall_time_s`` the time
from the start of the first to the end of the last (the script's own work between steps included).

Rates: ``examples_per_sec`` is the wall-clock rate (examples / ``wall_time_s``), the one a user
sees; ``step_examples_per_sec`` (examples / ``train_time_s``) is the rate inside the steps, higher
by whatever the loop does between them (data, evaluation, logging, checkpoints).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar, Protocol, Self

import torch

from psflow import errorreport, timeline
from psflow.config import TrainConfig
from psflow.errors import ConfigError
from psflow.fault import inject, parse_faults
from psflow.optim import OptimizerSpec, Schedule
from psflow.ps.placement import Placement
from psflow.train.towers import Batch, Towers, batch_examples, run_step_closure


class SupervisedTrainer(Protocol):
    """What the Supervisor uses of a trainer: every trainer derives it through :class:`TrainerBase`,
    whose defaults are those of a trainer without parameter servers (nothing to plan, never
    initialized by an earlier chief, no stop step, no connection to stop retrying)."""

    config: TrainConfig
    model: torch.nn.Module
    params: dict[str, torch.nn.Parameter]
    optimizer: OptimizerSpec
    schedule: Schedule | None
    ema_decay: float | None
    placement: Placement
    worker: int  # this task's replica index
    global_step: int
    local_step: int
    chief_logdir: str | None  # the chief sets it before prepare(); prepare() gives every task the chief's
    ready_info: Mapping[str, Any]  # what prepare() learnt: with parameter servers, each worker's data position
    stopped: bool  # the last step was refused: the job reached its stop step

    def plan_steps(self, *, stop_at: int | None = None, snapshot_every: int | None = None, data: Any = None) -> None: ...
    def ps_initialized(self) -> bool: ...
    def restore_from(self, step: int, tensors: Mapping[str, torch.Tensor], *,
                     data_positions: Mapping[str, Any] | None = None) -> None: ...
    def prepare(self) -> int: ...
    def step(self, closure: Callable[..., torch.Tensor], *, batch: Batch | torch.Tensor | None = None,
             batches: Sequence[Batch | torch.Tensor] | None = None, batch_size: int | None = None) -> float: ...
    def pull(self, *, averages: bool = False) -> int: ...
    def save_shards(self, root: str, step: int, *, exact: bool = False) -> list[dict[str, Any]]: ...
    def job_step(self) -> int: ...
    def job_status(self) -> Mapping[str, Any]: ...
    def waiting(self, what: str) -> contextlib.AbstractContextManager[None]: ...
    def end_training(self) -> None: ...
    def stop_reconnecting(self, reason: str) -> None: ...
    def close(self, failed: str | None = None) -> None: ...


class TrainerBase(SupervisedTrainer, ABC):
    """The parts of a trainer that do not depend on how gradients travel.

    Args:
        model: the model; an ordinary ``torch.nn.Module``.
        optimizer: a psflow optimizer spec, e.g. ``pf.optim.SGD(lr=0.01)``.
        task: the task from ``pf.init()``; default the current one.
        schedule: learning rate by global step, e.g. ``pf.optim.ExponentialDecay(...)``.
        ema_decay: keep moving averages of the parameters (read with ``pull(averages=True)``).
        devices: compute on several local devices (in-graph towers, see :class:`psflow.train.towers.Towers`).
        **settings: TrainConfig fields; given here they override the launcher's.

    Raises:
        ConfigError: the optimizer is not a psflow spec, or a setting is unknown or invalid.
    """

    # Why the optimizer must be a spec, in this strategy's words (the error's second sentence).
    _why_spec: ClassVar[str]

    config: TrainConfig
    towers: Towers | None
    global_step: int
    local_step: int
    examples: int
    train_time_s: float
    wall_time_s: float
    compute_s: float

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: OptimizerSpec,
        task: Any = None,
        *,
        schedule: Schedule | None = None,
        ema_decay: float | None = None,
        devices: Sequence[str | torch.device] | None = None,
        **settings: Any,
    ) -> None:
        if task is None:
            from psflow.task import current_task

            task = current_task()
        if not isinstance(optimizer, OptimizerSpec):
            raise ConfigError(
                f"optimizer must be a psflow optimizer spec such as pf.optim.SGD(lr=0.01); received "
                f"{type(optimizer).__name__}. {self._why_spec}"
            )
        try:
            self.config = replace(task.config, **settings).resolved(task.num_replicas)
        except TypeError as e:
            raise ConfigError(f"Unknown Trainer setting in {sorted(settings)}: {e}. See psflow.TrainConfig for the fields.") from e
        self.model = model
        self.task = task
        self.optimizer = optimizer
        self.schedule = schedule
        self.ema_decay = ema_decay
        self.worker: int = task.replica_index
        self.towers = Towers(model, devices) if devices else None
        self.params: dict[str, torch.nn.Parameter] = dict(model.named_parameters())
        self.global_step = 0
        self.local_step = 0
        self.examples = 0
        self.train_time_s = 0.0
        self.wall_time_s = 0.0
        self._first_step_at: float | None = None  # perf_counter at the start of the first applied step
        self.compute_s = 0.0
        self._progress_at: float | None = None
        self._restore: tuple[int, Mapping[str, torch.Tensor]] | None = None
        # The chief's logdir: the chief sets it before prepare(), which gives it to every task (the
        # Supervisor's logdir for a run that named none); None where the chief set none.
        self.chief_logdir: str | None = None
        self.ready_info: Mapping[str, Any] = {}
        self.stopped = False
        self._ready = False
        self._closed = False
        self.failure: str | None = None  # the error this task stopped on, if it did (close(failed=...))
        self._faults = parse_faults(getattr(task, "fail_at", None))
        if getattr(task, "logdir", None):
            # The progress scalars' writer imports tensorboard (~0.4 s): do it while the cluster gets ready.
            threading.Thread(target=importlib.import_module, args=("torch.utils.tensorboard",), daemon=True).start()
        self._init_strategy()
        task._attach_trainer(self)
        if self.config.log_placement:
            self._log_placement()

    @abstractmethod
    def _init_strategy(self) -> None:
        """Check the settings against the strategy and build its transport (no connection yet)."""

    def _log_placement(self) -> None:
        """``log_placement``: print where the parameters live."""
        if self.towers is not None:
            print(self.towers.format_placement(str(self.task.task_id)), flush=True)

    # -- readiness -------------------------------------------------------------------------
    def plan_steps(self, *, stop_at: int | None = None, snapshot_every: int | None = None, data: Any = None) -> None:
        """The job's exact stop and snapshot steps, kept where the updates are applied (the Supervisor
        calls it before ``prepare``). Nothing to do without parameter servers: every rank applies
        every step itself."""
        return

    def ps_initialized(self) -> bool:
        """Whether the parameter servers already hold the job (a restarted chief takes over). False
        without parameter servers."""
        return False

    def restore_from(self, step: int, tensors: Mapping[str, torch.Tensor], *,
                     data_positions: Mapping[str, Any] | None = None) -> None:
        """Start from a checkpoint instead of the model's own values (the Supervisor calls this before ``prepare``).

        Args:
            step: the global step to resume at.
            tensors: whole (unsplit) tensors by parameter name, plus optional optimizer slots
                ``opt/<param>/<slot>`` and moving averages ``ema/<param>``.
            data_positions: every worker's data position by replica index, for parameter servers to
                keep and hand back (:attr:`ready_info`); without them each rank loads its own, so
                they are not used here.

        Raises:
            ConfigError: the checkpoint lacks some of the model's parameters.
        """
        missing = [n for n in self.params if n not in tensors]
        if missing:
            raise ConfigError(
                f"The checkpoint has no values for {missing[:5]}. It was written for a different model; "
                "point logdir elsewhere or build the same model."
            )
        self._restore = (step, tensors)

    @abstractmethod
    def prepare(self) -> int:
        """Get ready to train (once; later calls return at once). Returns the global step."""

    # -- the step --------------------------------------------------------------------------
    @abstractmethod
    def step(
        self,
        closure: Callable[..., torch.Tensor],
        *,
        batch: Batch | torch.Tensor | None = None,
        batches: Sequence[Batch | torch.Tensor] | None = None,
        batch_size: int | None = None,
    ) -> float:
        """One training step; returns the loss as a float."""

    def _begin_step(self) -> float:
        """Before a step: the injected fault due now, readiness; returns the time the step's clock starts."""
        if self._faults:
            inject(self._faults, str(self.task.task_id), self.local_step)
        self.prepare()  # before the clock starts: getting ready is not training time
        return time.perf_counter()

    def _timed_compute(self, tl: timeline.Timeline, closure: Callable[..., torch.Tensor], batch: Any,
                       batches: Any, model: torch.nn.Module | None = None) -> float:
        """run_step_closure (on ``model``, default the bare model) with the timeline's forward and
        backward spans (one span with towers). Forward ends when the closure returns its loss."""
        start = tl.now()
        if self.towers is not None:
            value = run_step_closure(closure, self.model, towers=self.towers, batch=batch, batches=batches)
            tl.add("compute", "forward + backward (devices)", start, tl.now())
            return value
        forward_end: list[float] = []

        def timed(*args: Any) -> torch.Tensor:
            loss = closure(*args)
            forward_end.append(tl.now())
            return loss

        value = run_step_closure(timed, self.model if model is None else model, batch=batch, batches=batches)
        end = tl.now()
        middle = forward_end[0] if forward_end else end
        tl.add("forward", "forward", start, middle)
        tl.add("backward", "backward", middle, end)
        return value

    def _end_step(
        self,
        t0: float,
        loss: float,
        batch_size: int | None,
        batch: Batch | torch.Tensor | None,
        batches: Sequence[Batch | torch.Tensor] | None,
        *,
        end: float | None = None,
    ) -> None:
        """After a step the job applied: count it, its examples and its time (from ``t0`` to ``end``,
        default now: a pipelined step is counted once its replies are in); report progress."""
        self.local_step += 1
        n = batch_size if batch_size is not None else batch_examples(batch, batches)
        self.examples += n or 0
        end = time.perf_counter() if end is None else end
        self.train_time_s += end - t0
        if self._first_step_at is None:
            self._first_step_at = t0
        self.wall_time_s = end - self._first_step_at
        self._report_progress(loss)

    def waiting(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Around a wait for the other workers (a sync quorum, the ssp bound, the chief's wait for the
        others to finish): the task's heartbeats say so, and the launcher's watchdog does not take this
        task for the hung one while it lasts (see ``Task.waiting``).

        Example:
            >>> with trainer.waiting("the sync step's quorum"):
            ...     replies = trainer.client.recv_push_replies(...)
        """
        waiting = getattr(self.task, "waiting", None)
        return waiting(what) if waiting is not None else contextlib.nullcontext()

    @abstractmethod
    def pull(self, *, averages: bool = False) -> int:
        """Load the newest values (or their moving averages) into the model. Returns the global step."""

    # -- what the Supervisor needs -----------------------------------------------------------
    @abstractmethod
    def save_shards(self, root: str, step: int, *, exact: bool = False) -> list[dict[str, Any]]:
        """Write checkpoint ``step``'s shards under ``root``; returns each shard's ``{"record", "version", ...}``."""

    @abstractmethod
    def job_step(self) -> int:
        """The job's global step now."""

    def job_status(self) -> Mapping[str, Any]:
        """The parameter servers' view of the job now (its step, members, done and lost workers).

        Raises:
            ConfigError: this trainer has no parameter servers to ask.
        """
        raise ConfigError(f"{type(self).__name__} trains without parameter servers: there is no job status to ask them for.")

    def stop_reconnecting(self, reason: str) -> None:
        """A stop was requested (SIGTERM): a reconnect in progress gives up now, not at its deadline.
        Nothing to do without parameter-server connections."""
        return

    # -- counters --------------------------------------------------------------------------
    def _examples_per_sec(self) -> float:
        """The wall-clock rate: examples over the time from the first step's start to the last one's end."""
        return self.examples / self.wall_time_s if self.wall_time_s else 0.0

    def _step_examples_per_sec(self) -> float:
        """The rate inside the steps: examples over the time spent in them."""
        return self.examples / self.train_time_s if self.train_time_s else 0.0

    def _rates(self) -> dict[str, float]:
        """The counters behind both rates, and the rates (the job's are computed from the times:
        :func:`psflow.launch.metrics.job_rate`)."""
        return {"train_time_s": round(self.train_time_s, 4), "wall_time_s": round(self.wall_time_s, 4),
                "examples_per_sec": round(self._examples_per_sec(), 1),
                "step_examples_per_sec": round(self._step_examples_per_sec(), 1)}

    def stats(self) -> dict[str, Any]:
        """This task's counters (the launcher's summary holds them as ``trainer``)."""
        return {
            "global_step": self.global_step,
            "local_step": self.local_step,
            "examples": self.examples,
            "compute_s": round(self.compute_s, 4),
            **self._rates(),
        }

    def _report_progress(self, loss: float) -> None:
        """After a step, at most every ``progress_every_s``: the counters and the loss, to the launcher."""
        now = time.monotonic()
        if self._progress_at is not None and now - self._progress_at < self.config.progress_every_s:
            return
        self._progress_at = now
        scalar = getattr(self.task, "scalar", None)  # TensorBoard, with or without a Supervisor
        if scalar is not None and getattr(self.task, "logdir", None):
            for name, value in (("loss", loss), ("examples_per_sec", self._examples_per_sec()),
                                ("step_examples_per_sec", self._step_examples_per_sec()), ("global_step", self.global_step)):
                scalar(f"progress/{name}", float(value), self.global_step)
        send = getattr(self.task, "report_progress", None)  # tasks without a launcher: a no-op there
        if send is not None:
            send(global_step=self.global_step, local_step=self.local_step, examples=self.examples, **self._rates(),
                 loss=float(loss))

    # -- end -------------------------------------------------------------------------------
    def close(self, failed: str | None = None) -> None:
        """Release what the strategy holds (once; later calls do nothing). ``failed``: the error the
        task stopped on (:func:`psflow.errorreport.one_line`), said to the ps instead of "finished"."""
        if self._closed:
            return
        self._closed = True
        self.failure = failed
        # Training is over: from now on the heartbeats say so, and the launcher's watchdog does not take
        # what the script does after its loop (an evaluation, the exit) for a hang of its training.
        if hasattr(self.task, "waiting_for"):
            self.task.waiting_for = "nothing: its training is over"
        self._release()

    @abstractmethod
    def _release(self) -> None:
        """What ``close`` does, once."""

    def end_training(self) -> None:
        """This task takes no more steps, but has duties left before :meth:`close` (the chief's
        final checkpoint once the others are done): where others' steps wait for it (the ps's sync
        quorum, the ssp bound) they stop waiting. Nothing to do without parameter servers."""
        return

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self.close(failed=None if exc is None else errorreport.one_line(exc))

