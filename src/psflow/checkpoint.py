"""Sharded checkpoints: the on-disk format and the rules that make a checkpoint whole.

Layout under a checkpoint root::

    ROOT/ckpt-{step:010d}/shard-{k:05d}-of-{n:05d}.safetensors   one file per ps shard
    ROOT/ckpt-{step:010d}/manifest.json                          written last, by the chief

Invariants:

- A checkpoint is *whole* only if its final directory exists, its manifest parses and matches its
  own checksum (``manifest_sha256``), and every shard file's size and sha256 match the manifest.
  Nothing else is ever restored from.
- Every file of a checkpoint is a regular file inside its directory: a symlink (a shard, the
  manifest or the checkpoint directory itself) is refused, so a checkpoint never reads elsewhere.
- Nothing is written in place. Shards land in ``ckpt-{step}.partial/`` as ``*.tmp`` files that
  are fsynced and renamed; the manifest is written the same way, last; only then is the directory
  renamed to its final name and the parent fsynced. A crash at any point leaves the earlier
  checkpoints plus a ``.partial`` directory, never a checkpoint that looks whole and is not.
  Re-committing a step that exists keeps the old directory until the new one is in place (and
  puts it back if that rename fails).
- Tensor names are opaque strings (the ps layer chooses them) and unique across a checkpoint.

Callers: every ps task calls :func:`write_shard` for its own shard, in its own process, in
parallel, and sends the returned :class:`ShardRecord` to the chief as JSON; the chief calls
:func:`commit` once every shard has reported; a (re)starting task calls :func:`latest_checkpoint`
and :meth:`Checkpoint.load_shard`. This module does no networking.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from psflow.errors import CheckpointError, ConfigError

__all__ = [
    "Checkpoint", "NoWholeCheckpointError", "ShardRecord", "commit", "export_state_dict",
    "latest_checkpoint", "list_checkpoints", "read_checkpoint", "write_shard",
]

FORMAT = "psflow-checkpoint"
# Version 2 added ``manifest_sha256``: version 1 manifests had no checksum of their own.
VERSION = 2
MANIFEST_NAME = "manifest.json"
CHECKSUM_KEY = "manifest_sha256"

# 4 MiB reads: large enough that hashlib releases the GIL and syscalls are few, small enough
# that verifying a multi-GB shard never holds it in memory.
_HASH_CHUNK_BYTES = 4 << 20
# `{step:010d}` gives exactly 10 digits, or more without a leading zero.
_STEP = r"(\d{10}|[1-9]\d{10,})"
_FINAL_RE = re.compile(rf"ckpt-{_STEP}")
_PARTIAL_RE = re.compile(rf"ckpt-{_STEP}\.partial")
_TRASH_RE = re.compile(rf"ckpt-{_STEP}\.trash-[0-9a-f]+")
_SHARD_FILE_RE = re.compile(r"shard-\d{5,}-of-\d{5,}\.safetensors")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_RESERVED_META_PREFIX = "psflow."
_RECORD_KEYS = ("shard", "num_shards", "file", "sha256", "size_bytes", "tensor_names")

_log = logging.getLogger(__name__)


def _dir_name(step: int) -> str:
    return f"ckpt-{step:010d}"


def _shard_file_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard:05d}-of-{num_shards:05d}.safetensors"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def manifest_checksum(manifest: Mapping[str, Any]) -> str:
    """The sha256 of a manifest's canonical JSON, without its own ``manifest_sha256`` entry.

    Canonical (sorted keys, no whitespace) so that the checksum is of the content, not of its
    layout in the file; Python's floats round-trip through JSON exactly.
    """
    body = {k: v for k, v in manifest.items() if k != CHECKSUM_KEY}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class ShardRecord:
    """What one ps task reports to the chief after writing its shard file.

    Attributes:
        shard: Index ``k`` of the shard, ``0 <= k < num_shards``.
        num_shards: Number of shards ``n`` of the checkpoint.
        file: File name relative to the checkpoint directory; always
            ``shard-{k:05d}-of-{n:05d}.safetensors``, so a record can never point elsewhere.
        sha256: Lowercase hex digest of the whole file.
        size_bytes: Size of the file.
        tensor_names: Names of the tensors in the file, in the order they were given.
    """

    shard: int
    num_shards: int
    file: str
    sha256: str
    size_bytes: int
    tensor_names: tuple[str, ...]

    def __post_init__(self) -> None:
        names = self.tensor_names
        if isinstance(names, Sequence) and not isinstance(names, str):
            object.__setattr__(self, "tensor_names", tuple(names))
        problem = self._problem()
        if problem is not None:
            raise CheckpointError(
                f"Invalid shard record: {problem}. A record comes from write_shard; "
                "pass it on unchanged (ShardRecord.to_dict / ShardRecord.from_dict)."
            )

    def _problem(self) -> str | None:
        if not _is_int(self.num_shards) or self.num_shards < 1:
            return f"num_shards must be an int >= 1, received {self.num_shards!r}"
        if not _is_int(self.shard) or not 0 <= self.shard < self.num_shards:
            return f"shard must be an int in [0, {self.num_shards}), received {self.shard!r}"
        expected = _shard_file_name(self.shard, self.num_shards)
        if self.file != expected:
            return f"file must be {expected!r} for shard {self.shard}, received {self.file!r}"
        if not isinstance(self.sha256, str) or not _SHA256_RE.fullmatch(self.sha256):
            return f"sha256 must be 64 lowercase hex digits, received {self.sha256!r}"
        if not _is_int(self.size_bytes) or self.size_bytes < 0:
            return f"size_bytes must be an int >= 0, received {self.size_bytes!r}"
        names = self.tensor_names
        if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
            return f"tensor_names must be a sequence of str, received {names!r}"
        if len(set(names)) != len(names):
            dupes = sorted({n for n in names if names.count(n) > 1})
            return f"tensor_names repeats {dupes!r}"
        return None

    def to_dict(self) -> dict[str, Any]:
        """Returns the record as a JSON-able dict (the form sent to the chief and stored)."""
        return {
            "shard": self.shard,
            "num_shards": self.num_shards,
            "file": self.file,
            "sha256": self.sha256,
            "size_bytes": self.size_bytes,
            "tensor_names": list(self.tensor_names),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardRecord:
        """Builds a record from :meth:`to_dict`'s output, validating every field.

        Raises:
            CheckpointError: ``data`` is not such a dict, or a field is missing or invalid.
        """
        if not isinstance(data, Mapping):
            raise CheckpointError(
                f"A shard record must be a JSON object, received {type(data).__name__}: "
                f"{data!r:.200}. Send ShardRecord.to_dict()."
            )
        missing = [k for k in _RECORD_KEYS if k not in data]
        unknown = sorted(str(k) for k in data if k not in _RECORD_KEYS)
        if missing or unknown:
            raise CheckpointError(
                f"A shard record has missing keys {missing} and unknown keys {unknown}. "
                f"Received keys: {sorted(map(str, data))}. Expected exactly {list(_RECORD_KEYS)}."
            )
        return cls(**{k: data[k] for k in _RECORD_KEYS})


# --------------------------------------------------------------------------- file helpers


def _fsync_dir(path: Path) -> None:
    # A rename is durable only once the directory holding the new entry is fsynced.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "r+b") as f:
        os.fsync(f.fileno())


def _sha256_file(path: Path, *, fsync: bool = False) -> tuple[str, int]:
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


def _tmp_path(final: Path) -> Path:
    # Unique per writer: a restarted ps and its not-yet-dead predecessor never share a tmp file.
    return final.with_name(f"{final.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = _tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError:
        _unlink_quietly(tmp)
        raise


def _checkpoint_root(root: str | os.PathLike[str]) -> Path:
    path = Path(root)
    if path.exists() and not path.is_dir():
        raise ConfigError(
            f"The checkpoint root is not a directory. Received: {str(path)!r}. "
            "Pass a directory (it is created if missing)."
        )
    return path


def _check_step(step: object) -> None:
    if not _is_int(step) or step < 0:  # type: ignore[operator]
        raise ConfigError(f"step must be an int >= 0. Received: {step!r}.")


# --------------------------------------------------------------------------- writing a shard


def _prepare_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Returns dense, contiguous CPU tensors, copying only what safetensors cannot save as is."""
    if not isinstance(tensors, Mapping):
        raise ConfigError(
            "tensors must be a mapping of name -> torch.Tensor. "
            f"Received: {type(tensors).__name__}."
        )
    prepared: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ConfigError(
                f"Tensor names must be str other than '__metadata__' (reserved by safetensors). "
                f"Received: {name!r}."
            )
        is_tensor = isinstance(tensor, torch.Tensor)
        if not is_tensor or tensor.layout != torch.strided or tensor.is_meta:
            kind = f"{tensor.layout} on {tensor.device}" if is_tensor else type(tensor).__name__
            raise ConfigError(
                f"Tensor {name!r} must be a dense torch.Tensor with data. Received: {kind}. "
                "Convert sparse tensors with .to_dense(); materialise meta tensors first."
            )
        # safetensors writes raw memory: lazy conj/neg bits would be silently lost.
        tensor = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
        prepared[name] = tensor
    return _unshare(prepared)


