"""The ps's apply, side by side: ``Optimizer.step()`` against psflow's DirectStep (issue 13, item 1).

One process, no sockets: for each optimizer setting and size, two copies of the same parameters take
zero gradients (the values do not move, so every call does the same work), one through
``p.grad = g; optimizer.step()`` (what the ps did before DirectStep) and one through
:class:`psflow.ps.update.DirectStep` (what it does now). Repetitions interleaved; a repetition's
figure is the median of its calls (``harness.time_each``). CPU-bound and single-threaded
(``torch.set_num_threads(1)``, as a ps task), so it reads steadier under a loaded machine than the
transport table; it shows what each request's apply costs, not a round trip.

Run: ``.venv/bin/python benchmarks/scripts/apply_cost.py [--quick] [--reps N]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import harness  # noqa: E402  (the benchmark directory is not a package)
import torch  # noqa: E402

from psflow.optim import SGD, Adam, OptimizerSpec  # noqa: E402
from psflow.ps.update import DirectStep  # noqa: E402

SIZES = {"64 B": 16, "64 KiB": 16 << 10, "1 MiB": 256 << 10}
SPECS: dict[str, OptimizerSpec] = {"SGD": SGD(lr=1e-3), "SGD momentum 0.9": SGD(lr=1e-3, momentum=0.9),
                                   "Adam": Adam(lr=1e-3)}


def main() -> None:
    args = harness.arg_parser(__doc__.splitlines()[0]).parse_args()
    reps = harness.reps_of(args, full=7, quick=3)
    iters = 300 if args.quick else 1000
    torch.set_num_threads(1)
    print("## The ps's apply: Optimizer.step() vs DirectStep\n")
    print(f"`{harness.command_line()}`  \n{harness.machine()}\n")
    rows = []
    for size, numel in SIZES.items():
        for label, spec in SPECS.items():
            if label == "Adam" and numel > SIZES["64 KiB"]:
                continue  # torch's Adam allocates its temporaries per call: at 1 MiB the figures are torch's page faults
            harness.log(f"{size} {label}: {reps} reps x {iters} calls, step() and DirectStep interleaved")
            slow_p, fast_p = [torch.zeros(numel)], [torch.zeros(numel)]
            slow, fast = spec.build(slow_p), spec.build(fast_p)
            direct = DirectStep(fast)
            grad = torch.zeros(numel)

            def step_call(p: torch.Tensor = slow_p[0], opt: torch.optim.Optimizer = slow, g: torch.Tensor = grad) -> None:
                p.grad = g
                opt.step()
                p.grad = None

            res = harness.interleaved({
                "step()": lambda f=step_call: harness.time_each(f, iters),
                "DirectStep": lambda d=direct, g=grad: harness.time_each(lambda: d([g]), iters),
            }, reps)
            a, b = harness.median(res["step()"]), harness.median(res["DirectStep"])
            rows.append([size, label, f"{a * 1e6:.1f}", f"{b * 1e6:.1f}", f"{a / b:.2f}x", f"{(a - b) * 1e6:.1f}",
                         f"{harness.spread([x * 1e6 for x in res['step()']], '.1f')} / "
                         f"{harness.spread([x * 1e6 for x in res['DirectStep']], '.1f')}"])
    print(harness.md_table(["size", "optimizer", "step() us", "DirectStep us", "step() / DirectStep", "saved us",
                            "spread step() / DirectStep"], rows))


if __name__ == "__main__":
    main()
