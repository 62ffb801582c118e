"""Frame format of the psflow wire protocol (pure: bytes in, values out; no sockets).

A frame is::

    header  = struct "<4sHHIQ": magic b"PSF1", op (uint16), flags (uint16), meta_len (uint32), payload_len (uint64)
    meta    = meta_len bytes of UTF-8 JSON: an object; key "t" lists the tensors as [name, dtype, shape]
              (encoded and parsed by orjson: the meta of a small request is most of its cost in Python)
    payload = payload_len bytes: the raw bytes of each tensor in "t" order, C-contiguous, little-endian

Invariants: nothing is unpickled; the sum of the tensors' sizes equals payload_len; every dtype is in
ITEMSIZE; meta_len and payload_len are bounded by :class:`Limits` before any byte of the body is read, so an
oversized frame is refused before memory is allocated for it. A handshake frame (before the peer has proved
the job's secret) carries no tensors and at most ``Limits.max_handshake_bytes`` of meta: an unauthenticated
peer cannot make a task allocate more than that.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from psflow.errors import TransportError

if TYPE_CHECKING:
    import torch

MAGIC = b"PSF1"
HEADER = struct.Struct("<4sHHIQ")
HEADER_SIZE = HEADER.size

# dtype name on the wire -> bytes per element. torch itself is imported only when a frame carries
# tensors, so that processes which exchange JSON-only frames (the launcher) start without it.
ITEMSIZE: dict[str, int] = {
    "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
MAX_NDIM = 8
_JSON = json.JSONEncoder(separators=(",", ":"))  # orjson's fallback: integers past 64 bits
_ORJSON_OPTS = orjson.OPT_NON_STR_KEYS  # {1: x} -> {"1": x}, as the standard library writes it


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """Wire dtype name -> torch dtype (imports torch on first use)."""
    import torch

    return {name: getattr(torch, name) for name in ITEMSIZE}


@functools.cache
def dtype_names() -> dict[torch.dtype, str]:
    """torch dtype -> wire dtype name."""
    return {v: k for k, v in torch_dtypes().items()}


def __getattr__(name: str) -> Any:
    """``DTYPES`` and ``DTYPE_NAMES``: the two tables above, built (with torch) on first access."""
    if name == "DTYPES":
        return torch_dtypes()
    if name == "DTYPE_NAMES":
        return dtype_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class FrameError(TransportError):
    """A frame violates the protocol; the connection that sent it is closed."""

    kind = "refused"  # the ERROR reply's kind; a route's admission may refuse as its handler would (StaleTermError)


@dataclass(frozen=True)
class Limits:
    """Bounds on what a peer may send. Every limit is a field so tests and users can set it."""

    max_meta_bytes: int = 1 << 20
    max_payload_bytes: int = 8 << 30
    max_tensors: int = 100_000
    max_handshake_bytes: int = 4096  # meta of a handshake frame (HELLO, AUTH, AUTH_OK: a few hundred bytes)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor described in a frame's meta."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[dtype_names()[self.dtype]]


def tensor_specs(tensors: Sequence[tuple[str, torch.Tensor]]) -> list[list[Any]]:
    """Describe tensors for the meta's "t" key."""
    out = []
    names = dtype_names() if tensors else {}
    for name, t in tensors:
        if t.dtype not in names:
            raise TransportError(
                f"Tensor {name!r} has dtype {t.dtype}, which psflow cannot send. "
                f"Supported: {sorted(ITEMSIZE)}. Cast it (e.g. .float()) before sending."
            )
        out.append([name, names[t.dtype], list(t.shape)])
    return out


def encode_head(op: int, meta: dict[str, Any], payload_len: int, flags: int = 0) -> bytes:
    """Header plus meta bytes of a frame. The tensors' bytes follow separately (zero copy)."""
    meta_bytes = encode_meta(meta)
    return HEADER.pack(MAGIC, op, flags, len(meta_bytes), payload_len) + meta_bytes


