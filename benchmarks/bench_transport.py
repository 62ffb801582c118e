"""Transport benchmark: psflow's parameter pull + gradient push against a raw socket echo and a pyzmq echo.

What it measures, side by side in one run (repetitions interleaved, medians, spreads, ratios):

- bulk: for 1, 16, 64 and 256 MiB (256 MiB only without ``--quick``) of float32 parameters, one psflow
  round trip = ``PsClient.pull`` of the whole shard into a preallocated tensor + ``PsClient.push`` of
  a gradient of the same size, and ``PsClient.push_pull`` (the trainer's step: gradient up and
  updated values back in one request), against a ps task (``PsService`` on a ``Server``, async mode,
  SGD with a negligible lr) in another process; one raw round trip = ``sendall`` of N bytes to a
  plain socket echo server in another process, which ``recv_into``s them into a preallocated buffer
  and sends them back, read with ``recv_into`` into a preallocated buffer; and one pyzmq round trip =
  a REQ socket ``send(copy=False)`` of the same N bytes to a REP echo in a third process (which
  receives with ``copy=False`` and sends the received frame back with ``copy=False``), the reply
  received with ``copy=False`` (zero-copy frames: the bytes stay in libzmq's buffer, readable in
  place). All move N bytes each way, one direction after the other, so "GB/s each way" is
  N / (round-trip time) for all, and X/raw = raw time / X time.
- the apply's share: a raw round trip whose server, between receiving and sending, applies the ps's
  SGD step (psflow's ``DirectStep``, one thread) to N bytes of float32 values with the received
  bytes as the gradient, and sends the values back: a push_pull with nothing but the socket around
  the update. raw / (raw + step) is the most any ps that applies a push after receiving it can
  reach; push_pull / (raw + step) is psflow's own cost around that.
- small requests: round-trip time of psflow's PING op against a raw 64-byte echo and a pyzmq 64-byte
  echo.

Placement: where the two ends run decides a small round trip more than any code does. On this VM a
wake-up across cores costs ~40 us each way, on one core a context switch ~3 us, and an unpinned
run lands in either mode by chance (the raw echo's 8-84 us spreads of earlier reports were the two
modes). So each placement is measured on its own, every process pinned (``os.sched_setaffinity``):
``one-core`` (client and servers share one core: every microsecond of Python on either end shows)
and ``two-cores`` (servers on one core, the client on another: how a ps and a worker run). Both by
default where the machine has two cores; ``--placement free`` leaves the scheduler to choose.

Run: ``.venv/bin/python benchmarks/bench_transport.py [--quick] [--placement one-core|two-cores|free]``.
The markdown report goes to stdout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import harness
import torch
import zmq
from harness import MIB, log, md_table, median

from psflow.cluster import ClusterSpec, TaskId
from psflow.config import TrainConfig
from psflow.optim import SGD
from psflow.ps.client import PsClient
from psflow.ps.placement import ParamInfo, place
from psflow.ps.service import PsService
from psflow.ps.update import DirectStep
from psflow.server import Server
from psflow.wire.frame import io_view
from psflow.wire.ops import Op

SIZES_MIB = (1, 16, 64, 256)
QUICK_SIZES_MIB = (1, 16, 64)  # --quick leaves out 256 MiB (~3 GB of buffers across the processes, and time)
SMALL_BYTES = 64
SECRET = b"bench-transport"
TINY_LR = 1e-12  # OptimizerSpec refuses lr=0; with zero gradients the values stay bit-identical anyway


# Placement name -> (the client's cores, the servers' cores), as indices into the cores this process may use.
PLACEMENTS = {"one-core": ((0,), (0,)), "two-cores": ((0,), (1,)), "free": (None, None)}


def pin(cpus: set[int] | None) -> None:
    """Run this process (and the threads it starts) on ``cpus`` only; None leaves it as it is."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


def placements_of(arg: str | None) -> list[str]:
    """The placements to measure: the one asked for, or one-core and two-cores (one-core alone on a
    single core). Raises SystemExit if two-cores is asked of a machine with one core."""
    cores = len(os.sched_getaffinity(0))
    if arg is None:
        return ["one-core", "two-cores"] if cores >= 2 else ["one-core"]
    if arg == "two-cores" and cores < 2:
        raise SystemExit(f"--placement two-cores needs two cores; this process may use {cores}.")
    return [arg]