def _unshare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors whose memory overlaps (tied weights, a tensor and its view);
    # the file stores each name separately anyway, so clone the later ones of each overlap.
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
        for name, t in tensors.items()
        if t.numel() > 0
    )
    end = -1
    for start, stop, name in spans:
        if start < end:
            tensors[name] = tensors[name].clone()
        else:
            end = stop
    return tensors


def _shard_metadata(
    metadata: Mapping[str, str] | None, step: int, shard: int, num_shards: int
) -> dict[str, str]:
    user = dict(metadata or {})
    bad = {k: v for k, v in user.items() if not isinstance(k, str) or not isinstance(v, str)}
    reserved = [k for k in user if isinstance(k, str) and k.startswith(_RESERVED_META_PREFIX)]
    if bad or reserved:
        raise ConfigError(
            f"metadata must map str to str and not use the {_RESERVED_META_PREFIX!r} prefix. "
            f"Received non-str entries {bad!r:.200} and reserved keys {reserved}."
        )
    own = {"step": str(step), "shard": str(shard), "num_shards": str(num_shards)}
    return {**user, **{_RESERVED_META_PREFIX + k: v for k, v in own.items()}}


def _save_tmp(
    tensors: dict[str, torch.Tensor], tmp: Path, metadata: dict[str, str], crash_after: int | None
) -> None:
    try:
        save_file(tensors, tmp, metadata=metadata)
    except (OSError, RuntimeError, ValueError, KeyError, TypeError, SafetensorError) as e:
        _unlink_quietly(tmp)
        raise CheckpointError(
            f"Could not write shard file {tmp}: {e}. Received {len(tensors)} tensors "
            f"named {list(tensors)[:8]!r}. Check free disk space and the tensors' dtypes."
        ) from e
    if crash_after is not None:
        # Leave exactly what a process killed mid-write would: a short tmp file, nothing renamed.
        os.truncate(tmp, min(crash_after, tmp.stat().st_size))
        raise CheckpointError(f"injected crash after {crash_after} bytes of {tmp}")


