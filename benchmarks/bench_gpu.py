"""GPU benchmark: the third seed's CNN on CUDA, psflow against plain PyTorch on the same card.

The seed (TensorFlow, 4 GPU towers on an AWS g2.8xlarge, batch 100 per tower) prints 14,199-18,758
examples/sec. This runs the same network (``examples/mnist_cnn.py``) on this machine's GPU:

1. ``torch``: a plain single-process PyTorch loop on ``cuda:0`` (Adam, batch 100 and 400, the batch
   copied from host memory each step as a data loader's would be): the card's own rate here;
2. psflow through ``psflow run`` with the example as users run it (1 ps on the CPU, workers on the GPU):
   one tower, batch 100; four towers on ``cuda:0`` (the seed's layout, 4 x 100, on the one card
   lent here); four async workers sharing the card; two ps with four workers.

psflow figures are the run's headline examples/sec (``summary.json``: examples over the wall-clock
span from the first step to the last, all workers together), the in-step rate beside it, and where a
worker's step goes (``--timeline``: compute, the wait for the ps's reply, the transfers; the ps's
apply per global step). The
ratio to ``torch`` says what the ps round trip costs per step: the CNN's 1.66M parameters (6.7 MB of float32)
travel to the ps and back every step. Nothing here asserts on a timing.

Run: ``python benchmarks/bench_gpu.py [--steps N]`` on a machine with a CUDA GPU (markdown to stdout);
without one it reports the benchmark skipped, saying why, and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks" / "scripts"))

from cnn_steps import cnn  # noqa: E402  (the example's own model class)

CONFIGS: list[tuple[str, list[str], list[str]]] = [
    ("psflow 1 ps + 1 worker, 1 tower, batch 100", ["--ps", "1", "--workers", "1"], ["--devices", "cuda:0"]),
    ("psflow 1 ps + 1 worker, 4 towers on cuda:0, batch 4 x 100", ["--ps", "1", "--workers", "1"],
     ["--devices", "cuda:0,cuda:0,cuda:0,cuda:0", "--batch_size", "400"]),
    ("psflow 1 ps + 4 async workers on cuda:0, batch 100 each", ["--ps", "1", "--workers", "4"], ["--devices", "cuda:0"]),
    ("psflow 2 ps + 4 async workers on cuda:0, batch 100 each", ["--ps", "2", "--workers", "4"], ["--devices", "cuda:0"]),
]


def torch_rate(batch: int, steps: int, warmup: int = 20) -> float:
    """Examples/sec of a plain PyTorch Adam loop on cuda:0 (host batches copied in, as a loader's)."""
    import psflow as pf

    train = pf.data.mnist("train", flatten=False)
    model = cnn().to("cuda:0")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    n = len(train.y)

    def step(i: int) -> None:
        lo = (i * batch) % (n - batch)
        x = train.x[lo : lo + batch].to("cuda:0", non_blocking=True)
        y = train.y[lo : lo + batch].to("cuda:0", non_blocking=True)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t0)


def psflow_rate(psflow_args: list[str], script_args: list[str], steps: int, threads: int) -> dict[str, object]:
    """Run the example through ``psflow run``; its summary's rates and accuracy."""
    logdir = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    thread_args = ["--threads", str(threads)] if threads else []
    cmd = [sys.executable, "-c", "from psflow.cli import main; main()", "run", *psflow_args, "--logdir", str(logdir),
           "--timeline", *thread_args, str(REPO / "examples" / "mnist_cnn.py"), "--",
           *script_args, "--max_steps", str(steps), "--log_every", str(max(1, steps // 4)), "--test_examples", "2000"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        return {"error": f"exit {proc.returncode}", "wall_s": round(wall, 1)}
    summary = json.loads((logdir / "summary.json").read_text())
    tl = summary.get("timeline") or {}
    step = tl.get("step") or {}
    ps_apply = [t["busy_s"] * t["shares"].get("apply", 0.0) for k, t in (tl.get("tasks") or {}).items() if k.startswith("ps:")]
    steps_done = summary.get("global_step") or 1
    where = (f"compute {step.get('compute', step.get('forward', 0)):.0%}, wait {step.get('wait', 0):.0%}, "
             f"push+pull {step.get('push', 0) + step.get('pull', 0):.0%}; "
             f"ps apply {1e3 * sum(ps_apply) / steps_done:.1f} ms per global step, its threads summed")
    return {"where": where,"examples_per_sec": summary.get("examples_per_sec"), "step_examples_per_sec": summary.get("step_examples_per_sec"),
            "global_step": summary.get("global_step"), "test_accuracy": summary.get("test_accuracy"), "wall_s": round(wall, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000, help="global steps per psflow run (the job's max_steps)")
    p.add_argument("--torch-steps", type=int, default=500, help="timed steps of the plain PyTorch loop")
    p.add_argument("--threads", type=int, default=0, help="torch threads per task (default: psflow run's, cores / tasks)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("## GPU benchmark\n\nSkipped: no CUDA GPU here (torch.cuda.is_available() is False); run "
              "benchmarks/bench_gpu.py on a machine with one.")
        return
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    rows = [f"| torch single process, cuda:0, batch {b} | {torch_rate(b, args.torch_steps):,.0f} | | | | |" for b in (100, 400)]
    for name, ps_args, script_args in CONFIGS:
        r = psflow_rate(ps_args, script_args, args.steps, args.threads)
        print(name, r, file=sys.stderr, flush=True)
        if "error" in r:
            rows.append(f"| {name} | {r['error']} | | | {r['wall_s']} | |")
        else:
            rows.append(f"| {name} | {r['examples_per_sec']:,.0f} | {r['step_examples_per_sec']:,.0f} | "
                        f"{r['test_accuracy']} (step {r['global_step']}) | {r['wall_s']} | {r['where']} |")
    print("| configuration | examples/sec (wall clock) | in-step examples/sec | test accuracy | run wall s | where a step goes (--timeline) |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("| the seed: TensorFlow, 4 GPU towers (g2.8xlarge), batch 4 x 100 | 14,199-18,758 (its printed lines) | | | | |")


if __name__ == "__main__":
    main()
