"""Unit tests of psflow.wire.frame: the frame format, its validation, and zero-copy tensor views.

Pure: bytes in, values out, no sockets. The properties checked are the module's invariants: a frame
encoded from tensors decodes to the same tensor specs, and anything malformed, from any source, is
refused with a FrameError whose message names the problem (never another exception type).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psflow.errors import TransportError
from psflow.wire.frame import (
    DTYPES,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_NDIM,
    FrameError,
    Limits,
    TensorSpec,
    byte_view,
    decode_header,
    decode_meta,
    encode_head,
    io_view,
    tensor_specs,
)

torch.set_num_threads(1)

LIMITS = Limits()
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random values of ``dtype`` (no NaN, so torch.equal is a fair comparison)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, shape, generator=g, dtype=dtype)


def frame_bytes(op: int, named: list[tuple[str, torch.Tensor]], meta: dict | None = None) -> bytes:
    """A whole frame as the sender puts it on the wire: header + meta, then each tensor's bytes."""
    meta = dict(meta or {})
    meta["t"] = tensor_specs(named)
    views = [byte_view(t) for _, t in named]
    head = encode_head(op, meta, sum(v.nbytes for v in views))
    return head + b"".join(bytes(v) for v in views)


def meta_of(entries: object, **extra: object) -> bytes:
    return json.dumps({"t": entries, **extra}).encode()


# --- round trip ---------------------------------------------------------------------------------

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)
tensor_lists = st.lists(
    st.tuples(st.sampled_from(sorted(DTYPES)), shapes, st.integers(0, 2**31 - 1)),
    min_size=0,
    max_size=6,
)


@FAST
@given(entries=tensor_lists, op=st.integers(0, 0xFFFF),
       extra=st.dictionaries(st.text(max_size=8).filter(lambda k: k != "t"), st.integers() | st.text(max_size=8), max_size=3))
def test_encoded_tensors_decode_to_the_same_specs_and_bytes(
    entries: list[tuple[str, tuple[int, ...], int]], op: int, extra: dict[str, object]
) -> None:
    named = [(f"p{i}/{dt}", make_tensor(DTYPES[dt], shape, seed)) for i, (dt, shape, seed) in enumerate(entries)]
    wire = frame_bytes(op, named, extra)

    op_got, flags, meta_len, payload_len = decode_header(wire[:HEADER_SIZE], LIMITS)
    assert (op_got, flags) == (op, 0)
    assert payload_len == sum(t.numel() * t.element_size() for _, t in named)
    assert len(wire) == HEADER_SIZE + meta_len + payload_len

    meta, specs = decode_meta(wire[HEADER_SIZE : HEADER_SIZE + meta_len], payload_len, LIMITS)
    assert [(s.name, s.dtype, s.shape) for s in specs] == [(n, t.dtype, tuple(t.shape)) for n, t in named]
    assert {k: v for k, v in meta.items() if k != "t"} == extra

    # The payload is each tensor's raw bytes in order: rebuilding from it gives the same values.
    offset = HEADER_SIZE + meta_len
    for spec, (_, original) in zip(specs, named):
        chunk = bytearray(wire[offset : offset + spec.nbytes])
        offset += spec.nbytes
        rebuilt = torch.empty(spec.shape, dtype=spec.dtype)
        if spec.nbytes:
            byte_view(rebuilt)[:] = chunk
        assert torch.equal(rebuilt, original)
    assert offset == len(wire)


def test_zero_dim_scalar_and_empty_tensor_specs_keep_their_shapes() -> None:
    named = [("scalar", torch.tensor(3.5, dtype=torch.bfloat16)), ("empty", torch.zeros(0, 4, dtype=torch.int16))]
    wire = frame_bytes(7, named)
    _, _, meta_len, payload_len = decode_header(wire[:HEADER_SIZE], LIMITS)
    _, specs = decode_meta(wire[HEADER_SIZE : HEADER_SIZE + meta_len], payload_len, LIMITS)
    assert specs == [TensorSpec("scalar", torch.bfloat16, ()), TensorSpec("empty", torch.int16, (0, 4))]
    assert payload_len == 2  # one bfloat16, nothing for the empty one


