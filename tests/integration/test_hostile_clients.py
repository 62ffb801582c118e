"""A real ps task with a secret under hostile, unauthenticated clients, then a real job on it.

The ps runs by hand (the seeds' flags, ``PSFLOW_SECRET``) with a short handshake deadline and a small
cap on connections in their handshake (``PSFLOW_HANDSHAKE_TIMEOUT_S``, ``PSFLOW_MAX_HANDSHAKING``).
What is proven, from outside the process:

- handshake frames declaring GiB tensors and streaming their bytes do not grow the ps's memory
  (peak RSS from /proc/<pid>/status, against the baseline once the ps serves);
- a client trickling its handshake one byte at a time is cut off at the deadline;
- connections past the cap are turned away at once while the ps keeps serving;
- two real workers then train to the end against the same ps, which exits by itself.
"""

from __future__ import annotations

import queue
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, SOFTMAX, free_ports, task_env

from psflow.wire.frame import HEADER, HEADER_SIZE, Limits, decode_header, decode_meta
from psflow.wire.ops import Op

pytestmark = pytest.mark.timeout(240)

PS_SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "ps_task.py")
SECRET = "hostile-test-secret"
DEADLINE_S = 3.0  # the ps's handshake deadline: long enough for the idle connections to hold their slots on busy cores
CAP = 4  # the ps's cap on connections in their handshake
WAIT_S = 60.0


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in KiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM")}


def read_line_with(proc: subprocess.Popen, text: str, timeout_s: float) -> None:
    """Read the process's output until a line contains ``text`` (deadline ``timeout_s``).

    A thread reads, so that lines buffered by the text stream are never missed by a select on its fd."""
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
            if text in line:
                return
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    end = time.monotonic() + timeout_s
    while (left := end - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        seen.append(line)
        if text in line:
            return
        if not line:
            break
    raise AssertionError(f"no line with {text!r} within {timeout_s} s; output: {''.join(seen)[-2000:]}")


def connect_raw(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    sock.settimeout(WAIT_S)
    return sock


def frames_until_closed(sock: socket.socket) -> list[tuple[int, dict]]:
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    frames = []
    while len(data) >= HEADER_SIZE:
        op, _, meta_len, _ = decode_header(data[:HEADER_SIZE], Limits())
        frames.append((op, decode_meta(data[HEADER_SIZE:HEADER_SIZE + meta_len], 0, Limits())[0]))
        data = data[HEADER_SIZE + meta_len:]
    return frames


def declare_gib_and_stream(port: int, stream_bytes: int) -> int:
    """After the HELLO, declare a 4 GiB tensor in the first frame and stream its bytes. Returns the bytes sent."""
    meta = b'{"task":"worker:0","cnonce":"c","mac":"m","t":[["x","float32",[1073741824]]]}'
    chunk = b"\0" * (1 << 20)
    sent = 0
    with connect_raw(port) as sock:
        try:
            sock.sendall(HEADER.pack(b"PSF1", Op.AUTH, 0, len(meta), 4 << 30) + meta)
            while sent < stream_bytes:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:  # the ps closed the connection: what it should do
            pass
    return sent


def trickle_auth(port: int) -> tuple[bool, float, int, int]:
    """Send one AUTH frame (about 300 bytes) one byte every 0.1 s. Returns (closed, seconds, sent, length)."""
    meta = b'{"task":"worker:0","cnonce":"%s","mac":"%s"}' % (b"c" * 200, b"0" * 64)
    frame = HEADER.pack(b"PSF1", Op.AUTH, 0, len(meta), 0) + meta
    sent, closed = 0, False
    with connect_raw(port) as sock:
        t0 = time.monotonic()
        while sent < len(frame) and not closed:
            if select.select([sock], [], [], 0.1)[0]:  # also paces the trickle
                try:
                    closed = sock.recv(65536) == b""
                except ConnectionResetError:
                    closed = True
            if not closed:
                try:
                    sent += sock.send(frame[sent:sent + 1])
                except OSError:
                    closed = True
        return closed, time.monotonic() - t0, sent, len(frame)


def start(procs: list, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=task_env(**env), cwd=ROOT, start_new_session=True)
    procs.append(p)
    return p


def test_hostile_clients_cost_a_real_ps_little_and_a_real_job_trains_afterwards(procs, tmp_path):
    ports = free_ports(3)
    cluster = [f"--ps_hosts=localhost:{ports[0]}", f"--worker_hosts=localhost:{ports[1]},localhost:{ports[2]}"]
    ps = start(procs, [PS_SCRIPT, *cluster, "--job_name=ps", "--task_index=0"],
               {"PSFLOW_SECRET": SECRET, "PSFLOW_HANDSHAKE_TIMEOUT_S": str(DEADLINE_S), "PSFLOW_MAX_HANDSHAKING": str(CAP)})
    read_line_with(ps, "serving", WAIT_S)
    baseline = memory_kib(ps.pid)["VmRSS"]

    # Two connections declare 4 GiB tensors in their first frame and stream 256 MiB each.
    for _ in range(2):
        declare_gib_and_stream(ports[0], 256 << 20)
    # One trickles its handshake: cut off at the deadline, long before its frame is whole.
    closed, held_s, sent, length = trickle_auth(ports[0])
    assert closed and sent < length, f"still open after {sent} of {length} bytes"
    assert held_s < 4 * DEADLINE_S, held_s  # the frame alone would take 30 s
    # CAP idle connections hold every handshake slot; the next one is turned away at once.
    idle = [connect_raw(ports[0]) for _ in range(CAP)]
    try:
        for sock in idle:
            assert sock.recv(HEADER_SIZE)[:4] == b"PSF1"  # its HELLO: admitted
        with connect_raw(ports[0]) as extra:
            frames = frames_until_closed(extra)
        assert [(op, meta.get("kind")) for op, meta in frames] == [(Op.ERROR, "busy")]
        peak_growth_mib = (memory_kib(ps.pid)["VmHWM"] - baseline) / 1024
        assert peak_growth_mib < 50, f"the ps grew by {peak_growth_mib:.0f} MiB under unauthenticated clients"
        print(f"ps baseline RSS {baseline / 1024:.0f} MiB, peak growth under hostile clients {peak_growth_mib:.1f} MiB")
        # Real workers, started while the idle connections still hold the slots, wait them out and train.
        workers = [start(procs, [SOFTMAX, *cluster, "--job_name=worker", f"--task_index={i}", "--epochs", "1",
                                 "--init", "zeros", "--logdir", str(tmp_path / "run")], {"PSFLOW_SECRET": SECRET}) for i in range(2)]
        outs = [w.communicate(timeout=180)[0] for w in workers]
    finally:
        for sock in idle:
            sock.close()
    for i, (w, out) in enumerate(zip(workers, outs)):
        assert w.returncode == 0, out[-3000:]
        assert f"worker={i}, final accuracy = " in out
    ps_out = ps.communicate(timeout=60)[0]
    assert ps.returncode == 0, ps_out[-3000:]