def write_shard(
    root: str | os.PathLike[str],
    step: int,
    shard: int,
    num_shards: int,
    tensors: Mapping[str, torch.Tensor],
    *,
    metadata: Mapping[str, str] | None = None,
    _crash_after_bytes: int | None = None,
) -> ShardRecord:
    """Writes one ps shard of the checkpoint for ``step`` into ``ROOT/ckpt-{step}.partial/``.

    Safe to call from every ps task at once (each writes its own file). The tensors are read
    while the call runs, without a copy when they already are contiguous CPU tensors: pass a
    consistent snapshot, since an update applied concurrently would be saved half-done.

    Args:
        root: The checkpoint root directory; created if missing.
        step: The global step the checkpoint belongs to.
        shard: This shard's index ``k``, ``0 <= k < num_shards``.
        num_shards: Number of ps shards ``n`` in the checkpoint.
        tensors: Name -> tensor (any device, any strided layout); names are opaque strings.
        metadata: Extra str -> str entries for the safetensors header (no ``psflow.`` keys).
        _crash_after_bytes: Fault injection for tests: leave only this many bytes of the tmp
            file and raise, as if the process were killed mid-write.

    Returns:
        The record to send to the chief (``record.to_dict()`` is JSON-able).

    Raises:
        ConfigError: An argument is invalid (step, shard index, tensor names or values).
        CheckpointError: The file could not be written, or the injected crash fired.

    Example:
        >>> rec = write_shard("/tmp/ckpts", 100, 0, 2, {"fc.weight": torch.zeros(2, 3)})
        >>> rec.file
        'shard-00000-of-00002.safetensors'
    """
    _check_step(step)
    n_ok = _is_int(num_shards) and num_shards >= 1
    if not n_ok or not _is_int(shard) or not 0 <= shard < num_shards:
        raise ConfigError(
            f"shard must be in [0, num_shards) with num_shards >= 1. "
            f"Received: shard={shard!r}, num_shards={num_shards!r}."
        )
    crash = _crash_after_bytes
    if crash is not None and (not _is_int(crash) or crash < 0):
        raise ConfigError(f"_crash_after_bytes must be an int >= 0. Received: {crash!r}.")
    prepared = _prepare_tensors(tensors)
    header = _shard_metadata(metadata, step, shard, num_shards)
    root_path = _checkpoint_root(root)
    partial = root_path / f"{_dir_name(step)}.partial"
    name = _shard_file_name(shard, num_shards)
    final = partial / name
    tmp = _tmp_path(final)
    try:
        partial.mkdir(parents=True, exist_ok=True)
        _fsync_dir(root_path)
        _save_tmp(prepared, tmp, header, crash)
        sha256, size = _sha256_file(tmp, fsync=True)
        os.replace(tmp, final)
        _fsync_dir(partial)
    except OSError as e:
        _unlink_quietly(tmp)
        raise CheckpointError(
            f"Could not write shard {shard} of step {step} to {final}: {e}. "
            "Check that the checkpoint root is writable and has free space."
        ) from e
    return ShardRecord(shard, num_shards, name, sha256, size, tuple(prepared))


