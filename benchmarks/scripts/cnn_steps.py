"""The CNN benchmark's measuring loop, and the psflow script that ``bench_cnn.py`` launches.

Owns how one CNN configuration is timed, so that psflow (every mode, through ``psflow run``) and
the plain PyTorch baselines (single process, raw DDP, in ``bench_cnn.py``) are measured by the very
same code: ``warmup`` untimed steps, then ``steps`` timed steps, and the window's wall-clock start
and end (``time.time()``, one clock for every process of the machine) so that the figures of
several processes combine as *examples of all of them / the span from the first start to the last
end*, plus each process's median step time (a figure that a burst of load from a neighbour during
a few steps does not move).

Model and update: the third seed's CNN, imported from ``examples/mnist_cnn.py`` (so it is the same
class), batch 100 per process, Adam lr 1e-3 (the example's default). No learning-rate schedule and
no moving averages, so psflow and the ``torch.optim`` baselines do the same work per step.

As a psflow script (``psflow run ... benchmarks/scripts/cnn_steps.py -- FLAGS``) it has two modes:

- throughput (default): every worker takes ``--warmup`` + ``--steps`` local steps and reports
  ``bench={examples, steps, window_s, median_step_s, start_unix, end_unix}`` to the launcher (summary.json);
- ``--target_step G``: every worker steps until the job's global step reaches ``G``; the chief
  times global step ``--start_step`` to ``G`` and then evaluates the live parameters on
  ``--test_examples`` test images; every worker reports its median step time (for the slowdown);
- ``--target_accuracy A``: time to accuracy. The chief evaluates the live parameters on
  ``--test_examples`` test images every ``--eval_every`` global steps (from ``--start_step`` on) and
  stops the job once one reaches ``A`` (it creates ``--stop_file``, which every worker checks after
  each step: the tasks share this machine's file system), or at global step ``--max_step``. Its clock
  runs from global step ``--start_step`` and stops during each evaluation (evaluating is not
  training); the global steps the job took while the chief evaluated (possible with backup workers:
  the others may aggregate without it) are counted and reported (``steps_during_eval``).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
BATCH = 100
LR = 1e-3
EPOCHS = 1000  # the iterators are lazy; the loops stop by step count long before this


def cnn() -> torch.nn.Module:
    """A fresh ``CNN`` from examples/mnist_cnn.py (loaded from the file: the example's own class)."""
    path = REPO / "examples" / "mnist_cnn.py"
    spec = importlib.util.spec_from_file_location("mnist_cnn_example", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"Cannot load the example model from {path}.")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CNN()


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The example's loss: cross-entropy of ``model(x)`` against ``y``."""
    return F.cross_entropy(model(x), y)


def timed_steps(
    step: Callable[[torch.Tensor, torch.Tensor], object],
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    warmup: int,
    steps: int,
) -> dict[str, Any]:
    """Run ``warmup`` untimed then ``steps`` timed calls of ``step(x, y)``; return the window.

    ``step`` must finish its work before returning (a psflow step returns a float loss; the
    baselines call ``.item()``), so the window holds the whole computation.
    """
    it = iter(batches)
    for _ in range(warmup):
        step(*next(it))
    examples, step_s = 0, []
    start_unix, t0 = time.time(), time.perf_counter()
    for _ in range(steps):
        x, y = next(it)
        t = time.perf_counter()
        step(x, y)
        step_s.append(time.perf_counter() - t)
        examples += len(x)
    window_s = time.perf_counter() - t0
    return {"examples": examples, "steps": steps, "window_s": window_s, "median_step_s": statistics.median(step_s),
            "start_unix": start_unix, "end_unix": start_unix + window_s}


@torch.no_grad()
def accuracy(model: torch.nn.Module, limit: int) -> float:
    """Test accuracy of ``model`` on the first ``limit`` MNIST test images."""
    import psflow as pf

    test = pf.data.mnist("test", flatten=False)
    x, y = test.x[:limit], test.y[:limit]
    model.eval()
    correct = sum(int((model(x[i : i + 500]).argmax(1) == y[i : i + 500]).sum()) for i in range(0, len(y), 500))
    model.train()
    return correct / len(y)


def run_to_step(trainer: Any, task: Any, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                start_step: int, target_step: int) -> dict[str, Any]:
    """Step until the job's global step reaches ``target_step``; time ``start_step`` -> target."""
    trainer.prepare()
    step_s: list[float] = []
    t_start = t_end = None
    for x, y in batches:
        if trainer.global_step >= target_step:
            break
        t = time.perf_counter()
        trainer.step(loss_fn, batch=(x, y))
        now = time.perf_counter()
        step_s.append(now - t)
        if t_start is None and trainer.global_step >= start_step:
            t_start = now
        if trainer.global_step >= target_step:
            t_end = now
    out: dict[str, Any] = {
        "local_steps": len(step_s),
        "median_step_s": statistics.median(step_s) if step_s else None,
        "global_step": trainer.global_step,
    }
    if task.is_chief and t_start is not None and t_end is not None:
        out["time_s"] = t_end - t_start
    return out


def run_to_accuracy(trainer: Any, task: Any, model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                    args: argparse.Namespace) -> dict[str, Any]:
    """Step until the chief sees ``args.target_accuracy`` (or ``args.max_step``); see the module docstring."""
    stop_file = Path(args.stop_file)
    trainer.prepare()
    step_s: list[float] = []
    evals: list[dict[str, Any]] = []
    t_start: float | None = None
    paused_s, steps_during_eval, next_eval = 0.0, 0, args.start_step
    reached: dict[str, Any] | None = None
    for x, y in batches:
        if trainer.global_step >= args.max_step or stop_file.exists():
            break
        t = time.perf_counter()
        trainer.step(loss_fn, batch=(x, y))
        now = time.perf_counter()
        step_s.append(now - t)
        if not task.is_chief or trainer.global_step < args.start_step:
            continue
        if t_start is None:
            t_start = now
        if evals and "_after" not in evals[-1]:
            # The chief's first step after an evaluation: beyond its own one step, what the others took meanwhile.
            evals[-1]["_after"] = trainer.global_step
        if trainer.global_step >= next_eval:
            train_s = now - t_start - paused_s
            e0 = time.perf_counter()
            torch.set_num_threads(2)  # outside the clock: use the machine
            acc = accuracy(model, args.test_examples)
            torch.set_num_threads(args.threads)
            paused_s += time.perf_counter() - e0
            evals.append({"global_step": trainer.global_step, "train_s": round(train_s, 3), "accuracy": acc})
            next_eval = trainer.global_step + args.eval_every
            if acc >= args.target_accuracy:
                reached = evals[-1]
                stop_file.touch()
                break
    for e in evals:
        after = e.pop("_after", None)
        if after is not None:
            steps_during_eval += max(0, after - e["global_step"] - 1)
    out: dict[str, Any] = {"local_steps": len(step_s), "global_step": trainer.global_step,
                           "median_step_s": statistics.median(step_s) if step_s else None}
    if task.is_chief:
        stop_file.touch()  # also at max_step: the others stop too
        out.update({"evals": evals, "reached": reached, "eval_s": round(paused_s, 3),
                    "steps_during_eval": steps_during_eval})
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The script's own flags (``task.argv``: what follows ``--`` on the ``psflow run`` line)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warmup", type=int, default=10, help="untimed local steps first (throughput mode)")
    p.add_argument("--steps", type=int, default=60, help="timed local steps per worker (throughput mode)")
    p.add_argument("--target_step", type=int, default=0, help="step until this global step instead (0: throughput mode)")
    p.add_argument("--start_step", type=int, default=5, help="with --target_step: time from this global step on")
    p.add_argument("--test_examples", type=int, default=2000, help="with --target_step: test images the chief evaluates")
    p.add_argument("--target_accuracy", type=float, default=0.0,
                   help="step until the chief's test accuracy reaches this (0: off); needs --stop_file")
    p.add_argument("--eval_every", type=int, default=5, help="with --target_accuracy: global steps between evaluations")
    p.add_argument("--max_step", type=int, default=400, help="with --target_accuracy: give up at this global step")
    p.add_argument("--stop_file", default="", help="with --target_accuracy: the file the chief creates to stop the job")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (the example's default)")
    p.add_argument("--split_bytes", type=int, default=None, help="the Trainer's split_bytes (default: the config's)")
    p.add_argument("--push_inline", action="store_true",
                   help="A/B reference: send each push on the training thread (PushSender(threaded=False))")
    p.add_argument("--pipeline", action="store_true",
                   help="A/B: the async pipeline (a step computes while the one before travels; psflow.train.pipeline)")
    args = p.parse_args(argv)
    if min(args.warmup, args.steps, args.target_step, args.start_step) < 0 or args.steps < 1:
        p.error(f"step counts must be >= 0 and --steps >= 1; received {vars(args)}")
    if args.target_accuracy and (not args.stop_file or args.eval_every < 1 or not 0 < args.target_accuracy <= 1):
        p.error(f"--target_accuracy needs a value in (0, 1], --stop_file and --eval_every >= 1; received {vars(args)}")
    return args


def main() -> None:
    """One psflow task: a ps serves; a worker trains and reports its ``bench`` figures."""
    import psflow as pf

    task = pf.init()
    if task.is_ps:
        task.join()
        return
    args = parse_args(task.argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = cnn()
    settings: dict[str, Any] = {} if args.split_bytes is None else {"split_bytes": args.split_bytes}
    if args.pipeline:
        settings["pipeline"] = True
    trainer = pf.Trainer(model, pf.optim.Adam(lr=LR), task, **settings)
    if args.push_inline:
        from psflow.train.sender import PushSender

        trainer.sender = PushSender(threaded=False)
    train = pf.data.mnist("train", flatten=False).shard(task)
    batches = train.batches(BATCH, epochs=EPOCHS, seed=task.replica_index)
    if args.target_accuracy:
        task.report(bench=run_to_accuracy(trainer, task, model, batches, args))
        return
    if not args.target_step:
        task.report(bench=timed_steps(lambda x, y: trainer.step(loss_fn, batch=(x, y)), batches, args.warmup, args.steps))
        return
    result = run_to_step(trainer, task, batches, args.start_step, args.target_step)
    if task.is_chief:
        torch.set_num_threads(2)  # evaluation is outside the timed window; use the machine
        result["test_accuracy"] = accuracy(model, args.test_examples)
    task.report(bench=result)


if __name__ == "__main__":
    main()
