"""Where a ps may write the checkpoint shards the chief asks for (PS_SAVE): inside the run's checkpoint directory.

A PS_SAVE names a root; the ps writes ``ROOT/ckpt-<step>.partial/<its shard file>`` there. So that a
request cannot make a ps write elsewhere (another run's directory, a system path, through ``..`` or
a symlink), the root must lie inside the one directory this ps writes checkpoints under:

- its checkpoint directory (``PSFLOW_CHECKPOINT_DIR``, a directory or a URL), else
- its logdir (``PSFLOW_LOGDIR``; the Supervisor's default puts checkpoints in LOGDIR/checkpoints), else
- for a ps started by hand with neither, the root of the first PS_SAVE it serves: the chief's first
  choice is pinned (said once in the ps's log), and every later save must stay inside it. Give the
  ps its logdir or checkpoint directory to fix the place in advance.

Local paths are compared resolved (``os.path.realpath``: ``..`` and symlinks followed, the ones in
the part that exists), and the save writes to the resolved root. A URL must have the directory's
scheme and bucket, a path inside its path and no ``.`` or ``..`` segment. Called by
:func:`psflow.ps.service.default_save` on each PS_SAVE (connection threads: the pin is locked).
"""

from __future__ import annotations

import logging
import os
import threading

from psflow.checkpoint.format import is_url
from psflow.errors import ConfigError

log = logging.getLogger("psflow.ps")


class SaveRoot:
    """The directory a ps writes checkpoints under, and the check of each PS_SAVE's root.

    Args:
        task: the ps's name, for messages (``"ps:0"``).
        checkpoint_dir: the run's checkpoint directory or URL, if this ps was given one.
        logdir: the run's logdir, if this ps was given one (used without ``checkpoint_dir``).

    Example:
        >>> SaveRoot("ps:0", logdir="/runs/a").check("/runs/a/checkpoints")
        '/runs/a/checkpoints'
    """

    def __init__(self, task: str, *, checkpoint_dir: str | None = None, logdir: str | None = None) -> None:
        self.task = task
        base, self.source = ((checkpoint_dir, "its checkpoint directory (PSFLOW_CHECKPOINT_DIR)") if checkpoint_dir
                             else (logdir, "its logdir (PSFLOW_LOGDIR)") if logdir else (None, ""))
        self.base = None if base is None else _normal(str(base))
        self._lock = threading.Lock()

    def check(self, root: str) -> str:
        """The root to write a PS_SAVE's shard under: ``root`` resolved, if inside the base.

        Raises:
            ConfigError: ``root`` lies outside the base (names both, and what to do).
        """
        resolved = _normal(root)
        with self._lock:
            if self.base is None:
                self.base, self.source = resolved, "the first checkpoint directory the chief named (pinned)"
                log.warning("%s has no checkpoint directory or logdir (PSFLOW_CHECKPOINT_DIR, PSFLOW_LOGDIR): it "
                            "writes checkpoints under %s only, the first one the chief named.", self.task, resolved)
                return resolved
            base, source = self.base, self.source
        if _inside(resolved, base):
            return resolved
        shown = repr(root) if resolved == root else f"{root!r}, which resolves to {resolved!r}"
        raise ConfigError(
            f"PS_SAVE refused: {self.task} writes checkpoints only inside {base}, {source}; the chief asked for "
            f"{shown}. Give the chief and every ps the same checkpoint directory (psflow run --checkpoint-dir, "
            "PSFLOW_CHECKPOINT_DIR) or logdir (--logdir, PSFLOW_LOGDIR).")


def _normal(root: str) -> str:
    """A URL without its trailing slash; a local path absolute and resolved (symlinks, ``..``)."""
    return root.rstrip("/") if is_url(root) else os.path.realpath(root)


def _inside(root: str, base: str) -> bool:
    if is_url(root) != is_url(base):
        return False
    if is_url(root):
        path = root.partition("://")[2]
        if any(part in (".", "..") for part in path.split("/")):
            return False
    return root == base or root.startswith(base.rstrip("/") + "/")
