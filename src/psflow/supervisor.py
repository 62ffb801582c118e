"""The Supervisor: the chief's duties around a training loop (TensorFlow's ``tf.train.Supervisor``).

Owns: initialize-or-restore at start, readiness of the other workers, periodic and final
checkpoints, TensorBoard summaries, the stop decision (``should_stop``) and hooks. Every training
task (chief and workers) opens one around its loop; only the chief initializes, restores and saves.

States and transitions::

    created --__enter__--> running --(max_steps | max_seconds | request_stop | SIGTERM)--> stopping
    running/stopping --__exit__--> closed (chief: final checkpoint, DONE file; all: summaries closed,
                                           trainer closed so the ps can exit)

Invariants (each, and a restarted chief's takeover: ``docs/design/supervisor.md``): parameters never
pass through the chief (each ps writes its shard, the chief commits the manifest); only a whole
checkpoint is restored, and none of diverged (NaN) parameters is written at the end; steps are exact
(the ps hold ``max_steps`` and ``save_model_steps``: :class:`psflow.ps.progress.StepPlan`); a
checkpoint holds every worker's data position; a run continues its logdir's checkpoints only when
the logdir was named, one that names none gets its own (:func:`new_logdir`), and a chief by hand
holds its logdir's lock. A restarted chief takes over from the ps instead of starting the job again.
Layout under ``logdir``: ``checkpoints/ckpt-<step>/``, ``summaries/<task>/``, ``DONE``.

Example:
    >>> trainer = pf.Trainer(model, pf.optim.SGD(lr=0.01), task)
    >>> with pf.Supervisor(task, logdir="runs/mnist", save_model_secs=600) as sv:
    ...     for x, y in batches:
    ...         if sv.should_stop():
    ...             break
    ...         sv.step(lambda: F.cross_entropy(model(x), y), batch_size=len(x))
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import torch

from psflow import checkpoint, errorreport
from psflow.checkpoint import (
    CHECKPOINTS_DIR,
    Checkpoint,
    ShardRecord,
    load_whole_tensors,
    run_meta,
)
from psflow.config import check_logdir
from psflow.errors import CheckpointError, ConfigError, PsflowError, TrainingError
from psflow.rundir import DONE_FILE
from psflow.summary import EventWriter
from psflow.train.modes import mode_of
from psflow.wire.conn import ConnectStopped

if TYPE_CHECKING:
    from psflow.task import SupervisedTask
    from psflow.train.base import SupervisedTrainer

log = logging.getLogger("psflow")

RUNS_DIR = Path("runs")  # where a run that names no logdir gets its own (as psflow run's runs/<run id>)


def new_logdir(script: str | None = None, *, runs_dir: Path = RUNS_DIR) -> Path:
    """A new logdir for a run that named none: ``runs/<script>-<YYYYmmdd-HHMMSS>-<6 hex>``.

    Args:
        script: the script's path (default ``sys.argv[0]``); its stem starts the name.
        runs_dir: the directory it goes under.

    Example:
        >>> new_logdir("examples/mnist_softmax.py").parent
        PosixPath('runs')
    """
    stem = Path(script if script is not None else sys.argv[0]).stem or "run"
    return runs_dir / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


# ----------------------------------------------------------------------------------- hooks


class Hook:
    """Called by the Supervisor: ``begin`` after the parameters are ready, ``after_step`` after every
    step (with the global step and the loss), ``end`` when the loop is over."""

    def begin(self, sv: Supervisor) -> None:
        pass

    def after_step(self, sv: Supervisor, step: int, loss: float) -> None:
        pass

    def end(self, sv: Supervisor) -> None:
        pass


class LoggingHook(Hook):
    """Print the third seed's progress line every ``every_n_steps`` local steps:
    ``step N, loss = L (E examples/sec; S sec/batch)`` with N the global step."""

    def __init__(self, every_n_steps: int = 10, print_fn: Callable[[str], None] | None = None) -> None:
        _check_positive_int("every_n_steps", every_n_steps)
        self.every_n_steps = every_n_steps
        self.print_fn = print_fn or (lambda line: print(line, flush=True))
        self._t = 0.0
        self._examples = 0
        self._local = 0

    def begin(self, sv: Supervisor) -> None:
        self._t, self._examples, self._local = time.perf_counter(), sv.examples, sv.local_step

    def after_step(self, sv: Supervisor, step: int, loss: float) -> None:
        if sv.local_step % self.every_n_steps:
            return
        now = time.perf_counter()
        duration, batches = now - self._t, sv.local_step - self._local
        examples = sv.examples - self._examples
        eps = examples / duration if duration > 0 else 0.0
        self.print_fn(f"step {step}, loss = {loss:.2f} ({eps:.1f} examples/sec; {duration / max(1, batches):.3f} sec/batch)")
        self._t, self._examples, self._local = now, sv.examples, sv.local_step


class NanGuardHook(Hook):
    """Stop training with a :class:`TrainingError` as soon as the loss is NaN or infinite, naming the
    step and, after pulling the newest values, the parameters that hold NaN or infinity."""

    def after_step(self, sv: Supervisor, step: int, loss: float) -> None:
        if math.isfinite(loss):
            return
        sv.diverged = True  # the final checkpoint must not overwrite good ones with these values
        try:
            sv.trainer.pull()
        except PsflowError as e:
            log.warning("%s: could not pull the parameters to find the non-finite ones: %s", sv.task.task_id, e)
        bad = [n for n, p in sv.trainer.model.named_parameters() if not bool(torch.isfinite(p.detach()).all())]
        where = (
            f"Parameter(s) {bad[:5]} hold NaN or infinity: the updates diverged."
            if bad
            else "Every parameter is finite, so the loss itself overflowed: check the batch and the loss function."
        )
        raise TrainingError(
            f"The loss is {loss} at global step {step} on {sv.task.task_id}. {where} "
            "Lower the learning rate or clip the gradients, then restart: the chief restores the last checkpoint."
        )


# ------------------------------------------------------------------------------ the supervisor


class Supervisor:
    """Chief-led initialization or restore, checkpoints, summaries and the stop decision.

    Args:
        task: the task from ``pf.init()``; default the current one.
        logdir: where checkpoints, summaries and DONE go; default ``task.logdir``, else the chief's
            (a new ``runs/<script>-<time>-<id>`` made by the chief, see :func:`new_logdir`); see
            ``resume`` for what a logdir that holds checkpoints means.
        trainer: the trainer to supervise; default the task's first one.
        save_model_secs: chief: a checkpoint at most every this many seconds (None: never by time).
        save_model_steps: chief: a checkpoint each time the global step passes a multiple of this.
        keep_checkpoints: how many whole checkpoints to keep.
        max_steps: stop once the global step reaches this.
        max_seconds: stop after this many seconds of training.
        summary_every_steps: scalars every this many local steps (and once at the end).
        histogram_every_steps: histograms of parameters and gradients every this many local steps.
        hooks: extra :class:`Hook` objects.
        ema_for_export: the moving averages stand for the model in ``psflow export`` and the evaluator.
        data: this worker's batch iterator (``BatchIterator``; every worker passes its own): its
            position after each batch goes to the ps with the batch's gradients, is saved with each
            checkpoint, and each worker gets its own back on a restart. Iterate it directly
            (``for x, y in data``), without reading ahead, so the position is that of the batch trained.
        resume: whether this run may continue the checkpoints already in ``logdir``. None (the
            default): yes when the logdir (``logdir=`` here, or ``task.logdir``: the launcher's
            ``--logdir`` or ``PSFLOW_LOGDIR``) or the checkpoint directory was named; a run that
            named neither starts in a new logdir of its own. True (``PSFLOW_RESUME=1``): continue
            them, which needs the logdir named. False: refuse to start where checkpoints exist.
        poll_s: chief: seconds between looks at the ps's bookkeeping while it waits for the other
            workers to finish before the final checkpoint.
        checkpoint_dir: where the checkpoints go instead of ``logdir/checkpoints``: a directory, or a
            URL (``s3://bucket/run``: every ps uploads its shard, the chief the manifest last; see
            :mod:`psflow.checkpoint.remote`); default ``task.checkpoint_dir`` (``PSFLOW_CHECKPOINT_DIR``).
    """

    def __init__(
        self,
        task: SupervisedTask | None = None,
        *,
        logdir: str | os.PathLike[str] | None = None,
        trainer: SupervisedTrainer | None = None,
        save_model_secs: float | None = 600,
        save_model_steps: int | None = None,
        keep_checkpoints: int = 5,
        max_steps: int | None = None,
        max_seconds: float | None = None,
        summary_every_steps: int | None = 100,
        histogram_every_steps: int | None = None,
        hooks: Iterable[Hook] = (),
        ema_for_export: bool = False,
        data: Any = None,
        resume: bool | None = None,
        poll_s: float = 0.25,
        checkpoint_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if task is None:
            from psflow.task import current_task

            task = current_task()
        if trainer is None:
            if not task.trainers:
                raise ConfigError(
                    f"{task.task_id} has no Trainer to supervise. Create it first: "
                    "trainer = pf.Trainer(model, pf.optim.SGD(lr=0.01), task), then pf.Supervisor(task, ...)."
                )
            trainer = task.trainers[0]
        _check_arguments(trainer, seconds={"save_model_secs": save_model_secs, "max_seconds": max_seconds},
                         steps={"save_model_steps": save_model_steps, "max_steps": max_steps,
                                "summary_every_steps": summary_every_steps, "histogram_every_steps": histogram_every_steps},
                         keep_checkpoints=keep_checkpoints, ema_for_export=ema_for_export, resume=resume, poll_s=poll_s)
        self.task = task
        self.trainer: SupervisedTrainer = trainer
        self._choose_dirs(logdir, checkpoint_dir)
        # Resuming is deliberate: asked for, or implied by naming the logdir (as the launcher's --logdir does).
        self.resume = resume if resume is not None else task.resume
        self.save_model_secs = save_model_secs
        self.save_model_steps = save_model_steps
        self.keep_checkpoints = keep_checkpoints
        self.max_steps = max_steps
        self.max_seconds = max_seconds
        self.summary_every_steps = summary_every_steps
        self.histogram_every_steps = histogram_every_steps
        self.hooks: list[Hook] = list(hooks)
        self.ema_for_export = ema_for_export
        self.data = data
        self.poll_s = poll_s
        self.diverged = False
        self.examples = 0
        self.start_step = 0
        self.restored_from: Path | None = None
        self.took_over = False  # chief: it found the ps initialized (a restarted chief) and took over
        self.checkpoints: list[int] = []
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self._stop_reason: str | None = None
        self._last_saved_step: int | None = None
        self._t_start = self._t_save = 0.0
        self._writer: EventWriter | None = None
        self._interval: dict[str, float] = {}
        self._previous_term: Any = None
        self._terminated = False
        self._entered = False
        # All-reduce: the data position after the last step every rank applied (a failed step's batch
        # was taken from the iterator but not applied: a checkpoint written then must not skip it).
        self._applied_position: dict[str, Any] | None = None
        self._ended_training = False  # chief, sync/ssp: it told the ps its training is over (end_training)
        self._held = contextlib.ExitStack()  # a chief by hand: its logdir's lock, from __enter__ to __exit__
        self._held_logdir = False

    def _choose_dirs(self, logdir: str | os.PathLike[str] | None, checkpoint_dir: str | os.PathLike[str] | None) -> None:
        """The logdir (named, the task's, or a new one) and where the checkpoints go, and whether each was named."""
        named = logdir or self.task.logdir
        self.logdir = Path(named) if named else new_logdir()
        check_logdir(self.logdir, what="logdir")  # before any task waits on this one
        self._logdir_named = bool(named)
        where = checkpoint_dir or self.task.checkpoint_dir
        self._checkpoint_dir_named = where is not None
        if where is not None and checkpoint.is_url(str(where)):
            self.checkpoint_dir: Path | str = checkpoint.UrlPath(str(where))
        else:
            self.checkpoint_dir = Path(where).resolve() if where is not None else (self.logdir / CHECKPOINTS_DIR).resolve()

    # -- properties ------------------------------------------------------------------------
    is_chief = property(lambda self: bool(self.task.is_chief))
    _num_chiefs = property(lambda self: int(self.task.cluster.num_tasks("chief")))
    _allreduce = property(lambda self: self.trainer.config.strategy == "allreduce")
    _mode = property(lambda self: mode_of(self.trainer.config))  # over parameter servers: async, sync or ssp
    global_step = property(lambda self: int(self.trainer.global_step))
    local_step = property(lambda self: int(self.trainer.local_step))
    stop_reason = property(lambda self: self._stop_reason)

    # -- start -----------------------------------------------------------------------------
    def __enter__(self) -> Self:
        self._install_sigterm()
        try:
            if self._logdir_named:
                self._hold_logdir()  # at once: a second run into a named logdir is refused before it touches the ps
            self._start()
        except BaseException:
            self._restore_sigterm()
            self._held.close()
            raise
        self._entered = True
        return self

    def _hold_logdir(self) -> None:
        """A chief started by hand holds its logdir while it runs, as a launcher does for its run
        (:mod:`psflow.logdirlock`): a second job writing there is refused. Under a launcher the
        launcher holds it. A logdir nobody named is held once it is settled (:meth:`_settle_logdir`)."""
        if not self.is_chief or self.task.coordinator or self._held_logdir:
            return
        self._held_logdir = True
        from psflow.logdirlock import BY_HAND, LOCK_FILE, hold

        self.logdir.mkdir(parents=True, exist_ok=True)
        self._held.enter_context(hold(self.logdir / LOCK_FILE, str(self.task.task_id), where=str(self.logdir),
                                      role=BY_HAND, say=lambda m: self._say(f"note: {m}")))

    def _start(self) -> None:
        t0 = time.monotonic()
        ckpt = None
        self.took_over = self._finds_ps_initialized()
        if not self.took_over:
            self._check_resume()  # a chief that takes over restores nothing from the logdir
        if self.is_chief and not self.took_over:
            self.trainer.chief_logdir = str(self.logdir)  # every task learns it at prepare()
        # The ps hold the exact steps: where the job stops and where step-based checkpoints fall.
        self.trainer.plan_steps(stop_at=self.max_steps, snapshot_every=self.save_model_steps, data=self.data)
        if (self.is_chief and not self.took_over) or self._allreduce:
            ckpt = self._restore()  # all-reduce: every task restores its own optimizer slots
        if not self.is_chief:
            self._say(f"waiting for the chief to initialize the parameter servers (up to ready_timeout_s={self.trainer.config.ready_timeout_s:g} s)"
                      if not self._allreduce else "joining the all-reduce group")
        self.start_step = int(self.trainer.prepare())
        self._settle_logdir()
        if ckpt is not None and self.start_step != ckpt.step:
            # The ps were initialized between our look and our PS_INIT (an earlier attempt of this
            # chief, still alive, got there first): their state stands, not the checkpoint's.
            self._say(f"the parameter servers already hold step {self.start_step}; continuing from them, not from {ckpt.path}")
            ckpt = None
        if ckpt is not None:
            self.restored_from = ckpt.path
            self._say(f"restored from {ckpt.path} at step {self.start_step}")
        elif self.took_over:
            self._say(f"took over as chief (attempt {self.task.attempt}) at step {self.start_step}: the parameter "
                      "servers kept training; not initializing or restoring them")
        elif self.is_chief:
            self._say(f"initialized at step {self.start_step}")
        else:
            self._say(f"parameters ready at step {self.start_step} (waited {time.monotonic() - t0:.1f} s)")
        if not self._allreduce:
            self._resume_data_position()
        self._t_start = self._t_save = time.monotonic()
        self._last_saved_step = ckpt.step if ckpt is not None else None
        self._writer = EventWriter(self.logdir, self.task.task_id)
        self._reset_interval()
        for hook in self.hooks:
            hook.begin(self)
        self._note_applied_position()
        self._report()

    def _finds_ps_initialized(self) -> bool:
        """Chief: whether every ps shard holds the job already, so this chief takes over instead of
        initializing (it was restarted, or started again by hand, while the ps kept the job)."""
        if not self.is_chief or self._allreduce:
            return False
        return bool(self.trainer.ps_initialized())

    def _settle_logdir(self) -> None:
        """After prepare(): a task that named no logdir takes the chief's (a restarted chief: the one
        the job started with), so a run's summaries and checkpoints share one directory; the chief
        holds it and clears an earlier DONE there."""
        if not self._logdir_named:
            shared = self.trainer.chief_logdir
            if shared and (not self.is_chief or self.took_over):
                self.logdir = Path(shared)
                if not self._checkpoint_dir_named:
                    self.checkpoint_dir = (self.logdir / CHECKPOINTS_DIR).resolve()
            if self.is_chief and not self.took_over:
                self._say(f"logdir {self.logdir} (this run's own: it named none; to resume this run later, name it)")
        if self.is_chief:
            self._hold_logdir()
            (self.logdir / DONE_FILE).unlink(missing_ok=True)

    def _check_resume(self) -> None:
        """Refuse to continue checkpoints this run did not deliberately ask to continue."""
        named = self._logdir_named or self._checkpoint_dir_named
        if self.resume is True and not named:
            script = self.logdir.name.rsplit("-", 3)[0]  # new_logdir's <script>-<date>-<time>-<id>
            earlier = sorted(d for d in self.logdir.parent.glob(f"{script}-*-*-*") if d.is_dir())
            hint = f" The newest run of {script} here is {earlier[-1]}." if earlier else ""
            raise ConfigError(
                f"{self.task.task_id}: resume=True (PSFLOW_RESUME=1) needs to know which run to resume, and this run "
                "named no logdir. Name the logdir of the run to resume: --logdir DIR in the example scripts, "
                f"PSFLOW_LOGDIR=DIR, or Supervisor(logdir=DIR); a run that names none starts in a new one.{hint}"
            )
        if self.resume is True or (self.resume is None and named):
            return
        found = checkpoint.list_checkpoints(self.checkpoint_dir) if named else []  # a new logdir holds none
        if not found:
            return
        raise ConfigError(
            f"{self.task.task_id}: resume=False, but {self.checkpoint_dir} already holds {len(found)} checkpoint(s) "
            f"(newest {found[0].name}). Give this run another logdir to start fresh, or move {self.checkpoint_dir} away."
        )

    def _restore(self) -> Checkpoint | None:
        try:
            ckpt = checkpoint.latest_checkpoint(self.checkpoint_dir, warn=lambda m: self._say(f"warning: {m}"), strict=True)
        except checkpoint.NoWholeCheckpointError as e:
            raise CheckpointError(_all_corrupt_message(e)) from e
        if ckpt is None:
            return None
        tensors = load_whole_tensors(ckpt)
        for name, p in self.trainer.params.items():
            t = tensors.get(name)
            if t is not None and (tuple(t.shape) != tuple(p.shape) or t.dtype != p.dtype):
                raise ConfigError(
                    f"Checkpoint {ckpt.path} holds {name!r} as {tuple(t.shape)} {t.dtype}; the model has "
                    f"{tuple(p.shape)} {p.dtype}. Build the same model, or point logdir elsewhere to start afresh."
                )
        positions = ckpt.meta.get("data_position") or {}
        if not self._allreduce:
            # Every worker's position goes to the ps with the parameters; each gets its own back when ready.
            by_replica = {r: p for t, p in positions.items() if (r := _replica_of_task(t, self._num_chiefs)) is not None}
            self.trainer.restore_from(ckpt.step, tensors, data_positions=by_replica)
            return ckpt
        self.trainer.restore_from(ckpt.step, tensors)
        position = positions.get(str(self.task.task_id))
        if position is None and self.data is not None and positions:
            # All-reduce ranks step in lockstep: the chief's (epoch, batch) is every rank's position.
            chief = next(iter(positions.values()))
            position = {**self.data.state_dict(), "epoch": chief["epoch"], "batch_index": chief["batch_index"]}
        self._load_position(position, f"the data position saved in {ckpt.path}")
        return ckpt

    def _resume_data_position(self) -> None:
        """Every worker continues its own data where the ps's state says its batches ended."""
        position = (self.trainer.ready_info.get("data_positions") or {}).get(str(self.trainer.worker))
        if self._load_position(position, "its data position"):
            self._say(f"resuming its data at epoch {position['epoch']}, batch {position['batch_index']}")

    def _load_position(self, position: Mapping[str, Any] | None, what: str) -> bool:
        if self.data is None or position is None:
            return False
        try:
            self.data.load_state_dict(position)
        except ConfigError as e:
            self._say(f"warning: not resuming {what}: {e}")
            return False
        return True

    # -- the loop --------------------------------------------------------------------------
    def should_stop(self) -> bool:
        """True once the loop should end: a stop was requested (or SIGTERM came), the global step
        reached ``max_steps``, or ``max_seconds`` passed."""
        if self._stop_reason is None:
            if self.max_steps is not None and self.global_step >= self.max_steps:
                self._stop_reason = f"max_steps={self.max_steps} reached"
            elif self.max_seconds is not None and time.monotonic() - self._t_start >= self.max_seconds:
                self._stop_reason = f"max_seconds={self.max_seconds:g} passed"
        return self._stop_reason is not None

    def request_stop(self, reason: str = "stop requested") -> None:
        """Make :meth:`should_stop` return True (safe to call from a signal handler or a hook)."""
        if self._stop_reason is None:
            self._stop_reason = reason

    def step(self, closure: Callable[[], torch.Tensor], *, batch_size: int | None = None) -> float:
        """``trainer.step`` followed by :meth:`after_step`. Returns the loss."""
        loss = self.trainer.step(closure, batch_size=batch_size)
        self.after_step(loss, batch_size)
        return loss

    def after_step(self, loss: float, batch_size: int | None = None) -> None:
        """Run hooks, the chief's periodic checkpoint and the summaries after one trainer step."""
        if not self._entered:
            raise ConfigError("Supervisor.after_step() runs inside `with pf.Supervisor(...) as sv:`; enter it first.")
        if self.trainer.stopped:
            # The ps refused this batch: the job is at the chief's max_steps (the ps hold the exact stop).
            self.request_stop(f"the job reached its stop step {self.global_step}")
            return
        loss = float(loss)
        self.first_loss = loss if self.first_loss is None else self.first_loss
        self.last_loss = loss
        self.examples += int(batch_size or 0)
        self._interval["loss_sum"] += loss
        self._interval["steps"] += 1
        step = self.global_step
        self._note_applied_position()
        for hook in self.hooks:
            hook.after_step(self, step, loss)
        if self.is_chief:
            self._save_if_due(step)
            if getattr(self.data, "is_exhausted", False) and self._ends_before_others():
                # Its last batch: the others' steps go on without it. The final model is theirs too, so it
                # waits here, before the script's own end (a final pull, an accuracy) reads the model.
                self._end_training()
        local = self.local_step
        if self.summary_every_steps and local % self.summary_every_steps == 0:
            self._write_scalars()
        if self.histogram_every_steps and local % self.histogram_every_steps == 0:
            self._write_histograms()

    def _save_if_due(self, step: int) -> None:
        """Chief: a step-based checkpoint at its exact step, or a time-based one of the state now."""
        last = self._last_saved_step if self._last_saved_step is not None else self.start_step
        exact = due_checkpoint_step(step, last, self.save_model_steps)
        if exact is not None:
            self.save(exact)
        elif step != last and self.save_model_secs is not None and time.monotonic() - self._t_save >= self.save_model_secs:
            self.save()

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, step: int | None = None) -> Path:
        """Chief: checkpoint the job. Each ps writes its own shard, in parallel; the chief commits the
        manifest. Returns the checkpoint directory.

        Args:
            step: a step the job has reached that the ps kept a copy of (a multiple of
                ``save_model_steps``): the checkpoint holds exactly that step. None: the state now.

        Raises:
            CheckpointError: a ps failed or died while saving; the previous checkpoints are intact.
        """
        if not self.is_chief:
            raise ConfigError(f"Only the chief saves checkpoints; {self.task.task_id} is not the chief.")
        t0 = time.perf_counter()
        exact = step is not None
        step = step if step is not None else self.global_step
        try:
            if not exact:
                step = self._ps_step()
            replies = self.trainer.save_shards(str(self.checkpoint_dir), step, exact=exact)
            n = len(replies)
            records = [ShardRecord.from_dict(r["record"]) for r in replies]
            meta = self._manifest_meta(step, [int(r.get("version", step)) for r in replies], replies[0].get("data_positions"))
            path = checkpoint.commit(self.checkpoint_dir, step, records, meta=meta, keep=self.keep_checkpoints)
        except PsflowError as e:
            previous = f"step {self._last_saved_step}" if self._last_saved_step is not None else "none yet"
            raise CheckpointError(
                f"The checkpoint of step {step} under {self.checkpoint_dir} could not be written: {str(e).rstrip('.')}. "
                f"The previous whole checkpoint ({previous}) is untouched; a restarted chief restores from it."
            ) from e
        self._last_saved_step, self._t_save = step, time.monotonic()
        self.checkpoints.append(step)
        size = sum(r.size_bytes for r in records)
        self._say(f"saved checkpoint {path} at step {step} ({size / 1e6:.2f} MB, {n} shard(s), {time.perf_counter() - t0:.2f} s)")
        return path

    def _ps_step(self) -> int:
        """The job's global step now: shard 0's version (other workers may have stepped since our last push)."""
        return int(self.trainer.job_step())

    def _data_positions(self, by_replica: Mapping[str, Any] | None) -> dict[str, Any]:
        """Every worker's data position by task id: as the ps kept them, else (all-reduce) our own
        after the last step applied."""
        if by_replica:
            return {_task_of_replica(r, self._num_chiefs): p for r, p in sorted(by_replica.items())}
        if self.data is None:
            return {}
        return {str(self.task.task_id): self._applied_position or self.data.state_dict()}

    def _note_applied_position(self) -> None:
        if self._allreduce and self.data is not None:
            self._applied_position = self.data.state_dict()

    def _manifest_meta(self, step: int, versions: Sequence[int], positions: Mapping[str, Any] | None = None) -> dict[str, Any]:
        trainer = self.trainer
        return run_meta(
            step=step,
            placement=trainer.placement,
            optimizer=trainer.optimizer.to_dict(),
            schedule=trainer.schedule.to_dict() if trainer.schedule is not None else None,
            ema_decay=trainer.ema_decay,
            export_averages=self.ema_for_export,
            shard_versions=versions,
            data_positions=self._data_positions(positions),
            writer=str(self.task.task_id),
        )

    # -- summaries -------------------------------------------------------------------------
    def _reset_interval(self) -> None:
        self._interval = {"t": time.perf_counter(), "examples": float(self.examples), "global": float(self.global_step),
                          "loss_sum": 0.0, "steps": 0.0}

    def _learning_rate(self) -> float:
        lr = float(self.trainer.optimizer.lr)
        schedule = self.trainer.schedule
        return float(schedule.lr_at(lr, self.global_step)) if schedule is not None else lr

    def _write_scalars(self) -> None:
        iv = self._interval
        if self._writer is None or not iv["steps"]:
            return
        dt = time.perf_counter() - iv["t"]
        self._writer.scalars(self.global_step, {
            "loss": iv["loss_sum"] / iv["steps"],
            "examples_per_sec": (self.examples - iv["examples"]) / dt if dt > 0 else 0.0,
            "global_steps_per_sec": (self.global_step - iv["global"]) / dt if dt > 0 else 0.0,
            "learning_rate": self._learning_rate(),
        })
        self._reset_interval()

    def _write_histograms(self) -> None:
        if self._writer is None:
            return
        params = dict(self.trainer.model.named_parameters())
        self._writer.histograms(self.global_step, params, prefix="parameters/")
        grads = {n: p.grad for n, p in params.items() if p.grad is not None}
        self._writer.histograms(self.global_step, grads, prefix="gradients/")

    # -- end -------------------------------------------------------------------------------
    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        failing = exc_type is not None
        stopped = _stopped_reconnecting(exc)
        try:
            # Its training is over: not a hang for the watchdog (closing the trainer then says so for good).
            with self.trainer.waiting("the end of its loop: hooks, summaries, the final checkpoint"):
                self._end(failing, exc_type)
        finally:
            self._restore_sigterm()
            if self._writer is not None:
                self._quietly(True, "closing the summary writer", self._writer.close)
            self._held.close()  # the logdir's lock (a chief by hand): nothing more is written there
            # its PS_DONE says why it stops: a failing task is waited for (a restart), not counted finished
            failed = None if exc is None else errorreport.one_line(exc)
            self._quietly(failing, "closing the trainer", lambda: self.trainer.close(failed=failed))
        if stopped is not None:
            # SIGTERM came while a ps was unreachable: the script's code after its loop would wait for the
            # ps again, past the launcher's grace. End now, as the stop asked, with SIGTERM's exit status.
            newest = f"step {self._last_saved_step}" if self._last_saved_step is not None else "none"
            self._say(f"stopped by SIGTERM while a ps was unreachable ({stopped}); the newest checkpoint is {newest}"
                      f"{' (no final one: the values live on the ps)' if self.is_chief else ''}; exiting with "
                      f"status {128 + signal.SIGTERM}, as a stopped task")
            raise SystemExit(128 + signal.SIGTERM) from exc

    def _end(self, failing: bool, exc_type: type[BaseException] | None) -> None:
        for hook in self.hooks:
            self._quietly(failing, f"hook {type(hook).__name__}.end", lambda h=hook: h.end(self))
        self._quietly(failing, "the last summary", self._write_scalars)
        if self.is_chief:
            if not failing and not self.diverged and not self._allreduce and not self._mode.steps_wait_for_workers:
                with self.trainer.waiting("the other workers to finish"):  # not a hang (the watchdog)
                    self._wait_for_other_workers()
            elif not failing and not self.diverged and self._ends_before_others():
                self._end_training()
            self._final_checkpoint(failing)
            if not failing:
                self._write_done()
        reason = f"{exc_type.__name__}" if exc_type is not None else self._stop_reason or "the loop ended"
        self._say(f"stopped at step {max(self.global_step, self._last_saved_step or 0)} ({reason})")
        self._report()

    def _final_checkpoint(self, failing: bool) -> None:
        if self.diverged:
            self._say("not writing a final checkpoint: the parameters diverged (NaN); the last checkpoint stays the newest")
            return

        def save_if_new() -> None:
            if self._ps_step() not in (self._last_saved_step, 0):  # else nothing new since the last one
                self.save()

        self._quietly(failing, "the final checkpoint", save_if_new)

    def _ends_before_others(self) -> bool:
        """Chief, sync or ssp over parameter servers with other workers: their steps wait for this
        one's gradient or clock, so it must tell the ps when it takes no more (:meth:`_end_training`)."""
        return (not self._allreduce and self._mode.steps_wait_for_workers
                and self.task.num_replicas > 1)

    def _end_training(self) -> None:
        """Chief, sync or ssp, once: tell the ps it takes no more steps (they count it done for every
        step from now on, and serve it until it closes), then wait for the others to finish, so that
        the final checkpoint and the values the script pulls after its loop are the job's last step's
        (with a backup worker, or a longer shard, the others go on after the chief's data ran out)."""
        if self._ended_training:
            return
        self._ended_training = True
        self.trainer.end_training()
        with self.trainer.waiting("the other workers to finish"):  # not a hang (the watchdog)
            self._wait_for_other_workers()

    def _wait_for_other_workers(self) -> None:
        """Keep checkpointing until every other worker is done, so that the final checkpoint holds the
        whole job's training even when the chief's own loop ends first (a shorter shard, say).

        Async: the chief waits before its PS_DONE (nothing waits for it). Sync or ssp: a step needs the
        chief's gradients or clock, so it waits after saying its training is over (:meth:`_end_training`).
        SIGTERM ends the wait (the others got it too).
        A worker the ps reports lost (its connections closed without finishing) is not waited for: the
        ps itself waits for it, up to lost_worker_timeout_s, and names it.
        """
        announced = False
        while not self._terminated:
            status = self.trainer.job_status()
            # The ps counts the job's members now (psflow scale adds and retires workers).
            others = set(range(int(status.get("num_workers", self.task.num_replicas)))) - {int(self.trainer.worker)}
            unfinished = others - {int(w) for w in status["done_workers"]}
            missing = sorted(unfinished - {int(w) for w in status.get("lost_workers", ())})
            if not missing:
                if unfinished:
                    from psflow.ps.requests import replica_name

                    names = ", ".join(replica_name(self.task.cluster, w) for w in sorted(unfinished))
                    self._say(f"not waiting for {names}: lost (its connection to the ps closed without finishing; "
                              "killed or crashed?); the final checkpoint holds the job's training until now")
                return
            if not announced:
                self._say(f"waiting for {len(missing)} other worker(s) to finish before the final checkpoint")
                announced = True
            self._save_if_due(int(status["version"]))
            time.sleep(self.poll_s)  # a poll of the ps's bookkeeping, not a synchronisation: any reply order is fine

    def _write_done(self) -> None:
        done = self.logdir / DONE_FILE
        tmp = done.with_name(f"{DONE_FILE}.{os.getpid()}.tmp")
        step = max(self.global_step, self._last_saved_step or 0)
        tmp.write_text(json.dumps({"global_step": step, "task": str(self.task.task_id), "time_unix": time.time()}))
        os.replace(tmp, done)

    def _quietly(self, swallow: bool, what: str, fn: Callable[[], Any]) -> None:
        """Run ``fn``; while another exception propagates, a failure here is logged, not raised,
        so it does not hide the original one."""
        try:
            fn()
        except Exception as e:
            if not swallow:
                raise
            self._say(f"warning: {what} failed: {type(e).__name__}: {e}")

    # -- helpers ---------------------------------------------------------------------------
    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        # The handler only records the request: printing or I/O from a handler can re-enter a stream.
        self._previous_term = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._terminated = True
        self.request_stop("SIGTERM")
        self.trainer.stop_reconnecting("SIGTERM")  # a reconnect to a ps that is down gives up now, not at its deadline

    def _restore_sigterm(self) -> None:
        if self._previous_term is not None:
            signal.signal(signal.SIGTERM, self._previous_term)
            self._previous_term = None

    def _say(self, message: str) -> None:
        print(f"{self.task.task_id}: {message}", flush=True)

    def _report(self) -> None:
        self.task.report(supervisor={
            "start_step": self.start_step,
            "restored_from": str(self.restored_from) if self.restored_from else None,
            "took_over": self.took_over,
            "global_step": self.global_step,
            "local_step": self.local_step,
            "checkpoints": list(self.checkpoints),
            "first_loss": self.first_loss,
            "last_loss": self.last_loss,
            "stop_reason": self._stop_reason,
        })