def cores_of(placement: str, cores: set[int]) -> tuple[set[int] | None, set[int] | None]:
    """The client's and the servers' core sets of ``placement`` among ``cores`` (the ones this process may use)."""
    mine = sorted(cores)
    client, servers = PLACEMENTS[placement]
    return (None if client is None else {mine[i] for i in client},
            None if servers is None else {mine[i] for i in servers})


# --------------------------------------------------------------------------- the servers (child processes)


def serve_ps(sizes_mib: tuple[int, ...], pipe: Any, cpus: set[int] | None = None) -> None:
    """A ps task process: one Server + PsService per size (a ps shard pulls all its values at once)."""
    pin(cpus)
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


def serve_echo(pipe: Any, cpus: set[int] | None = None) -> None:
    """A plain socket echo server: each connection first says its message size N, then every N bytes
    it sends are received into a preallocated buffer and sent back."""
    serve_sockets(pipe, cpus, _echo_conn)


def serve_sockets(pipe: Any, cpus: set[int] | None, handle: Callable[[socket.socket], None]) -> None:
    """A raw socket server process (pinned to ``cpus``, one torch thread as a ps has): it sends its
    port through ``pipe``, serves each connection with ``handle`` in a thread of its own, and stops
    when ``pipe`` says so (after the clients closed their connections: each thread ends at its EOF)."""
    pin(cpus)
    torch.set_num_threads(1)
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    pipe.send(lsock.getsockname()[1])
    conns: list[threading.Thread] = []

    def accept() -> None:
        while True:
            try:
                sock, _ = lsock.accept()
            except OSError:
                return
            conns.append(threading.Thread(target=handle, args=(sock,), daemon=True))
            conns[-1].start()

    threading.Thread(target=accept, daemon=True).start()
    pipe.recv()
    lsock.close()
    for t in conns:
        t.join(timeout=10)  # an interpreter exiting under a thread inside torch aborts ("terminate called")


