"""The evaluator task: evaluate every new checkpoint while the job trains (TensorFlow's ``evaluator`` job).

:func:`run_evaluator` watches ``LOGDIR/checkpoints``. For each checkpoint newer than the last one it
evaluated, it loads the whole tensors into a fresh model, calls ``eval_fn(model)`` for a dict of
metrics, writes them as ``eval/<metric>`` scalars to ``LOGDIR/summaries/evaluator-0`` at the
checkpoint's step and reports them to the launcher (``task.report(eval=...)``).

It ends when the job is done, that is when the chief's Supervisor has written ``LOGDIR/DONE`` (after
one more look, so the final checkpoint is evaluated), on SIGTERM, or at ``timeout_s``. A ``DONE``
file written more than a second before the evaluator started belongs to an earlier run in the same
logdir and is ignored. When several checkpoints appear between two looks only the newest is
evaluated, as TensorFlow's continuous evaluation does. No parameter server is contacted: checkpoints
are read from disk, so evaluation never slows training down.

Called from a training script for ``task.is_evaluator`` (see ``examples/mnist_softmax_supervised.py``).
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from psflow import checkpoint
from psflow.checkpoint import CHECKPOINTS_DIR, state_dict_from
from psflow.errors import CheckpointError, ConfigError
from psflow.summary import EventWriter
from psflow.supervisor import DONE_FILE

if TYPE_CHECKING:
    from psflow.task import SupervisedTask

_STALE_DONE_MARGIN_S = 1.0  # file times come from a coarser clock than time.time()


def load_into(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy whole tensors by parameter name into ``model``'s parameters.

    Raises:
        CheckpointError: a parameter of the model is missing from ``state`` or has another shape.
    """
    own = dict(model.named_parameters())
    missing = [n for n in own if n not in state]
    if missing:
        raise CheckpointError(
            f"The checkpoint has no values for {missing[:5]} (it holds {sorted(state)[:5]}...). "
            "model_fn must build the model that was trained."
        )
    with torch.no_grad():
        for name, p in own.items():
            t = state[name]
            if tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(f"Checkpoint tensor {name!r} has shape {tuple(t.shape)}; the model's is {tuple(p.shape)}.")
            p.copy_(t)


