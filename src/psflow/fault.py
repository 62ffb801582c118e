"""Fault injection, as an argument of the entry point, so that faults are exact and repeatable.

Syntax: ``TASK@step=N[:ACTION]`` with ACTION one of ``raise`` (default: an exception, so the task
writes its error report), ``kill`` (SIGKILL itself: no report, like an OOM kill) or ``stall=S``
(sleep S seconds once, like a slow or hung worker). Several faults are separated by commas.

Example: ``psflow run --fail-at worker:1@step=30:kill ...``
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

from psflow.errors import ConfigError, TrainingError

_RE = re.compile(r"^(?P<task>[a-z]+:\d+)@step=(?P<step>\d+)(?::(?P<action>raise|kill|stall=(?P<stall>[0-9.]+)|delay=(?P<delay>[0-9.]+)))?$")


@dataclass(frozen=True)
class Fault:
    task: str
    step: int
    action: str = "raise"  # raise | kill | stall | delay (delay: sleep before every step from `step` on)
    seconds: float = 0.0


def parse_faults(text: str | None) -> list[Fault]:
    """Parse ``--fail-at``. Raises ConfigError naming the bad part and the syntax."""
    faults = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        m = _RE.match(part)
        if not m:
            raise ConfigError(
                f"Bad fault spec {part!r}. Use TASK@step=N[:raise|:kill|:stall=SECONDS|:delay=SECONDS], e.g. worker:1@step=30:kill."
            )
        action = (m["action"] or "raise").split("=")[0]
        faults.append(Fault(m["task"], int(m["step"]), action, float(m["stall"] or m["delay"] or 0.0)))
    return faults


def inject(faults: list[Fault], task: str, step: int) -> None:
    """Carry out the faults planned for ``task`` at ``step`` (called by the trainer before each step)."""
    for f in faults:
        if f.task != task:
            continue
        if f.action == "delay" and step >= f.step:
            time.sleep(f.seconds)  # a deliberately slow worker
        if step != f.step:
            continue
        if f.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.action == "stall":
            time.sleep(f.seconds)  # a deliberately stalled worker
        elif f.action == "raise":
            raise TrainingError(f"Injected failure in {task} at step {step} (--fail-at).")