# --------------------------------------------------------------------------- committing


def _order_records(step: int, records: Sequence[ShardRecord]) -> tuple[ShardRecord, ...]:
    """Checks that ``records`` cover shards 0..n-1 exactly once; returns them by shard."""
    if isinstance(records, (str, bytes)) or not isinstance(records, Sequence) or not records:
        raise CheckpointError(
            f"Cannot commit step {step}: records must be a non-empty sequence of ShardRecord. "
            f"Received: {records!r:.200}. Collect one record per ps shard first."
        )
    wrong = [r for r in records if not isinstance(r, ShardRecord)]
    if wrong:
        raise CheckpointError(
            f"Cannot commit step {step}: records must be ShardRecord objects. Received: "
            f"{type(wrong[0]).__name__}. Rebuild them with ShardRecord.from_dict."
        )
    counts = sorted({r.num_shards for r in records})
    if len(counts) > 1:
        raise CheckpointError(
            f"Cannot commit step {step}: the records disagree on num_shards: {counts}. "
            "Every ps task must write with the same num_shards."
        )
    n = counts[0]
    by_shard: dict[int, ShardRecord] = {}
    for record in records:
        if record.shard in by_shard:
            raise CheckpointError(
                f"Cannot commit step {step}: shard {record.shard} of {n} ({record.file}) is "
                "reported twice. Send each ps shard's record once."
            )
        by_shard[record.shard] = record
    missing = [k for k in range(n) if k not in by_shard]
    if missing:
        raise CheckpointError(
            f"Cannot commit step {step}: no record for shard {missing[0]} of {n} "
            f"({_shard_file_name(missing[0], n)}); missing shards: {missing}. Received records "
            f"for shards {sorted(by_shard)}. Commit only after every ps shard has reported."
        )
    return tuple(by_shard[k] for k in range(n))


def _check_unique_names(records: Sequence[ShardRecord], where: str) -> None:
    owner: dict[str, int] = {}
    for record in records:
        for name in record.tensor_names:
            if name in owner:
                raise CheckpointError(
                    f"Tensor name {name!r} is in both shard {owner[name]} and shard "
                    f"{record.shard} of {where}. Every tensor must live on exactly one shard."
                )
            owner[name] = record.shard


def _check_files(step: int, directory: Path, records: Sequence[ShardRecord]) -> None:
    for record in records:
        path = directory / record.file
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(
                f"Cannot commit step {step}: shard {record.shard} file {path} does not exist. "
                "The ps task that reported it must write it again."
            ) from None
        if size != record.size_bytes:
            raise CheckpointError(
                f"Cannot commit step {step}: shard {record.shard} file {path} has {size} bytes, "
                f"its record says {record.size_bytes}. The ps task must write it again."
            )


def _remove_junk(directory: Path, keep: set[str]) -> None:
    # Leftovers of crashed writers (tmp files, shards of another num_shards) would otherwise
    # live in the final directory forever.
    for entry in directory.iterdir():
        is_ours = entry.name.endswith(".tmp") or _SHARD_FILE_RE.fullmatch(entry.name)
        if is_ours and entry.name not in keep and entry.is_file():
            _unlink_quietly(entry)


