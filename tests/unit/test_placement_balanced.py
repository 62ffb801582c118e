"""The default placement (``balanced``): equal bytes per shard, model order kept, and the imbalance check.

The bound every test holds the placement to: no shard holds more than its fair share
(``total / num_shards``) plus the largest unit that may not be cut (a row of a cuttable tensor, or
a whole tensor that is not cuttable: one row, no dims, or at most ``split_bytes`` bytes).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from psflow.config import PLACEMENTS, TrainConfig
from psflow.ps.placement import (
    BALANCED_SPLIT_BYTES,
    DEFAULT_STRATEGY,
    STRATEGIES,
    ParamInfo,
    Placement,
    assemble,
    imbalance,
    imbalance_message,
    place,
    split_tensor,
)

# examples/mnist_cnn.py's CNN and examples/mnist_softmax.py's regression, as named_parameters() lists them.
CNN = [
    ParamInfo("conv1.weight", (32, 1, 5, 5)), ParamInfo("conv1.bias", (32,)),
    ParamInfo("conv2.weight", (64, 32, 5, 5)), ParamInfo("conv2.bias", (64,)),
    ParamInfo("fc1.weight", (512, 3136)), ParamInfo("fc1.bias", (512,)),
    ParamInfo("fc2.weight", (10, 512)), ParamInfo("fc2.bias", (10,)),
]
SOFTMAX = [ParamInfo("w", (784, 10)), ParamInfo("b", (10,))]


def largest_unit(params: list[ParamInfo], split_bytes: int | None) -> int:
    """The largest piece ``balanced`` may not cut: a row of a cuttable tensor, else a whole tensor."""
    min_cut = BALANCED_SPLIT_BYTES if split_bytes is None else split_bytes
    units = [
        p.nbytes // p.shape[0] if p.shape and p.shape[0] >= 2 and p.nbytes > min_cut else p.nbytes
        for p in params
    ]
    return max(units, default=0)


def assert_balanced(pl: Placement, split_bytes: int | None = None) -> None:
    loads = pl.shard_bytes()
    # max load <= total / n + unit, in integers
    assert max(loads) * pl.num_shards <= sum(loads) + pl.num_shards * largest_unit(list(pl.params), split_bytes)


def test_balanced_is_the_default_of_the_config_and_of_place() -> None:
    assert TrainConfig().placement == DEFAULT_STRATEGY == "balanced"
    assert PLACEMENTS == STRATEGIES  # config.py keeps its own copy (no torch import there)
    assert place(CNN, 2) == place(CNN, 2, strategy="balanced")


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("params", [CNN, SOFTMAX], ids=["cnn", "softmax"])
def test_the_seeds_models_are_balanced_within_one_row(params: list[ParamInfo], num_shards: int) -> None:
    pl = place(params, num_shards)
    assert_balanced(pl)
    assert imbalance(pl) is None


def test_the_cnn_on_two_shards_splits_fc1_once_and_keeps_model_order() -> None:
    pl = place(CNN, 2)
    assert [(p.key, p.shard) for p in pl.pieces] == [
        ("conv1.weight", 0), ("conv1.bias", 0), ("conv2.weight", 0), ("conv2.bias", 0),
        ("fc1.weight#0:249", 0), ("fc1.weight#249:512", 1),
        ("fc1.bias", 1), ("fc2.weight", 1), ("fc2.bias", 1),
    ]
    assert pl.shard_bytes() == [3_331_840, 3_321_640]  # round_robin: [6_651_008, 2_472]


def test_a_tensor_at_most_split_bytes_stays_whole_on_the_shard_of_its_midpoint() -> None:
    params = [ParamInfo("a", (100,)), ParamInfo("b", (100,)), ParamInfo("c", (100,))]
    pl = place(params, 2)  # 400 B each, below BALANCED_SPLIT_BYTES: like contiguous
    assert [(p.key, p.shard) for p in pl.pieces] == [("a", 0), ("b", 1), ("c", 1)]
    cut = place(params, 2, split_bytes=0)
    assert [(p.key, p.shard) for p in cut.pieces] == [("a", 0), ("b#0:50", 0), ("b#50:100", 1), ("c", 1)]
    assert cut.shard_bytes() == [600, 600]


def test_one_shard_holds_every_tensor_whole() -> None:
    pl = place(CNN, 1, split_bytes=0)
    assert all(p.rows is None and p.shard == 0 for p in pl.pieces)


def test_a_tensor_with_rows_larger_than_a_shard_leaves_a_shard_empty_rather_than_break_order() -> None:
    pl = place([ParamInfo("w", (2, 100))], 3, split_bytes=0)
    assert [(p.key, p.shard) for p in pl.pieces] == [("w#0:1", 0), ("w#1:2", 2)]


shapes = st.lists(st.integers(1, 6), min_size=0, max_size=2).flatmap(
    lambda rest: st.integers(0, 40).map(lambda d0: (d0, *rest))
) | st.just(())


@settings(max_examples=200, deadline=None)
@given(
    shape_list=st.lists(shapes, min_size=1, max_size=8),
    num_shards=st.integers(1, 6),
    split_bytes=st.one_of(st.none(), st.integers(0, 300)),
    dtype=st.sampled_from(["float32", "float16", "float64"]),
)
def test_balanced_bounds_every_shard_keeps_model_order_and_assembles(
    shape_list: list[tuple[int, ...]], num_shards: int, split_bytes: int | None, dtype: str
) -> None:
    params = [ParamInfo(f"p{i}", s, dtype) for i, s in enumerate(shape_list)]
    pl = place(params, num_shards, split_bytes=split_bytes)
    assert_balanced(pl, split_bytes)
    # Shards follow model order (the last layers on the last shard: they can leave during backward)...
    shards = [p.shard for p in pl.pieces]
    assert shards == sorted(shards)
    # ...and only the tensors a cut falls in are split: at most num_shards - 1 extra pieces.
    assert len(pl.pieces) <= len(params) + num_shards - 1
    full = {p.name: torch.randn(p.shape) for p in params}
    pieces = {p.key: split_tensor(full[p.param], p) for p in pl.pieces}
    out = assemble(params, pieces, pl)
    assert all(torch.equal(out[n], full[n]) for n in full)


def test_imbalance_names_the_heavy_shard_under_round_robin_on_the_cnn() -> None:
    pl = place(CNN, 2, strategy="round_robin")
    shard, share = imbalance(pl)  # type: ignore[misc]
    assert shard == 0 and share > 0.99
    assert imbalance_message(pl, "round_robin") == (
        "Unbalanced ps shards: ps:0 holds 6,651,008 of the 6,653,480 parameter bytes (99.96%; a fair share with 2 ps "
        "is 50.0%) under --placement round_robin, so it does most of the work while the other ps wait. Use --placement "
        "balanced (the default), which cuts the model into equal byte runs and splits the large tensors they fall in; "
        "keep round_robin only for TensorFlow's layout.")


def test_imbalance_under_the_default_says_the_tensors_cannot_be_cut_finer() -> None:
    pl = place([ParamInfo("emb", (1, 100_000)), ParamInfo("b", (10,))], 2)  # one row: no cut balances it
    assert [(p.key, p.shard) for p in pl.pieces] == [("emb", 0), ("b", 1)]
    assert imbalance_message(pl, "balanced") == (
        "Unbalanced ps shards: ps:0 holds 400,000 of the 400,040 parameter bytes (99.99%; a fair share with 2 ps is "
        "50.0%) under --placement balanced, so it does most of the work while the other ps wait. Its tensors cannot "
        "be cut finer (one row, or at most split_bytes bytes): use fewer ps, or lower split_bytes.")


@pytest.mark.parametrize("params", [CNN, SOFTMAX], ids=["cnn", "softmax"])
@pytest.mark.parametrize("num_shards", [2, 3, 4])
def test_no_imbalance_under_the_default(params: list[ParamInfo], num_shards: int) -> None:
    assert imbalance_message(place(params, num_shards), "balanced") is None


def test_no_imbalance_with_one_shard_or_a_model_of_a_few_kib() -> None:
    assert imbalance(place(CNN, 1, strategy="round_robin")) is None
    tiny = place([ParamInfo("w", (64, 64)), ParamInfo("b", (64,))], 2, strategy="round_robin")  # 16 KiB on ps:0
    assert tiny.shard_bytes()[0] > 1.5 * sum(tiny.shard_bytes()) / 2
    assert imbalance(tiny) is None


def test_an_uncuttable_tensor_under_the_default_says_why_and_what_to_change() -> None:
    pl = place([ParamInfo("table", (1, 1 << 20)), ParamInfo("b", (4,))], 2)
    message = imbalance_message(pl, "balanced")
    assert message is not None and "ps:0 holds" in message
    assert "cannot be cut finer" in message and "use fewer ps" in message


def _loads(*elements: int) -> Placement:
    """A round-robin placement whose shard i holds one float32 vector of ``elements[i]`` elements."""
    return place([ParamInfo(f"p{i}", (n,)) for i, n in enumerate(elements)], len(elements), strategy="round_robin")


def test_imbalance_flags_more_than_1_5_times_the_fair_share_and_at_least_64_kib_beyond_it() -> None:
    assert imbalance(_loads(49152, 16384)) is None  # 192 KiB against a fair 128 KiB: exactly 1.5 times, not more
    assert imbalance(_loads(32768, 0)) == (0, 1.0)  # 128 KiB against a fair 64 KiB: exactly 64 KiB beyond it
    assert imbalance(_loads(25000, 0)) is None  # all of a 100 kB model: 50 kB beyond its share, too few to matter
    assert imbalance(_loads(32768)) is None  # one shard holds its fair share, whatever it holds
    assert imbalance(_loads(0, 0)) is None  # no bytes at all


def test_imbalance_names_the_first_of_equally_heavy_shards() -> None:
    assert imbalance(_loads(32768, 32768, 0, 0)) == (0, 0.5)
