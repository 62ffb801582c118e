"""The ps's check for NaN/inf gradients (TrainConfig.nonfinite, psflow.ps.finite): its cost per push.

A ps checks every push before applying it (``nonfinite = refuse``, the default) or not at all
(``apply``). This times one async push into a :class:`~psflow.ps.store.ParameterStore` (SGD, one
thread, as a ps runs it) with the check and without, for gradients of 1 MiB and 16 MiB (float32, as
8 tensors) and of the MNIST CNN (3.27M values, ``examples/mnist_cnn.py``), interleaved
(harness.interleaved); and the check alone, against the obvious ``torch.isfinite(g).all()`` per
tensor. The figure is the check's added time per push, in microseconds and against the push.

    .venv/bin/python benchmarks/bench_nonfinite.py [--quick] [--reps N]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import torch  # noqa: E402

from psflow.config import TrainConfig  # noqa: E402
from psflow.optim import SGD  # noqa: E402
from psflow.ps.finite import nonfinite_keys  # noqa: E402
from psflow.ps.store import ParameterStore  # noqa: E402

CNN_SHAPES = [(32, 1, 5, 5), (32,), (64, 32, 5, 5), (64,), (1024, 3136), (1024,), (10, 1024), (10,)]


def shapes_of(size_bytes: int, parts: int = 8) -> list[tuple[int, ...]]:
    return [(size_bytes // 4 // parts,)] * parts


def pusher(shapes: list[tuple[int, ...]], policy: str, iters: int):
    gen = torch.Generator().manual_seed(0)
    values = {f"p{i}": torch.randn(s, generator=gen) for i, s in enumerate(shapes)}
    grads = {k: torch.randn(v.shape, generator=gen) * 1e-3 for k, v in values.items()}
    store = ParameterStore(shard=0, num_workers=1)
    store.initialize(values, optimizer=SGD(lr=1e-3).to_dict(), config=TrainConfig(nonfinite=policy), placement_digest="")

    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            store.push(0, store.version, grads)
        return (time.perf_counter() - t0) / iters * 1e6

    return run


def checker(shapes: list[tuple[int, ...]], naive: bool, iters: int):
    gen = torch.Generator().manual_seed(0)
    grads = {f"p{i}": torch.randn(s, generator=gen) for i, s in enumerate(shapes)}

    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            if naive:
                [bool(torch.isfinite(g).all()) for g in grads.values()]
            else:
                nonfinite_keys(grads)
        return (time.perf_counter() - t0) / iters * 1e6

    return run


def main() -> None:
    args = harness.arg_parser(__doc__ or "").parse_args()
    reps = harness.reps_of(args, full=7, quick=3)
    torch.set_num_threads(1)
    iters = 5 if args.quick else 20
    rows = []
    for label, shapes in (("1 MiB", shapes_of(harness.MIB)), ("16 MiB", shapes_of(16 * harness.MIB)),
                          ("CNN 12.5 MiB", CNN_SHAPES)):
        res = harness.interleaved({"apply": pusher(shapes, "apply", iters), "refuse": pusher(shapes, "refuse", iters),
                                   "check": checker(shapes, False, iters), "isfinite": checker(shapes, True, iters)}, reps)
        a, r, c, n = (median(res[k]) for k in ("apply", "refuse", "check", "isfinite"))
        rows.append([label, f"{a:.0f} ({harness.spread(res['apply'], '.0f')})", f"{r:.0f} ({harness.spread(res['refuse'], '.0f')})",
                     f"{r - a:+.0f} ({(r - a) / a:+.1%})", f"{c:.0f}", f"{n:.0f}"])
    print(f"### The ps's NaN/inf check per push (async SGD push into the store, 1 thread, {reps} interleaved reps, us)\n")
    print(harness.md_table(["gradient", "push, nonfinite=apply (spread)", "push, nonfinite=refuse (spread)",
                            "the check's cost", "the check alone", "isfinite().all() per tensor"], rows))
    print(f"\n`{harness.command_line()}` on {harness.machine()}")


if __name__ == "__main__":
    main()
