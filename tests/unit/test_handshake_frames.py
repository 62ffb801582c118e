"""Frames before the peer has proved the job's secret (HELLO, AUTH, AUTH_OK): no payload, no tensors,
at most ``Limits.max_handshake_bytes`` of meta, checked from the header alone; and the meta of a frame
without payload (``decode_small_meta``), the path of every small request."""

from __future__ import annotations

import re

import pytest
import torch

from psflow.wire.frame import (
    HEADER,
    MAGIC,
    FrameError,
    Limits,
    decode_handshake_meta,
    decode_header,
    decode_small_meta,
)


def whole(message: str) -> str:
    """A pattern that matches ``message`` and nothing around it."""
    return "^" + re.escape(message) + "$"


def header(meta_len: int, payload_len: int, op: int = 5, flags: int = 0) -> bytes:
    return HEADER.pack(MAGIC, op, flags, meta_len, payload_len)


def test_a_handshake_header_may_not_declare_a_payload_however_small() -> None:
    with pytest.raises(FrameError, match=whole(
            "A handshake frame carries no tensors; this one declares a payload of 1 bytes. "
            "Nothing is received from a peer before it proves the job's secret.")):
        decode_header(header(10, 1), Limits(), handshake=True)
    assert decode_header(header(10, 1), Limits()) == (5, 0, 10, 1)  # after the handshake: any payload in the limits


def test_a_handshake_meta_is_bounded_by_its_own_limit_not_the_frames() -> None:
    limits = Limits(max_meta_bytes=1 << 20, max_handshake_bytes=100)
    assert decode_header(header(100, 0, op=2, flags=1), limits, handshake=True) == (2, 1, 100, 0)
    with pytest.raises(FrameError, match=whole(
            "Handshake frame meta of 101 bytes exceeds the limit of 100 bytes (Limits.max_handshake_bytes).")):
        decode_header(header(101, 0), limits, handshake=True)
    assert decode_header(header(101, 0), limits) == (5, 0, 101, 0)


def test_a_handshake_header_still_obeys_the_frame_limits() -> None:
    limits = Limits(max_meta_bytes=50, max_handshake_bytes=100)
    with pytest.raises(FrameError, match=whole("Frame meta of 60 bytes exceeds the limit of 50 bytes (Limits.max_meta_bytes).")):
        decode_header(header(60, 0), limits, handshake=True)


def test_a_handshake_meta_is_a_json_object_listing_no_tensors() -> None:
    assert decode_handshake_meta(b'{"task":"worker:0","cnonce":"c"}') == {"task": "worker:0", "cnonce": "c"}
    assert decode_handshake_meta(b"") == {}
    with pytest.raises(FrameError, match=whole(
            "A handshake frame carries no tensors; this one lists some. Prove the job's secret first.")):
        decode_handshake_meta(b'{"task":"worker:0","t":[]}')
    with pytest.raises(FrameError, match=whole("Frame meta must be a JSON object; received list.")):
        decode_handshake_meta(b"[1]")


def test_small_meta_without_tensors_is_returned_as_is() -> None:
    data = b'{"op":"pull","keys":[1,2]}'
    assert decode_small_meta(data, Limits()) == ({"op": "pull", "keys": [1, 2]}, [])
    assert decode_small_meta(memoryview(b"x" + data)[1:], Limits()) == ({"op": "pull", "keys": [1, 2]}, [])


def test_small_meta_may_list_empty_tensors_and_the_list_is_taken_out_of_the_meta() -> None:
    data = b'{"v":3,"t":[["a","float32",[0]],["b","int64",[2,0]]]}'
    meta, specs = decode_small_meta(memoryview(data), Limits())
    assert meta == {"v": 3}
    assert [(s.name, s.dtype, s.shape) for s in specs] == [("a", torch.float32, (0,)), ("b", torch.int64, (2, 0))]


def test_small_meta_listing_a_tensor_with_bytes_is_refused_it_has_no_payload() -> None:
    with pytest.raises(FrameError, match=whole("Frame declares tensors of 12 bytes but a payload of 0 bytes.")):
        decode_small_meta(b'{"t":[["a","float32",[3]]]}', Limits())
    with pytest.raises(FrameError, match=whole("Frame tensor list must be a list of at most 1 entries; received 2 entries.")):
        decode_small_meta(b'{"t":[["a","float32",[0]],["b","float32",[0]]]}', Limits(max_tensors=1))
