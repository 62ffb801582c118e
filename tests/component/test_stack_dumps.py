"""A task's stack dump on SIGUSR1 (psflow.heartbeat.install_stack_dumps), in a real child process.

The dump must not harm a busy task: faulthandler's C handler, which psflow used before, walks the
other threads' frames while they run, printed ``line ???`` for frames in flux and once crashed a
training ps with SIGSEGV. And it must come while the main thread is stuck in C and never runs a
Python signal handler: here the main thread blocks the signal and sleeps in libc.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from inproc import wait_until

from psflow.platform.stacks import parse_dump

pytestmark = pytest.mark.timeout(90)

BUSY = r"""
import sys, threading, time
from psflow.heartbeat import install_stack_dumps

def spin():
    def down(n):
        return n if n < 1 else down(n - 1)
    while True:
        down(40)

print(install_stack_dumps(), flush=True)
for _ in range(3):
    threading.Thread(target=spin, daemon=True).start()
print("spinning", flush=True)
while True:
    time.sleep(0.001)
"""

STUCK_IN_C = r"""
import ctypes, signal, sys
from psflow.heartbeat import install_stack_dumps

print(install_stack_dumps(), flush=True)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # the main thread never takes it
print("blocked", flush=True)
ctypes.CDLL(None).sleep(60)  # in C, without the GIL
"""


@contextmanager
def running(code: str, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, Path]]:
    """``code`` in a child process (its own session: a child it forks goes with it), its stderr in a
    file; yields once the child has said that the dumps are installed; kills them all at the end."""
    log = tmp_path / "stderr.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "True"
            yield proc, log
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def dumps_in(text: str) -> list[list[dict]]:
    """Every dump in ``text``, each a list of threads. Dumps follow each other with nothing between,
    so they are told apart by their last thread: the main thread, whose outermost frame is the module."""
    dumps: list[list[dict]] = [[]]
    for thread in parse_dump(text.splitlines()):
        dumps[-1].append(thread)
        if thread["frames"] and thread["frames"][-1]["function"] == "<module>":
            dumps.append([])
    return [d for d in dumps if d]


def test_a_busy_task_survives_many_dumps_and_each_dump_is_whole(tmp_path: Path) -> None:
    with running(BUSY, tmp_path) as (proc, log):
        assert proc.stdout is not None and proc.stdout.readline().strip() == "spinning"
        for _ in range(150):
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(0.004)
        wait_until(lambda: log.read_text().count("most recent call first") >= 5, 20, "the first dump")
        assert proc.poll() is None, "the task died of its stack dumps"
    text = log.read_text()
    assert "???" not in text, text[:3000]
    for threads in dumps_in(text)[:-1]:  # the last may have been cut by the kill
        assert all(t["frames"] for t in threads), threads
        main = threads[-1]["frames"]
        assert main[-1]["function"] == "<module>", main
        spinners = [t for t in threads if any(f["function"] == "spin" for f in t["frames"])]
        assert len(spinners) == 3, threads


def test_the_dump_comes_while_the_main_thread_is_stuck_in_c(tmp_path: Path) -> None:
    with running(STUCK_IN_C, tmp_path) as (proc, log):
        assert proc.stdout is not None and proc.stdout.readline().strip() == "blocked"
        os.kill(proc.pid, signal.SIGUSR1)
        wait_until(lambda: log.read_text().rstrip().endswith("in <module>"), 20, "the stuck task's dump")
        assert proc.poll() is None
    (threads,) = dumps_in(log.read_text())
    assert [f["function"] for f in threads[-1]["frames"]] == ["<module>"]  # the main thread, in ctypes' sleep
    assert threads[0]["current"] and any(f["function"] == "_dump_on_wakeup" for f in threads[0]["frames"])


def test_a_forked_child_installs_its_own_dumper(tmp_path: Path) -> None:
    """A child forked after install (a fork server's task, a data loader's worker) inherits the
    wakeup pipe but not the thread that reads it: installing again in the child must answer there."""
    code = r"""
import os, signal, sys, time
from psflow.heartbeat import install_stack_dumps
print(install_stack_dumps(), flush=True)
pid = os.fork()
if pid == 0:
    install_stack_dumps()
    print(f"child {os.getpid()}", flush=True)
    time.sleep(60)
    os._exit(0)
time.sleep(60)
"""
    with running(code, tmp_path) as (proc, log):
        assert proc.stdout is not None
        child = int(proc.stdout.readline().split()[1])
        os.kill(child, signal.SIGUSR1)
        wait_until(lambda: "most recent call first" in log.read_text(), 20, "the child's dump")
    (threads,) = dumps_in(log.read_text())
    assert any(f["function"] == "_dump_on_wakeup" for t in threads for f in t["frames"])


def test_the_main_thread_dumps_when_asyncio_took_the_wakeup_descriptor(tmp_path: Path) -> None:
    """A script's event loop that handles signals takes the process's one wakeup descriptor: the
    dump then comes from the main thread's handler, as the loop runs."""
    code = r"""
import asyncio, signal
from psflow.heartbeat import install_stack_dumps
print(install_stack_dumps(), flush=True)

async def main():
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: None)
    print("looping", flush=True)
    while True:
        await asyncio.sleep(0.01)

asyncio.run(main())
"""
    with running(code, tmp_path) as (proc, log):
        assert proc.stdout is not None and proc.stdout.readline().strip() == "looping"
        os.kill(proc.pid, signal.SIGUSR1)
        wait_until(lambda: "most recent call first" in log.read_text(), 20, "the dump")
        assert proc.poll() is None
    (threads,) = dumps_in(log.read_text())
    assert threads[-1]["current"], threads[-1]  # the main thread wrote it, from its signal handler
    assert [f["function"] for f in threads[-1]["frames"][:2]] == ["_dump_to", "_on_signal"], threads[-1]
