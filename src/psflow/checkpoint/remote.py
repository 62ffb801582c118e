"""Checkpoints under a URL (``s3://bucket/run/checkpoints``, any fsspec filesystem): the same format,
the same rule that a checkpoint is whole only once its manifest is.

:func:`psflow.checkpoint.write_shard`, :func:`~psflow.checkpoint.commit`,
:func:`~psflow.checkpoint.list_checkpoints`, :func:`~psflow.checkpoint.latest_checkpoint` and
:func:`~psflow.checkpoint.read_checkpoint` hand a URL root to this module; nothing else changes for
their callers (every ps writes its shard, the chief commits, a restarting task restores).

An object store has no rename, so the local layout's ``.partial`` directory cannot be published
whole. Here the manifest is the publication:

- each ps writes its shard as one object, ``ROOT/ckpt-{step}/shard-k-of-n.safetensors``: a PUT is
  whole or absent, never torn (a writer that dies mid-upload leaves nothing);
- the chief checks that every shard's object is there with its recorded size, then writes
  ``ROOT/ckpt-{step}/manifest.json``, last;
- a checkpoint exists only where its manifest does (:func:`list_checkpoints`); reading downloads it
  into a local cache and verifies it exactly as a local one (manifest checksum, every shard's size
  and sha256), so a shard replaced after the manifest (a rollback re-reaching the step, before its
  new manifest) reads as corrupt and the previous checkpoint is used;
- pruning deletes an old checkpoint's manifest first (it stops being one), then its shards.

Credentials and endpoints are fsspec's (for S3, s3fs reads ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY`` and ``AWS_ENDPOINT_URL``); ``pip install s3fs`` for ``s3://``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from psflow.checkpoint.format import FINAL_RE, MANIFEST_NAME, ShardRecord, dir_name, shard_file_name
from psflow.errors import CheckpointError, ConfigError


class UrlPath(str):
    """A checkpoint's URL, with the ``name`` a local checkpoint's Path has (``ckpt-0000000100``)."""

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]

    def __truediv__(self, other: str) -> UrlPath:
        return UrlPath(f"{self.rstrip('/')}/{other}")


# This process's filesystems, by scheme, process and environment. A new s3fs client costs far more
# than a 1 MB upload (a botocore session loads its service models; the first request opens its
# connections): a fresh one per call made a save of a few KB take seconds, 5-7 clients a save.
# fsspec's own cache keys on arguments only, not on the environment (AWS_ENDPOINT_URL, credentials)
# that s3fs reads, so the key holds the environment: one that changed gets a new client. The process
# id is in it because a forked child must not share its parent's event loop and connections.
_clients: dict[tuple[str, int, int], Any] = {}


def _fs(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` (this process's, for this environment) and the path inside it."""
    import fsspec

    key = (url.split("://", 1)[0], os.getpid(), hash(frozenset(os.environ.items())))
    fs = _clients.get(key)
    try:
        if fs is None:
            fs, _ = fsspec.core.url_to_fs(url, skip_instance_cache=True)
            for old in [k for k in _clients if k[1:] != key[1:]]:
                del _clients[old]  # an older environment's or a parent's: never used again
            _clients[key] = fs
        path = fs._strip_protocol(url)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"Cannot use the checkpoint root {url!r}: {e}. For s3:// install s3fs (pip install s3fs); "
                          "other schemes need their fsspec package.") from e
    return fs, path.rstrip("/")


def warm_up(root: str) -> None:
    """Start, in a daemon thread, what a task's first save under ``root`` would otherwise wait for:
    importing the filesystem's package (s3fs, botocore) and opening its client's connection (about
    1 s of a 0.03 MB checkpoint's first save took that; the later ones, 0.05 s). Failures are left
    to the save itself to report."""

    def connect() -> None:
        try:
            fs, path = _fs(root)
            fs.exists(path)
        except Exception as e:  # noqa: BLE001 (a warm-up only)
            import logging

            logging.getLogger("psflow.checkpoint").debug("warm-up of %s failed: %r", root, e)

    import threading

    threading.Thread(target=connect, name="psflow-checkpoint-warm-up", daemon=True).start()


def _join(url: str, *names: str) -> str:
    return "/".join([url.rstrip("/"), *names])


def write_shard(root: str, step: int, shard: int, num_shards: int, tensors: dict[str, torch.Tensor],
                header: dict[str, str], *, crash_after_bytes: int | None = None) -> ShardRecord:
    """One shard as one object under ``root`` (tensors and header already checked by the writer).

    Raises:
        CheckpointError: the upload failed (the message names the object), or the injected crash
            fired (nothing is uploaded: a writer killed mid-PUT leaves no object).
    """
    name = shard_file_name(shard, num_shards)
    url = _join(root, dir_name(step), name)
    try:
        data = save(tensors, metadata=header)
    except (RuntimeError, ValueError, TypeError) as e:
        raise CheckpointError(f"Could not serialise shard {shard} of step {step}: {e}.") from e
    if crash_after_bytes is not None:
        raise CheckpointError(f"injected crash after {crash_after_bytes} bytes of {url}")
    fs, path = _fs(url)
    try:
        fs.pipe_file(path, data)
    except Exception as e:  # noqa: BLE001 (each filesystem raises its own errors: botocore's, OSError, ...)
        raise CheckpointError(f"Could not write shard {shard} of step {step} to {url}: {type(e).__name__}: {e}. "
                              "Check the URL, the credentials and that the bucket exists.") from e
    return ShardRecord(shard, num_shards, name, hashlib.sha256(data).hexdigest(), len(data), tuple(tensors))


