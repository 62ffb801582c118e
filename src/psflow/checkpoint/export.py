"""Exporting a checkpoint as one safetensors file that plain torch + safetensors load.

Invariant: an exported file is written to a tmp name, fsynced and renamed, then its directory is
fsynced: ``out`` is never half-written and no tmp file is left, even on failure.

Callers: ``psflow export`` (cli.py), scripts that want a checkpoint's tensors in one file."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from psflow.checkpoint.files import fsync_dir, fsync_file, tmp_path, unlink_quietly
from psflow.checkpoint.reader import Checkpoint
from psflow.errors import CheckpointError, ConfigError


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
    tmp = tmp_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # "format": "pt" is what Hugging Face loaders expect in a PyTorch safetensors file.
        save_file(selected, tmp, metadata={"format": "pt"})
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except (OSError, SafetensorError, RuntimeError, ValueError) as e:
        unlink_quietly(tmp)
        raise CheckpointError(f"Could not export {ckpt.path} to {path}: {e}.") from e
    return path
