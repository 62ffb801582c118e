"""Writing a checkpoint: each ps writes its shard, the chief commits the manifest last.

:func:`write_shard` puts one shard file into ``ROOT/ckpt-{step}.partial/`` (tmp + fsync + rename)
and returns its :class:`~psflow.checkpoint.format.ShardRecord`; :func:`commit` checks that every
shard reported exactly once, writes the manifest (with its own checksum) last, renames the
directory to its final name and prunes old checkpoints and stale ``.partial`` directories.

Invariants: a crash at any point leaves the earlier checkpoints plus a ``.partial`` directory,
never a checkpoint that looks whole and is not; re-committing an existing step keeps the old
directory until the new one is in place.

Callers: every ps task (:func:`write_shard`, in parallel, each its own shard) and the chief's
Supervisor (:func:`commit`), also the all-reduce trainer (one shard)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from psflow.checkpoint.files import (
    fsync_dir,
    sha256_file,
    tmp_path,
    unlink_quietly,
    write_bytes_atomic,
)
from psflow.checkpoint.format import (
    CHECKSUM_KEY,
    FINAL_RE,
    FORMAT,
    MANIFEST_NAME,
    PARTIAL_RE,
    SHARD_FILE_RE,
    TRASH_RE,
    VERSION,
    ShardRecord,
    check_step,
    check_unique_names,
    checkpoint_root,
    dir_name,
    is_int,
    is_url,
    manifest_checksum,
    shard_file_name,
)
from psflow.checkpoint.reader import list_checkpoints, looks_whole
from psflow.errors import CheckpointError, ConfigError

_RESERVED_META_PREFIX = "psflow."

# One logger for the whole package: users configure "psflow.checkpoint", not its modules.
_log = logging.getLogger("psflow.checkpoint")

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
        unlink_quietly(tmp)
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
    check_step(step)
    n_ok = is_int(num_shards) and num_shards >= 1
    if not n_ok or not is_int(shard) or not 0 <= shard < num_shards:
        raise ConfigError(
            f"shard must be in [0, num_shards) with num_shards >= 1. "
            f"Received: shard={shard!r}, num_shards={num_shards!r}."
        )
    crash = _crash_after_bytes
    if crash is not None and (not is_int(crash) or crash < 0):
        raise ConfigError(f"_crash_after_bytes must be an int >= 0. Received: {crash!r}.")
    prepared = _prepare_tensors(tensors)
    header = _shard_metadata(metadata, step, shard, num_shards)
    if is_url(root):
        from psflow.checkpoint import remote

        return remote.write_shard(str(root), step, shard, num_shards, prepared, header, crash_after_bytes=crash)
    root_path = checkpoint_root(root)
    partial = root_path / f"{dir_name(step)}.partial"
    name = shard_file_name(shard, num_shards)
    final = partial / name
    tmp = tmp_path(final)
    try:
        partial.mkdir(parents=True, exist_ok=True)
        fsync_dir(root_path)
        _save_tmp(prepared, tmp, header, crash)
        sha256, size = sha256_file(tmp, fsync=True)
        os.replace(tmp, final)
        fsync_dir(partial)
    except OSError as e:
        unlink_quietly(tmp)
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
            f"({shard_file_name(missing[0], n)}); missing shards: {missing}. Received records "
            f"for shards {sorted(by_shard)}. Commit only after every ps shard has reported."
        )
    return tuple(by_shard[k] for k in range(n))


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
        is_ours = entry.name.endswith(".tmp") or SHARD_FILE_RE.fullmatch(entry.name)
        if is_ours and entry.name not in keep and entry.is_file():
            unlink_quietly(entry)


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
    fsync_dir(final.parent)  # the old one, now trash, goes in _prune's sweep, which commit runs next


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
    check_step(step)
    if not is_int(keep) or keep < 1:
        raise ConfigError(f"keep must be an int >= 1. Received: {keep!r}.")
    if not isinstance(meta, Mapping) or not all(isinstance(k, str) for k in meta):
        raise ConfigError(f"meta must be a mapping with str keys. Received: {meta!r:.200}.")
    if is_url(root):
        from psflow.checkpoint import remote

        ordered = _order_records(step, records)
        check_unique_names(ordered, f"step {step}")
        return remote.publish(str(root), step, ordered, manifest_bytes(step, ordered, meta), keep=keep)  # type: ignore[return-value]
    root_path = checkpoint_root(root)
    partial = root_path / f"{dir_name(step)}.partial"
    ordered = _order_records(step, records)
    check_unique_names(ordered, f"step {step}")
    if not partial.is_dir():
        raise CheckpointError(
            f"Cannot commit step {step}: {partial} does not exist. "
            f"Every ps task must call write_shard(root, {step}, ...) before the chief commits."
        )
    _check_files(step, partial, ordered)
    data = manifest_bytes(step, ordered, meta)
    final = root_path / dir_name(step)
    try:
        _remove_junk(partial, {r.file for r in ordered})
        write_bytes_atomic(partial / MANIFEST_NAME, data)
        _publish(partial, final)
    except OSError as e:
        raise CheckpointError(
            f"Could not commit the checkpoint of step {step} at {final}: {e}. "
            "Check that the checkpoint root is writable and has free space."
        ) from e
    _prune(root_path, keep)
    return final


def manifest_bytes(step: int, ordered: Sequence[ShardRecord], meta: Mapping[str, Any]) -> bytes:
    """The manifest of ``step`` over its shards' records (in shard order), with its own checksum.

    Raises:
        ConfigError: ``meta`` is not JSON-serialisable.
    """
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
        return json.dumps(manifest, indent=2, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise ConfigError(f"meta must be JSON-serialisable: {e}. Received: {meta!r:.200}.") from e


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
    named = FINAL_RE.fullmatch(directory.name)  # list_checkpoints lists only such names
    assert named is not None, directory
    return int(named.group(1))


def _prune(root: Path, keep: int) -> None:
    whole_steps: list[int] = []
    for path in list_checkpoints(root):
        if len(whole_steps) >= keep:
            _remove_dir(path)
        elif looks_whole(path):
            whole_steps.append(_step_of(path))
    newest = whole_steps[0] if whole_steps else -1
    for entry in list(root.iterdir()):  # listed first: _remove_dir renames while we go
        partial = PARTIAL_RE.fullmatch(entry.name)
        if partial and int(partial.group(1)) < newest:
            _remove_dir(entry)
        elif TRASH_RE.fullmatch(entry.name):
            shutil.rmtree(entry, ignore_errors=True)