def _stopped_reconnecting(exc: BaseException | None) -> ConnectStopped | None:
    """The ConnectStopped that ``exc`` is or was raised from (a stop request ended a reconnect), else None."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, ConnectStopped):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def due_checkpoint_step(global_step: int, last_step: int, every: int | None) -> int | None:
    """The step-based checkpoint due once the job is at ``global_step``: the newest multiple of
    ``every`` past ``last_step`` (the last checkpoint, or the step the run started at), else None.

    Example:
        >>> due_checkpoint_step(401, 200, 200), due_checkpoint_step(399, 200, 200)
        (400, None)
    """
    if every is None:
        return None
    target = global_step // every * every
    return target if target > last_step else None


def _task_of_replica(replica: str, num_chiefs: int) -> str:
    """Replica index -> task id: a ``chief`` job's task is replica 0, then the workers in order."""
    r = int(replica)
    return "chief:0" if r < num_chiefs else f"worker:{r - num_chiefs}"


def _replica_of_task(task: str, num_chiefs: int) -> str | None:
    job, _, index = task.partition(":")
    if job == "chief" and num_chiefs:
        return "0"
    if job == "worker" and index.isdigit():
        return str(num_chiefs + int(index))
    return None  # a task this cluster has no replica for: its position is dropped


def _all_corrupt_message(e: checkpoint.NoWholeCheckpointError) -> str:
    listed = "; ".join(f"{path.name}: {', '.join(why)}" for path, why in e.problems)
    return (
        f"Every checkpoint in {e.root} failed its checks, so the training they hold cannot be resumed: {listed}. "
        "psflow does not start over at step 0 on its own (that would silently drop that training). "
        f"To start fresh on purpose, give this run another logdir (--logdir NEW, or Supervisor(logdir=...)) "
        f"or move the checkpoints away (mv {e.root} {e.root}.corrupt); to resume, put a good copy of a checkpoint "
        f"back into {e.root}."
    )


def _check_arguments(trainer: SupervisedTrainer, *, seconds: Mapping[str, float | None], steps: Mapping[str, int | None],
                     keep_checkpoints: int, ema_for_export: bool, resume: bool | None, poll_s: float) -> None:
    """The Supervisor's arguments, checked where they enter.

    Raises:
        ConfigError: naming the argument, the value received and what is allowed.
    """
    for name, value in seconds.items():
        if value is not None and not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
            raise ConfigError(f"{name} must be a positive number of seconds or None; received {value!r}.")
    if not (isinstance(poll_s, (int, float)) and poll_s > 0 and math.isfinite(poll_s)):
        raise ConfigError(f"poll_s must be a positive number of seconds; received {poll_s!r}.")
    for name, count in steps.items():
        if count is not None:
            _check_positive_int(name, count)
    _check_positive_int("keep_checkpoints", keep_checkpoints)
    if ema_for_export and trainer.ema_decay is None:
        raise ConfigError("ema_for_export=True needs moving averages: create the Trainer with ema_decay=0.99 (or similar).")
    if resume is not None and not isinstance(resume, bool):
        raise ConfigError(f"resume must be True, False or None; received {resume!r}.")


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer; received {value!r}.")
