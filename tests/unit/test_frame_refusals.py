"""What the frame codec tells a user or an operator when it refuses something, and the lazy torch
tables: a JSON-only frame never imports torch (the launcher's side starts without it)."""

from __future__ import annotations

import re
import subprocess
import sys

import orjson
import pytest
import torch

from psflow.errors import TransportError
from psflow.wire import frame
from psflow.wire.frame import (
    HEADER,
    FrameError,
    Limits,
    byte_view,
    decode_header,
    decode_meta,
    encode_head,
    tensor_specs,
)


def test_the_dtype_tables_are_module_attributes_and_other_names_are_not() -> None:
    assert frame.DTYPES["float32"] is torch.float32
    assert frame.DTYPE_NAMES[torch.int64] == "int64"
    with pytest.raises(AttributeError, match=re.escape("module 'psflow.wire.frame' has no attribute 'dtypes'")):
        frame.dtypes  # noqa: B018


def test_a_frame_without_tensors_is_encoded_without_importing_torch() -> None:
    assert tensor_specs([]) == []
    code = ("import sys\nfrom psflow.wire.frame import tensor_specs, encode_head\n"
            "encode_head(1, {'t': tensor_specs([])}, 0)\nprint('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.stdout.strip() == "False", r.stderr


def test_a_foreign_protocol_is_named_as_such() -> None:
    data = HEADER.pack(b"HTTP", 1, 0, 0, 0)
    with pytest.raises(FrameError, match=re.escape(
            "Not a psflow frame: magic b'HTTP', expected b'PSF1'. "
            "Is something other than a psflow task talking to this port?")):
        decode_header(data, Limits())


def test_meta_that_is_not_json_is_quoted_up_to_64_bytes() -> None:
    data = b"\xff" + b"a" * 99
    with pytest.raises(FrameError) as e:
        decode_meta(data, 0, Limits())
    assert str(e.value).endswith(f"Received {data[:64]!r}...")


def test_a_tensor_named_twice_is_refused_saying_names_must_be_unique() -> None:
    meta = encode_head(1, {"t": [["a", "float32", [1]], ["a", "float32", [1]]]}, 8)[HEADER.size:]
    with pytest.raises(FrameError, match="^" + re.escape(
            "Frame names the same tensor twice; every tensor in a frame needs a unique name.") + "$"):
        decode_meta(meta, 8, Limits())


def test_a_non_contiguous_tensor_is_refused_saying_what_to_call() -> None:
    with pytest.raises(TransportError, match="^" + re.escape(
            "Tensor is not contiguous; call .contiguous() before sending.") + "$"):
        byte_view(torch.zeros(3, 2).t())


def test_meta_is_written_as_the_standard_library_would_where_orjson_differs() -> None:
    """orjson writes NaN as null, which a nullable field would take for 'not given': the standard
    library's NaN is kept (the receiver then refuses it by name); integers past 64 bits too."""
    from psflow.wire.frame import encode_meta

    assert encode_meta({}) == b"{}"
    assert encode_meta({"a": 1, "b": [1.5, "x"], 3: True}) == b'{"a":1,"b":[1.5,"x"],"3":true}'
    assert encode_meta({"timeout_s": float("nan")}) == b'{"timeout_s":NaN}'
    assert encode_meta({"position": None}) == b'{"position":null}'
    big = encode_meta({"seed": 2**70})
    assert big == b'{"seed":1180591620717411303424}'
    assert decode_meta(big, 0, Limits())[0] == {"seed": 2**70}  # parsed by the standard library's fallback
    assert decode_meta(b'{"timeout_s":NaN}', 0, Limits())[0]["timeout_s"] != 0  # NaN, refused later by the schema


def test_a_shape_whose_dimensions_overflow_is_refused_even_when_it_holds_no_element() -> None:
    """Issue 23 item 5: [0, 2**39, 2**39] declares 0 bytes, so it passed the payload check, and torch's
    stride calculation overflowed in the connection's thread (a RuntimeError with a traceback)."""
    meta = orjson.dumps({"t": [["w", "float32", [0, 2**39, 2**39]]]})
    with pytest.raises(FrameError, match=re.escape("Tensor 'w' has a shape [0, 549755813888, 549755813888] whose "
                                                   "dimensions multiply to")):
        decode_meta(meta, 0, Limits())
    assert decode_meta(orjson.dumps({"t": [["e", "float32", [0, 1000]]]}), 0, Limits())[1][0].shape == (0, 1000)


def test_an_empty_tensor_may_spread_as_far_as_the_payload_limit_and_not_a_byte_further() -> None:
    """Its dimensions other than the 0 multiply to at most the bytes a full tensor could hold."""
    limits = Limits(max_payload_bytes=4000)
    assert decode_meta(orjson.dumps({"t": [["w", "float32", [0, 1000]]]}), 0, limits)[1][0].shape == (0, 1000)
    assert decode_meta(orjson.dumps({"t": [["w", "int8", [4000, 0]]]}), 0, limits)[1][0].shape == (4000, 0)
    with pytest.raises(FrameError, match="^" + re.escape(
            "Tensor 'w' has a shape [0, 1001] whose dimensions multiply to 4004 bytes of float32, past the payload "
            "limit of 4000 bytes (Limits.max_payload_bytes), even where one is 0.") + "$"):
        decode_meta(orjson.dumps({"t": [["w", "float32", [0, 1001]]]}), 0, limits)