def _publish(partial: Path, final: Path) -> None:
    trash = None
    if final.exists():
        # Reached only after a rollback re-reached this step: the new state is the job's truth
        # from now on. Between the two renames no checkpoint of this step exists (not a torn one).
        trash = final.with_name(f"{final.name}.trash-{uuid.uuid4().hex[:8]}")
        os.replace(final, trash)
    try:
        os.replace(partial, final)
    except OSError:
        if trash is not None:
            os.replace(trash, final)  # the new one could not take its place: keep the old one
        raise
    _fsync_dir(final.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def commit(
    root: str | os.PathLike[str],
    step: int,
    records: Sequence[ShardRecord],
    *,
    meta: Mapping[str, Any],
    keep: int = 5,
) -> Path:
    """Makes the checkpoint of ``step`` whole: writes its manifest last, then publishes it.

    Called by the chief once every ps shard has reported its record. Afterwards keeps the
    newest ``keep`` whole checkpoints and deletes ``.partial`` directories older than the newest
    one. Pruning judges "whole" by manifest and file sizes only (hashing every kept checkpoint
    at every save would cost ``keep`` times the model in reads); hashes are checked on restore.
    Committing a step that is already committed replaces it (a rollback re-reached that step).

    Args:
        root: The checkpoint root that the shards were written under.
        step: The step passed to :func:`write_shard`.
        records: One record per shard ``0..n-1``, in any order.
        meta: JSON-able data stored with the checkpoint (global step, data position, ...).
        keep: How many whole checkpoints to keep, >= 1.

    Returns:
        The final checkpoint directory.

    Raises:
        ConfigError: ``step``, ``keep`` or ``meta`` is invalid.
        CheckpointError: A shard's record is missing or repeated, or its file is missing or
            has the wrong size; the message names the shard.
    """
    _check_step(step)
    if not _is_int(keep) or keep < 1:
        raise ConfigError(f"keep must be an int >= 1. Received: {keep!r}.")
    if not isinstance(meta, Mapping) or not all(isinstance(k, str) for k in meta):
        raise ConfigError(f"meta must be a mapping with str keys. Received: {meta!r:.200}.")
    root_path = _checkpoint_root(root)
    partial = root_path / f"{_dir_name(step)}.partial"
    ordered = _order_records(step, records)
    _check_unique_names(ordered, f"step {step}")
    if not partial.is_dir():
        raise CheckpointError(
            f"Cannot commit step {step}: {partial} does not exist. "
            f"Every ps task must call write_shard(root, {step}, ...) before the chief commits."
        )
    _check_files(step, partial, ordered)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "num_shards": len(ordered),
        "shards": [r.to_dict() for r in ordered],
        "meta": dict(meta),
        "created_unix": time.time(),
    }
    try:
        manifest[CHECKSUM_KEY] = manifest_checksum(manifest)
        data = json.dumps(manifest, indent=2, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise ConfigError(f"meta must be JSON-serialisable: {e}. Received: {meta!r:.200}.") from e
    final = root_path / _dir_name(step)
    try:
        _remove_junk(partial, {r.file for r in ordered})
        _write_bytes_atomic(partial / MANIFEST_NAME, data)
        _publish(partial, final)
    except OSError as e:
        raise CheckpointError(
            f"Could not commit the checkpoint of step {step} at {final}: {e}. "
            "Check that the checkpoint root is writable and has free space."
        ) from e
    _prune(root_path, keep)
    return final


def _remove_dir(path: Path) -> None:
    # Rename first: a half-deleted checkpoint must not look like one to a concurrent reader.
    trash = path.with_name(f"{path.name.split('.')[0]}.trash-{uuid.uuid4().hex[:8]}")
    try:
        os.replace(path, trash)
        shutil.rmtree(trash)
    except OSError as e:
        _log.warning("Could not delete old checkpoint directory %s: %s. Delete it by hand.",
                     path, e)


def _step_of(directory: Path) -> int:
    return int(directory.name.split("-", 1)[1].split(".", 1)[0])


def _prune(root: Path, keep: int) -> None:
    whole_steps: list[int] = []
    for path in list_checkpoints(root):
        if len(whole_steps) >= keep:
            _remove_dir(path)
        elif _looks_whole(path):
            whole_steps.append(_step_of(path))
    newest = whole_steps[0] if whole_steps else -1
    for entry in list(root.iterdir()):  # listed first: _remove_dir renames while we go
        partial = _PARTIAL_RE.fullmatch(entry.name)
        if partial and int(partial.group(1)) < newest:
            _remove_dir(entry)
        elif _TRASH_RE.fullmatch(entry.name):
            shutil.rmtree(entry, ignore_errors=True)


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint as its manifest describes it.

    Attributes:
        path: The final checkpoint directory.
        step: The step it was saved at.
        num_shards: Number of ps shards.
        shards: One record per shard, ordered by shard index.
        meta: The ``meta`` given to :func:`commit`.
    """

    path: Path
    step: int
    num_shards: int
    shards: tuple[ShardRecord, ...]
    meta: dict[str, Any]

    def load_shard(self, shard: int) -> dict[str, torch.Tensor]:
        """Loads one shard's tensors after checking the file's size and sha256.

        Args:
            shard: The shard index, ``0 <= shard < num_shards``.

        Returns:
            Name -> CPU tensor, in the order the ps wrote them.

        Raises:
            ConfigError: ``shard`` is out of range.
            CheckpointError: The file is missing, corrupt or unreadable; the message names it.
        """
        if not _is_int(shard) or not 0 <= shard < self.num_shards:
            raise ConfigError(
                f"shard must be in [0, {self.num_shards}) for checkpoint {self.path}. "
                f"Received: {shard!r}."
            )
        record = self.shards[shard]
        path = self.path / record.file
        problem = _file_problem(self.path, record)
        if problem is None:
            try:
                tensors = load_file(path)
            except (OSError, SafetensorError, ValueError, RuntimeError) as e:
                problem = f"shard file {path} cannot be read by safetensors: {e}"
        if problem is None and set(tensors) != set(record.tensor_names):
            problem = f"shard file {path} holds tensors that differ from its manifest record"
        if problem is not None:
            raise CheckpointError(
                f"Cannot load shard {shard} of checkpoint {self.path}: {problem}. "
                "Restore from an older checkpoint (latest_checkpoint skips corrupt ones)."
            )
        return {name: tensors[name] for name in record.tensor_names}

    def load_all(self) -> dict[str, torch.Tensor]:
        """Loads and verifies every shard; returns the union of their tensors.

        Raises:
            CheckpointError: A shard is corrupt, or a tensor name is on two shards.
        """
        _check_unique_names(self.shards, f"checkpoint {self.path}")
        tensors: dict[str, torch.Tensor] = {}
        for record in self.shards:
            tensors.update(self.load_shard(record.shard))
        return tensors


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Returns the final checkpoint directories under ``root``, newest step first.

    ``.partial`` directories and other entries are ignored; nothing is verified here.
    A missing ``root`` has no checkpoints.
    """
    root_path = _checkpoint_root(root)
    if not root_path.exists():
        return []
    found = []
    for entry in root_path.iterdir():
        match = _FINAL_RE.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return [path for _, path in sorted(found, reverse=True)]


def _escape_problem(directory: Path, name: str) -> str | None:
    """Says how ``directory / name`` leads out of ``directory``, or None when it does not.

    psflow writes only regular files with plain names: a symlink, or a name that is not one
    path component, would make a restore read a file that is not part of the checkpoint.
    """
    path = directory / name
    if Path(name).name != name or name in ("", ".", ".."):
        return f"{path} is not a file name inside the checkpoint directory {directory}"
    if path.is_symlink():
        return (f"{path} is a symlink (to {os.readlink(path)!r}); a checkpoint holds only regular "
                "files, so it is refused")
    return None


def _file_problem(directory: Path, record: ShardRecord) -> str | None:
    """Says what is wrong with a shard file (place, size, sha256), or None when it is intact."""
    path = directory / record.file
    escape = _escape_problem(directory, record.file)
    if escape is not None:
        return escape
    try:
        size = path.stat().st_size
        if size != record.size_bytes:
            return f"shard file {path} has {size} bytes, the manifest says {record.size_bytes}"
        digest, _ = _sha256_file(path)
    except FileNotFoundError:
        return f"shard file {path} is missing"
    except OSError as e:
        return f"shard file {path} cannot be read: {e}"
    if digest != record.sha256:
        return f"shard file {path} has sha256 {digest}, the manifest says {record.sha256}"
    return None


def _manifest_field(manifest: dict[str, Any], key: str, kind: type, path: Path) -> Any:
    value = manifest.get(key)
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        raise CheckpointError(
            f"manifest {path} has {key}={value!r:.100}, expected {kind.__name__}"
        )
    return value


def _check_manifest_checksum(manifest: dict[str, Any], path: Path) -> None:
    # A manifest damaged in a way that still parses (a changed digit, size or name) must not
    # pass for a whole one: it decides which bytes are restored.
    stored = manifest.get(CHECKSUM_KEY)
    try:
        actual = manifest_checksum(manifest)
    except ValueError:  # NaN or infinity in a parsed manifest: never written by commit
        actual = None
    if stored != actual:
        raise CheckpointError(
            f"manifest {path} does not match its own checksum ({CHECKSUM_KEY} {stored!r:.70}, "
            f"the content hashes to {actual}): it was changed or damaged after it was written"
        )


def _read_manifest(directory: Path) -> Checkpoint:
    """Parses and checks ``directory``'s manifest without touching the shard files."""
    path = directory / MANIFEST_NAME
    if _PARTIAL_RE.fullmatch(directory.name) or _TRASH_RE.fullmatch(directory.name):
        raise CheckpointError(
            f"{directory} is not a committed checkpoint (its commit never finished)"
        )
    if directory.is_symlink():
        raise CheckpointError(
            f"checkpoint directory {directory} is a symlink (to {os.readlink(directory)!r}); "
            "checkpoints are refused unless they are real directories under the checkpoint root"
        )
    escape = _escape_problem(directory, MANIFEST_NAME)
    if escape is not None:
        raise CheckpointError(escape)
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {directory} has no {MANIFEST_NAME}") from None
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"manifest {path} cannot be parsed (truncated?): {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} manifest, it holds {manifest!r:.200}")
    version = _manifest_field(manifest, "version", int, path)
    if version != VERSION:
        raise CheckpointError(
            f"manifest {path} has version {version}; this psflow reads version {VERSION} "
            "(use the psflow release that wrote it)"
        )
    _check_manifest_checksum(manifest, path)
    step = _manifest_field(manifest, "step", int, path)
    named = _FINAL_RE.fullmatch(directory.name)
    if named and int(named.group(1)) != step:
        raise CheckpointError(f"manifest {path} says step {step}, its directory name does not")
    num_shards = _manifest_field(manifest, "num_shards", int, path)
    raw = _manifest_field(manifest, "shards", list, path)
    meta = _manifest_field(manifest, "meta", dict, path)
    try:
        records = tuple(ShardRecord.from_dict(r) for r in raw)
    except CheckpointError as e:
        raise CheckpointError(f"manifest {path} has an invalid shard entry: {e}") from e
    if [r.shard for r in records] != list(range(num_shards)) or any(
        r.num_shards != num_shards for r in records
    ):
        raise CheckpointError(
            f"manifest {path} does not list shards 0..{num_shards - 1} in order; "
            f"it lists {[r.shard for r in records]}"
        )
    return Checkpoint(directory, step, num_shards, records, meta)