def encode_meta(meta: dict[str, Any]) -> bytes:
    """A frame's meta as compact UTF-8 JSON, as the standard library writes it: orjson, unless the
    result holds a null (orjson writes NaN and infinities so; the standard library writes them as
    NaN and Infinity, which the receiver then refuses by name) or an integer past 64 bits."""
    if not meta:
        return b"{}"
    try:
        out = orjson.dumps(meta, option=_ORJSON_OPTS)
    except orjson.JSONEncodeError:
        return _JSON.encode(meta).encode()
    return out if b"null" not in out else _JSON.encode(meta).encode()


def decode_header(data: bytes, limits: Limits, *, handshake: bool = False) -> tuple[int, int, int, int]:
    """Validate a header. Returns (op, flags, meta_len, payload_len). Raises FrameError.

    With ``handshake`` (the peer has not proved the job's secret yet) the frame may carry no payload
    and at most ``limits.max_handshake_bytes`` of meta.
    """
    if len(data) != HEADER_SIZE:
        raise FrameError(f"Frame header is {len(data)} bytes; expected {HEADER_SIZE}.")
    magic, op, flags, meta_len, payload_len = HEADER.unpack(data)  # data: bytes or a view of the receive buffer
    if magic != MAGIC:
        raise FrameError(
            f"Not a psflow frame: magic {magic!r}, expected {MAGIC!r}. "
            "Is something other than a psflow task talking to this port?"
        )
    if handshake:
        _check_handshake_sizes(meta_len, payload_len, limits)
    if meta_len > limits.max_meta_bytes:
        raise FrameError(f"Frame meta of {meta_len} bytes exceeds the limit of {limits.max_meta_bytes} bytes (Limits.max_meta_bytes).")
    if payload_len > limits.max_payload_bytes:
        raise FrameError(
            f"Frame payload of {payload_len} bytes exceeds the limit of {limits.max_payload_bytes} bytes "
            "(Limits.max_payload_bytes)."
        )
    return op, flags, meta_len, payload_len


def _check_handshake_sizes(meta_len: int, payload_len: int, limits: Limits) -> None:
    if payload_len:
        raise FrameError(
            f"A handshake frame carries no tensors; this one declares a payload of {payload_len} bytes. "
            "Nothing is received from a peer before it proves the job's secret."
        )
    if meta_len > limits.max_handshake_bytes:
        raise FrameError(
            f"Handshake frame meta of {meta_len} bytes exceeds the limit of {limits.max_handshake_bytes} bytes "
            "(Limits.max_handshake_bytes)."
        )


def decode_meta(data: bytes, payload_len: int, limits: Limits) -> tuple[dict[str, Any], list[TensorSpec]]:
    """Parse and validate a frame's meta against its payload length. Raises FrameError."""
    meta = _json_object(data)
    if "t" not in meta and not payload_len:
        return meta, []  # a small request or reply: nothing more to check
    specs = _parse_specs(meta.get("t", []), limits)
    total = sum(s.nbytes for s in specs)
    if total != payload_len:
        raise FrameError(f"Frame declares tensors of {total} bytes but a payload of {payload_len} bytes.")
    return meta, specs


def decode_small_meta(data: bytes | memoryview, limits: Limits) -> tuple[dict[str, Any], list[TensorSpec]]:
    """:func:`decode_meta` of a frame without payload (its tensors, if it lists any, are empty).
    Raises FrameError. ``data`` may be a view of the receive buffer: it is parsed, not kept."""
    meta = _json_object(data)
    if "t" not in meta:
        return meta, []
    meta, specs = decode_meta(bytes(data), 0, limits)
    meta.pop("t")
    return meta, specs


def decode_handshake_meta(data: bytes) -> dict[str, Any]:
    """Parse a handshake frame's meta: a JSON object that lists no tensors. Raises FrameError."""
    meta = _json_object(data)
    if "t" in meta:
        raise FrameError("A handshake frame carries no tensors; this one lists some. Prove the job's secret first.")
    return meta


# 19 digits in a row: maybe an integer past 64 bits, which orjson parses as a float (it loses digits).
_LONG_NUMBER = re.compile(rb"\d{19}")