def publish(root: str, step: int, ordered: Sequence[ShardRecord], manifest: bytes, *, keep: int) -> UrlPath:
    """Publish the checkpoint of ``step`` (called by :func:`psflow.checkpoint.commit`, which checked the
    records and made the manifest): every shard object checked, then the manifest, written last.

    Raises:
        CheckpointError: a shard object is missing or of another size than its record; the upload failed.
    """
    final = UrlPath(_join(root, dir_name(step)))
    fs, path = _fs(final)
    fs.invalidate_cache()  # the shards were uploaded by the ps processes, not through this cache
    for r in ordered:
        try:
            size = fs.info(f"{path}/{r.file}")["size"]
        except FileNotFoundError:
            raise CheckpointError(f"Cannot commit step {step}: shard {r.shard} object {final / r.file} does not exist. "
                                  "The ps task that reported it must write it again.") from None
        if size != r.size_bytes:
            raise CheckpointError(f"Cannot commit step {step}: shard {r.shard} object {final / r.file} has {size} "
                                  f"bytes, its record says {r.size_bytes}. The ps task must write it again.")
    try:
        fs.pipe_file(f"{path}/{MANIFEST_NAME}", manifest)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"Could not commit the checkpoint of step {step} at {final}: {type(e).__name__}: {e}.") from e
    _prune(root, keep)
    return final


def list_checkpoints(root: str) -> list[UrlPath]:
    """The published checkpoints under ``root`` (those with a manifest), newest step first."""
    fs, path = _fs(root)
    fs.invalidate_cache()  # other processes (every ps, the chief) write here: no listing from a cache
    try:
        manifests = fs.glob(f"{path}/ckpt-*/{MANIFEST_NAME}")
    except FileNotFoundError:
        return []
    found = []
    for m in manifests:
        name = m.rstrip("/").split("/")[-2]
        match = FINAL_RE.fullmatch(name)
        if match:
            found.append((int(match.group(1)), UrlPath(_join(root, name))))
    return [url for _, url in sorted(found, reverse=True)]


def root_of(url: str, subdir: str) -> str:
    """The checkpoint root that ``url`` names: a URL logdir's ``subdir`` (``psflow run --logdir
    s3://...`` saves under ``<url>/checkpoints``) where that holds objects, else ``url`` itself (a
    ``--checkpoint-dir`` URL)."""
    fs, path = _fs(url)
    fs.invalidate_cache()
    try:
        return _join(url, subdir) if fs.isdir(f"{path}/{subdir}") else url.rstrip("/")
    except Exception as e:  # noqa: BLE001 (each filesystem raises its own errors: botocore's, OSError, ...)
        raise CheckpointError(f"Could not list {url}: {type(e).__name__}: {e}. Check the URL, the credentials "
                              "and that the bucket exists.") from e


def _prune(root: str, keep: int) -> None:
    fs, _ = _fs(root)
    for old in list_checkpoints(root)[keep:]:
        _, path = _fs(old)
        try:
            fs.rm_file(f"{path}/{MANIFEST_NAME}")  # first: from now on it is not a checkpoint
            fs.rm(path, recursive=True)
        except Exception as e:  # noqa: BLE001 (an old checkpoint left behind costs space, not correctness)
            import logging

            logging.getLogger("psflow.checkpoint").warning("Could not delete old checkpoint %s: %s.", old, e)


_fetched: list[Path] = []  # this process's downloads: only the newest is kept


def fetch(url: str) -> Path:
    """Download the checkpoint at ``url`` (its manifest first, then the shards it names) into a fresh
    private directory (``mkdtemp``: 0700, under ``$XDG_CACHE_HOME`` or the temp dir), to be verified
    like any local checkpoint; returns it. The process's earlier download is deleted.

    Raises:
        CheckpointError: it cannot be downloaded.
    """
    import json

    ckpt = UrlPath(url)
    base = os.environ.get("XDG_CACHE_HOME")
    if base:
        Path(base).mkdir(parents=True, exist_ok=True)
    local = Path(tempfile.mkdtemp(prefix="psflow-ckpt-", dir=base or None)) / ckpt.name
    local.mkdir()
    while _fetched:
        shutil.rmtree(_fetched.pop().parent, ignore_errors=True)
    _fetched.append(local)
    fs, path = _fs(ckpt)
    try:
        fs.get_file(f"{path}/{MANIFEST_NAME}", str(local / MANIFEST_NAME))
        names = [s.get("file") for s in json.loads((local / MANIFEST_NAME).read_text()).get("shards", [])]
        for name in names:
            if isinstance(name, str) and "/" not in name and name not in ("", ".", ".."):
                fs.get_file(f"{path}/{name}", str(local / name))
    except (FileNotFoundError, ValueError, AttributeError):
        pass  # what is missing or malformed shows in the verification, named, as locally
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"Could not download the checkpoint {url}: {type(e).__name__}: {e}.") from e
    return local


def latest(root: str, open_verified: Callable[[Path], tuple[Any, list[str]]],
           report: Callable[[str], None]) -> tuple[Any, list[tuple[str, list[str]]]]:
    """The newest whole checkpoint under ``root`` (downloaded, verified), and those skipped with why."""
    skipped: list[tuple[str, list[str]]] = []
    for url in list_checkpoints(root):
        ckpt, problems = open_verified(fetch(url))
        if ckpt is not None:
            return ckpt, skipped
        skipped.append((url, problems))
        report(f"Skipping checkpoint {url}: {'; '.join(problems)}. Falling back to the previous checkpoint.")
    return None, skipped