def _looks_whole(directory: Path) -> bool:
    try:
        ckpt = _read_manifest(directory)
        return all(
            (directory / r.file).stat().st_size == r.size_bytes for r in ckpt.shards
        )
    except (CheckpointError, OSError):
        return False


def _open_verified(directory: Path) -> tuple[Checkpoint | None, list[str]]:
    """Returns (checkpoint, []) when whole, else (None, what is wrong with it)."""
    try:
        ckpt = _read_manifest(directory)
    except CheckpointError as e:
        return None, [str(e).rstrip(".")]
    # Threads overlap the shards' reads and hashing: both release the GIL.
    with ThreadPoolExecutor(max_workers=max(1, min(4, len(ckpt.shards)))) as pool:
        problems = [p for p in pool.map(lambda r: _file_problem(directory, r), ckpt.shards) if p]
    return (None, problems) if problems else (ckpt, [])


def read_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Opens a committed checkpoint after verifying every shard's size and sha256.

    Args:
        path: A final checkpoint directory, e.g. ``ROOT/ckpt-0000000100``.

    Returns:
        The checkpoint; load tensors with :meth:`Checkpoint.load_shard` or ``load_all``.

    Raises:
        CheckpointError: The manifest or a shard is missing, partial or corrupt; the message
            names each bad file and what is wrong with it.
    """
    directory = Path(path)
    ckpt, problems = _open_verified(directory)
    if ckpt is None:
        raise CheckpointError(
            f"Checkpoint {directory} is not usable: {'; '.join(problems)}. "
            "Restore from an older checkpoint or delete this directory."
        )
    return ckpt


class NoWholeCheckpointError(CheckpointError):
    """Every committed checkpoint under a root failed its checks (see :func:`latest_checkpoint`).

    Attributes:
        root: The checkpoint root.
        problems: Each checkpoint directory, newest first, with what is wrong with it.
    """

    def __init__(self, root: Path, problems: Sequence[tuple[Path, Sequence[str]]]) -> None:
        self.root = root
        self.problems = [(path, list(why)) for path, why in problems]
        listed = "; ".join(f"{path}: {', '.join(why)}" for path, why in self.problems)
        super().__init__(
            f"None of the {len(self.problems)} checkpoint(s) under {root} is whole, so the "
            f"training they hold cannot be resumed: {listed}. Nothing was restored. To start "
            f"fresh on purpose, use another checkpoint root, or move {root} away."
        )


def latest_checkpoint(
    root: str | os.PathLike[str],
    *,
    warn: Callable[[str], None] | None = None,
    strict: bool = False,
) -> Checkpoint | None:
    """Returns the newest whole checkpoint under ``root``, or None when there is none.

    A corrupt or incomplete checkpoint is skipped with one warning naming the bad file(s),
    and the previous one is tried.

    Args:
        root: The checkpoint root directory (may not exist yet).
        warn: Receives each warning; defaults to this module's logger.
        strict: When committed checkpoints exist but every one is corrupt, raise instead of
            returning None: a caller that would otherwise start over at step 0 must not lose
            the earlier training silently. ``.partial`` directories are not checkpoints.

    Raises:
        NoWholeCheckpointError: ``strict`` and no checkpoint under ``root`` is whole; it
            names each checkpoint and what is wrong with it.

    Example:
        >>> ckpt = latest_checkpoint("runs/mnist/checkpoints")
        >>> state = ckpt.load_shard(0) if ckpt else None
    """
    report = warn if warn is not None else _log.warning
    skipped: list[tuple[Path, list[str]]] = []
    for directory in list_checkpoints(root):
        ckpt, problems = _open_verified(directory)
        if ckpt is not None:
            return ckpt
        skipped.append((directory, problems))
        report(
            f"Skipping checkpoint {directory}: {'; '.join(problems)}. "
            "Falling back to the previous checkpoint."
        )
    if strict and skipped:
        raise NoWholeCheckpointError(Path(root), skipped)
    return None


def export_state_dict(
    ckpt: Checkpoint,
    out: str | os.PathLike[str],
    *,
    rename: Callable[[str], str | None] | None = None,
) -> Path:
    """Writes the checkpoint's tensors (all, or those ``rename`` keeps) as one safetensors file.

    The file is written to a tmp name, fsynced and renamed, so ``out`` is never half-written.
    Tensors are exported as stored: a tensor the ps layer split across shards stays in pieces
    unless ``rename`` and the caller reassemble it.

    Args:
        ckpt: A checkpoint from :func:`read_checkpoint` or :func:`latest_checkpoint`.
        out: The file to write; parent directories are created.
        rename: Maps a stored name to the exported name, or to None to drop the tensor.

    Returns:
        ``out`` as a Path.

    Raises:
        ConfigError: ``rename`` returned a non-str, mapped two tensors to one name, or dropped all.
        CheckpointError: A shard is corrupt, or the file could not be written.
    """
    selected: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    for record in ckpt.shards:
        for name, tensor in ckpt.load_shard(record.shard).items():
            new = name if rename is None else rename(name)
            if new is None:
                continue
            if not isinstance(new, str) or new in selected:
                raise ConfigError(
                    f"rename must return a new unique str or None. Received {new!r} for "
                    f"{name!r}" + (f", already used for {source[new]!r}." if new in source else ".")
                )
            selected[new], source[new] = tensor, name
    if not selected:
        raise ConfigError(
            f"Nothing to export from {ckpt.path}: rename dropped all "
            f"{sum(len(r.tensor_names) for r in ckpt.shards)} tensors. Keep at least one."
        )
    path = Path(out)
    tmp = _tmp_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # "format": "pt" is what Hugging Face loaders expect in a PyTorch safetensors file.
        save_file(selected, tmp, metadata={"format": "pt"})
        _fsync_file(tmp)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except (OSError, SafetensorError, RuntimeError, ValueError) as e:
        _unlink_quietly(tmp)
        raise CheckpointError(f"Could not export {ckpt.path} to {path}: {e}.") from e
    return path