def test_tensor_spec_nbytes_is_elements_times_itemsize() -> None:
    assert TensorSpec("a", torch.float64, (3, 4)).nbytes == 96
    assert TensorSpec("b", torch.bool, ()).nbytes == 1
    assert TensorSpec("c", torch.float32, (5, 0)).nbytes == 0


# --- header validation --------------------------------------------------------------------------


def test_wrong_magic_is_refused_and_quoted() -> None:
    data = HEADER.pack(b"GET ", 1, 0, 0, 0)
    with pytest.raises(FrameError, match=r"Not a psflow frame: magic b'GET '.*expected b'PSF1'"):
        decode_header(data, LIMITS)


def test_short_header_is_refused_with_its_length() -> None:
    with pytest.raises(FrameError, match=rf"header is 5 bytes; expected {HEADER_SIZE}"):
        decode_header(MAGIC + b"\x00", LIMITS)


def test_oversized_meta_is_refused_naming_size_and_limit() -> None:
    data = HEADER.pack(MAGIC, 1, 0, 101, 0)
    with pytest.raises(FrameError, match=r"meta of 101 bytes exceeds the limit of 100 bytes.*max_meta_bytes"):
        decode_header(data, Limits(max_meta_bytes=100))


def test_oversized_payload_is_refused_naming_size_limit_and_setting() -> None:
    data = HEADER.pack(MAGIC, 1, 0, 0, 2**64 - 1)
    with pytest.raises(FrameError, match=rf"payload of {2**64 - 1} bytes exceeds the limit of 1024 bytes.*max_payload_bytes"):
        decode_header(data, Limits(max_payload_bytes=1024))


def test_header_at_exactly_the_limits_is_accepted() -> None:
    data = HEADER.pack(MAGIC, 9, 3, 100, 1024)
    assert decode_header(data, Limits(max_meta_bytes=100, max_payload_bytes=1024)) == (9, 3, 100, 1024)


# --- meta validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("meta", "payload_len", "pattern"),
    [
        (b"{not json", 0, r"meta is not valid UTF-8 JSON"),
        (b"\xff\xfe{}", 0, r"meta is not valid UTF-8 JSON"),
        (b"[" * 100_000, 0, r"meta is not valid UTF-8 JSON"),  # nesting deeper than the parser's stack
        (b'{"a": ' + b"9" * 5000 + b"}", 0, r"meta is not valid UTF-8 JSON"),  # past Python's int digit limit
        (b"[1, 2]", 0, r"must be a JSON object; received list"),
        (b'"t"', 0, r"must be a JSON object; received str"),
        (meta_of({"a": 1}), 0, r"tensor list must be a list.*received dict"),
        (meta_of([["a", "float32"]]), 0, r"entry must be \[name, dtype, shape\]; received \['a', 'float32'\]"),
        (meta_of(["a"]), 0, r"entry must be \[name, dtype, shape\]"),
        (meta_of([["a", "float32", [1], 0]]), 0, r"entry must be \[name, dtype, shape\]"),
        (meta_of([["a", "complex64", [1]]]), 8, r"unknown dtype.*complex64.*Known dtypes"),
        (meta_of([["a", ["float32"], [1]]]), 4, r"unknown dtype"),
        (meta_of([["a", {"x": 1}, [1]]]), 4, r"unknown dtype"),
        (meta_of([[7, "float32", [1]]]), 4, r"bad name"),
        (meta_of([["w", "float32", [-1]]]), 0, r"Tensor 'w' has a bad shape \[-1\]"),
        (meta_of([["w", "float32", [1 << 40]]]), 0, rf"Tensor 'w' has a bad shape \[{1 << 40}\]"),
        (meta_of([["w", "float32", [True, 2]]]), 8, r"Tensor 'w' has a bad shape \[True, 2\]"),
        (meta_of([["w", "float32", [2.0]]]), 8, r"Tensor 'w' has a bad shape \[2.0\]"),
        (meta_of([["w", "float32", "2"]]), 8, r"Tensor 'w' has a bad shape '2'"),
        (meta_of([["w", "float32", [1] * (MAX_NDIM + 1)]]), 4, r"Tensor 'w' has a bad shape"),
        (meta_of([["w", "float32", [3]]]), 8, r"declares tensors of 12 bytes but a payload of 8 bytes"),
        (b"{}", 4, r"declares tensors of 0 bytes but a payload of 4 bytes"),
    ],
)
def test_malformed_meta_is_refused_with_a_message_naming_the_problem(meta: bytes, payload_len: int, pattern: str) -> None:
    with pytest.raises(FrameError, match=pattern):
        decode_meta(meta, payload_len, LIMITS)


