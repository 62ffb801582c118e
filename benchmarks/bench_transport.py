"""Transport benchmark: psflow's parameter pull + gradient push against a raw socket echo.

What it measures, side by side in one run (repetitions interleaved, medians, ratios):

- bulk: for 1, 16 and 64 MiB of float32 parameters, one psflow round trip = ``PsClient.pull`` of the
  whole shard into a preallocated tensor + ``PsClient.push`` of a gradient of the same size (and,
  where the client has it, ``PsClient.push_pull``: the trainer's step, gradient up and updated values
  back in one request), against
  a ps task (``PsService`` on a ``Server``, async mode, SGD with a negligible lr) in another process;
  and one raw round trip = ``sendall`` of N bytes to a plain socket echo server in another process,
  which ``recv_into``s them into a preallocated buffer and sends them back, read with ``recv_into``
  into a preallocated buffer. Both move N bytes each way, one direction after the other, so
  "GB/s each way" is N / (round-trip time) for both, and psflow/raw = raw time / psflow time.
- small requests: round-trip time of psflow's PING op against a raw 20-byte echo.

Run: ``.venv/bin/python benchmarks/bench_transport.py [--quick]``. The markdown report goes to stdout.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import harness
import torch
from harness import MIB, log, md_table, median

from psflow.cluster import ClusterSpec, TaskId
from psflow.config import TrainConfig
from psflow.optim import SGD
from psflow.ps.client import PsClient
from psflow.ps.service import PsService
from psflow.server import Server
from psflow.wire.ops import Op

SIZES_MIB = (1, 16, 64)
SMALL_BYTES = 20
SECRET = b"bench-transport"
TINY_LR = 1e-12  # OptimizerSpec refuses lr=0; with zero gradients the values stay bit-identical anyway


# --------------------------------------------------------------------------- the servers (child processes)


def serve_ps(sizes_mib: tuple[int, ...], pipe: Any) -> None:
    """A ps task process: one Server + PsService per size (a ps shard pulls all its values at once)."""
    torch.set_num_threads(1)
    services = []
    addresses = []
    for _ in sizes_mib:
        server = Server("ps:0", secret=SECRET)
        # The ps checks every request against its cluster: the clients' (client_of) with a stand-in ps address.
        cluster = ClusterSpec.from_dict({"ps": ["127.0.0.1:3"], "worker": ["127.0.0.1:1", "127.0.0.1:2"]})
        services.append(PsService(server, 0, cluster))
        addresses.append(server.start())
    pipe.send(addresses)
    pipe.recv()  # the benchmark is over
    for s in services:
        s.server.stop()


def serve_echo(pipe: Any) -> None:
    """A plain socket echo server: each connection first says its message size N, then every N bytes
    it sends are received into a preallocated buffer and sent back."""
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    pipe.send(lsock.getsockname()[1])
    threading.Thread(target=_echo_accept, args=(lsock,), daemon=True).start()
    pipe.recv()
    lsock.close()


def _echo_accept(lsock: socket.socket) -> None:
    while True:
        try:
            sock, _ = lsock.accept()
        except OSError:
            return
        threading.Thread(target=_echo_conn, args=(sock,), daemon=True).start()


def _echo_conn(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with sock:
        head = bytearray(8)
        if not _recv_exact(sock, memoryview(head)):
            return
        (n,) = struct.unpack("<Q", head)
        buf = memoryview(bytearray(n))
        while _recv_exact(sock, buf):
            sock.sendall(buf)


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return False
        got += k
    return True


# --------------------------------------------------------------------------- the clients


class RawEcho:
    """Client of the echo server for one message size."""

    def __init__(self, port: int, nbytes: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(struct.pack("<Q", nbytes))
        self.out = memoryview(bytearray(b"\x5a" * nbytes))
        self.into = memoryview(bytearray(nbytes))

    def round_trip(self) -> None:
        self.sock.sendall(self.out)
        if not _recv_exact(self.sock, self.into):
            raise ConnectionError("the echo server closed the connection")

    def close(self) -> None:
        self.sock.close()


class PsRoundTrip:
    """A worker's pull + push of one float32 parameter of ``nbytes`` against one ps shard."""

    def __init__(self, address: str, nbytes: int) -> None:
        self.client = client_of(address, 0)
        n = nbytes // 4
        self.initial = torch.arange(n, dtype=torch.float32)
        self.client.initialize(
            [{"w": self.initial}],
            {"optimizer": SGD(lr=TINY_LR).to_dict(), "config": TrainConfig().to_dict(), "placement_digest": "bench"},
        )
        self.dest = torch.empty(n, dtype=torch.float32)
        self.grad = torch.zeros(n, dtype=torch.float32)
        self.version = 0
        self.pull_s: list[float] = []
        self.push_s: list[float] = []
        self.has_push_pull = hasattr(self.client, "push_pull")

    def round_trip(self) -> None:
        t0 = time.perf_counter()
        self.version = self.client.pull([{"w": self.dest}])[0]
        t1 = time.perf_counter()
        self.client.push(0, [self.version], [[("w", self.grad)]])
        t2 = time.perf_counter()
        self.pull_s.append(t1 - t0)
        self.push_s.append(t2 - t1)

    def push_pull(self) -> None:
        """The trainer's hot path: gradients up, the updated values back, in one round trip."""
        replies = self.client.push_pull(0, [self.version], [[("w", self.grad)]], [{"w": self.dest}], wait_s=0.0)
        self.version = int(replies[0]["version"])

    def check(self) -> None:
        """The bytes really travelled: the pulled values are the initial ones (zero gradients)."""
        self.client.pull([{"w": self.dest}])
        if not torch.equal(self.dest, self.initial):
            raise RuntimeError("psflow pulled values that differ from the ones it was initialized with")

    def close(self) -> None:
        self.client.close()