def _echo_conn(sock: socket.socket) -> None:
    """One echo connection. Its first 16 bytes: the message size N, and whether to step. With
    ``step``, the N bytes are a float32 gradient: the connection's own N bytes of values take the
    ps's SGD step with it (psflow's update kernel, the ps's one thread), and the values go back,
    as a ps answers a push_pull, with only the socket around it."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with sock:
        head = bytearray(16)
        if not _recv_exact(sock, memoryview(head)):
            return
        n, step = struct.unpack("<QQ", head)
        if not step:
            buf = memoryview(bytearray(n))
            while _recv_exact(sock, buf):
                sock.sendall(buf)
            return
        values, grad = torch.zeros(n // 4), torch.zeros(n // 4)
        update = DirectStep(SGD(lr=TINY_LR).build([values]))
        into, out = io_view(grad), io_view(values)
        while _recv_exact(sock, into):
            update([grad])
            sock.sendall(out)


def serve_zmq(pipe: Any, cpus: set[int] | None = None) -> None:
    """A pyzmq echo server: a REP socket that sends every message it receives back, zero-copy
    (``copy=False`` both ways: the received frame itself is sent back)."""
    pin(cpus)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    pipe.send(port)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not pipe.poll(0):
        if poller.poll(100):  # ms; lets the loop see the pipe's stop between requests
            sock.send(sock.recv(copy=False), copy=False)
    sock.close()
    ctx.term()


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
    """Client of the echo server for one message size (``step``: the server applies the ps's SGD
    step to its values with the received bytes as the gradient, and sends the values back)."""

    def __init__(self, port: int, nbytes: int, *, step: bool = False) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(struct.pack("<QQ", nbytes, int(step)))
        self.out = memoryview(bytearray(nbytes))  # zeros: as a gradient, they leave the values as they are
        self.into = memoryview(bytearray(nbytes))

    def round_trip(self) -> None:
        self.sock.sendall(self.out)
        if not _recv_exact(self.sock, self.into):
            raise ConnectionError("the echo server closed the connection")

    def check_step(self) -> None:
        """The server really steps: a gradient of ones takes its (zero) values to -lr, which the
        zero gradients of the timed round trips then leave as they are."""
        ones = torch.ones(len(self.out) // 4)
        self.out[:] = io_view(ones)  # ``ones`` holds the bytes io_view points at
        self.round_trip()
        self.out[:] = bytes(len(self.out))
        if not torch.equal(torch.frombuffer(self.into, dtype=torch.float32), torch.full((len(self.into) // 4,), -TINY_LR)):
            raise RuntimeError("the stepping echo sent back values that are not the ones its SGD step gives")

    def close(self) -> None:
        self.sock.close()


class ZmqEcho:
    """Client of the pyzmq echo for one message size: REQ, zero-copy frames both ways."""

    def __init__(self, ctx: zmq.Context, port: int, nbytes: int) -> None:
        self.sock = ctx.socket(zmq.REQ)
        self.sock.linger = 0
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.nbytes = nbytes
        self.out = memoryview(bytearray(b"\x5a" * nbytes))
        self.reply: zmq.Frame | None = None

    def round_trip(self) -> None:
        self.sock.send(self.out, copy=False)
        self.reply = self.sock.recv(copy=False)
        if len(self.reply) != self.nbytes:
            raise RuntimeError(f"the zmq echo sent back {len(self.reply)} bytes; sent {self.nbytes}")

    def check(self) -> None:
        """The bytes really travelled: the last reply is the message sent."""
        self.round_trip()
        if self.reply is None or self.reply.buffer != self.out:
            raise RuntimeError("the zmq echo sent back bytes that differ from the ones sent")

    def close(self) -> None:
        self.reply = None
        self.sock.close()


class PsRoundTrip:
    """A worker's pull + push of one float32 parameter of ``nbytes`` against one ps shard."""

    def __init__(self, address: str, nbytes: int) -> None:
        self.client = client_of(address, 0)
        n = nbytes // 4
        self.initial = torch.arange(n, dtype=torch.float32)
        self.client.initialize([{"w": self.initial}], init_meta(n))
        self.dest = torch.empty(n, dtype=torch.float32)
        self.grad = torch.zeros(n, dtype=torch.float32)
        self.version = 0
        self.pull_s: list[float] = []
        self.push_s: list[float] = []

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


def init_meta(n: int) -> dict[str, Any]:
    """A PS_INIT's meta for one float32 parameter ``w`` of ``n`` values on one shard, as the chief's
    trainer sends it (the ps admits only the tensors its ``meta.placement`` puts on the shard)."""
    placement = place([ParamInfo("w", (n,))], 1).to_dict()
    return {"optimizer": SGD(lr=TINY_LR).to_dict(), "config": TrainConfig().to_dict(), "placement_digest": "bench",
            "meta": {"placement": placement}}


def gbs(nbytes: int, t: float) -> float:
    """GB/s each way of a round trip that moves ``nbytes`` each way in ``t`` seconds."""
    return nbytes / t / 1e9


