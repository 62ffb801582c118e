"""Overlap benchmark: how much a ps could win by applying a push's gradient while it moves.

A psflow ps applies a push once its whole gradient is in (the rules decide from the whole request;
an update is never half applied: a connection lost mid-gradient changes nothing), then sends the
values back. Issue 13 asks whether overlapping that update with the transfer would pay. This
measures the most it could win, with raw sockets and nothing else around the update, so that no
psflow overhead hides or inflates it. One float32 "shard" of N bytes on a server process, the
client sends an N-byte gradient and reads the N bytes of values back; the server, per mode:

- ``raw``: no update (the plain echo; the transport benchmark's reference);
- ``after``: receive the whole gradient, apply the SGD step, send the values (what psflow does);
- ``send-overlap``: receive the whole gradient, then apply it piece by piece, each applied piece's
  values handed to the socket without blocking (the client reads them while the next piece is
  applied), the rest sent once every piece is applied;
- ``receive-overlap``: apply each piece as soon as it has arrived, while the rest is still coming.
  This is the upper bound of streaming apply; it is *not safe* as it stands (a connection lost
  mid-gradient leaves a half-applied update), which is why psflow does not do it.

The step is psflow's own (``DirectStep`` over the SGD spec, the ps's one thread). Pieces are
``--piece-kib`` (default: an eighth of the size, at most 1 MiB). The server runs on one core and
the client on another (the transport benchmark's ``two-cores`` placement: how a ps and a worker run).

Run: ``.venv/bin/python benchmarks/bench_overlap.py [--quick] [--reps N]``. Markdown to stdout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import struct
import sys

import harness
import torch
from bench_transport import TINY_LR, _recv_exact, cores_of, per_rep, pin, serve_sockets
from harness import MIB, log, md_table, median

from psflow.optim import SGD
from psflow.ps.update import DirectStep
from psflow.wire.frame import io_view

MODES = ("raw", "after", "send-overlap", "receive-overlap")
SIZES_MIB = (1, 16, 64, 256)
QUICK_SIZES_MIB = (1, 16, 64)


def _serve_conn(sock: socket.socket) -> None:
    """One connection of the server process (``bench_transport.serve_sockets``): it first says N,
    its mode and its piece size, then each N bytes it sends are a gradient, answered per its mode."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with sock:
        head = bytearray(24)
        if not _recv_exact(sock, memoryview(head)):
            return
        n, mode_index, piece = struct.unpack("<QQQ", head)
        mode = MODES[mode_index]
        values, grad = torch.zeros(n // 4), torch.zeros(n // 4)
        update = DirectStep(SGD(lr=TINY_LR).build([values]))
        into, out = io_view(grad), io_view(values)
        # One update per piece: the same elementwise step on views (SGD's is exact by pieces).
        steps = [(DirectStep(SGD(lr=TINY_LR).build([values[a:a + piece // 4]])), grad[a:a + piece // 4], a * 4)
                 for a in range(0, n // 4, piece // 4)]
        while True:
            if mode == "receive-overlap":
                if not _receive_applying(sock, into, steps):
                    return
                sock.sendall(out)
                continue
            if not _recv_exact(sock, into):
                return
            if mode == "raw":
                sock.sendall(into)
            elif mode == "after":
                update([grad])
                sock.sendall(out)
            else:
                _apply_sending(sock, out, steps)


def _receive_applying(sock: socket.socket, into: memoryview, steps: list[tuple[DirectStep, torch.Tensor, int]]) -> bool:
    """Receive the gradient, applying each piece once it is whole."""
    n, got, done = into.nbytes, 0, 0
    while got < n:
        k = sock.recv_into(into[got:], n - got)
        if k == 0:
            return False
        got += k
        while done < len(steps) and steps[done][2] + steps[done][1].numel() * 4 <= got:
            step, g, _ = steps[done]
            step([g])
            done += 1
    return True


def _apply_sending(sock: socket.socket, out: memoryview, steps: list[tuple[DirectStep, torch.Tensor, int]]) -> None:
    """Apply piece by piece; after each, hand the socket what is applied, without blocking."""
    sent = 0
    sock.setblocking(False)
    try:
        for step, g, start in steps:
            step([g])
            ready = start + g.numel() * 4
            while sent < ready:
                try:
                    sent += sock.send(out[sent:ready])
                except BlockingIOError:
                    break
    finally:
        sock.setblocking(True)
    if sent < out.nbytes:
        sock.sendall(out[sent:])


class Client:
    """One connection in one mode: a round trip sends N bytes of (zero) gradient and reads N bytes back."""

    def __init__(self, port: int, nbytes: int, mode: str, piece: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(struct.pack("<QQQ", nbytes, MODES.index(mode), piece))
        self.out = memoryview(bytearray(nbytes))
        self.into = memoryview(bytearray(nbytes))
        self.mode = mode

    def round_trip(self) -> None:
        self.sock.sendall(self.out)
        if not _recv_exact(self.sock, self.into):
            raise ConnectionError("the server closed the connection")

    def check(self) -> None:
        """The update really happens in every mode but raw: a gradient of ones takes the values to -lr."""
        ones = torch.ones(len(self.out) // 4)
        self.out[:] = io_view(ones)  # ``ones`` holds the bytes io_view points at
        self.round_trip()
        self.out[:] = bytes(len(self.out))
        got = torch.frombuffer(self.into, dtype=torch.float32)
        want = ones if self.mode == "raw" else torch.full_like(ones, -TINY_LR)
        if not torch.equal(got, want):
            raise RuntimeError(f"mode {self.mode}: the server sent back values its update does not give")

    def close(self) -> None:
        self.sock.close()


def main() -> None:
    p = harness.arg_parser(__doc__.splitlines()[0])
    p.add_argument("--piece-kib", type=int, default=None, help="piece size (default: size / 8, at most 1024)")
    args = p.parse_args()
    reps = harness.reps_of(args, full=7, quick=3)
    sizes = QUICK_SIZES_MIB if args.quick else SIZES_MIB
    budget = (48 if args.quick else 160) * MIB
    mine = os.sched_getaffinity(0)
    if len(mine) < 2:  # on one core nothing can overlap: the figures would say nothing
        raise SystemExit(f"bench_overlap.py needs two cores (the server on one, the client on the other); "
                         f"this process may use {len(mine)}.")
    client_cpus, server_cpus = cores_of("two-cores", mine)
    print(f"## Overlapping the ps's update with the transfer: the upper bound, raw sockets\n\n"
          f"`{harness.command_line()}`  \n{harness.machine()}\n")
    print(f"{reps} interleaved repetitions per mode; a repetition's figure is the median of its round trips; the "
          f"table gives the median round trip (ms) over repetitions and, per mode, its spread. Server on core "
          f"{sorted(server_cpus or ())}, client on core {sorted(client_cpus or ())}.\n")
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=serve_sockets, args=(there, server_cpus, _serve_conn), daemon=True)
    proc.start()
    rows = []
    try:
        pin(client_cpus)
        port = here.recv()
        for size_mib in sizes:
            nbytes = size_mib * MIB
            piece = (args.piece_kib * 1024) if args.piece_kib else min(MIB, nbytes // 8)
            clients = {mode: Client(port, nbytes, mode, piece) for mode in MODES}
            for c in clients.values():
                c.check()
            iters = max(3, budget // nbytes)
            log(f"{size_mib} MiB, pieces of {piece // 1024} KiB: {reps} reps x {iters} round trips of each mode, interleaved")
            res = harness.interleaved({m: per_rep(c.round_trip, iters) for m, c in clients.items()}, reps)
            t = {m: median(v) for m, v in res.items()}
            rows.append([
                f"{size_mib} MiB", f"{piece // 1024} KiB", *(f"{t[m] * 1e3:.2f}" for m in MODES),
                f"{100 * t['raw'] / t['after']:.0f}%",
                f"**{t['after'] / t['send-overlap']:.2f}x**",
                f"**{t['after'] / t['receive-overlap']:.2f}x**",
                f"{100 * t['raw'] / t['receive-overlap']:.0f}%",
                " / ".join(harness.spread([x * 1e3 for x in res[m]], ".2f") for m in MODES),
            ])
            for c in clients.values():
                c.close()
    finally:
        pin(mine)
        try:
            here.send("stop")
        except OSError:
            pass
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    print(md_table(
        ["size", "piece", *(f"{m} ms" for m in MODES), "raw / after (a ps that applies after receiving)",
         "send-overlap speed-up", "receive-overlap speed-up", "raw / receive-overlap", f"spread ms ({' / '.join(MODES)})"],
        rows,
    ))


if __name__ == "__main__":
    sys.exit(main())