def test_too_many_tensors_is_refused_naming_limit_and_count() -> None:
    entries = [[f"t{i}", "uint8", [0]] for i in range(4)]
    with pytest.raises(FrameError, match=r"at most 3 entries; received 4 entries"):
        decode_meta(meta_of(entries), 0, Limits(max_tensors=3))
    meta, specs = decode_meta(meta_of(entries), 0, Limits(max_tensors=4))
    assert len(specs) == 4


def test_huge_shape_that_overflows_int64_is_refused_by_name_not_a_crash() -> None:
    shape = [(1 << 40) - 1] * MAX_NDIM
    with pytest.raises(FrameError, match=r"Tensor 'w' has a shape .* whose dimensions multiply to \d+ bytes of float64"):
        decode_meta(meta_of([["w", "float64", shape]]), 0, LIMITS)


def test_empty_meta_means_no_tensors() -> None:
    assert decode_meta(b"", 0, LIMITS) == ({}, [])


# --- fuzz: only FrameError ever escapes ----------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)
near_entries = st.lists(
    st.lists(json_values | st.sampled_from(sorted(DTYPES)), min_size=0, max_size=4)
    | st.tuples(st.text(max_size=3), json_values | st.sampled_from(sorted(DTYPES)), json_values).map(list),
    max_size=3,
)


@FAST
@given(data=st.binary(min_size=0, max_size=64), payload_len=st.integers(0, 2**64 - 1))
def test_random_bytes_as_header_or_meta_only_ever_raise_frame_error(data: bytes, payload_len: int) -> None:
    for attempt in (
        lambda: decode_header(data, LIMITS),
        lambda: decode_header(MAGIC + data[: HEADER_SIZE - 4].ljust(HEADER_SIZE - 4, b"\0"), Limits(1024, 4096, 8)),
        lambda: decode_meta(data, payload_len, LIMITS),
    ):
        try:
            attempt()
        except FrameError:
            pass


@FAST
@given(raw_meta=json_values, entries=near_entries, payload_len=st.integers(0, 4096))
def test_random_json_meta_only_ever_raises_frame_error(raw_meta: object, entries: list, payload_len: int) -> None:
    for meta in (json.dumps(raw_meta).encode(), meta_of(entries), meta_of(raw_meta)):
        try:
            _, specs = decode_meta(meta, payload_len, LIMITS)
        except FrameError:
            continue
        # Accepted: then it really is consistent.
        assert sum(s.nbytes for s in specs) == payload_len
        assert all(s.dtype in DTYPES.values() and len(s.shape) <= MAX_NDIM for s in specs)


# --- byte_view and tensor_specs -----------------------------------------------------------------


VIEWS = [pytest.param(byte_view, id="byte_view"), pytest.param(io_view, id="io_view")]


@pytest.mark.parametrize("view_of", VIEWS)
@pytest.mark.parametrize(
    "tensor",
    [
        pytest.param(torch.arange(12.0).reshape(3, 4).t(), id="transposed"),
        pytest.param(torch.arange(10)[::2], id="strided-slice"),
        pytest.param(torch.zeros(2, 3, 4).permute(2, 0, 1), id="permuted"),
    ],
)
def test_byte_view_refuses_non_contiguous_tensors(view_of: Callable[[torch.Tensor], memoryview], tensor: torch.Tensor) -> None:
    with pytest.raises(TransportError, match=r"not contiguous; call \.contiguous\(\)"):
        view_of(tensor)
    assert view_of(tensor.contiguous()).nbytes == tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("view_of", VIEWS)