def bench_bulk(
    sizes_mib: tuple[int, ...], ps_addresses: list[str], echo_port: int, zmq_port: int, reps: int, budget_bytes: int
) -> tuple[list[list[str]], list[list[str]], dict[str, dict[int, float]]]:
    """Raw echo (alone and with the ps's step) vs psflow pull+push and push_pull vs pyzmq echo, per
    size, interleaved.

    Returns the summary rows (one per size), the detail rows (pull and push alone) and, per case,
    size -> raw time / case time.
    """
    summary, detail = [], []
    ratios: dict[str, dict[int, float]] = {"pull+push": {}, "push_pull": {}, "pyzmq": {}}
    zctx = zmq.Context()
    for size_mib, address in zip(sizes_mib, ps_addresses):
        nbytes = size_mib * MIB
        iters = max(3, budget_bytes // nbytes)
        raw, ps, zq = RawEcho(echo_port, nbytes), PsRoundTrip(address, nbytes), ZmqEcho(zctx, zmq_port, nbytes)
        raw_step = RawEcho(echo_port, nbytes, step=True)
        cases = {
            "raw": per_rep(raw.round_trip, iters),
            "raw+step": per_rep(raw_step.round_trip, iters),
            "pull+push": per_rep(ps.round_trip, iters),
            "push_pull": per_rep(ps.push_pull, iters),
            "pyzmq": per_rep(zq.round_trip, iters),
        }
        log(f"bulk {size_mib} MiB: {reps} reps x {iters} round trips each of {', '.join(cases)}, interleaved")
        ps.check()
        zq.check()
        raw_step.check_step()
        res = harness.interleaved(cases, reps)
        ps.check()
        zq.check()
        t = {name: median(times) for name, times in res.items()}
        for name in ratios:
            ratios[name][size_mib] = t["raw"] / t[name]
        summary.append([
            f"{size_mib} MiB",
            f"{gbs(nbytes, t['raw']):.2f}",
            f"{gbs(nbytes, t['pull+push']):.2f}",
            f"{gbs(nbytes, t['push_pull']):.2f}",
            f"{gbs(nbytes, t['pyzmq']):.2f}",
            f"**{100 * ratios['pull+push'][size_mib]:.0f}%**",
            f"**{100 * ratios['push_pull'][size_mib]:.0f}%**",
            f"**{100 * ratios['pyzmq'][size_mib]:.0f}%**",
            " / ".join(harness.spread([gbs(nbytes, x) for x in res[name]], ".2f") for name in cases if name != "raw+step"),
        ])
        detail.append([
            f"{size_mib} MiB",
            f"{gbs(nbytes, median(ps.pull_s)):.2f}",
            f"{gbs(nbytes, median(ps.push_s)):.2f}",
            f"{t['pull+push'] * 1e3:.2f}",
            f"{t['push_pull'] * 1e3:.2f}",
            f"{t['raw'] * 1e3:.2f}",
            f"{t['raw+step'] * 1e3:.2f}",
            f"{100 * t['raw'] / t['raw+step']:.0f}%",
            f"**{100 * t['raw+step'] / t['push_pull']:.0f}%**",
            f"{t['pyzmq'] * 1e3:.2f}",
        ])
        raw.close()
        raw_step.close()
        ps.close()
        zq.close()
        del raw, raw_step, ps, zq, cases, res  # free this size's buffers before the next (256 MiB: ~1.3 GB here)
    zctx.term()
    return summary, detail, ratios


def bench_small(ps_address: str, echo_port: int, zmq_port: int, reps: int, iters: int) -> tuple[list[str], dict[str, float]]:
    """Raw 64-byte echo vs psflow PING vs pyzmq 64-byte echo. Returns the summary row and, per case,
    case RTT / raw RTT."""
    log(f"small requests: {reps} reps x {iters} round trips each, raw {SMALL_BYTES}-byte echo, psflow PING and "
        f"pyzmq {SMALL_BYTES}-byte echo interleaved")
    zctx = zmq.Context()
    raw, zq = RawEcho(echo_port, SMALL_BYTES), ZmqEcho(zctx, zmq_port, SMALL_BYTES)
    client = client_of(ps_address, 1)
    conn = client.conns[0]
    zq.check()
    res = harness.interleaved(
        {
            "raw": per_rep(raw.round_trip, iters),
            "psflow": per_rep(lambda: conn.request(Op.PING), iters),
            "pyzmq": per_rep(zq.round_trip, iters),
        },
        reps,
    )
    raw.close()
    zq.close()
    client.close()
    zctx.term()
    t = {name: median(times) for name, times in res.items()}
    ratios = {"psflow": t["psflow"] / t["raw"], "pyzmq": t["pyzmq"] / t["raw"]}
    row = [
        f"small round trip ({SMALL_BYTES} B; psflow: PING), RTT us",
        f"{t['raw'] * 1e6:.1f}",
        f"{t['psflow'] * 1e6:.1f}",
        "-",
        f"{t['pyzmq'] * 1e6:.1f}",
        f"**{ratios['psflow']:.2f}x** RTT",
        "-",
        f"**{ratios['pyzmq']:.2f}x** RTT",
        " / ".join(harness.spread([x * 1e6 for x in res[name]], ".1f") for name in ("raw", "psflow", "pyzmq")),
    ]
    return row, ratios


def main() -> None:
    p = harness.arg_parser(__doc__.splitlines()[0])
    p.add_argument("--placement", choices=sorted(PLACEMENTS), default=None,
                   help="where the client and the servers run (default: one-core, then two-cores)")
    args = p.parse_args()
    reps = harness.reps_of(args, full=7, quick=3)
    placements = placements_of(args.placement)
    print(f"## Transport: psflow ps vs raw socket echo vs pyzmq echo\n\n`{harness.command_line()}`  \n{harness.machine()}\n")
    print(
        f"{reps} interleaved repetitions per case; a repetition's figure is the median of its round trips (each timed "
        "alone), the table gives the median over repetitions and the spread (min-max) of the repetitions. Loopback TCP; "
        "the ps, the raw echo and the pyzmq echo each run in their own process. Bulk: GB/s each way and % of the raw "
        "echo's throughput (raw time / case time); small: round-trip time and case time / raw time.\n"
    )
    mine = os.sched_getaffinity(0)
    try:
        for placement in placements:
            client, servers = cores_of(placement, mine)
            pin(client)
            report_placement(placement, client, servers, args.quick, reps)
    finally:
        pin(mine)


def report_placement(placement: str, client: set[int] | None, servers: set[int] | None, quick: bool, reps: int) -> None:
    """Measure every case with the processes where ``placement`` puts them, and print its tables."""
    sizes = QUICK_SIZES_MIB if quick else SIZES_MIB
    budget = (48 if quick else 160) * MIB  # bytes each way per repetition of a bulk case (at least 3 round trips)
    small_iters = 500 if quick else 1500
    where = ("the scheduler's choice" if client is None
             else f"client on core {sorted(client)}, servers on core {sorted(servers or ())}")
    log(f"placement {placement}: {where}")
    ctx = mp.get_context("spawn")
    ps_here, ps_there = ctx.Pipe()
    echo_here, echo_there = ctx.Pipe()
    zmq_here, zmq_there = ctx.Pipe()
    procs = [
        ctx.Process(target=serve_ps, args=(sizes, ps_there, servers), daemon=True),
        ctx.Process(target=serve_echo, args=(echo_there, servers), daemon=True),
        ctx.Process(target=serve_zmq, args=(zmq_there, servers), daemon=True),
    ]
    for proc in procs:
        proc.start()
    try:
        ps_addresses: list[str] = ps_here.recv()
        echo_port: int = echo_here.recv()
        zmq_port: int = zmq_here.recv()
        summary, detail, ratios = bench_bulk(sizes, ps_addresses, echo_port, zmq_port, reps, budget)
        small_row, small_ratios = bench_small(ps_addresses[0], echo_port, zmq_port, reps, small_iters)
    finally:
        for pipe in (ps_here, echo_here, zmq_here):
            try:
                pipe.send("stop")
            except OSError:
                pass
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    print(f"### Placement {placement}: {where}\n")
    print(md_table(
        ["size", "raw echo", "psflow pull+push", "psflow push_pull", "pyzmq echo", "pull+push / raw",
         "push_pull / raw", "pyzmq / raw", "spread raw / pull+push / push_pull / pyzmq"],
        [*summary, small_row],
    ) + "\n")
    print(md_table(
        ["size", "psflow pull alone GB/s", "psflow push alone GB/s", "pull+push ms", "push_pull ms", "raw echo ms",
         "raw echo + the ps's SGD step ms", "raw echo / (raw echo + step)", "push_pull / (raw echo + step)",
         "pyzmq echo ms"],
        detail,
    ) + "\n")
    psflow_min = min(min(ratios["pull+push"].values()), min(ratios["push_pull"].values()))
    bulk_met = psflow_min >= 0.9
    each = ", ".join(
        f"{s} MiB {100 * ratios['pull+push'][s]:.0f}% / {100 * ratios['push_pull'][s]:.0f}%" for s in sizes
    )
    print(
        f"Targets ({placement}): psflow pull+push and push_pull >= 90% of raw at every size: "
        f"{'met' if bulk_met else 'not met'} (pull+push / push_pull: {each}); small RTT within 1.5x of raw: "
        f"{'met' if small_ratios['psflow'] <= 1.5 else 'not met'} ({small_ratios['psflow']:.2f}x; pyzmq "
        f"{small_ratios['pyzmq']:.2f}x).\n"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
