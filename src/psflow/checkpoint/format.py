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
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from psflow.errors import CheckpointError, ConfigError
from psflow.validation import checked

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


_RECORD_FIX = "A record comes from write_shard; pass it on unchanged (ShardRecord.to_dict / ShardRecord.from_dict)."


@checked(what="A shard record", error_class=CheckpointError, fix=_RECORD_FIX)
@pydantic_dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid"))
class ShardRecord:
    """What one ps task reports to the chief after writing its shard file (each field's
    description says what it holds). ``file`` is always ``shard-{k:05d}-of-{n:05d}.safetensors``,
    so a record can never point elsewhere."""

    shard: int = Field(ge=0, description="index k of the shard, 0 <= k < num_shards")
    num_shards: int = Field(ge=1, description="number of shards n of the checkpoint")
    file: str = Field(description="the shard's file name, relative to the checkpoint directory")
    sha256: str = Field(pattern=rf"^{_SHA256_RE.pattern}$", description="64 lowercase hex digits: the whole file's digest")
    size_bytes: int = Field(ge=0, description="the size of the file")
    tensor_names: tuple[str, ...] = Field(description="the names of the tensors in the file, in the order given")

    @field_validator("tensor_names", mode="before")
    @classmethod
    def _as_tuple(cls, names: object) -> object:
        return tuple(names) if isinstance(names, Sequence) and not isinstance(names, str) else names

    @model_validator(mode="after")
    def _consistent(self) -> ShardRecord:
        problem = None
        expected = shard_file_name(self.shard, self.num_shards)
        if self.shard >= self.num_shards:
            problem = f"shard must be an int in [0, {self.num_shards}), received {self.shard!r}"
        elif self.file != expected:
            problem = f"file must be {expected!r} for shard {self.shard}, received {self.file!r}"
        elif len(set(self.tensor_names)) != len(self.tensor_names):
            dupes = sorted({n for n in self.tensor_names if self.tensor_names.count(n) > 1})
            problem = f"tensor_names repeats {dupes!r}"
        if problem is not None:
            raise CheckpointError(f"A shard record: {problem}. {_RECORD_FIX}")
        return self

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
        return cls(**data)



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

