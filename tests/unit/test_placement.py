"""Placement of parameters on ps shards: strategies, splitting, tables and serialization."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from psflow.errors import ConfigError
from psflow.ps.placement import (
    ParamInfo,
    Piece,
    Placement,
    assemble,
    place,
    split_tensor,
)

torch.set_num_threads(1)


def _vec(name: str, n: int) -> ParamInfo:
    return ParamInfo(name, (n,), "float32")


def test_from_module_lists_trainable_params_in_order_with_dtype_and_bytes() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2).half())
    model[0].bias.requires_grad_(False)
    infos = ParamInfo.from_module(model)
    assert [(p.name, p.shape, p.dtype) for p in infos] == [
        ("0.weight", (4, 3), "float32"),
        ("1.weight", (2, 4), "float16"),
        ("1.bias", (2,), "float16"),
    ]
    assert [p.nbytes for p in infos] == [48, 16, 4]
    assert infos[0].numel == 12


def test_round_robin_puts_ith_param_on_shard_i_mod_n() -> None:
    params = [_vec(f"p{i}", 10 * (i + 1)) for i in range(5)]
    placement = place(params, 2, strategy="round_robin")
    assert [(p.param, p.shard, p.rows) for p in placement.pieces] == [
        ("p0", 0, None), ("p1", 1, None), ("p2", 0, None), ("p3", 1, None), ("p4", 0, None),
    ]
    assert placement.shard_bytes() == [4 * (10 + 30 + 50), 4 * (20 + 40)]


def test_greedy_puts_largest_first_on_least_loaded_shard() -> None:
    params = [_vec("a", 10), _vec("b", 100), _vec("c", 50), _vec("d", 60), _vec("e", 10)]
    placement = place(params, 2, strategy="greedy")
    # b(400) -> 0; d(240) -> 1; c(200) -> 1 (240 < 400); a(40) -> 0 (400 < 440); e(40): 440 = 440,
    # tie -> lowest index 0. Pieces stay in model order.
    assert {p.param: p.shard for p in placement.pieces} == {"a": 0, "b": 0, "c": 1, "d": 1, "e": 0}
    assert [p.param for p in placement.pieces] == ["a", "b", "c", "d", "e"]
    assert placement.shard_bytes() == [480, 440]


def test_greedy_breaks_ties_by_lowest_shard_then_model_order() -> None:
    params = [_vec(f"p{i}", 8) for i in range(4)]
    placement = place(params, 3, strategy="greedy")
    assert [p.shard for p in placement.pieces] == [0, 1, 2, 0]


def test_large_param_is_split_into_nearly_equal_row_ranges_on_distinct_shards() -> None:
    params = [ParamInfo("emb", (10, 4)), ParamInfo("w", (4, 4)), ParamInfo("b", (4,))]
    placement = place(params, 3, strategy="round_robin", split_bytes=100)
    assert [(p.key, p.shard) for p in placement.pieces] == [
        ("emb#0:4", 0), ("emb#4:7", 1), ("emb#7:10", 2),
        # Pieces count as variables for round robin, as TF's partitioned variables do.
        ("w", 0), ("b", 1),
    ]
    assert placement.piece_shape(placement.pieces[1]) == (3, 4)


def test_split_uses_at_most_dim0_pieces_and_never_splits_a_single_row() -> None:
    params = [ParamInfo("tall", (2, 100)), ParamInfo("row", (1, 100)), ParamInfo("s", ())]
    placement = place(params, 4, strategy="round_robin", split_bytes=0)
    assert [p.key for p in placement.pieces_of("tall")] == ["tall#0:1", "tall#1:2"]
    assert [p.key for p in placement.pieces_of("row")] == ["row"]
    assert [p.key for p in placement.pieces_of("s")] == ["s"]


def test_greedy_split_pieces_go_to_distinct_least_loaded_shards() -> None:
    # "row" (160 B) cannot be split (one row), so it goes first, onto ps:0; big's three 40 B
    # pieces then take ps:1 and ps:2, and the last one ps:0, the only shard left without a piece.
    params = [ParamInfo("big", (3, 10)), ParamInfo("row", (1, 40))]
    placement = place(params, 3, strategy="greedy", split_bytes=50)
    assert {p.key: p.shard for p in placement.pieces} == {
        "big#0:1": 1, "big#1:2": 2, "big#2:3": 0, "row": 0,
    }
    assert placement.shard_bytes() == [200, 40, 40]
    assert [p.key for p in placement.pieces_on(0)] == ["big#2:3", "row"]  # in placement order
    assert [p.key for p in placement.pieces_on(2)] == ["big#1:2"]


shapes = st.lists(st.integers(1, 4), min_size=0, max_size=2).flatmap(
    lambda rest: st.integers(1, 12).map(lambda d0: (d0, *rest))
)


@settings(max_examples=60, deadline=None)
@given(
    shape_list=st.lists(shapes, min_size=1, max_size=5),
    num_shards=st.integers(1, 6),
    split_bytes=st.one_of(st.none(), st.integers(0, 200)),
    strategy=st.sampled_from(["round_robin", "greedy"]),
)
def test_split_pieces_cover_every_row_once_and_assemble_is_identity(
    shape_list: list[tuple[int, ...]], num_shards: int, split_bytes: int | None, strategy: str
) -> None:
    params = [ParamInfo(f"p{i}", s) for i, s in enumerate(shape_list)]
    placement = place(params, num_shards, strategy=strategy, split_bytes=split_bytes)
    full = {p.name: torch.randn(p.shape) for p in params}
    for info in params:
        pieces = placement.pieces_of(info.name)
        should_split = split_bytes is not None and info.nbytes > split_bytes and info.shape[0] >= 2
        expected_count = min(num_shards, info.shape[0]) if should_split else 1
        assert len(pieces) == expected_count
        if expected_count == 1:
            assert pieces[0].rows is None
        else:
            covered = [r for p in pieces for r in range(*p.rows)]
            assert covered == list(range(info.shape[0]))
            sizes = [p.rows[1] - p.rows[0] for p in pieces]
            assert max(sizes) - min(sizes) <= 1
        assert len({p.shard for p in pieces}) == len(pieces)
        assert all(0 <= p.shard < num_shards for p in pieces)
    split = {p.key: split_tensor(full[p.param], p) for p in placement.pieces}
    for piece in placement.pieces:
        assert tuple(split[piece.key].shape) == placement.piece_shape(piece)
    rebuilt = assemble(params, split, placement)
    assert list(rebuilt) == [p.name for p in params]
    for name, t in rebuilt.items():
        assert torch.equal(t, full[name])
    assert sum(placement.shard_bytes()) == sum(p.nbytes for p in params)


def test_split_tensor_is_a_view_of_the_full_tensor() -> None:
    t = torch.zeros(6, 2)
    view = split_tensor(t, Piece("w", 1, (2, 4)))
    view.fill_(1.0)
    assert t[:, 0].tolist() == [0, 0, 1, 1, 0, 0]


def test_split_tensor_rejects_a_tensor_with_too_few_rows() -> None:
    with pytest.raises(ConfigError, match=r"rows 2:4 of 'w'.*\(3, 2\)"):
        split_tensor(torch.zeros(3, 2), Piece("w", 1, (2, 4)))


def test_assemble_names_the_missing_piece_and_its_shard() -> None:
    placement = place([ParamInfo("emb", (4, 2))], 2, split_bytes=0)
    pieces = {"emb#0:2": torch.zeros(2, 2)}
    with pytest.raises(ConfigError, match=r"Missing piece 'emb#2:4' \(held by ps:1\)"):
        assemble(placement.params, pieces, placement)


def test_assemble_rejects_a_piece_of_the_wrong_shape() -> None:
    placement = place([ParamInfo("w", (4, 2))], 1)
    with pytest.raises(ConfigError, match=r"'w' has shape \(2, 2\), expected \(4, 2\)"):
        assemble(placement.params, {"w": torch.zeros(2, 2)}, placement)


def test_format_table_lists_every_piece_shard_and_per_shard_totals() -> None:
    params = [
        ParamInfo("embedding.weight", (10, 4)), ParamInfo("fc.weight", (4, 4)), _vec("fc.bias", 4)
    ]
    placement = place(params, 3, strategy="round_robin", split_bytes=100)
    table = placement.format_table()
    lines = table.splitlines()
    assert lines[0].split() == ["parameter", "shape", "bytes", "shard", "rows"]
    assert len(lines) == 1 + len(placement.pieces) + 1
    for p in params:
        assert p.name in table
    for shard in range(3):
        assert f"ps:{shard}" in lines[-1]
    assert "emb" in lines[2] and "ps:1" in lines[2] and "4:7" in lines[2] and "48" in lines[2]
    assert lines[-1] == "total: ps:0 128 bytes  ps:1 64 bytes  ps:2 48 bytes"


@settings(max_examples=40, deadline=None)
@given(
    shape_list=st.lists(shapes, min_size=1, max_size=4),
    num_shards=st.integers(1, 4),
    split_bytes=st.one_of(st.none(), st.integers(0, 100)),
    dtype=st.sampled_from(["float32", "float16", "bfloat16", "float64"]),
)
def test_to_dict_from_dict_round_trips_through_json(
    shape_list: list[tuple[int, ...]], num_shards: int, split_bytes: int | None, dtype: str
) -> None:
    params = [ParamInfo(f"layer{i}.weight", s, dtype) for i, s in enumerate(shape_list)]
    placement = place(params, num_shards, split_bytes=split_bytes)
    again = Placement.from_dict(json.loads(json.dumps(placement.to_dict())))
    assert again == placement


def _two_row_placement() -> dict:
    return place([ParamInfo("w", (4, 2))], 2, split_bytes=0).to_dict()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("pieces"), r"Placement: pieces is required and missing"),
        (lambda d: d.update(extra=1), r"Placement has no setting 'extra' \(received 1\)"),
        (lambda d: d.update(num_shards=0), r"num_shards must be an int >= 1.*Received: 0"),
        (lambda d: d["pieces"][1].update(shard=5), r"shard 5, outside \[0, 2\)"),
        (lambda d: d["pieces"][1].update(shard=0), r"distinct shards. Received shards: \[0, 0\]"),
        (lambda d: d["pieces"][1].update(rows=[1, 4]), r"cover rows \[0, 4\).*'w#1:4'"),
        (lambda d: d["pieces"][1].update(rows=[2, 3]), r"cover rows \[0, 4\).*'w#2:3'"),
        (lambda d: d["pieces"][0].update(param="v"), r"unknown parameter.*'v'"),
        (lambda d: d["pieces"].pop(), r"cover rows \[0, 4\)"),
        (lambda d: d["params"][0].update(dtype="float99"), r"dtype. Received: 'float99'"),
        (lambda d: d["params"][0].update(shape=[4, -1]), r"invalid shape. Received: \[4, -1\]"),
        (lambda d: d["pieces"][0].update(rows="0:2"), r"pieces\[0\].rows must be a valid list; received '0:2'"),
    ],
)
def test_from_dict_rejects_malformed_placements_with_the_value(mutate, message: str) -> None:
    d = _two_row_placement()
    mutate(d)
    with pytest.raises(ConfigError, match=message):
        Placement.from_dict(d)


def test_unknown_strategy_is_rejected_listing_the_allowed_ones() -> None:
    with pytest.raises(ConfigError, match=r"'fastest'.*\['balanced', 'round_robin', 'greedy', 'contiguous'\]"):
        place([_vec("a", 1)], 1, strategy="fastest")


@pytest.mark.parametrize("num_shards", [0, -1, 1.5, True])
def test_num_shards_below_one_or_not_an_int_is_rejected(num_shards) -> None:
    with pytest.raises(ConfigError, match=f"Received: {num_shards!r}"):
        place([_vec("a", 1)], num_shards)


def test_duplicate_parameter_names_are_rejected() -> None:
    with pytest.raises(ConfigError, match="Duplicate parameter name 'a'"):
        place([_vec("a", 1), _vec("a", 2)], 2)


def test_negative_split_bytes_is_rejected() -> None:
    with pytest.raises(ConfigError, match="split_bytes.*Received: -1"):
        place([_vec("a", 1)], 1, split_bytes=-1)


def test_contiguous_keeps_model_order_in_byte_balanced_runs():
    params = [ParamInfo(f"l{i}.weight", (10, 10)) for i in range(6)]
    pl = place(params, 3, strategy="contiguous")
    shards = [pl.pieces_of(p.name)[0].shard for p in params]
    assert shards == sorted(shards) == [0, 0, 1, 1, 2, 2]


def test_contiguous_places_a_split_parameter_on_distinct_shards():
    params = [ParamInfo("a", (2,)), ParamInfo("big", (9, 4)), ParamInfo("c", (2,))]
    pl = place(params, 3, strategy="contiguous", split_bytes=16)
    assert sorted(pc.shard for pc in pl.pieces_of("big")) == [0, 1, 2]


@pytest.mark.parametrize(("make", "message"), [
    (lambda: ParamInfo("", (2,)), "A parameter name must be a non-empty string. Received: ''."),
    (lambda: ParamInfo(3, (2,)), "A parameter name must be a non-empty string. Received: 3."),  # type: ignore[arg-type]
    (lambda: ParamInfo("w", "2x3"), "Parameter 'w' has an invalid shape. Received: '2x3'. Pass a sequence of non-negative ints."),  # type: ignore[arg-type]
    (lambda: ParamInfo("w", b"23"), "Parameter 'w' has an invalid shape. Received: b'23'."),  # type: ignore[arg-type]
    (lambda: ParamInfo("w", 6), "Parameter 'w' has an invalid shape. Received: 6."),  # type: ignore[arg-type]
    (lambda: ParamInfo("w", (2, True)), "Parameter 'w' has an invalid shape. Received: (2, True). Pass a sequence of non-negative ints."),
    (lambda: ParamInfo("w", (2.0,)), "Parameter 'w' has an invalid shape. Received: (2.0,)."),  # type: ignore[arg-type]
    (lambda: ParamInfo("w", (2,), torch.float32), "Unknown parameter dtype. Received: torch.float32. Use a torch dtype "  # type: ignore[arg-type]
     "name such as 'float32', 'float16' or 'bfloat16'."),
    (lambda: ParamInfo("w", (2,), "Tensor"), "Unknown parameter dtype. Received: 'Tensor'."),
    (lambda: place([("w", (2,))], 1), "place() takes ParamInfo objects. Received: ('w', (2,))."),  # type: ignore[list-item]
])
def test_a_bad_parameter_description_is_refused_with_the_value(make, message: str) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError) as refused:
        make()
    assert str(refused.value).startswith(message)


def test_a_parameter_of_zero_rows_or_no_dims_is_described_and_placed_whole() -> None:
    assert (ParamInfo("s", ()).numel, ParamInfo("s", ()).nbytes, ParamInfo("e", (0, 3)).nbytes) == (1, 4, 0)
    assert ParamInfo("h", (2, 3), "float16").nbytes == 12
    pl = place([ParamInfo("s", ()), ParamInfo("e", (0, 3))], 2, strategy="round_robin", split_bytes=0)
    assert [p.key for p in pl.pieces] == ["s", "e"]


@pytest.mark.parametrize("pieces", [
    [Piece("w", 0), Piece("w", 1, (0, 2))],  # whole and a range at once
    [Piece("s", 0, (0, 1)), Piece("s", 1, (1, 2))],  # rows of a tensor without dim 0
])
def test_pieces_mixing_whole_and_rows_or_rows_of_a_scalar_are_refused(pieces: list[Piece]) -> None:
    params = (ParamInfo("w", (2, 2)),) if pieces[0].param == "w" else (ParamInfo("s", ()),)
    with pytest.raises(ConfigError, match=re.escape(
            f"Parameter {params[0].name!r} of shape {params[0].shape} has inconsistent pieces: {[p.key for p in pieces]}. "
            "Use one whole piece or row ranges covering dim 0.")):
        Placement(2, params, tuple(pieces))


def test_a_placement_refuses_a_parameter_without_pieces_and_a_piece_of_an_unknown_one() -> None:
    with pytest.raises(ConfigError, match=re.escape("Placement has no piece of parameter 'b'.")):
        Placement(1, (ParamInfo("w", (2,)), ParamInfo("b", (2,))), (Piece("w", 0),))
    with pytest.raises(ConfigError, match=re.escape(
            "Placement has a piece of an unknown parameter. Received: Piece(param='v', shard=0, rows=None). "
            "Known parameters: ['b', 'w'].")):
        Placement(1, (ParamInfo("w", (2,)), ParamInfo("b", (2,))), (Piece("w", 0), Piece("b", 0), Piece("v", 0)))
    with pytest.raises(ConfigError, match=re.escape("Piece 'w' is on shard True, outside [0, 2).")):
        Placement(2, (ParamInfo("w", (2,)),), (Piece("w", True),))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=re.escape("Piece 'w' is on shard 2, outside [0, 2).")):
        Placement(2, (ParamInfo("w", (2,)),), (Piece("w", 2),))


@pytest.mark.parametrize("rows", [[(0, 0), (0, 2)], [(0, 1), (1, 2.0)]])
def test_an_empty_or_non_int_row_range_is_refused(rows) -> None:  # noqa: ANN001
    pieces = tuple(Piece("w", i, r) for i, r in enumerate(rows))
    with pytest.raises(ConfigError, match=re.escape("Pieces of 'w' must cover rows [0, 2) in order, each once.")):
        Placement(2, (ParamInfo("w", (2, 3)),), pieces)


def test_a_piece_keeps_its_rows_as_a_tuple_whatever_it_was_given() -> None:
    piece = Piece("w", 0, [0, 2])  # type: ignore[arg-type]  # as JSON gives them
    assert piece.rows == (0, 2) and hash(piece) == hash(Piece("w", 0, (0, 2)))


def test_split_tensor_takes_the_last_rows_and_refuses_a_scalar() -> None:
    t = torch.arange(4.0)
    assert split_tensor(t, Piece("w", 1, (2, 4))).tolist() == [2.0, 3.0]
    with pytest.raises(ConfigError, match=re.escape(
            "Cannot take rows 0:1 of 'w': the tensor has shape (). Pass the full tensor that the placement was computed for.")):
        split_tensor(torch.tensor(1.0), Piece("w", 0, (0, 1)))
