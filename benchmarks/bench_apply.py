"""The ps's optimizer step (psflow.ps.update.DirectStep): torch's fused kernels against its for-loop ones.

What a ps does per update (an async push, a sync step, and on a backup copy once more per update it
follows): one optimizer step over its shard's values. This times that step alone, on one thread as a
ps runs it, over the MNIST CNN's parameters (3.27M float32 values, ``examples/mnist_cnn.py``), for
each optimizer psflow builds fused by default (``OptimizerSpec.fused``) and its ``fused=False``
twin. A repetition is ``iters`` steps; the two cases' repetitions are interleaved
(harness.interleaved). The figure is for-loop time / fused time (above 1: fused is faster).

    .venv/bin/python benchmarks/bench_apply.py [--quick] [--reps N]
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import torch  # noqa: E402

from psflow.optim import SGD, Adagrad, Adam, OptimizerSpec  # noqa: E402
from psflow.ps.update import DirectStep  # noqa: E402

# The CNN's parameters as the ps holds them (conv1, conv2, fc1, fc2: weights and biases).
CNN_SHAPES = [(32, 1, 5, 5), (32,), (64, 32, 5, 5), (64,), (1024, 3136), (1024,), (10, 1024), (10,)]
SPECS: list[OptimizerSpec] = [SGD(lr=0.01), SGD(lr=0.01, momentum=0.9), Adagrad(lr=0.01), Adam(lr=1e-3)]


def stepper(spec: OptimizerSpec, iters: int):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in CNN_SHAPES]
    grads = [torch.randn(s, generator=gen) * 1e-3 for s in CNN_SHAPES]
    step = DirectStep(spec.build(params))
    step(grads)  # the first step creates the state (through step())

    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            step(grads)
        return (time.perf_counter() - t0) / iters * 1e3

    return run


def main() -> None:
    args = harness.arg_parser(__doc__ or "").parse_args()
    reps = harness.reps_of(args, full=7, quick=3)
    torch.set_num_threads(1)
    iters = 5 if args.quick else 20
    rows = []
    for spec in SPECS:
        loop = dataclasses.replace(spec, fused=False)
        res = harness.interleaved({"fused": stepper(spec, iters), "for-loop": stepper(loop, iters)}, reps)
        f, lp = res["fused"], res["for-loop"]
        label = type(spec).__name__ + (f" momentum={spec.momentum}" if getattr(spec, "momentum", 0) else "")
        rows.append([label, f"{median(lp):.2f} ({harness.spread(lp, '.2f')})", f"{median(f):.2f} ({harness.spread(f, '.2f')})",
                     f"{median(lp) / median(f):.2f}x"])
    print(f"### The ps's optimizer step, fused against for-loop (MNIST CNN, 3.27M values, 1 thread, {reps} interleaved reps)\n")
    print(harness.md_table(["optimizer", "for-loop ms per step (spread)", "fused ms per step (spread)",
                            "for-loop / fused"], rows))
    print(f"\n`{harness.command_line()}` on {harness.machine()}")


if __name__ == "__main__":
    main()
