"""Training benchmark: the seed's MNIST softmax regression on psflow and on PyTorch's own ways.

Every configuration trains the same model (``examples/mnist_softmax.py``'s 784x10 + bias, zero
init), batch 100 per worker, SGD lr 0.01, on ``pf.data.mnist("train")``, for the same number of
epochs (one epoch = 60 000 examples in total, split between the workers), and is measured the way
psflow's Trainer measures itself: examples / seconds spent inside the training step (pull, forward,
backward, push or optimizer step; slicing the next batch is outside), with the examples of every
worker summed and divided by the slowest worker's step time.

- psflow async: 1 ps + 2 workers through the real launcher (``psflow run``), figures from its summary.json;
- psflow sync: the same with ``--mode sync`` (N = M = 2);
- PyTorch single process: ``torch.set_num_threads(2)``, a plain ``torch.optim.SGD`` loop;
- torch.distributed.rpc parameter server: rank 0 holds the model and applies SGD, 2 trainers
  ``rpc_sync`` to get the parameters and to push gradients (the tutorial pattern), one thread each;
- DDP (gloo): 2 processes, one thread each, each its half of the data.

Also "launch to 0.88": the smallest epochs at which psflow async reaches test accuracy 0.88, and the
launcher's wall time for that run (process start to exit, everything included).

The configurations run in interleaved rounds (each round runs each of them once, the order reversed
every other round); the report gives medians and ratios to single-process PyTorch.

Run: ``.venv/bin/python benchmarks/bench_training.py [--quick]``. The markdown report goes to stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import torch
import torch.nn.functional as F
from harness import REPO, log, md_table, median

BATCH = 100
TRAIN_EXAMPLES = 60_000
LR = 0.01
TARGET_ACCURACY = 0.88
TF_ASYNC_EX_PER_SEC = 26_000  # the issue's published TF 1.x figure, async softmax 1 ps + 2 workers
TF_SYNC_EX_PER_SEC = 20_800  # the issue's: TF 1.x SyncReplicasOptimizer, softmax, 2 workers
TF_LAUNCH_TO_088_S = 22.6
CHILD_TIMEOUT_S = 300
SINGLE_1 = "PyTorch single process, 1 thread (reference)"


def softmax_model() -> torch.nn.Module:
    """The example's own model class (imported from the file, so it is the same model), zero init."""
    spec = importlib.util.spec_from_file_location("mnist_softmax_example", REPO / "examples" / "mnist_softmax.py")
    if spec is None or spec.loader is None:
        raise RuntimeError(f"Cannot load the example model from {REPO / 'examples' / 'mnist_softmax.py'}.")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Softmax("zeros")


def accuracy_on_test_set(model: torch.nn.Module) -> float:
    import psflow as pf

    test = pf.data.mnist("test")
    with torch.no_grad():
        return (model(test.x).argmax(1) == test.y).float().mean().item()


# --------------------------------------------------------------------------- psflow through the launcher


