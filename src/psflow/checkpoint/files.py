"""Durable file writes for checkpoints: nothing is written in place.

Every file goes to a tmp name unique per writer (pid + random), is fsynced, renamed over its final
name, and the directory holding it is fsynced, so a crash leaves the old file or the new one,
never a torn one. Also: hashing a file in bounded memory (optionally fsyncing it on the way).

Callers: :mod:`psflow.checkpoint.writer` (shards, manifests), :mod:`psflow.checkpoint.reader`
(verifying sha256), :mod:`psflow.checkpoint.export` (exported files)."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

# 4 MiB reads: large enough that hashlib releases the GIL and syscalls are few, small enough
# that verifying a multi-GB shard never holds it in memory.
_HASH_CHUNK_BYTES = 4 << 20

# --------------------------------------------------------------------------- file helpers


def fsync_dir(path: Path) -> None:
    # A rename is durable only once the directory holding the new entry is fsynced.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "r+b") as f:
        os.fsync(f.fileno())


def sha256_file(path: Path, *, fsync: bool = False) -> tuple[str, int]:
    """Returns (sha256 hex, size) of ``path``; with ``fsync``, forces its bytes to disk too."""
    digest = hashlib.sha256()
    buffer = bytearray(_HASH_CHUNK_BYTES)
    view = memoryview(buffer)
    size = 0
    with open(path, "r+b" if fsync else "rb") as f:
        while count := f.readinto(buffer):
            digest.update(view[:count])
            size += count
        if fsync:
            os.fsync(f.fileno())
    return digest.hexdigest(), size


def tmp_path(final: Path) -> Path:
    # Unique per writer: a restarted ps and its not-yet-dead predecessor never share a tmp file.
    return final.with_name(f"{final.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")


def unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError:
        unlink_quietly(tmp)
        raise

