"""Checkpoint benchmark: the Supervisor's sharded checkpoint against ``torch.save`` of the same state dict.

What it measures, side by side in one run (repetitions interleaved, medians, spreads):

- a ~100 MB model (six 2048x2048 linear layers, float32; each weight split across every ps shard
  with ``split_bytes``) held by 1, 2 and 4 ps tasks, each a separate process;
- write: ``Supervisor.save()`` = every ps snapshots its shard and writes, hashes and fsyncs its own
  safetensors file in parallel, then the chief commits the manifest; against ``torch.save`` of the
  model's state dict to one file, then fsync, in one process;
- load: ``latest_checkpoint`` (every shard's sha256 verified) + reading the shards + putting the
  split tensors back together, in the chief; against ``torch.load`` of the single file;
- restore: the chief's whole ``Supervisor.__enter__`` on fresh (but warmed-up) ps processes: load
  as above, send each shard its values, wait until ready, pull the model, end to end.

MB/s is the checkpoint's bytes over the median time. Timings of the same run compare; absolute
figures depend on the disk and on the neighbours (see the machine line).

Run: ``.venv/bin/python benchmarks/bench_checkpoint.py [--quick] [--reps N]``. The markdown report goes to stdout.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import torch
from harness import MIB, log, md_table, median, spread

SECRET = b"bench-checkpoint"
LAYERS, WIDTH = 6, 2048
TINY_LR = 1e-12  # OptimizerSpec refuses lr=0; zero gradients keep the values anyway


def ps_main(index: int, num_ps: int, conn: Any) -> None:
    """A ps task in its own process: serve one shard (with the default PS_SAVE writer) until done."""
    torch.set_num_threads(1)
    from psflow.cluster import ClusterSpec
    from psflow.ps.service import PsService, default_save
    from psflow.server import Server

    # The first torch.optim optimizer of a process costs ~1 s (lazy imports); pay it before the clock
    # runs, so "restore" measures the checkpoint, not torch's start-up.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    server = Server(f"ps:{index}", secret=SECRET)
    # The ps checks every request against its cluster: connect()'s, with stand-in ps addresses.
    cluster = ClusterSpec.from_dict({"ps": [f"127.0.0.1:{10 + i}" for i in range(num_ps)], "worker": ["127.0.0.1:1"]})
    service = PsService(server, index, cluster)
    service.on_save = default_save(service)
    conn.send(server.start())
    service.join()
    deadline = time.monotonic() + 5.0
    while server.num_connections and time.monotonic() < deadline:  # let the last PS_DONE reply go out
        time.sleep(0.01)
    server.stop()


class PsProcesses:
    """``n`` ps processes on 127.0.0.1, each bound to port 0; ``addresses`` in shard order."""

    def __init__(self, n: int) -> None:
        ctx = mp.get_context("spawn")
        self.procs, self.addresses = [], []
        pipes = []
        for i in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=ps_main, args=(i, n, child), daemon=True)
            p.start()
            self.procs.append(p)
            pipes.append(parent)
        for parent in pipes:
            if not parent.poll(120):
                raise SystemExit("a ps process did not report its address within 120 s")
            self.addresses.append(parent.recv())

    def close(self) -> None:
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def connect(ps: PsProcesses, logdir: Path, model: torch.nn.Module) -> tuple[Any, Any]:
    """The chief's Task and Trainer against ``ps`` (the ps are initialized by the Supervisor)."""
    import psflow as pf
    from psflow.cluster import ClusterSpec, TaskId
    from psflow.identity import TaskIdentity
    from psflow.server import Server
    from psflow.task import Task

    cluster = ClusterSpec.from_dict({"ps": ps.addresses, "worker": ["127.0.0.1:1"]})
    task = Task(TaskIdentity(TaskId("worker", 0), cluster), secret=SECRET, server=Server("worker:0", secret=SECRET),
                config=pf.TrainConfig(), argv=[], coordinator=None, logdir=str(logdir), connect_timeout_s=60.0)
    trainer = pf.Trainer(model, pf.optim.SGD(lr=TINY_LR), task, split_bytes=4 * MIB)
    return task, trainer


def supervisor(task: Any) -> Any:
    import psflow as pf

    return pf.Supervisor(task, save_model_secs=None, summary_every_steps=None, keep_checkpoints=1)


