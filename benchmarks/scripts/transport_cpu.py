"""CPU time per bulk round trip, user and system, of the client and of the server process: the raw
socket echo against psflow's push_pull and pull+push (issue 13, item 2: why 1 MiB is slow).

Reuses ``bench_transport.py``'s servers and clients (same processes, same buffers). For each case,
``--n`` round trips after 100 untimed ones; the server's CPU is read from ``/proc/PID/stat`` (Linux),
the client's from ``os.times()``; two interleaved rounds. A diagnosis, not a ratio benchmark: the
figures show where a round trip's fixed cost lies, which the wall-clock table cannot.

Run: ``.venv/bin/python benchmarks/scripts/transport_cpu.py [--mib 1] [--n 1500]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench_transport as bt  # noqa: E402  (the benchmark directory is not a package)

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_of(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid`` so far, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) * TICK_S, int(fields[12]) * TICK_S


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1, help="message size in MiB (default 1)")
    p.add_argument("--n", type=int, default=1500, help="timed round trips per case and round (default 1500)")
    args = p.parse_args()
    if args.mib < 1 or args.n < 1:
        raise SystemExit(f"--mib and --n must be at least 1; received --mib {args.mib} --n {args.n}.")
    ctx = mp.get_context("spawn")
    ps_here, ps_there = ctx.Pipe()
    echo_here, echo_there = ctx.Pipe()
    ps_proc = ctx.Process(target=bt.serve_ps, args=((args.mib,), ps_there), daemon=True)
    echo_proc = ctx.Process(target=bt.serve_echo, args=(echo_there,), daemon=True)
    ps_proc.start()
    echo_proc.start()
    try:
        address = ps_here.recv()[0]
        port = echo_here.recv()
        ps, raw = bt.PsRoundTrip(address, args.mib * bt.MIB), bt.RawEcho(port, args.mib * bt.MIB)
        cases = {"raw echo": (raw.round_trip, echo_proc.pid), "push_pull": (ps.push_pull, ps_proc.pid),
                 "pull+push": (ps.round_trip, ps_proc.pid)}
        print(f"{args.mib} MiB, {args.n} round trips per case and round; us per round trip")
        print("| case | wall | client user | client sys | server user | server sys |\n|---|---|---|---|---|---|")
        for _ in range(2):
            for name, (fn, pid) in cases.items():
                for _ in range(100):
                    fn()
                s0, c0, w0 = cpu_of(pid), os.times(), time.perf_counter()
                for _ in range(args.n):
                    fn()
                s1, c1, w1 = cpu_of(pid), os.times(), time.perf_counter()
                us = [(w1 - w0), c1.user - c0.user, c1.system - c0.system, s1[0] - s0[0], s1[1] - s0[1]]
                print(f"| {name} | " + " | ".join(f"{x / args.n * 1e6:.0f}" for x in us) + " |")
        ps.close()
        raw.close()
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


if __name__ == "__main__":
    main()