def test_byte_view_refuses_tensors_not_on_the_cpu(view_of: Callable[[torch.Tensor], memoryview]) -> None:
    with pytest.raises(TransportError, match=r"Tensor on meta cannot be sent directly; move it to the CPU"):
        view_of(torch.empty(3, device="meta"))


@pytest.mark.parametrize("view_of", VIEWS)
def test_byte_view_is_a_zero_copy_view_of_the_tensor_storage(view_of: Callable[[torch.Tensor], memoryview]) -> None:
    t = torch.zeros(4, dtype=torch.int32)
    view = view_of(t)
    view[4:8] = struct.pack("<i", 123456)
    assert t.tolist() == [0, 123456, 0, 0]


@pytest.mark.parametrize("view_of", VIEWS)
def test_byte_view_accepts_a_parameter_that_requires_grad_and_an_offset_view(
    view_of: Callable[[torch.Tensor], memoryview],
) -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    assert bytes(view_of(p)) == struct.pack("<2f", 1.0, -2.0)
    base = torch.arange(6, dtype=torch.int16)
    assert bytes(view_of(base[2:4])) == struct.pack("<2h", 2, 3)
    assert bytes(view_of(torch.tensor([True, False, True]))) == b"\x01\x00\x01"
    assert bytes(view_of(torch.tensor([1.5], dtype=torch.bfloat16))) == torch.tensor([1.5], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()


@pytest.mark.parametrize("view_of", VIEWS)
def test_byte_view_of_an_empty_tensor_is_empty(view_of: Callable[[torch.Tensor], memoryview]) -> None:
    assert view_of(torch.empty(0, 5)).nbytes == 0


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.uint16, torch.float8_e4m3fn])
def test_tensor_specs_refuses_unsupported_dtypes_naming_the_dtype(dtype: torch.dtype) -> None:
    t = torch.zeros(2, dtype=dtype)
    with pytest.raises(TransportError, match=rf"Tensor 'grad/w' has dtype {dtype}, which psflow cannot send.*Supported"):
        tensor_specs([("ok", torch.zeros(1)), ("grad/w", t)])


def test_tensor_specs_describe_name_dtype_name_and_shape() -> None:
    assert tensor_specs([("a", torch.zeros(2, 0, dtype=torch.bool)), ("b", torch.tensor(1, dtype=torch.bfloat16))]) == [
        ["a", "bool", [2, 0]],
        ["b", "bfloat16", []],
    ]


def test_every_supported_dtype_has_a_matching_itemsize() -> None:
    for name, dtype in DTYPES.items():
        assert TensorSpec(name, dtype, (3,)).nbytes == 3 * torch.empty((), dtype=dtype).element_size()
    assert TensorSpec("s", torch.float64, ()).nbytes == 8  # a 0-dim spec is one element


def test_integers_past_64_bits_in_the_meta_arrive_exact():
    """orjson parses an integer past 64 bits as a float (hypothesis found -2**63 - 1 arriving as
    -9.223372036854776e+18): such meta is parsed by the standard library."""
    extra = {"low": -(2**63) - 1, "high": 2**64, "huge": -(10**30), "edge": 2**63, "text": "1234567890123456789012"}
    wire = frame_bytes(1, [], extra)
    _op, _flags, meta_len, payload_len = decode_header(wire[:HEADER_SIZE], LIMITS)
    meta, _specs = decode_meta(wire[HEADER_SIZE : HEADER_SIZE + meta_len], payload_len, LIMITS)
    assert {k: v for k, v in meta.items() if k != "t"} == extra
    assert all(type(meta[k]) is int for k in ("low", "high", "huge", "edge"))

