"""Sharded checkpoints: the on-disk format, the rules that make a checkpoint whole, and export.

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
- Tensor names are opaque strings to the format and unique across a checkpoint; psflow's trainers
  name them by one scheme (:mod:`psflow.checkpoint.keys`).

The package, one concept per module:

- :mod:`~psflow.checkpoint.format`: names on disk, the manifest's checksum, :class:`ShardRecord`.
- :mod:`~psflow.checkpoint.files`: durable file writes (tmp file, fsync, rename, fsync the directory).
- :mod:`~psflow.checkpoint.writer`: :func:`write_shard` (every ps) and :func:`commit` (the chief).
- :mod:`~psflow.checkpoint.reader`: listing, verifying and loading (:func:`latest_checkpoint`).
- :mod:`~psflow.checkpoint.keys`: the tensor names of a training state (``opt/<name>/<slot>``, ``ema/<name>``).
- :mod:`~psflow.checkpoint.assembly`: a psflow run's checkpoint: its manifest meta, whole tensors from pieces.
- :mod:`~psflow.checkpoint.export`: one safetensors file out of a checkpoint (one durable writer).

Callers: every ps task calls :func:`write_shard` for its own shard, in its own process, in
parallel, and sends the returned :class:`ShardRecord` to the chief as JSON; the chief calls
:func:`commit` once every shard has reported; a (re)starting task calls :func:`latest_checkpoint`
and :meth:`Checkpoint.load_shard`; the Supervisor builds the manifest meta with :func:`run_meta` and
restores with :func:`load_whole_tensors`; ``psflow export`` calls :func:`export_checkpoint`. A
root that is a URL (``s3://...``) goes to :mod:`~psflow.checkpoint.remote` (fsspec: one object per
shard, the manifest written last, read back through a verified local copy); nothing else networks.
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