def _json_object(data: bytes | memoryview) -> dict[str, Any]:
    # orjson: invalid UTF-8, NaN and deep nesting (past 1024 levels) are JSONDecodeError, a
    # ValueError; an integer past 64 bits it parses as a float, so meta with 19 digits in a row goes
    # to the standard library, which keeps every integer exact.
    if data == b"{}" or not data:
        return {}
    if _LONG_NUMBER.search(data):
        meta = _stdlib_json(data)
    else:
        try:
            meta = orjson.loads(data)
        except orjson.JSONDecodeError:
            meta = _stdlib_json(data)
    if not isinstance(meta, dict):
        raise FrameError(f"Frame meta must be a JSON object; received {type(meta).__name__}.")
    return meta


def _stdlib_json(data: bytes | memoryview) -> Any:
    """Meta orjson cannot parse exactly, parsed by the standard library, or a FrameError."""
    # ValueError covers JSONDecodeError and ints past Python's digit limit; RecursionError, deep nesting.
    try:
        return json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FrameError(f"Frame meta is not valid UTF-8 JSON: {e}. Received {bytes(data[:64])!r}...") from e


def _parse_specs(raw: Any, limits: Limits) -> list[TensorSpec]:
    if not isinstance(raw, list) or len(raw) > limits.max_tensors:
        received = f"{len(raw)} entries" if isinstance(raw, list) else type(raw).__name__
        raise FrameError(f"Frame tensor list must be a list of at most {limits.max_tensors} entries; received {received}.")
    specs = []
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 3):
            raise FrameError(f"Tensor entry must be [name, dtype, shape]; received {entry!r:.80}.")
        name, dtype, shape = entry
        if not isinstance(name, str) or not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise FrameError(f"Tensor entry has a bad name or an unknown dtype: {entry!r:.80}. Known dtypes: {sorted(ITEMSIZE)}.")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_NDIM
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < (1 << 40) for d in shape)
        ):
            raise FrameError(f"Tensor {name!r} has a bad shape {shape!r:.80}.")
        # An empty tensor's bytes pass any payload check, but torch still multiplies its other dimensions
        # (strides, storage size) in 64 bits: bound them by the payload limit, as a full tensor is.
        spread = math.prod(max(d, 1) for d in shape) * ITEMSIZE[dtype]
        if spread > limits.max_payload_bytes:
            raise FrameError(f"Tensor {name!r} has a shape {shape!r:.80} whose dimensions multiply to {spread} bytes "
                             f"of {dtype}, past the payload limit of {limits.max_payload_bytes} bytes "
                             "(Limits.max_payload_bytes), even where one is 0.")
        specs.append(TensorSpec(name, torch_dtypes()[dtype], tuple(shape)))
    if len({s.name for s in specs}) != len(specs):
        raise FrameError("Frame names the same tensor twice; every tensor in a frame needs a unique name.")
    return specs


def byte_view(t: torch.Tensor) -> memoryview:
    """A flat byte memoryview over a contiguous CPU tensor's storage (no copy)."""
    if t.device.type != "cpu":
        raise TransportError(f"Tensor on {t.device} cannot be sent directly; move it to the CPU first.")
    if not t.is_contiguous():
        raise TransportError("Tensor is not contiguous; call .contiguous() before sending.")
    if t.numel() == 0:
        return memoryview(b"")
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def io_view(t: torch.Tensor) -> memoryview:
    """:func:`byte_view` for one send or receive: the same bytes and checks in two cheap calls, but
    the view does not keep ``t`` alive, so the caller must hold ``t`` while the view is in use (a
    connection's send and receive do). Why: a frame's tensors are viewed right after megabytes
    went through the CPU's caches, where each of byte_view's torch calls costs ~5 us (20 us in
    all, against 3 us warm); this is 4 us there."""
    if not t.is_cpu or not t.is_contiguous():
        return byte_view(t)  # raises the error that says what to do
    n = t.nbytes
    if not n:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
