"""Fault injection, as an argument of the entry point, so that faults are exact and repeatable.

Syntax: ``TASK@step=N[:ACTION]`` with ACTION one of ``raise`` (default: an exception, so the task
writes its error report), ``kill`` (SIGKILL itself: no report, like an OOM kill), ``stall=S``
(sleep S seconds once, like a slow or hung worker), ``delay=S`` (sleep S seconds before every step
from step N on: a slow worker) or ``hang`` (the main thread stops for ever at step N, while the task's
other threads, its heartbeats among them, go on: what the hang watchdog catches). Several faults are
separated by commas.

Shorthands of ``psflow run`` (:func:`hang_spec`, :func:`slow_spec`): ``--hang-at worker:1@step=20``
is ``worker:1@step=20:hang``; ``--slow worker:2=0.2s`` is ``worker:2@step=0:delay=0.2``.

Checkpoint faults: ``ps:K@save=N:crash_after=BYTES`` makes ps task K die (SIGKILL itself) while it
writes its shard of the N-th checkpoint it is asked for (counted from 1), leaving exactly BYTES bytes
of the shard's temporary file on disk, as a process killed mid-write would.

Parameter-server faults at a step: ``ps:K@step=N:kill`` makes ps task K SIGKILL itself once the
shard it serves as its own reaches version N (for ps:0, the global step), while it answers the push
that took it there, before the worker has its reply (the hard case for replication: the update may
be on the backup without the worker knowing). Only ``kill`` is a ps step action.

Attempts: a fault fires on a task's first attempt only (attempt 0), so that a task restarted after it
(``psflow run --restart on-failure``) goes on instead of meeting the same fault again. A suffix
``@attempt=K`` moves it to the task's K-th restart: ``worker:1@step=30:kill@attempt=1`` kills the
first restart of worker:1 at its step 30. Each task reads only the faults of its own attempt
(:func:`for_attempt`, with ``PSFLOW_ATTEMPT``).

Example: ``psflow run --fail-at worker:1@step=30:kill ...``, ``--fail-at ps:0@save=2:crash_after=100``,
``--fail-at worker:1@step=30:kill,worker:1@step=40:kill@attempt=1``
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from psflow.errors import CheckpointError, ConfigError, TrainingError

_ATTEMPT = r"(?:@attempt=(?P<attempt>\d+))?"
_RE = re.compile(r"^(?P<task>[a-z]+:\d+)@step=(?P<step>\d+)"
                 r"(?::(?P<action>raise|kill|hang|stall=(?P<stall>[0-9.]+)|delay=(?P<delay>[0-9.]+)))?" + _ATTEMPT + "$")
_HANG_RE = re.compile(r"^(?P<task>[a-z]+:\d+)@step=(?P<step>\d+)" + _ATTEMPT + "$")
_SLOW_RE = re.compile(r"^(?P<task>[a-z]+:\d+)=(?P<seconds>\d+(?:\.\d*)?|\.\d+)s?" + _ATTEMPT + "$")
_SAVE_RE = re.compile(r"^(?P<task>[a-z]+:\d+)@save=(?P<save>[1-9]\d*):crash_after=(?P<bytes>\d+)" + _ATTEMPT + "$")


@dataclass(frozen=True)
class Fault:
    task: str
    step: int
    # raise | kill | stall | delay (sleep before every step from `step` on) | hang (for ever) | crash_save
    action: str = "raise"
    seconds: float = 0.0
    crash_after_bytes: int = 0  # crash_save: bytes of the shard file left on disk; `step` is the save number
    attempt: int = 0  # the task's attempt it fires on (0: the first start; n: the n-th restart)


def parse_faults(text: str | None) -> list[Fault]:
    """Parse ``--fail-at``. Raises ConfigError naming the bad part and the syntax."""
    faults = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        saving = _SAVE_RE.match(part)
        if saving:
            faults.append(Fault(saving["task"], int(saving["save"]), "crash_save", crash_after_bytes=int(saving["bytes"]),
                                attempt=int(saving["attempt"] or 0)))
            continue
        m = _RE.match(part)
        if not m:
            raise ConfigError(
                f"Bad fault spec {part!r}. Use TASK@step=N[:raise|:kill|:hang|:stall=SECONDS|:delay=SECONDS][@attempt=K], e.g. "
                "worker:1@step=30:kill, or ps:K@save=N:crash_after=BYTES[@attempt=K]."
            )
        action = (m["action"] or "raise").split("=")[0]
        faults.append(Fault(m["task"], int(m["step"]), action, float(m["stall"] or m["delay"] or 0.0), attempt=int(m["attempt"] or 0)))
    return faults


def hang_spec(text: str | None) -> str | None:
    """``--hang-at`` as ``--fail-at`` faults: ``worker:1@step=20`` -> ``worker:1@step=20:hang``.

    Example:
        >>> hang_spec("worker:1@step=20,worker:1@step=5@attempt=1")
        'worker:1@step=20:hang,worker:1@step=5:hang@attempt=1'

    Raises:
        ConfigError: naming the part that is wrong and the syntax.
    """
    return _as_fail_at(text, _HANG_RE, lambda m: f"{m['task']}@step={m['step']}:hang", lambda part: (
        f"--hang-at {part!r}: use TASK@step=N[@attempt=K], e.g. worker:1@step=20 (its main "
        "thread stops for ever before step N; heartbeats go on)."))


def slow_spec(text: str | None) -> str | None:
    """``--slow`` as ``--fail-at`` faults: ``worker:2=0.2s`` -> ``worker:2@step=0:delay=0.2``.

    Example:
        >>> slow_spec("worker:2=0.2s")
        'worker:2@step=0:delay=0.2'

    Raises:
        ConfigError: naming the part that is wrong and the syntax.
    """
    return _as_fail_at(text, _SLOW_RE, lambda m: f"{m['task']}@step=0:delay={float(m['seconds']):g}", lambda part: (
        f"--slow {part!r}: use TASK=SECONDS[s][@attempt=K], e.g. worker:2=0.2s (that task "
        "sleeps 0.2 s before every step)."))


def _as_fail_at(text: str | None, pattern: re.Pattern[str], render: Callable[[re.Match[str]], str],
                error: Callable[[str], str]) -> str | None:
    """The comma-separated parts of a shorthand option, each matched by ``pattern`` and rendered as
    a ``--fail-at`` fault (its ``@attempt=K`` kept); ConfigError ``error(part)`` for a part that does not match."""
    out = []
    for part in (p.strip() for p in (text or "").split(",")):
        if not part:
            continue
        m = pattern.match(part)
        if not m:
            raise ConfigError(error(part))
        out.append(render(m) + (f"@attempt={m['attempt']}" if m["attempt"] else ""))
    return ",".join(out) or None


def join_specs(*specs: str | None) -> str | None:
    """Several fault specs as one (``--fail-at``, ``--hang-at``, ``--slow`` together), or None."""
    return ",".join(s for s in specs if s) or None


def for_attempt(text: str | None, attempt: int) -> str | None:
    """The part of a ``--fail-at`` spec that fires on a task's ``attempt`` (None if nothing does).

    Example:
        >>> for_attempt("worker:1@step=30:kill,worker:1@step=9@attempt=1", 1)
        'worker:1@step=9@attempt=1'
    """
    parts = [p.strip() for p in (text or "").split(",") if p.strip()]
    kept = [p for p in parts if parse_faults(p)[0].attempt == attempt]
    return ",".join(kept) or None


_TRAINERS = ("chief", "worker")  # the jobs that take steps (and so reach a step trigger)


def check_faults(faults: list[Fault], tasks: list[str], last_attempt: Mapping[str, int] | None = None) -> None:
    """Check that every fault can fire in a run of ``tasks``, before any task starts.

    Args:
        faults: the parsed ``--fail-at``.
        tasks: the run's tasks.
        last_attempt: the highest attempt each job's tasks can reach under the run's restart policy
            (0 for a job that is never restarted); None: not checked.

    Raises:
        ConfigError: a fault names a task the run does not have, a step trigger on a task that takes
            no steps (a ps, the evaluator), a checkpoint-save crash on a task that is not a ps, or an
            attempt the task never reaches.
    """
    for f in faults:
        job = f.task.split(":")[0]
        if f.task not in tasks:
            raise ConfigError(f"--fail-at names {f.task}, which this run does not have. Its tasks: {', '.join(tasks)}.")
        if last_attempt is not None and f.attempt > last_attempt.get(job, 0):
            most = last_attempt.get(job, 0)
            trigger = f"save={f.step}" if f.action == "crash_save" else f"step={f.step}"
            raise ConfigError(f"--fail-at {f.task}@{trigger}...@attempt={f.attempt}: {f.task} reaches attempt {most} at "
                              f"most ({'it is never restarted' if most == 0 else f'--max-restarts {most}'}), so this "
                              f"fault would never fire. Restart it (--restart {job}=on-failure, --max-restarts "
                              f"{f.attempt}) or name an earlier attempt.")
        if f.action == "crash_save" and job != "ps":
            raise ConfigError(f"--fail-at {f.task}@save=...: only a ps task writes checkpoint shards; name a ps "
                              f"(e.g. ps:0@save={f.step}:crash_after={f.crash_after_bytes}).")
        if job == "ps" and f.action == "kill":
            continue  # ps:K@step=N:kill: fires when the ps's own shard reaches version N (ps_step_kill)
        if f.action != "crash_save" and job not in _TRAINERS:
            trainers = [t for t in tasks if t.split(":")[0] in _TRAINERS]
            raise ConfigError(f"--fail-at {f.task}@step={f.step}: a {job} task takes no steps, so this fault would never "
                              f"fire. Step faults are for {', '.join(trainers) or 'chief/worker tasks'}; a ps fails with "
                              "ps:K@step=N:kill (at its shard's version N) or ps:K@save=N:crash_after=BYTES.")


def inject(faults: list[Fault], task: str, step: int) -> None:
    """Carry out the faults planned for ``task`` at ``step`` (called by the trainer before each step)."""
    for f in faults:
        if f.task != task or f.action == "crash_save":
            continue
        if f.action == "delay" and step >= f.step:
            time.sleep(f.seconds)  # a deliberately slow worker
        if step != f.step:
            continue
        if f.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.action == "stall":
            time.sleep(f.seconds)  # a deliberately stalled worker
        elif f.action == "hang":
            print(f"{task}: injected hang before step {step} (--hang-at): the main thread stops here for ever; "
                  "its other threads go on", flush=True)
            while True:  # the frame a stack dump shows; only a signal ends it
                time.sleep(3600)
        elif f.action == "raise":
            raise TrainingError(f"Injected failure in {task} at step {step} (--fail-at).")


def ps_step_kill(faults: list[Fault], task: str) -> Callable[[int], None] | None:
    """For a ps ``task`` with a ``ps:K@step=N:kill`` fault: a function of its own shard's version
    that SIGKILLs the process once the version reaches N (None: no such fault)."""
    steps = [f.step for f in faults if f.task == task and f.action == "kill"]
    if not steps:
        return None
    at = min(steps)

    def check(version: int) -> None:
        if version >= at:
            print(f"{task}: injected kill at its shard's version {version} (--fail-at {task}@step={at}:kill)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    return check


def crashing_save(save: Callable[[dict[str, Any]], dict[str, Any]], faults: list[Fault], task: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Wrap a ps's PS_SAVE handler so that the ``crash_save`` faults of ``task`` fire on their save.

    The N-th call writes only ``crash_after_bytes`` of the shard's temporary file, then the process
    SIGKILLs itself: the chief sees a dead ps, and the disk holds what a real crash leaves.
    """
    planned = {f.step: f.crash_after_bytes for f in faults if f.task == task and f.action == "crash_save"}
    if not planned:
        return save
    count = 0

    def save_or_crash(meta: dict[str, Any]) -> dict[str, Any]:
        nonlocal count
        count += 1
        if count not in planned:
            return save(meta)
        # The injected truncation raises CheckpointError once the shard is cut; then die like a killed process.
        with contextlib.suppress(CheckpointError):
            save({**meta, "crash_after_bytes": planned[count]})
        print(f"{task}: injected crash while writing checkpoint {count} (step {meta.get('step')}) (--fail-at)", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        raise TrainingError("unreachable: SIGKILL did not end the process")

    return save_or_crash
