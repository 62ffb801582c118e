"""Gradient compression's codec (psflow.wire.compress): the setting's grammar, round trips of each
kind, top-k's error feedback (nothing a step leaves out is lost), and what the ps's decoder refuses
in a compressed push, with the message an operator reads."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from psflow.config import TrainConfig
from psflow.errors import ConfigError
from psflow.wire.compress import SAMPLED_ABOVE, Compression, GradientEncoder, cast_values, decode
from psflow.wire.frame import FrameError

# -- the setting -------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "kind", "ratio"), [
    ("none", "none", 1.0), ("fp16", "fp16", 1.0), ("BF16", "bf16", 1.0), ("topk:0.01", "topk", 0.01), ("topk:1", "topk", 1.0),
])
def test_the_compress_setting_parses_each_form(text: str, kind: str, ratio: float) -> None:
    assert Compression.parse(text) == Compression(kind, ratio)


@pytest.mark.parametrize(("text", "says"), [
    ("gzip", "Unknown compress setting 'gzip'."),
    ("topk", "Unknown compress setting 'topk'."),
    ("topk:0", "the top-k ratio must be a number in (0, 1]; received '0'."),
    ("topk:1.5", "the top-k ratio must be a number in (0, 1]; received '1.5'."),
    ("topk:nan", "the top-k ratio must be a number in (0, 1]; received 'nan'."),
    ("fp16:0.5", "Unknown compress setting 'fp16:0.5'."),
])
def test_a_bad_compress_setting_is_refused_naming_the_allowed_forms(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)) as e:
        TrainConfig(compress=text)
    assert "Allowed: none, fp16, bf16, topk:RATIO" in str(e.value)


def test_compress_pull_needs_a_half_precision() -> None:
    assert TrainConfig(compress="bf16", compress_pull=True).compress_pull
    with pytest.raises(ConfigError, match=re.escape("compress='topk:0.1' does not have. Use compress fp16 or bf16")):
        TrainConfig(compress="topk:0.1", compress_pull=True)


def test_compression_is_refused_for_allreduce() -> None:
    with pytest.raises(ConfigError, match=re.escape("compress='fp16' applies to --strategy ps")):
        TrainConfig(compress="fp16", strategy="allreduce", mode="sync")


# -- round trips -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_half_precision_halves_the_bytes_and_round_trips_within_its_precision(kind: str) -> None:
    g = torch.randn(64, 33)
    sent = GradientEncoder(Compression.parse(kind)).encode([("w", g)])
    assert sent[0][1].nbytes == g.nbytes // 2
    dense = decode(kind, dict(sent), {"w": torch.zeros(64, 33)}, {})
    tol = 1e-3 if kind == "fp16" else 8e-3
    torch.testing.assert_close(dense["w"], g, rtol=tol, atol=tol)
    assert dense["w"].dtype == torch.float32


def test_topk_sends_the_largest_entries_and_their_positions() -> None:
    g = torch.tensor([[0.1, -5.0, 0.2], [3.0, 0.0, -0.3]])
    sent = dict(GradientEncoder(Compression.parse("topk:0.34")).encode([("w", g)]))  # ceil(0.34 * 6) = 3
    assert sorted(sent["w#i"].tolist()) == [1, 3, 5]
    dense = decode("topk", sent, {"w": torch.zeros(2, 3)}, {})["w"]
    assert torch.equal(dense, torch.tensor([[0.0, -5.0, 0.0], [3.0, 0.0, -0.3]]))


def test_decode_reuses_the_callers_buffers_and_clears_what_the_last_push_left() -> None:
    like = {"w": torch.zeros(10)}
    out: dict[str, torch.Tensor] = {}
    enc = GradientEncoder(Compression.parse("topk:0.1"))
    first = decode("topk", dict(enc.encode([("w", torch.arange(10.0))])), like, out)["w"]
    second = decode("topk", dict(enc.encode([("w", -torch.arange(10.0) * 100)])), like, out)["w"]
    assert first is second  # the same buffer
    assert torch.count_nonzero(second) == 1 and second[9] == -900.0


@settings(max_examples=40, deadline=None)
@given(numel=st.integers(1, 300), ratio=st.floats(0.001, 1.0), steps=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_topk_error_feedback_sends_the_whole_gradient_over_steps(numel: int, ratio: float, steps: int, seed: int) -> None:
    """What every step sent plus the residual the worker keeps equals the sum of the true gradients."""
    gen = torch.Generator().manual_seed(seed)
    enc = GradientEncoder(Compression("topk", ratio))
    like = {"p": torch.zeros(numel)}
    true_sum, sent_sum = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64)
    for _ in range(steps):
        g = torch.randn(numel, generator=gen)
        true_sum += g.double()
        frame = dict(enc.encode([("p", g)]))
        assert frame["p#i"].numel() == Compression("topk", ratio).k_of(numel)
        sent_sum += decode("topk", frame, like, {})["p"].double()
    torch.testing.assert_close(sent_sum + enc.residuals["p"].double(), true_sum, rtol=0, atol=1e-4)


def test_topk_with_ratio_1_sends_everything_and_keeps_no_residual() -> None:
    g = torch.randn(4, 5)
    enc = GradientEncoder(Compression.parse("topk:1"))
    dense = decode("topk", dict(enc.encode([("w", g)])), {"w": torch.zeros(4, 5)}, {})["w"]
    torch.testing.assert_close(dense, g, rtol=0, atol=0)
    assert torch.count_nonzero(enc.residuals["w"]) == 0


def test_pulled_values_are_cast_to_the_asked_precision_and_ints_stay() -> None:
    out = dict(cast_values([("w", torch.ones(3)), ("n", torch.ones(2, dtype=torch.int64))], "bfloat16"))
    assert out["w"].dtype == torch.bfloat16 and out["n"].dtype == torch.int64
    with pytest.raises(FrameError, match=re.escape("A pull asks for values in 'float64'; a ps sends them in float16")):
        cast_values([("w", torch.ones(3))], "float64")


# -- what the ps refuses -----------------------------------------------------------------------

LIKE = {"w": torch.zeros(2, 5)}


def topk_frame(idx: list[int], vals: list[float], *, idx_dtype: torch.dtype = torch.int32) -> dict[str, torch.Tensor]:
    return {"w#i": torch.tensor(idx, dtype=idx_dtype), "w#v": torch.tensor(vals, dtype=torch.float32)}


@pytest.mark.parametrize(("frame", "says"), [
    (topk_frame([0, 10], [1.0, 2.0]),
     "Top-k gradient 'w' has index 10, out of range for a parameter of 10 elements (indices must be in 0..9)."),
    (topk_frame([-1, 2], [1.0, 2.0]),
     "Top-k gradient 'w' has index -1, out of range for a parameter of 10 elements (indices must be in 0..9)."),
    (topk_frame([0, 1, 2], [1.0, 2.0]),
     "Top-k gradient 'w' has indices of shape [3] and values of shape [2]; expected two 1-D tensors of the same length."),
    (topk_frame(list(range(10)) + [0], [1.0] * 11),
     "Top-k gradient 'w' has 11 entries; its parameter has only 10 elements."),
    ({"w#i": torch.tensor([0]), "w#v": torch.tensor([1.0], dtype=torch.float64)},
     "Top-k gradient 'w' has indices of torch.int64 and values of torch.float64; expected int32 (or int64) indices"),
    ({"w#i": torch.tensor([0.0]), "w#v": torch.tensor([1.0])},
     "Top-k gradient 'w' has indices of torch.float32 and values of torch.float32"),
    ({"w#v": torch.tensor([1.0])},
     "A topk push does not carry the tensors of this shard's parameters (missing ['w#i'], unexpected [])."),
    ({"w": torch.zeros(2, 5)},
     "A topk push does not carry the tensors of this shard's parameters (missing ['w#i', 'w#v'], unexpected ['w'])."),
])
def test_a_bad_topk_push_is_refused_naming_the_tensor_and_the_value(frame: dict[str, torch.Tensor], says: str) -> None:
    with pytest.raises(FrameError, match=re.escape(says)):
        decode("topk", frame, LIKE, {})


def test_a_half_precision_push_of_the_wrong_dtype_or_shape_is_refused() -> None:
    with pytest.raises(FrameError, match=re.escape(
            "Gradient 'w' of a fp16 push is float32 of shape [2, 5]; expected float16 of shape [2, 5].")):
        decode("fp16", {"w": torch.zeros(2, 5)}, LIKE, {})
    with pytest.raises(FrameError, match=re.escape(
            "Gradient 'w' of a bf16 push is bfloat16 of shape [10]; expected bfloat16 of shape [2, 5].")):
        decode("bf16", {"w": torch.zeros(10, dtype=torch.bfloat16)}, LIKE, {})


def test_an_unknown_compression_kind_is_refused_saying_which_are_known() -> None:
    with pytest.raises(FrameError, match=re.escape("A push names compress='zstd'; this ps decodes fp16, bf16, topk.")):
        decode("zstd", {}, LIKE, {})


def test_topk_of_a_large_gradient_sends_about_k_of_the_largest_and_keeps_the_rest() -> None:
    """Above SAMPLED_ABOVE entries the threshold comes from a sample: about k entries, at most 2k,
    every one sent at least as large as every one kept, and nothing lost over steps."""
    numel, ratio = SAMPLED_ABOVE * 3, 0.01
    k = Compression("topk", ratio).k_of(numel)
    enc = GradientEncoder(Compression("topk", ratio))
    gen = torch.Generator().manual_seed(5)
    true_sum, sent_sum = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64)
    for _ in range(3):
        g = torch.randn(numel, generator=gen)
        true_sum += g.double()
        acc = g + enc.residuals.get("p", torch.zeros(numel))
        frame = dict(enc.encode([("p", g)]))
        sent = frame["p#i"].long()
        assert k // 2 <= sent.numel() <= 2 * k
        kept = torch.ones(numel, dtype=torch.bool)
        kept[sent] = False
        assert acc[sent].abs().min() >= acc[kept].abs().max()
        sent_sum += decode("topk", frame, {"p": torch.zeros(numel)}, {})["p"].double()
    torch.testing.assert_close(sent_sum + enc.residuals["p"].double(), true_sum, rtol=0, atol=1e-4)
