"""Placement rules as the module docstring states them, checked against small reference models of
each strategy over generated models, plus the table, the JSON refusals and assembly."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from psflow.errors import ConfigError
from psflow.ps.placement import ParamInfo, Piece, Placement, assemble, place

# ----------------------------------------------------------------------------- reference models


def _units(params: list[ParamInfo], num_shards: int, split_bytes: int | None) -> dict[str, list]:
    """Row ranges per parameter: split along dim 0 into min(num_shards, rows) nearly equal ranges."""
    out = {}
    for p in params:
        k = min(num_shards, p.shape[0]) if p.shape else 1
        if split_bytes is None or p.nbytes <= split_bytes or k < 2:
            out[p.name] = [None]
            continue
        sizes = [p.shape[0] // k + (1 if i < p.shape[0] % k else 0) for i in range(k)]
        starts = [sum(sizes[:i]) for i in range(k)]
        out[p.name] = [(s, s + n) for s, n in zip(starts, sizes)]
    return out


def _unit_bytes(p: ParamInfo, rows: tuple[int, int] | None) -> int:
    return p.nbytes if rows is None else p.nbytes // p.shape[0] * (rows[1] - rows[0])


def _reference_greedy(params, units, num_shards):
    """Largest first, each piece onto the shard with the fewest bytes so far (lowest index on ties),
    the pieces of one parameter on distinct shards."""
    loads = [0] * num_shards
    out = {}
    for p in sorted(params, key=lambda q: -q.nbytes):
        shards = []
        for rows in units[p.name]:
            s = min((s for s in range(num_shards) if s not in shards), key=lambda s: (loads[s], s))
            loads[s] += _unit_bytes(p, rows)
            shards.append(s)
        out[p.name] = shards
    return out


def _reference_contiguous(params, units, num_shards):
    """Model order cut into num_shards byte ranges: a parameter goes where its midpoint lies; the
    pieces of a split one on consecutive shards from there."""
    total = sum(p.nbytes for p in params) or 1
    out, done = {}, 0
    for p in params:
        home = min(num_shards - 1, math.floor((done + p.nbytes / 2) * num_shards / total))
        out[p.name] = [(home + i) % num_shards for i in range(len(units[p.name]))]
        done += p.nbytes
    return out


_DTYPES = ["float32", "float16", "int8", "float64"]


@st.composite
def _models(draw):
    n = draw(st.integers(1, 6))
    params = [ParamInfo(f"p{i}", tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))),
                        draw(st.sampled_from(_DTYPES))) for i in range(n)]
    return params, draw(st.integers(1, 4)), draw(st.one_of(st.none(), st.integers(0, 64)))


@settings(max_examples=60, deadline=None)
@given(_models(), st.sampled_from(["greedy", "contiguous"]))
def test_greedy_and_contiguous_follow_their_stated_rules(model, strategy) -> None:
    params, num_shards, split_bytes = model
    pl = place(params, num_shards, strategy=strategy, split_bytes=split_bytes)
    units = _units(params, num_shards, split_bytes)
    ref = (_reference_greedy if strategy == "greedy" else _reference_contiguous)(params, units, num_shards)
    assert [(pc.param, pc.rows, pc.shard) for pc in pl.pieces] == [
        (p.name, rows, s) for p in params for rows, s in zip(units[p.name], ref[p.name])]


def test_contiguous_puts_a_parameter_where_its_midpoint_lies() -> None:
    # 1 + 2 + 1 bytes over 2 shards: b spans bytes [1, 3), its midpoint 2 is the first byte of ps:1.
    params = [ParamInfo("a", (1,), "int8"), ParamInfo("b", (2,), "int8"), ParamInfo("c", (1,), "int8")]
    assert [p.shard for p in place(params, 2, strategy="contiguous").pieces] == [0, 1, 1]
    # A trailing empty parameter stays on the last shard: shards never decrease in model order.
    params = [ParamInfo("a", (4,)), ParamInfo("b", (4,)), ParamInfo("z", (0,))]
    assert [p.shard for p in place(params, 2, strategy="contiguous").pieces] == [0, 1, 1]


def test_greedy_counts_a_split_parameter_by_the_bytes_of_each_piece() -> None:
    # emb (3 rows) splits into 2 rows + 1 row: ps:0 gets 16 bytes, ps:1 gets 8, so b goes to ps:1.
    params = [ParamInfo("emb", (3, 2)), ParamInfo("b", (1,))]
    pl = place(params, 2, strategy="greedy", split_bytes=8)
    assert [(p.key, p.shard) for p in pl.pieces] == [("emb#0:2", 0), ("emb#2:3", 1), ("b", 1)]
    assert pl.shard_bytes() == [16, 12]


# ----------------------------------------------------------------------------- the placement value


def test_format_table_lists_each_piece_then_the_bytes_per_shard() -> None:
    pl = place([ParamInfo("emb", (3, 2)), ParamInfo("b", (2,), "float16")], 2, strategy="round_robin", split_bytes=8)
    assert pl.format_table() == (
        "parameter  shape   bytes  shard  rows\n"
        "emb        (2, 2)  16     ps:0   0:2\n"
        "emb        (1, 2)  8      ps:1   2:3\n"
        "b          (2,)    4      ps:0   all\n"
        "total: ps:0 20 bytes  ps:1 8 bytes"
    )


def test_a_placement_built_from_lists_equals_one_built_from_tuples() -> None:
    info, piece = ParamInfo("w", (2,)), Piece("w", 0)
    a, b = Placement(1, [info], [piece]), Placement(1, (info,), (piece,))  # type: ignore[arg-type]
    assert a == b and hash(a) == hash(b) and isinstance(a.params, tuple)


def test_asking_for_an_unknown_parameter_lists_the_known_ones() -> None:
    pl = place([ParamInfo("w", (2,))], 1)
    with pytest.raises(ConfigError, match=re.escape("Placement has no parameter 'z'. Known: ['w'].")):
        pl.param_info("z")


_GOOD = {"num_shards": 1, "params": [{"name": "w", "shape": [2], "dtype": "float32"}],
         "pieces": [{"param": "w", "shard": 0, "rows": None}]}


@pytest.mark.parametrize("d,message", [
    ([1], "Placement: the value must be a mapping (a JSON object); received [1]."),
    ({**_GOOD, "extra": 1}, "Placement has no setting 'extra' (received 1). Known: num_shards, params, pieces."),
    ({**_GOOD, "params": "w"}, "Placement: params must be a valid list; received 'w'."),
    ({**_GOOD, "pieces": 3}, "Placement: pieces must be a valid list; received 3."),
    ({**_GOOD, "params": [{"name": "w"}]}, "Placement: params[0].shape is required and missing. Also wrong: params[0].dtype."),
    ({**_GOOD, "params": [{"name": "w", "shape": 2, "dtype": "float32"}]}, "params[0].shape must be a valid list; received 2."),
    ({**_GOOD, "pieces": [{"param": "w"}]}, "Placement: pieces[0].shard is required and missing. Also wrong: pieces[0].rows."),
    ({**_GOOD, "pieces": [{"param": "w", "shard": 0, "rows": "0:2"}]}, "pieces[0].rows must be a valid list; received '0:2' ("),
    ({**_GOOD, "pieces": [{"param": "w", "shard": 0, "rows": [0, 1, 2]}]},
     "pieces[0].rows must hold at most 2 items; received [0, 1, 2] (null for the whole tensor, else [start, stop] of its rows)."),
    ({**_GOOD, "pieces": [{"param": "w", "shard": 0, "rows": [0, "2"]}]},
     "pieces[0].rows[1] must be a valid integer; received '2'"),
])
def test_from_dict_names_the_part_that_is_wrong(d: object, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        Placement.from_dict(d)  # type: ignore[arg-type]


def test_assemble_returns_a_whole_piece_as_is_and_glues_row_ranges_into_a_new_tensor() -> None:
    params = [ParamInfo("w", (2, 2)), ParamInfo("emb", (3, 2))]
    pl = place(params, 2, strategy="round_robin", split_bytes=16)
    w, emb = torch.ones(2, 2), torch.arange(6.0).reshape(3, 2)
    pieces = {"w": w, "emb#0:2": emb[0:2], "emb#2:3": emb[2:3]}
    out = assemble(params, pieces, pl)
    assert out["w"] is w and torch.equal(out["emb"], emb)
    one_range = Placement(1, (ParamInfo("v", (2,)),), (Piece("v", 0, (0, 2)),))
    v = torch.ones(2)
    assert assemble(one_range.params, {"v#0:2": v}, one_range)["v"] is not v


def test_assemble_of_a_parameter_the_placement_lacks_says_where_to_compute_it() -> None:
    pl = place([ParamInfo("w", (2,))], 1)
    with pytest.raises(ConfigError, match=re.escape(
            "Placement has no pieces of parameter 'z'. Compute the placement from the same model.")):
        assemble([ParamInfo("z", (2,))], {}, pl)