def run_evaluator(
    task: SupervisedTask,
    model_fn: Callable[[], torch.nn.Module],
    eval_fn: Callable[[torch.nn.Module], Mapping[str, float]],
    logdir: str | os.PathLike[str] | None = None,
    *,
    poll_s: float = 2.0,
    timeout_s: float | None = None,
    averages: bool | None = None,
    once: bool = False,
) -> dict[int, dict[str, float]]:
    """Evaluate each new checkpoint of the run until the chief says the job is done.

    Args:
        task: this evaluator task (``pf.init()``; what it uses of it: :class:`psflow.task.SupervisedTask`);
            its id names the summary directory; its ``checkpoint_dir`` (``PSFLOW_CHECKPOINT_DIR``), if
            set, is where the checkpoints are read instead of ``logdir/checkpoints``.
        model_fn: builds a fresh model of the trained architecture.
        eval_fn: ``model -> {metric: number}``, e.g. ``{"accuracy": 0.91}``.
        logdir: the run's logdir; default ``task.logdir``. An evaluator started by hand names it
            (``PSFLOW_LOGDIR``): it reads the chief's checkpoints and DONE there.
        poll_s: seconds between looks for a new checkpoint.
        timeout_s: give up after this many seconds (None: wait for DONE or SIGTERM).
        averages: evaluate the moving averages; None: what the run chose (``ema_for_export``).
        once: evaluate the newest checkpoint (if any) and return, e.g. for a finished run.

    Returns:
        ``{step: metrics}`` for every checkpoint evaluated.

    Raises:
        ConfigError: no logdir was named, so there is no run to follow.

    Example:
        >>> if task.is_evaluator:
        ...     run_evaluator(task, lambda: Net(), lambda m: {"accuracy": accuracy(m, test)})
    """
    if not (isinstance(poll_s, (int, float)) and poll_s > 0 and math.isfinite(poll_s)):
        raise ConfigError(f"poll_s must be a positive number of seconds; received {poll_s!r}.")
    if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ConfigError(f"timeout_s must be a positive number of seconds or None; received {timeout_s!r}.")
    if not (logdir or task.logdir):
        raise ConfigError(
            f"{task.task_id} has no logdir to follow: the evaluator reads the chief's checkpoints and DONE in the run's "
            "logdir, and this task named none. Name the chief's logdir (PSFLOW_LOGDIR=DIR, or run_evaluator(logdir=DIR)); "
            "psflow run --evaluator does this for you."
        )
    base = Path(logdir or task.logdir)
    where = task.checkpoint_dir  # the run's --checkpoint-dir: a directory or a URL
    root: Path | str = (where if checkpoint.is_url(where) else Path(where)) if where else base / CHECKPOINTS_DIR
    done_file = base / DONE_FILE
    started_unix, started = time.time(), time.monotonic()
    stop = threading.Event()
    previous = _on_sigterm(stop.set)
    writer = EventWriter(base, task.task_id)
    results: dict[int, dict[str, float]] = {}
    last = -1
    try:
        while True:
            # Look for DONE before the checkpoints: the chief commits its final checkpoint before writing
            # DONE, so the scan that follows sees it.
            done = once or _is_fresh(done_file, started_unix)
            ckpt = None
            if _newest_step(root) > last:  # listing is cheap; reading verifies (on a URL: downloads) the checkpoint
                ckpt = checkpoint.latest_checkpoint(root, warn=lambda m: print(f"{task.task_id}: warning: {m}", flush=True))
            if ckpt is not None and ckpt.step > last:
                results[ckpt.step] = _evaluate(task, ckpt, model_fn, eval_fn, writer, averages)
                last = ckpt.step
            if done or stop.is_set():
                break
            if timeout_s is not None and time.monotonic() - started >= timeout_s:
                print(f"{task.task_id}: no DONE file in {base} after timeout_s={timeout_s:g} s; stopping the evaluation.", flush=True)
                break
            stop.wait(poll_s)
    finally:
        writer.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return results


def _newest_step(root: Path | str) -> int:
    """The step of the newest checkpoint listed under ``root`` (not verified), or -1."""
    found = checkpoint.list_checkpoints(root)
    return int(found[0].name.split("-", 1)[1]) if found else -1


def _evaluate(task: SupervisedTask, ckpt: checkpoint.Checkpoint, model_fn: Callable[[], torch.nn.Module],
              eval_fn: Callable[[torch.nn.Module], Mapping[str, float]], writer: EventWriter, averages: bool | None) -> dict[str, float]:
    model = model_fn()
    load_into(model, state_dict_from(ckpt, averages=averages))
    model.eval()
    with torch.no_grad():
        raw = eval_fn(model)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"eval_fn must return a dict of metric -> number; it returned {type(raw).__name__}: {raw!r:.100}.")
    metrics = {str(k): float(v) for k, v in raw.items()}
    writer.scalars(ckpt.step, {f"eval/{k}": v for k, v in metrics.items()})
    writer.flush()
    print(f"{task.task_id}: step {ckpt.step}: " + ", ".join(f"{k} = {v:.4f}" for k, v in metrics.items()), flush=True)
    task.report(eval={"step": ckpt.step, **metrics})
    return metrics


def _is_fresh(done_file: Path, started_unix: float) -> bool:
    try:
        mtime = done_file.stat().st_mtime
    except FileNotFoundError:
        return False
    return mtime >= started_unix - _STALE_DONE_MARGIN_S


def _on_sigterm(handler: Callable[[], None]) -> Any:
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, lambda signum, frame: handler())

