"""A run's own files as the HTTP API serves them: task logs (tail, and from an offset to follow),
the list of checkpoints, a checkpoint's export and the root cause's error report, never anything
outside the run's log directory.

Every path is built from the run's record (its ``logdir``) and a name checked against what the run
has: a task must be one of the run's tasks, a checkpoint name must be ``ckpt-<digits>``; the resolved
path (symlinks followed) must still lie inside the log directory. So ``../../etc/passwd``, an
encoded one, or a symlink planted in the logdir is refused with :class:`RunFileError`.

Called by :mod:`psflow.platform.api`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psflow.errors import PsflowError
from psflow.rundir import RunDir

_CKPT = re.compile(r"ckpt-\d{1,20}")


class RunFileError(PsflowError):
    """A file of a run that cannot be served: not one of the run's, or outside its directory."""


@dataclass(frozen=True)
class LogChunk:
    """Bytes ``[offset, next_offset)`` of a log of ``size`` bytes, decoded (bad UTF-8 replaced)."""

    text: str
    offset: int
    next_offset: int
    size: int

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "offset": self.offset, "next_offset": self.next_offset, "size": self.size}


def inside(logdir: Path, path: Path) -> Path:
    """``path`` resolved, if it lies inside ``logdir`` (resolved too).

    Raises:
        RunFileError: it does not (a ``..`` or a symlink leads out).
    """
    root, target = logdir.resolve(), path.resolve()
    if target != root and root not in target.parents:
        raise RunFileError(f"{path} is outside the run's directory {root}; only the run's own files are served.")
    return target


def log_path(run: dict[str, Any], task: str) -> Path:
    """The log file of ``task`` (``worker:1``) of ``run`` (a job store record).

    Raises:
        RunFileError: ``task`` is not one of the run's tasks.
    """
    tasks = list(run.get("tasks") or {})
    if task not in tasks:
        raise RunFileError(f"{task!r} is not a task of run {run.get('id')}. Its tasks: {', '.join(tasks)}.")
    run_dir = RunDir(run["logdir"])
    return inside(run_dir.path, run_dir.log(task))


def read_log(path: Path, *, offset: int | None, max_bytes: int) -> LogChunk:
    """From ``offset`` (None: the last ``max_bytes``, a tail) at most ``max_bytes``. A log that has not
    been written yet reads empty; an ``offset`` past the end (the log was rotated) reads from 0."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            start = max(0, size - max_bytes) if offset is None else (offset if 0 <= offset <= size else 0)
            f.seek(start)
            data = f.read(max_bytes)
    except FileNotFoundError:
        return LogChunk("", 0, 0, 0)
    if offset is None and start > 0:  # a tail starts at a line's beginning
        cut = data.find(b"\n")
        if 0 <= cut < len(data) - 1:
            data, start = data[cut + 1:], start + cut + 1
    return LogChunk(data.decode(errors="replace"), start, start + len(data), size)


def checkpoint_path(run: dict[str, Any], name: str) -> Path:
    """The checkpoint directory ``name`` (``ckpt-0000000600``) of ``run``.

    Raises:
        RunFileError: not a checkpoint name, or no such checkpoint in the run's directory.
    """
    if not _CKPT.fullmatch(name):
        raise RunFileError(f"{name!r} is not a checkpoint name (ckpt-<step>, as the checkpoints list gives them).")
    run_dir = RunDir(run["logdir"])
    path = inside(run_dir.path, run_dir.checkpoint(name))
    if not path.is_dir():
        raise RunFileError(f"Run {run.get('id')} has no checkpoint {name}.")
    return path


def checkpoints(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's checkpoints, newest first: name, step, shards, bytes, each worker's data position
    (epoch, batch) at it, and whether each verifies."""
    from psflow import checkpoint

    out = []
    for path in checkpoint.list_checkpoints(RunDir(run["logdir"]).checkpoints):
        try:
            ckpt = checkpoint.read_checkpoint(path)
        except PsflowError as e:
            out.append({"name": path.name, "ok": False, "error": str(e)})
            continue
        out.append({"name": path.name, "step": ckpt.step, "shards": ckpt.num_shards, "ok": True,
                    "size_bytes": sum(r.size_bytes for r in ckpt.shards),
                    "data_position": ckpt.meta.get("data_position") or {}})
    return out


def dump_lines(run: dict[str, Any], log: str, line: int, *, max_lines: int = 5000) -> list[str]:
    """Lines ``line``.. of a task's log (1-based) where the launcher said a stack dump went; the log
    must be inside the run's directory.

    Raises:
        RunFileError: the log is outside the run's directory.
    """
    import itertools

    path = inside(Path(run["logdir"]), Path(log))
    try:
        with path.open(errors="replace") as f:
            return list(itertools.islice(f, max(0, line - 1), max(0, line - 1) + max_lines))
    except FileNotFoundError:
        return []


def root_cause_of(run: dict[str, Any]) -> dict[str, Any] | None:
    """A failed run's root cause in words (:func:`psflow.errorreport.describe_root_cause`), as
    its launcher put it at the run's end (in its summary); for a run recorded without it, from the
    root task's error report (inside the run's directory only) or how it ended where it left none.
    None while the run has no root cause."""
    from psflow import errorreport

    stored = errorreport.recorded_failure(run.get("summary"))
    if stored is not None:
        return stored
    root = run.get("root_cause")
    tasks = run.get("tasks") or {}
    if not root or root not in tasks:  # none yet, or a finding (a sentence), not a task
        return errorreport.describe_root_cause(root)
    return errorreport.failure_from_files(RunDir(run["logdir"]), root, (tasks.get(root) or {}).get("exit_cause"))
