"""The checkpoint format: names on disk, the manifest's checksum, and a shard's record.

Owns what a checkpoint *is* independent of reading or writing it: the directory and file names
(``ckpt-{step:010d}``, ``shard-{k:05d}-of-{n:05d}.safetensors``, ``manifest.json``), the manifest's
format tag and version, its self-checksum, and :class:`ShardRecord`, the JSON a ps sends the chief.

Invariants: a record's ``file`` is always the canonical shard file name (it can never point
elsewhere); tensor names are unique within a checkpoint (:func:`check_unique_names`); the manifest
checksum is over canonical JSON, so it is of the content, not of the file's layout.

Callers: :mod:`psflow.checkpoint.writer` and :mod:`psflow.checkpoint.reader`; the chief rebuilds
records with :meth:`ShardRecord.from_dict`."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psflow.errors import CheckpointError, ConfigError

FORMAT = "psflow-checkpoint"
# Version 2 added ``manifest_sha256``: version 1 manifests had no checksum of their own.
VERSION = 2
MANIFEST_NAME = "manifest.json"
CHECKSUM_KEY = "manifest_sha256"

# `{step:010d}` gives exactly 10 digits, or more without a leading zero.
_STEP = r"(\d{10}|[1-9]\d{10,})"
FINAL_RE = re.compile(rf"ckpt-{_STEP}")
PARTIAL_RE = re.compile(rf"ckpt-{_STEP}\.partial")
TRASH_RE = re.compile(rf"ckpt-{_STEP}\.trash-[0-9a-f]+")
SHARD_FILE_RE = re.compile(r"shard-\d{5,}-of-\d{5,}\.safetensors")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_RECORD_KEYS = ("shard", "num_shards", "file", "sha256", "size_bytes", "tensor_names")



def dir_name(step: int) -> str:
    return f"ckpt-{step:010d}"


def shard_file_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard:05d}-of-{num_shards:05d}.safetensors"


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def manifest_checksum(manifest: Mapping[str, Any]) -> str:
    """The sha256 of a manifest's canonical JSON, without its own ``manifest_sha256`` entry.

    Canonical (sorted keys, no whitespace) so that the checksum is of the content, not of its
    layout in the file; Python's floats round-trip through JSON exactly.
    """
    body = {k: v for k, v in manifest.items() if k != CHECKSUM_KEY}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()



def is_url(root: object) -> bool:
    """Whether a checkpoint root is a URL (``s3://bucket/run/checkpoints``: :mod:`psflow.checkpoint.remote`)
    rather than a local directory."""
    return isinstance(root, str) and "://" in root


def checkpoint_root(root: str | os.PathLike[str]) -> Path:
    path = Path(root)
    if path.exists() and not path.is_dir():
        raise ConfigError(
            f"The checkpoint root is not a directory. Received: {str(path)!r}. "
            "Pass a directory (it is created if missing)."
        )
    return path


def check_step(step: object) -> None:
    if not is_int(step) or step < 0:  # type: ignore[operator]
        raise ConfigError(f"step must be an int >= 0. Received: {step!r}.")



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
        if not is_int(self.num_shards) or self.num_shards < 1:
            return f"num_shards must be an int >= 1, received {self.num_shards!r}"
        if not is_int(self.shard) or not 0 <= self.shard < self.num_shards:
            return f"shard must be an int in [0, {self.num_shards}), received {self.shard!r}"
        expected = shard_file_name(self.shard, self.num_shards)
        if self.file != expected:
            return f"file must be {expected!r} for shard {self.shard}, received {self.file!r}"
        if not isinstance(self.sha256, str) or not _SHA256_RE.fullmatch(self.sha256):
            return f"sha256 must be 64 lowercase hex digits, received {self.sha256!r}"
        if not is_int(self.size_bytes) or self.size_bytes < 0:
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



def check_unique_names(records: Sequence[ShardRecord], where: str) -> None:
    owner: dict[str, int] = {}
    for record in records:
        for name in record.tensor_names:
            if name in owner:
                raise CheckpointError(
                    f"Tensor name {name!r} is in both shard {owner[name]} and shard "
                    f"{record.shard} of {where}. Every tensor must live on exactly one shard."
                )
            owner[name] = record.shard

