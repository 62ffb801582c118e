"""The cost of the ps's request timing (psflow.ps.latency): push and pull with it against without it.

One ps process hosts two ``PsService`` shards side by side: one as psflow builds it (each push and
pull timed into its :class:`~psflow.ps.latency.LatencyBook`) and one built with the timing left out
(``service._TIMED`` emptied while it is made: the handlers exactly as before the timing existed).
The benchmark's process is a worker of both: per size (64 B and 1 MiB of float32), a repetition is
``iters`` pushes or pulls, each timed alone, its figure their median; the repetitions of the two
shards are interleaved (harness.interleaved). The figure is timed / untimed per op (1.00: no cost).
Also printed: the book's own cost per request (``record`` of two ``perf_counter`` readings), timed
in this process.

    .venv/bin/python benchmarks/bench_pslatency.py [--quick] [--reps N]
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
import timeit
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import torch  # noqa: E402
from bench_transport import SECRET, client_of, init_meta  # noqa: E402

from psflow.cluster import ClusterSpec  # noqa: E402
from psflow.ps import service as service_module  # noqa: E402
from psflow.ps.latency import LatencyBook  # noqa: E402
from psflow.ps.service import PsService  # noqa: E402
from psflow.server import Server  # noqa: E402

SIZES = (64, 1 << 20)


def serve(pipe: Any) -> None:
    """The ps process: per size, a timed and an untimed shard, each on its own Server."""
    torch.set_num_threads(1)
    cluster = ClusterSpec.from_dict({"ps": ["127.0.0.1:3"], "worker": ["127.0.0.1:1", "127.0.0.1:2"]})
    services, addresses = [], []
    for timed in [t for _ in SIZES for t in (True, False)]:
        server = Server("ps:0", secret=SECRET)
        saved = service_module._TIMED
        if not timed:
            service_module._TIMED = {}
        try:
            services.append(PsService(server, 0, cluster))
        finally:
            service_module._TIMED = saved
        addresses.append(server.start())
    pipe.send(addresses)
    pipe.recv()
    for s in services:
        s.server.stop()


class Worker:
    """Pushes and pulls of one float32 parameter of ``nbytes`` to one shard."""

    def __init__(self, address: str, nbytes: int) -> None:
        self.client = client_of(address, 0)
        n = max(1, nbytes // 4)
        self.client.initialize([{"w": torch.zeros(n)}], init_meta(n))
        self.dest, self.grad, self.version = torch.empty(n), torch.zeros(n), 0

    def pull(self) -> None:
        self.version = self.client.pull([{"w": self.dest}])[0]

    def push(self) -> None:
        self.client.push(0, [self.version], [[("w", self.grad)]])


def main() -> None:
    args = harness.arg_parser(__doc__.splitlines()[0]).parse_args()
    reps = harness.reps_of(args, full=9, quick=3)
    iters = 300 if args.quick else 1000
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(there,), daemon=True)
    proc.start()
    rows = []
    try:
        addresses = here.recv()
        for i, nbytes in enumerate(SIZES):
            timed, untimed = Worker(addresses[2 * i], nbytes), Worker(addresses[2 * i + 1], nbytes)
            for op in ("push", "pull"):
                harness.log(f"{nbytes} B {op}: {reps} reps x {iters}")
                res = harness.interleaved({"timed": lambda w=timed, o=op: harness.time_each(getattr(w, o), iters),
                                           "untimed": lambda w=untimed, o=op: harness.time_each(getattr(w, o), iters)},
                                          reps)
                t, u = harness.median(res["timed"]), harness.median(res["untimed"])
                ratios = [a / b for a, b in zip(res["timed"], res["untimed"], strict=True)]
                rows.append([f"{nbytes:,} B", op, f"{u * 1e6:.1f}", f"{t * 1e6:.1f}", f"**{t / u:.3f}**",
                             harness.spread(ratios, ".3f")])
            timed.client.close()
            untimed.client.close()
    finally:
        here.send("stop")
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    book = LatencyBook(time.monotonic())
    clock, n = time.perf_counter, 200_000

    def one() -> None:
        start = clock()
        book.record("push", clock() - start)

    per_ns = min(timeit.repeat(one, number=n, repeat=5)) / n * 1e9
    print(f"## ps request timing: with against without\n\n`{harness.command_line()}`  \n{harness.machine()}\n")
    print(f"{reps} interleaved repetitions of {iters} requests, each timed alone; a repetition's figure is their "
          "median; the table gives the median over repetitions.\n")
    print(harness.md_table(["size", "op", "untimed us", "timed us", "timed / untimed", "spread of the per-rep ratio"],
                           rows))
    print(f"\nThe timing's own cost per request (two perf_counter readings and a list append), in this process: "
          f"{per_ns:.0f} ns.")


if __name__ == "__main__":
    main()
