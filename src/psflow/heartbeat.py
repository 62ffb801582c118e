"""A task's signs of life for the launcher's watchdog: heartbeats, and its stacks on request.

Two parts, both set up by :func:`psflow.init` in every task:

- :func:`install_stack_dumps`: on ``SIGUSR1`` the task writes the stacks of all its threads to its
  stderr, which the launcher keeps in the task's log (``faulthandler``: the dump is written by a C
  signal handler, so it comes also while the main thread is stuck in a lock or a C call). ``kill
  -USR1 PID`` does the same by hand.
- :class:`Heartbeat`: a daemon thread that sends ``{"attempt", "waiting"}`` every ``every_s`` through
  the ``send`` it is given (the task's own connection to the launcher's coordinator), whatever the
  main thread does. So a task whose heartbeats come but whose steps do not is *hung*, and one whose
  heartbeats stop is *frozen* or dead (see :mod:`psflow.launch.watchdog`). ``waiting`` names what
  the main thread waits for when it waits for its peers (a sync step's quorum, the ssp bound): such a
  task is not the one that holds the job up.

States of a Heartbeat: ``new --start()--> beating --stop()--> stopped`` (stop is idempotent; a send
that fails is retried at the next beat, never raised).
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

STACKS_SIGNAL = signal.SIGUSR1


def install_stack_dumps(sig: int = STACKS_SIGNAL) -> bool:
    """Make ``sig`` write every thread's stack to stderr (the task's log). False where stderr has no
    file descriptor to write to (an embedded interpreter, a test's captured stream)."""
    try:
        faulthandler.register(sig, file=sys.stderr, all_threads=True, chain=False)
    except (AttributeError, ValueError, OSError, RuntimeError):  # no fileno(), or not supported here
        return False
    return True


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