def psflow_run(epochs: int, mode: str, workdir: Path, *, preload: bool = True) -> dict[str, Any]:
    """One ``psflow run`` of the example; returns the summary's headline figures."""
    logdir = Path(tempfile.mkdtemp(prefix=f"psflow-{mode}-", dir=workdir))
    exe = Path(sys.executable).with_name("psflow")
    cmd = [str(exe), "run", "--ps", "1", "--workers", "2", "--logdir", str(logdir)]
    if not preload:
        cmd.append("--no-preload")
    if mode != "async":
        cmd += ["--mode", mode]
    cmd += ["examples/mnist_softmax.py", "--", "--epochs", str(epochs), "--init", "zeros", "--print_every", "100000"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    command_s = time.perf_counter() - t0
    summary_path = logdir / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        raise RuntimeError(f"`{' '.join(cmd)}` failed with code {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    s = json.loads(summary_path.read_text())
    shutil.rmtree(logdir, ignore_errors=True)
    if int(s["examples"]) != TRAIN_EXAMPLES * epochs:
        raise RuntimeError(f"`{' '.join(cmd)}` trained {s['examples']} examples; expected {TRAIN_EXAMPLES * epochs}.")
    return {
        # the rate inside the steps, as the baselines' below (the summary's headline is wall-clock)
        "examples_per_sec": float(s["step_examples_per_sec"]),
        "wall_s": command_s,  # the whole `psflow run` command: the launcher's own start and exit included
        "tasks_wall_s": float(s["wall_s"]),  # the summary's: from starting the tasks to their exit
        "test_accuracy": float(s["test_accuracy"]),
        "examples": int(s["examples"]),
    }


# --------------------------------------------------------------------------- baselines (child processes)


def child_single(epochs: int, threads: int = 2) -> dict[str, Any]:
    """Single-process PyTorch, ``threads`` intra-op threads, plain torch.optim.SGD."""
    import psflow as pf

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    model = softmax_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    examples, step_s = 0, 0.0
    for x, y in pf.data.mnist("train").batches(BATCH, epochs=epochs, seed=0):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        float(loss.detach())
        step_s += time.perf_counter() - t0
        examples += len(x)
    return {"examples": examples, "train_time_s": step_s, "test_accuracy": accuracy_on_test_set(model)}


# The torch.distributed.rpc parameter server: module-level state on rank 0, reached by rpc_sync.
_PS: ParameterServer | None = None


class ParameterServer:
    """Holds the model and applies SGD as gradients arrive (async, under a lock, as the tutorial)."""

    def __init__(self) -> None:
        self.model = softmax_model()
        self.params = list(self.model.parameters())
        self.opt = torch.optim.SGD(self.params, lr=LR)
        self.lock = threading.Lock()

    def get(self) -> list[torch.Tensor]:
        with self.lock:
            return [p.detach().clone() for p in self.params]

    def push(self, grads: list[torch.Tensor]) -> None:
        with self.lock:
            for p, g in zip(self.params, grads):
                p.grad = g
            self.opt.step()


def _ps_get() -> list[torch.Tensor]:
    assert _PS is not None
    return _PS.get()


def _ps_push(grads: list[torch.Tensor]) -> None:
    assert _PS is not None
    _PS.push(grads)


def _rpc_rank(rank: int, init_file: str, out_dir: str, epochs: int) -> None:
    global _PS
    import torch.distributed.rpc as rpc

    import psflow as pf

    torch.set_num_threads(1)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{init_file}", num_worker_threads=4)
    if rank == 0:
        _PS = ParameterServer()
    rpc.init_rpc("ps" if rank == 0 else f"trainer{rank - 1}", rank=rank, world_size=3, rpc_backend_options=opts)
    if rank > 0:
        index = rank - 1
        torch.manual_seed(index)
        model = softmax_model()
        params = list(model.parameters())
        examples, step_s = 0, 0.0
        for x, y in pf.data.mnist("train").shard(index, 2).batches(BATCH, epochs=epochs, seed=index):
            t0 = time.perf_counter()
            values = rpc.rpc_sync("ps", _ps_get)
            with torch.no_grad():
                for p, v in zip(params, values):
                    p.copy_(v)
                    p.grad = None
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            rpc.rpc_sync("ps", _ps_push, args=([p.grad for p in params],))
            float(loss.detach())
            step_s += time.perf_counter() - t0
            examples += len(x)
        result: dict[str, Any] = {"examples": examples, "train_time_s": step_s}
        if index == 0:
            values = rpc.rpc_sync("ps", _ps_get)
            with torch.no_grad():
                for p, v in zip(params, values):
                    p.copy_(v)
            result["test_accuracy"] = accuracy_on_test_set(model)
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    rpc.shutdown()  # waits for every rank: the ps serves until both trainers are done


def _ddp_rank(rank: int, init_file: str, out_dir: str, epochs: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import psflow as pf

    torch.set_num_threads(1)
    torch.manual_seed(rank)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    inner = softmax_model()
    model = DistributedDataParallel(inner)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    examples, step_s = 0, 0.0
    for x, y in pf.data.mnist("train").shard(rank, 2).batches(BATCH, epochs=epochs, seed=rank):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        float(loss.detach())
        step_s += time.perf_counter() - t0
        examples += len(x)
    result: dict[str, Any] = {"examples": examples, "train_time_s": step_s}
    if rank == 0:
        result["test_accuracy"] = accuracy_on_test_set(inner)
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def child_spawned(fn: Callable[[int, str, str, int], None], nprocs: int, epochs: int) -> dict[str, Any]:
    import torch.multiprocessing as tmp

    with tempfile.TemporaryDirectory(prefix="psflow-bench-") as d:
        init_file = os.path.join(d, "rendezvous")
        tmp.spawn(fn, args=(init_file, d, epochs), nprocs=nprocs)
        results = [json.loads(p.read_text()) for p in sorted(Path(d).glob("*.json"))]
    accuracy = next((r["test_accuracy"] for r in results if "test_accuracy" in r), float("nan"))
    return {
        "examples": sum(r["examples"] for r in results),
        "train_time_s": max(r["train_time_s"] for r in results),
        "test_accuracy": accuracy,
    }


CHILDREN: dict[str, Callable[[int], dict[str, Any]]] = {
    "single": child_single,
    "single1": lambda epochs: child_single(epochs, threads=1),
    "rpc": lambda epochs: child_spawned(_rpc_rank, 3, epochs),
    "ddp": lambda epochs: child_spawned(_ddp_rank, 2, epochs),
}


def baseline_run(kind: str, epochs: int, workdir: Path) -> dict[str, Any]:
    """Run one baseline in a fresh process tree (so each configuration starts from the same state)."""
    out = workdir / f"{kind}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--epochs", str(epochs), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"baseline {kind} failed with code {proc.returncode}:\n{proc.stderr[-3000:]}")
    r = json.loads(out.read_text())
    if r["examples"] != TRAIN_EXAMPLES * epochs:
        raise RuntimeError(f"baseline {kind} trained {r['examples']} examples; expected {TRAIN_EXAMPLES * epochs}.")
    r["examples_per_sec"] = r["examples"] / r["train_time_s"]
    return r


# --------------------------------------------------------------------------- the report


def launch_to_accuracy(
    workdir: Path, start: int, max_epochs: int, known: dict[int, list[dict[str, Any]]], *, search: bool = True
) -> tuple[int | None, list[dict[str, Any]]]:
    """The fewest epochs at which psflow async reaches TARGET_ACCURACY, and the async runs of that many.

    Starts at ``start`` epochs and walks down while the target is reached, up while it is not (the
    accuracy grows with the epochs). ``known`` holds runs already made, by epochs; its first run of a
    given epoch count is the probe. Without ``search`` only the known runs are looked at.
    """
    def probe(epochs: int) -> list[dict[str, Any]]:
        if epochs not in known:
            known[epochs] = [psflow_run(epochs, "async", workdir)]
        r = known[epochs][0]
        log(f"launch-to-{TARGET_ACCURACY}: epochs={epochs} accuracy={r['test_accuracy']:.4f} wall={r['wall_s']:.1f}s")
        return known[epochs]

    def reached(epochs: int) -> bool:
        return probe(epochs)[0]["test_accuracy"] >= TARGET_ACCURACY

    if not search:
        return (start, known[start]) if reached(start) else (None, [])
    epochs = start
    if reached(epochs):
        while epochs > 1 and reached(epochs - 1):
            epochs -= 1
        return epochs, known[epochs]
    while epochs < max_epochs:
        epochs += 1
        if reached(epochs):
            return epochs, known[epochs]
    return None, []


def main() -> None:
    p = harness.arg_parser(__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=None, help="epochs of every configuration (default 3, quick 1)")
    p.add_argument("--max-epochs-to-target", type=int, default=8, help="launch-to-0.88: give up past this many epochs")
    p.add_argument("--target-runs", type=int, default=None,
                   help="launch-to-0.88: runs at the epochs found, for the median wall time (default 3, quick: no search)")
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    epochs = args.epochs if args.epochs is not None else (1 if args.quick else 3)
    if epochs < 1:
        raise SystemExit(f"--epochs must be at least 1; received {epochs}.")
    if args.child:
        Path(args.out).write_text(json.dumps(CHILDREN[args.child](epochs)))
        return
    reps = harness.reps_of(args, full=2, quick=1)
    header = harness.machine()
    with tempfile.TemporaryDirectory(prefix="psflow-bench-training-") as d:
        workdir = Path(d)
        reference = [] if args.quick else [(SINGLE_1, lambda: baseline_run("single1", epochs, workdir))]
        cases: dict[str, Callable[[], dict[str, Any]]] = dict([
            ("psflow async (1 ps + 2 workers)", lambda: psflow_run(epochs, "async", workdir)),
            ("psflow sync (N = M = 2)", lambda: psflow_run(epochs, "sync", workdir)),
            ("PyTorch single process, 2 threads", lambda: baseline_run("single", epochs, workdir)),
            *reference,  # --quick leaves it out
            ("torch.distributed.rpc ps, 2 trainers", lambda: baseline_run("rpc", epochs, workdir)),
            ("DDP gloo, 2 processes", lambda: baseline_run("ddp", epochs, workdir)),
        ])
        log(f"training: {reps} interleaved rounds of {len(cases)} configurations, {epochs} epoch(s) each")
        res = harness.interleaved(cases, reps, warmup=0)
        known = {epochs: list(res["psflow async (1 ps + 2 workers)"])}
        if args.quick:
            log("launch to 0.88: --quick looks only at the runs above (no search)")
        else:
            log(f"launch to 0.88: psflow async from {epochs} epoch(s), down while it reaches 0.88, up while it does not")
        target_epochs, target_runs = launch_to_accuracy(
            workdir, epochs, args.max_epochs_to_target, known, search=not args.quick
        )
        want = args.target_runs if args.target_runs is not None else (1 if args.quick else 3)
        while target_epochs is not None and len(target_runs) < want:
            target_runs.append(psflow_run(target_epochs, "async", workdir))
            log(f"launch-to-{TARGET_ACCURACY}: another run of {target_epochs} epoch(s): "
                f"accuracy={target_runs[-1]['test_accuracy']:.4f} wall={target_runs[-1]['wall_s']:.1f}s")
        preload_ab: dict[str, list[dict[str, Any]]] = {"preload": [], "no-preload": []}
        if target_epochs is not None and not args.quick:
            log(f"launch: {want} interleaved pairs of {target_epochs}-epoch runs, fork server (default) vs --no-preload")
            for i in range(want):
                for name in (("preload", "no-preload") if i % 2 == 0 else ("no-preload", "preload")):
                    preload_ab[name].append(psflow_run(target_epochs, "async", workdir, preload=name == "preload"))
    print(report(res, epochs, reps, header, target_epochs, target_runs, args.quick, preload_ab))


def report(
    res: dict[str, list[dict[str, Any]]], epochs: int, reps: int, header: str,
    target_epochs: int | None, target_runs: list[dict[str, Any]], quick: bool,
    preload_ab: dict[str, list[dict[str, Any]]] | None = None,
) -> str:
    eps = {name: median([r["examples_per_sec"] for r in runs]) for name, runs in res.items()}
    single = eps["PyTorch single process, 2 threads"]
    single1 = eps.get(SINGLE_1)
    rows = []
    for name, runs in res.items():
        rows.append([
            name,
            f"{eps[name]:,.0f}",
            harness.spread([r["examples_per_sec"] for r in runs], ",.0f"),
            f"{eps[name] / single:.2f}",
            f"{eps[name] / single1:.2f}" if single1 else "-",
            f"{median([r['test_accuracy'] for r in runs]):.4f}",
        ])
    async_eps = eps["psflow async (1 ps + 2 workers)"]
    sync_eps = eps["psflow sync (N = M = 2)"]
    lines = [
        "## Training: MNIST softmax regression, examples/sec",
        "",
        f"`{harness.command_line()}`  ",
        header,
        "",
        f"{reps} interleaved round(s), {epochs} epoch(s) of 60 000 examples per configuration, batch 100 per worker, "
        "SGD lr 0.01; examples/sec = examples / time inside the training step (slowest worker); medians. "
        "psflow's figure is its launcher's summary.json's step_examples_per_sec; like the baselines', its step time excludes the one-time "
        "setup (the chief initializing the ps, the others waiting for it).",
        "",
        md_table(["configuration", "examples/sec", "spread", "vs single process (2 threads)", "vs single process (1 thread)",
                  "test accuracy"], rows),
        "",
        f"psflow async vs TensorFlow 1.x runtime (async softmax 1 ps + 2 workers, {TF_ASYNC_EX_PER_SEC:,} ex/s: "
        f"orientation figure from the issue, NOT measured here): {async_eps / TF_ASYNC_EX_PER_SEC:.2f}x (target >= 2.5x). "
        f"psflow sync vs TensorFlow's SyncReplicasOptimizer ({TF_SYNC_EX_PER_SEC:,} ex/s, the issue's, NOT measured "
        f"here): {sync_eps / TF_SYNC_EX_PER_SEC:.2f}x (target >= 2.5x).",
        "",
    ]
    if target_runs:
        walls = [r["wall_s"] for r in target_runs]
        accs = [r["test_accuracy"] for r in target_runs]
        hits = sum(a >= TARGET_ACCURACY for a in accs)
        lines.append(
            f"Launch to {TARGET_ACCURACY} test accuracy (psflow async, 1 ps + 2 workers; the wall time of the whole "
            f"`psflow run` command, from its start to its exit: the launcher's and every task's Python and torch "
            f"imports included): **{median(walls):.1f} s**, the "
            f"median of {len(walls)} run(s) of {target_epochs} epoch(s), the fewest whose first run reached it "
            f"({hits} of {len(walls)} reached it; wall {harness.spread(walls, '.1f')} s, accuracy "
            f"{harness.spread(accs, '.4f')}). TensorFlow 1.x (issue, not measured here): {TF_LAUNCH_TO_088_S} s; "
            f"psflow/TF time {median(walls) / TF_LAUNCH_TO_088_S:.2f}."
        )
        if preload_ab and preload_ab["preload"] and preload_ab["no-preload"]:
            pre = [r["wall_s"] for r in preload_ab["preload"]]
            fresh = [r["wall_s"] for r in preload_ab["no-preload"]]
            lines += ["", (
                f"Fork server (the default) vs `--no-preload` (every task a fresh interpreter), {len(pre)} interleaved "
                f"pairs of {target_epochs}-epoch runs, whole command: **{median(pre):.1f} s** "
                f"({harness.spread(pre, '.1f')}) vs **{median(fresh):.1f} s** ({harness.spread(fresh, '.1f')}); "
                f"{median(fresh) - median(pre):.1f} s sooner with the fork server."
            )]
    else:
        lines.append(
            f"Launch to {TARGET_ACCURACY}: not reached within the epochs tried"
            + (" (--quick does not search; run without it)." if quick else ".")
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