# --------------------------------------------------------------------------- measurement


def per_rep(fn: Callable[[], None], iters: int) -> Callable[[], float]:
    """One repetition: ``iters`` calls, each timed alone; the repetition's figure is their median."""
    return lambda: harness.time_each(fn, iters)


def client_of(ps_address: str, worker: int) -> PsClient:
    """A worker's PsClient for a one-shard cluster (the worker's own address is never dialled)."""
    cluster = ClusterSpec.from_dict({"ps": [ps_address], "worker": ["127.0.0.1:1", "127.0.0.1:2"]})
    return PsClient(cluster, TaskId("worker", worker), SECRET)


def bench_bulk(ps_addresses: list[str], echo_port: int, reps: int, budget_bytes: int) -> tuple[str, dict[int, float]]:
    """Raw echo vs psflow pull+push (and push_pull) per size. Returns the table and raw/psflow time ratios."""
    rows = []
    ratios: dict[int, float] = {}
    for size_mib, address in zip(SIZES_MIB, ps_addresses):
        nbytes = size_mib * MIB
        iters = max(3, budget_bytes // nbytes)
        raw, ps = RawEcho(echo_port, nbytes), PsRoundTrip(address, nbytes)
        cases = {"raw": per_rep(raw.round_trip, iters), "pull+push": per_rep(ps.round_trip, iters)}
        if ps.has_push_pull:
            cases["push_pull"] = per_rep(ps.push_pull, iters)
        log(f"bulk {size_mib} MiB: {reps} reps x {iters} round trips each of {', '.join(cases)}, interleaved")
        ps.check()
        res = harness.interleaved(cases, reps)
        ps.check()
        t_raw, t_ps = median(res["raw"]), median(res["pull+push"])
        t_pp = median(res["push_pull"]) if ps.has_push_pull else float("nan")
        gbs = lambda t, n=nbytes: n / t / 1e9  # noqa: E731
        ratios[size_mib] = t_raw / t_ps
        rows.append([
            f"{size_mib} MiB",
            f"{gbs(t_raw):.2f}",
            f"{gbs(t_ps):.2f}",
            f"**{100 * t_raw / t_ps:.0f}%**",
            f"{gbs(median(ps.pull_s)):.2f} / {gbs(median(ps.push_s)):.2f}",
            f"{gbs(t_pp):.2f}" if ps.has_push_pull else "-",
            f"{100 * t_raw / t_pp:.0f}%" if ps.has_push_pull else "-",
            f"{harness.spread([nbytes / t / 1e9 for t in res['raw']], '.2f')} / "
            f"{harness.spread([nbytes / t / 1e9 for t in res['pull+push']], '.2f')}",
        ])
        raw.close()
        ps.close()
    table = md_table(
        ["size", "raw echo GB/s each way", "psflow pull+push GB/s each way", "pull+push / raw",
         "psflow pull / push alone GB/s", "psflow push_pull GB/s each way", "push_pull / raw",
         "spread GB/s raw / pull+push"],
        rows,
    )
    return table, ratios


def bench_small(ps_address: str, echo_port: int, reps: int, iters: int) -> tuple[str, float]:
    """Raw 20-byte echo vs psflow PING. Returns the table and the psflow/raw RTT ratio."""
    log(f"small requests: {reps} reps x {iters} round trips each, raw 20-byte echo and psflow PING interleaved")
    raw = RawEcho(echo_port, SMALL_BYTES)
    client = client_of(ps_address, 1)
    conn = client.conns[0]
    res = harness.interleaved(
        {"raw": per_rep(raw.round_trip, iters), "psflow": per_rep(lambda: conn.request(Op.PING), iters)}, reps
    )
    raw.close()
    client.close()
    t_raw, t_ps = median(res["raw"]), median(res["psflow"])
    table = md_table(
        ["request", "raw 20-byte echo RTT us", "psflow PING RTT us", "psflow/raw", "spread us raw / psflow"],
        [[
            "small round trip",
            f"{t_raw * 1e6:.1f}",
            f"{t_ps * 1e6:.1f}",
            f"{t_ps / t_raw:.2f}x",
            f"{harness.spread([t * 1e6 for t in res['raw']])} / {harness.spread([t * 1e6 for t in res['psflow']])}",
        ]],
    )
    return table, t_ps / t_raw


def main() -> None:
    p = harness.arg_parser(__doc__.splitlines()[0])
    args = p.parse_args()
    reps = harness.reps_of(args, full=7, quick=3)
    budget = (48 if args.quick else 160) * MIB  # bytes each way per repetition of a bulk case
    small_iters = 500 if args.quick else 1500
    ctx = mp.get_context("spawn")
    ps_here, ps_there = ctx.Pipe()
    echo_here, echo_there = ctx.Pipe()
    ps_proc = ctx.Process(target=serve_ps, args=(SIZES_MIB, ps_there), daemon=True)
    echo_proc = ctx.Process(target=serve_echo, args=(echo_there,), daemon=True)
    ps_proc.start()
    echo_proc.start()
    try:
        ps_addresses: list[str] = ps_here.recv()
        echo_port: int = echo_here.recv()
        header = harness.machine()
        bulk, ratios = bench_bulk(ps_addresses, echo_port, reps, budget)
        small, small_ratio = bench_small(ps_addresses[0], echo_port, reps, small_iters)
    finally:
        for pipe in (ps_here, echo_here):
            try:
                pipe.send("stop")
            except OSError:
                pass
        for proc in (ps_proc, echo_proc):
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    verdict_bulk = all(ratios[s] >= 0.9 for s in (16, 64))
    print(f"## Transport: psflow ps vs raw socket echo\n\n`{harness.command_line()}`  \n{header}\n")
    print(
        f"{reps} interleaved repetitions per case; a repetition's figure is the median of its round trips (each timed "
        "alone), the table gives the median over repetitions and the spread of the repetitions. Loopback TCP; the ps "
        "and the echo server each run in their own process.\n"
    )
    print(bulk + "\n")
    print(small + "\n")
    print(
        f"Targets: psflow/raw >= 90% at 16 MiB and above: "
        f"{'met' if verdict_bulk else 'not met'} (16 MiB {100 * ratios[16]:.0f}%, 64 MiB {100 * ratios[64]:.0f}%); "
        f"small RTT within 1.5x of raw: {'met' if small_ratio <= 1.5 else 'not met'} ({small_ratio:.2f}x).\n"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
