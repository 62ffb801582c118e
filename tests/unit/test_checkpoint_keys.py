"""Tests of psflow.checkpoint.keys: the one naming scheme of a training state's tensors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psflow.checkpoint.keys import (
    StateKey,
    ema_key,
    opt_key,
    opt_key_of,
    parse_key,
    split_state,
)
from psflow.errors import CheckpointError

names = st.text(min_size=1, max_size=12)  # a parameter's name may hold '/', '#', ':' ...
slots = st.text(min_size=1, max_size=8).filter(lambda s: "/" not in s)


@settings(max_examples=200, deadline=None)
@given(name=names, slot=slots)
def test_built_keys_parse_back_to_what_built_them(name: str, slot: str) -> None:
    assert parse_key(opt_key(name, slot)) == StateKey("opt", name, slot)
    assert parse_key(ema_key(name)) == StateKey("ema", name)
    assert parse_key(opt_key(name, slot)).key == opt_key(name, slot)
    assert parse_key(ema_key(name)).key == ema_key(name)


@settings(max_examples=200, deadline=None)
@given(name=names.filter(lambda n: not n.startswith(("opt/", "ema/"))))
def test_any_other_name_is_a_value(name: str) -> None:
    assert parse_key(name) == StateKey("value", name)
    assert parse_key(name).key == name


def test_the_scheme_on_disk_is_spelled_as_before() -> None:
    # Checkpoints written by earlier releases must keep restoring: the spelling is a format.
    assert opt_key("w#0:392", "exp_avg") == "opt/w#0:392/exp_avg"
    assert ema_key("fc.weight") == "ema/fc.weight"
    assert parse_key("opt/a/b/step") == StateKey("opt", "a/b", "step")  # the slot follows the last '/'


@pytest.mark.parametrize("key, expected", [
    ("opt/w", "opt/<name>/<slot>"),
    ("opt//step", "opt/<name>/<slot>"),
    ("opt/w/", "opt/<name>/<slot>"),
    ("ema/", "ema/<name>"),
    ("", "non-empty str"),
])
def test_a_malformed_key_is_refused_with_the_key_and_the_expected_form(key: str, expected: str) -> None:
    with pytest.raises(CheckpointError) as caught:
        parse_key(key)
    assert repr(key) in str(caught.value) and expected in str(caught.value)


@pytest.mark.parametrize("build", [
    lambda: opt_key("w", "a/b"),
    lambda: opt_key("w", ""),
    lambda: opt_key("", "step"),
    lambda: ema_key(""),
    lambda: opt_key_of("no_slot"),
])
def test_a_key_that_would_not_parse_back_is_never_built(build) -> None:
    with pytest.raises(CheckpointError, match="Received|cannot be named|not <name>/<slot>"):
        build()


def test_split_state_sorts_by_kind_in_the_optimizers_flat_form() -> None:
    tensors = {"w": 1, opt_key_of("w/momentum_buffer"): 2, "opt/w/step": 3, "ema/w": 4, "b": 5}

    values, slots, averages = split_state(tensors)

    assert values == {"w": 1, "b": 5}
    assert slots == {"w/momentum_buffer": 2, "w/step": 3}
    assert averages == {"w": 4}
    with pytest.raises(CheckpointError, match="'opt/w'"):
        split_state({"opt/w": 0})


def test_renamed_keeps_the_kind_and_slot_for_a_piece() -> None:
    assert parse_key("opt/w/exp_avg").renamed("w#0:4").key == "opt/w#0:4/exp_avg"
    assert parse_key("ema/w").renamed("w#4:8").key == "ema/w#4:8"
