"""Exporting a checkpoint as one safetensors file that plain torch + safetensors load.

Two exports, one writer (:func:`write_tensors_file`): :func:`export_checkpoint` writes a psflow
run's model as whole tensors by parameter name (``psflow export``); :func:`export_state_dict`
writes a checkpoint's tensors as stored, optionally renamed or filtered.

Invariant: an exported file is written to a tmp name, fsynced and renamed, then its directory is
fsynced: ``out`` is never half-written and no tmp file is left, even on failure.

Callers: ``psflow export`` and ``psflow checkpoints`` (cli/files.py, :func:`find_root`), scripts that
want a checkpoint's tensors in one file, the evaluator (:func:`find_checkpoint`'s layout, ``CHECKPOINTS_DIR``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from psflow.checkpoint.assembly import exports_averages, state_dict_from
from psflow.checkpoint.files import fsync_dir, fsync_file, tmp_path, unlink_quietly
from psflow.checkpoint.format import FINAL_RE, MANIFEST_NAME, is_url
from psflow.checkpoint.reader import Checkpoint, latest_checkpoint, read_checkpoint
from psflow.errors import CheckpointError, ConfigError
from psflow.rundir import CHECKPOINTS_DIR


def write_tensors_file(
    tensors: Mapping[str, torch.Tensor], out: str | os.PathLike[str], *, metadata: Mapping[str, str], source: object
) -> Path:
    """Writes ``tensors`` as one safetensors file at ``out``, durably and atomically.

    Written to a tmp name, fsynced, renamed over ``out``, and the directory fsynced; on failure
    the tmp file is removed and ``out`` is untouched. Parent directories are created.

    Args:
        tensors: name -> contiguous tensor.
        out: the file to write.
        metadata: the safetensors header's str -> str entries.
        source: what is exported, for the error message (a checkpoint directory).

    Raises:
        CheckpointError: the file could not be written.
    """
    path = Path(out)
    tmp = tmp_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(dict(tensors), tmp, metadata=dict(metadata))
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except (OSError, SafetensorError, RuntimeError, ValueError) as e:
        unlink_quietly(tmp)
        raise CheckpointError(
            f"Could not export {source} to {path}: {e}. Check that its directory is writable and has free space."
        ) from e
    return path


def find_root(path: str | os.PathLike[str]) -> Path | str:
    """The checkpoint root that ``path`` names, local or a URL alike: a logdir's ``checkpoints/``
    where it has one, else ``path`` itself (a checkpoint root, such as a ``--checkpoint-dir`` URL).

    Raises:
        CheckpointError: a URL that cannot be listed.

    Example:
        >>> find_root("s3://bucket/mnist")  # doctest: +SKIP
        's3://bucket/mnist/checkpoints'
    """
    if is_url(path):
        from psflow.checkpoint import remote

        return remote.root_of(str(path), CHECKPOINTS_DIR)
    p = Path(path)
    return p / CHECKPOINTS_DIR if (p / CHECKPOINTS_DIR).is_dir() else p


def find_checkpoint(path: str | os.PathLike[str], *, warn: Callable[[str], None] | None = None) -> Checkpoint:
    """The checkpoint that ``path`` names: a checkpoint directory, a checkpoint root, or a logdir
    (its ``checkpoints/``), each local or a URL; for a root or logdir the newest whole one.

    Raises:
        CheckpointError: there is no whole checkpoint there.
    """
    if is_url(path):  # a checkpoint's URL, a root URL (--checkpoint-dir s3://...) or a URL logdir
        url = str(path).rstrip("/")
        if FINAL_RE.fullmatch(url.rsplit("/", 1)[-1]):
            return read_checkpoint(url)
        found = latest_checkpoint(find_root(url), warn=warn, strict=True)
        if found is None:
            raise CheckpointError(f"No whole checkpoint under {url}. Received: {str(path)!r}. Pass a URL logdir, the "
                                  "--checkpoint-dir URL of a run that saved at least once, or one of its ckpt-<step> URLs.")
        return found
    p = Path(path)
    if (p / MANIFEST_NAME).is_file():
        return read_checkpoint(p)
    root = find_root(p)
    ckpt = latest_checkpoint(root, warn=warn, strict=True)
    if ckpt is None:
        raise CheckpointError(
            f"No whole checkpoint under {root}. Received: {str(path)!r}. Pass a run's logdir, its checkpoints/ "
            "directory or one ckpt-<step> directory of a run that saved at least once."
        )
    return ckpt


def export_checkpoint(
    path: str | os.PathLike[str], out: str | os.PathLike[str], *, averages: bool | None = None,
    warn: Callable[[str], None] | None = None,
) -> tuple[Path, Checkpoint, bool]:
    """Write a checkpoint's parameters as one safetensors file that plain torch + safetensors load.

    The file holds whole tensors by parameter name (``model.load_state_dict(load_file(out))``),
    written by :func:`write_tensors_file`, so ``out`` is never half-written.

    Args:
        path: a logdir, checkpoint root or checkpoint directory (see :func:`find_checkpoint`).
        out: the ``.safetensors`` file to write.
        averages: export the moving averages; None: what the run chose.
        warn: receives a warning for each corrupt checkpoint skipped.

    Returns:
        (out, the checkpoint exported, whether the averages were exported).

    Raises:
        CheckpointError: no whole checkpoint, no averages when asked for, or the file could not be written.

    Example:
        >>> export_checkpoint("runs/mnist", "model.safetensors")
    """
    ckpt = find_checkpoint(path, warn=warn)
    chosen = exports_averages(ckpt) if averages is None else averages
    state = state_dict_from(ckpt, averages=chosen)
    # "format": "pt" is what Hugging Face loaders expect in a PyTorch safetensors file.
    meta = {"format": "pt", "psflow.step": str(ckpt.step), "psflow.values": "averages" if chosen else "values"}
    return write_tensors_file(state, out, metadata=meta, source=ckpt.path), ckpt, chosen

def export_state_dict(
    ckpt: Checkpoint,
    out: str | os.PathLike[str],
    *,
    rename: Callable[[str], str | None] | None = None,
) -> Path:
    """Writes the checkpoint's tensors (all, or those ``rename`` keeps) as one safetensors file.

    Written by :func:`write_tensors_file`, so ``out`` is never half-written.
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
    # "format": "pt" is what Hugging Face loaders expect in a PyTorch safetensors file.
    return write_tensors_file(selected, out, metadata={"format": "pt"}, source=ckpt.path)