class ShardedCase:
    """One live cluster of ``n`` ps whose chief saves repeatedly (one zero-gradient step between saves,
    so each save is a new step and the previous one is pruned, as in training)."""

    def __init__(self, n: int, root: Path) -> None:
        self.n, self.logdir = n, root / f"ps{n}"
        self.ps = PsProcesses(n)
        self.model = make_model()
        self.task, self.trainer = connect(self.ps, self.logdir, self.model)
        self.sv = supervisor(self.task).__enter__()
        self.bytes = 0

    def write(self) -> float:
        self.sv.step(lambda: sum((p * 0).sum() for p in self.model.parameters()))
        t0 = time.perf_counter()
        path = self.sv.save()
        dt = time.perf_counter() - t0
        self.bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        return dt

    def load(self) -> float:
        from psflow import checkpoint
        from psflow.checkpoint import load_whole_tensors

        t0 = time.perf_counter()
        tensors = load_whole_tensors(checkpoint.latest_checkpoint(self.sv.checkpoint_dir))
        dt = time.perf_counter() - t0
        assert tensors["0.weight"].shape == (WIDTH, WIDTH)
        return dt

    def restore(self) -> float:
        """A fresh chief and fresh ps restore the newest checkpoint (timed: Supervisor.__enter__)."""
        ps = PsProcesses(self.n)
        try:
            task, _ = connect(ps, self.logdir, make_model())
            sv = supervisor(task)
            t0 = time.perf_counter()
            sv.__enter__()
            dt = time.perf_counter() - t0
            assert sv.restored_from is not None
            sv.__exit__(None, None, None)
            return dt
        finally:
            ps.close()

    def close(self) -> None:
        self.sv.__exit__(None, None, None)
        self.ps.close()


class TorchCase:
    """``torch.save`` / ``torch.load`` of the same model's state dict, one file, one process."""

    def __init__(self, root: Path) -> None:
        self.state = make_model().state_dict()
        self.path = root / "torch" / "model.pt"
        self.path.parent.mkdir(parents=True)
        self.bytes = 0

    def write(self) -> float:
        t0 = time.perf_counter()
        with open(self.path, "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())
        dt = time.perf_counter() - t0
        self.bytes = self.path.stat().st_size
        return dt

    def load(self) -> float:
        t0 = time.perf_counter()
        state = torch.load(self.path, weights_only=True)
        dt = time.perf_counter() - t0
        assert state["0.weight"].shape == (WIDTH, WIDTH)
        return dt


def run_cases(root: Path, shards: tuple[int, ...], reps: int) -> tuple[Any, ...]:
    try:
        sharded = {n: ShardedCase(n, root) for n in shards}
        baseline = TorchCase(root)
        writes = harness.interleaved({**{f"ps{n}": c.write for n, c in sharded.items()}, "torch": baseline.write}, reps)
        loads = harness.interleaved({**{f"ps{n}": c.load for n, c in sharded.items()}, "torch": baseline.load}, reps)
        restores = harness.interleaved({f"ps{n}": c.restore for n, c in sharded.items()}, max(1, reps // 2), warmup=0)
        for c in sharded.values():
            c.close()
        return sharded, baseline, writes, loads, restores
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    args = harness.arg_parser(__doc__.splitlines()[0]).parse_args()
    reps = harness.reps_of(args, full=5, quick=2)
    shards = (1, 2) if args.quick else (1, 2, 4)
    torch.set_num_threads(1)
    log(f"machine: {harness.machine()}")
    root = Path(tempfile.mkdtemp(prefix="psflow-bench-ckpt-"))
    # The Supervisor's progress lines go to stderr with the harness's; stdout carries only the report.
    with contextlib.redirect_stdout(sys.stderr):
        cases = run_cases(root, shards, reps)
    sharded, baseline, writes, loads, restores = cases
    rows = []
    for name, case in [*((f"ps{n}", c) for n, c in sharded.items()), ("torch", baseline)]:
        mb = case.bytes / 1e6
        w, lo = median(writes[name]), median(loads[name])
        label = f"psflow, {name[2:]} ps" if name != "torch" else "torch.save / torch.load, 1 process"
        rest = median(restores[name]) if name in restores else None
        rows.append([label, f"{mb:.1f}", f"{w:.3f} ({spread(writes[name])})", f"{mb / w:.0f}",
                     f"{lo:.3f} ({spread(loads[name])})", f"{mb / lo:.0f}", "-" if rest is None else f"{rest:.3f}"])
    print("## Checkpoint write and restore: ~100 MB model\n")
    print(md_table(["case", "MB", "write s (min-max)", "write MB/s", "load s (min-max)", "load MB/s", "restore into ps s"], rows))
    print(f"\nMedians of {reps} interleaved repetitions (restore: {max(1, reps // 2)}). psflow write = PS_SAVE to every "
          "shard (snapshot, safetensors, sha256, fsync, in parallel) + manifest commit; load = verify every sha256 + "
          "read + reassemble split tensors; restore = the chief's Supervisor.__enter__ on fresh, warmed-up ps processes "
          "(load + send the shards + readiness + one pull). torch.save is followed by fsync.")
    print(f"\nMachine: {harness.machine()}  \nCommand: `{harness.command_line()}`")


if __name__ == "__main__":
    main()
