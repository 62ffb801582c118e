"""A task's signs of life for the launcher's watchdog: heartbeats, and its stacks on request.

Two parts, both set up by :func:`psflow.init` in every task:

- :func:`install_stack_dumps`: on ``SIGUSR1`` the task writes the stacks of all its threads to its
  stderr, which the launcher keeps in the task's log, in faulthandler's format. ``kill -USR1 PID``
  does the same by hand. A thread of its own writes it, woken by the signal at the C level (the
  signal's wakeup file descriptor), so the dump comes also while the main thread is stuck in a lock
  or a C call that released the GIL; it reads the stacks with ``sys._current_frames()`` under the
  GIL. Not faulthandler's own C handler: that one walks the other threads' frames while they run,
  and crashed a busy ps with SIGSEGV (a clean-clone CI run, "dump all tasks" on a training job).
  faulthandler stays the fallback where the wakeup descriptor is not ours to take (called off the
  main thread, or another library holds it).
- :class:`Heartbeat`: a daemon thread that sends ``{"attempt", "waiting", "waiting_on"}`` every
  ``every_s`` through the ``send`` it is given (the task's own connection to the launcher's
  coordinator), whatever the main thread does. So a task whose heartbeats come but whose steps do not is *hung*, and one whose
  heartbeats stop is *frozen* or dead (see :mod:`psflow.launch.watchdog`). ``waiting`` names what
  the main thread waits for when it waits for its peers (a sync step's quorum, the ssp bound);
  ``waiting_on`` the task it is blocked on (``"ps:1"``: a reply, in any mode). Such a task is not the
  one that holds the job up.

States of a Heartbeat: ``new --start()--> beating --stop()--> stopped`` (stop is idempotent; a send
that fails is retried at the next beat, never raised).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

STACKS_SIGNAL = signal.SIGUSR1


_installed: dict[int, int] = {}  # signal -> the pid that answers it (a forked child must install again)
_wakeup: dict[str, int] = {}  # the wakeup pipe this module made ("pid", "r", "w") and the dumps' "out" (a forked child inherits them)
_dump_signals: set[int] = set()  # the signals the dumper thread answers with a dump


def install_stack_dumps(sig: int = STACKS_SIGNAL) -> bool:
    """Make ``sig`` write every thread's stack to stderr (the task's log). Idempotent per process.
    False where stderr has no file descriptor to write to (an embedded interpreter, a test's
    captured stream)."""
    try:
        out = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        return False
    if _installed.get(sig) == os.getpid():
        return True
    if threading.current_thread() is threading.main_thread() and _own_wakeup(out):
        _dump_signals.add(sig)
        signal.signal(sig, _on_signal)  # a Python handler, so that the C handler writes to the descriptor
        _installed[sig] = os.getpid()
        return True
    try:
        faulthandler.register(sig, file=out, all_threads=True, chain=False)
    except (AttributeError, ValueError, OSError, RuntimeError):  # not supported here
        return False
    _installed[sig] = os.getpid()
    return True


def _own_wakeup(out: int) -> bool:
    """Make the signals' wakeup descriptor a pipe that a dumper thread of this process reads. False
    (nothing changed) where another library holds the descriptor."""
    if _wakeup.get("pid") == os.getpid():
        return True
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(r)
        os.close(w)
        return False
    if previous != -1 and previous == _wakeup.get("w"):  # a forked child: the parent's pipe, its thread gone
        os.close(_wakeup["r"])
        os.close(previous)
        _dump_signals.clear()
        previous = -1
    if previous != -1:
        signal.set_wakeup_fd(previous)  # another library's: give it back
        os.close(r)
        os.close(w)
        return False
    _wakeup.update(pid=os.getpid(), r=r, w=w, out=out)
    threading.Thread(target=_dump_on_wakeup, args=(r, out), name="psflow-stack-dumps", daemon=True).start()
    return True


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """The main thread's part: nothing while the descriptor is still ours (the dumper thread, woken
    by it, writes the dump). If a library took it since (asyncio's ``add_signal_handler`` does), the
    main thread writes the dump itself: here, between two bytecodes, the stacks hold still too."""
    current = signal.set_wakeup_fd(-1)
    ours = current == _wakeup.get("w")
    signal.set_wakeup_fd(current, warn_on_full_buffer=not ours)
    if not ours:
        _dump_to(_wakeup["out"])


def _dump_on_wakeup(r: int, out: int) -> None:
    while True:
        try:
            data = os.read(r, 512)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data:
            return
        if _dump_signals.intersection(data):
            _dump_to(out)


def _dump_to(out: int) -> None:
    """Every thread's stack, now, into ``out``; a closed ``out`` (stderr gone) leaves nobody to tell."""
    with contextlib.suppress(OSError):
        write_all(out, format_stacks(sys._current_frames(), threading.get_ident(), threading.main_thread().ident))


def format_stacks(frames: dict[int, FrameType], current: int, main: int | None) -> bytes:
    """Every thread's stack in faulthandler's format (:func:`psflow.platform.stacks.parse_dump`
    reads it): innermost frame first, the main thread last."""
    order = [t for t in frames if t != main] + ([main] if main in frames else [])
    lines = []
    for tid in order:
        lines.append(f"{'Current thread' if tid == current else 'Thread'} 0x{tid:016x} (most recent call first):")
        f: FrameType | None = frames[tid]
        while f is not None:
            line = f.f_lineno
            lines.append(f'  File "{f.f_code.co_filename}", line {line if line is not None else "???"} in {f.f_code.co_name}')
            f = f.f_back
        lines.append("")
    return ("\n".join(lines) + "\n").encode("utf-8", "backslashreplace")


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class Heartbeat:
    """Send ``payload()`` through ``send`` every ``every_s`` seconds from a daemon thread.

    Args:
        send: sends one heartbeat; returns False if it could not (the next beat tries again).
        payload: what to send, read at each beat (the attempt, what the main thread waits for).
        every_s: the interval.
        name: the thread's name (shows in a stack dump).

    Example:
        >>> hb = Heartbeat(lambda beat: True, lambda: {"attempt": 0, "waiting": None}, every_s=1.0).start()
        >>> hb.stop()
    """

    def __init__(self, send: Callable[[dict[str, Any]], bool], payload: Callable[[], dict[str, Any]], *,
                 every_s: float, name: str = "psflow-heartbeat") -> None:
        if not every_s > 0:
            raise ValueError(f"Heartbeat every_s must be a positive number of seconds; received {every_s!r}.")
        self._send, self._payload, self.every_s = send, payload, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.sent = 0

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop beating; waits up to ``timeout_s`` for a beat in flight."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            if self._send(self._payload()):
                self.sent += 1
            if self._stop.wait(self.every_s):
                return
