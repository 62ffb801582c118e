"""Reading checkpoints: list, verify, load; only a whole checkpoint is ever restored from.

A checkpoint is whole when its manifest parses, matches its own checksum and names a real
directory, and every shard file is a regular file whose size and sha256 match the manifest.
:func:`latest_checkpoint` skips one that is not (with one warning naming the bad files) and tries
the previous one; ``strict=True`` refuses to report "no checkpoint" when every one is corrupt.

Callers: the Supervisor at start (restore), the evaluator, ``psflow checkpoints``/``export``,
and :mod:`psflow.checkpoint.writer` when pruning."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from psflow.checkpoint.files import sha256_file
from psflow.checkpoint.format import (
    CHECKSUM_KEY,
    FINAL_RE,
    FORMAT,
    MANIFEST_NAME,
    PARTIAL_RE,
    TRASH_RE,
    VERSION,
    ShardRecord,
    check_unique_names,
    checkpoint_root,
    is_int,
    is_url,
    manifest_checksum,
)
from psflow.errors import CheckpointError, ConfigError

# One logger for the whole package: users configure "psflow.checkpoint", not its modules.
_log = logging.getLogger("psflow.checkpoint")

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
        if not is_int(shard) or not 0 <= shard < self.num_shards:
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
        check_unique_names(self.shards, f"checkpoint {self.path}")
        tensors: dict[str, torch.Tensor] = {}
        for record in self.shards:
            tensors.update(self.load_shard(record.shard))
        return tensors


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Returns the final checkpoint directories under ``root``, newest step first.

    ``.partial`` directories and other entries are ignored; nothing is verified here.
    A missing ``root`` has no checkpoints. Under a URL root, the published ones (with a manifest).
    """
    if is_url(root):
        from psflow.checkpoint import remote

        return remote.list_checkpoints(str(root))  # type: ignore[return-value]
    root_path = checkpoint_root(root)
    if not root_path.exists():
        return []
    found = []
    for entry in root_path.iterdir():
        match = FINAL_RE.fullmatch(entry.name)
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
        digest, _ = sha256_file(path)
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
    if PARTIAL_RE.fullmatch(directory.name) or TRASH_RE.fullmatch(directory.name):
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
    named = FINAL_RE.fullmatch(directory.name)
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


def looks_whole(directory: Path) -> bool:
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
    if is_url(path):  # verified in a local copy, as any checkpoint
        from psflow.checkpoint import remote

        path = remote.fetch(str(path))
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
    if is_url(root):
        from psflow.checkpoint import remote

        found, skipped_urls = remote.latest(str(root), _open_verified, report)
        if found is None and strict and skipped_urls:
            raise NoWholeCheckpointError(root, skipped_urls)  # type: ignore[arg-type]
        return found
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

