"""Sharded checkpoints: the on-disk format, the rules that make a checkpoint whole, and export.

Layout under a checkpoint root::

    ROOT/ckpt-{step:010d}/shard-{k:05d}-of-{n:05d}.safetensors   one file per ps shard
    ROOT/ckpt-{step:010d}/manifest.json                          written last, by the chief

Invariants (each, and why: ``docs/design/checkpoints.md``):

- A checkpoint is *whole* only if its final directory exists, its manifest matches its own checksum
  and every shard file's size and sha256 match the manifest; nothing else is ever restored from.
- Every file of a checkpoint is a regular file inside its directory (a symlink is refused).
- Nothing is written in place: shards and the manifest are fsynced temporary files renamed into
  ``ckpt-{step}.partial/``, renamed to its final name last; a crash leaves the earlier checkpoints
  and a ``.partial`` directory, never a checkpoint that looks whole and is not.
- Tensor names are opaque to the format and unique in a checkpoint (:mod:`psflow.checkpoint.keys`).

One concept per module: ``format`` (names, the manifest's checksum, :class:`ShardRecord`),
``files`` (durable writes), ``writer`` (:func:`write_shard`, :func:`commit`), ``reader``
(:func:`latest_checkpoint`), ``keys``, ``assembly`` (a run's manifest meta, whole tensors from
pieces), ``export`` (one safetensors file), ``remote`` (a URL root, through fsspec).

Callers: every ps writes its own shard (:func:`write_shard`) and sends its :class:`ShardRecord` to
the chief, which calls :func:`commit` once every shard reported; the Supervisor restores
(:func:`load_whole_tensors`); ``psflow export`` calls :func:`export_checkpoint`.
"""

from __future__ import annotations

from psflow.checkpoint.assembly import (
    assemble_pieces,
    load_whole_tensors,
    run_meta,
    state_dict_from,
)
from psflow.checkpoint.export import (
    CHECKPOINTS_DIR,
    export_checkpoint,
    export_state_dict,
    find_checkpoint,
    find_root,
    write_tensors_file,
)
from psflow.checkpoint.format import (
    CHECKSUM_KEY,
    FORMAT,
    MANIFEST_NAME,
    VERSION,
    ShardRecord,
    is_url,
    manifest_checksum,
)
from psflow.checkpoint.reader import (
    Checkpoint,
    NoWholeCheckpointError,
    latest_checkpoint,
    list_checkpoints,
    read_checkpoint,
)
from psflow.checkpoint.remote import UrlPath
from psflow.checkpoint.writer import commit, write_shard

__all__ = [
    "CHECKPOINTS_DIR", "CHECKSUM_KEY", "FORMAT", "MANIFEST_NAME", "VERSION",
    "Checkpoint", "NoWholeCheckpointError", "ShardRecord", "UrlPath", "assemble_pieces", "commit", "is_url",
    "export_checkpoint", "export_state_dict", "find_checkpoint", "find_root", "latest_checkpoint", "list_checkpoints",
    "load_whole_tensors", "manifest_checksum", "read_checkpoint", "run_meta", "state_dict_from",
    "write_shard", "write_tensors_file",
]
