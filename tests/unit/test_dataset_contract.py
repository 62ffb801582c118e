"""The contract of pf.data.Dataset and BatchIterator a user relies on: defaults, what is refused and
how the message says so, the saved position's format, and which saved positions a resume accepts."""

from __future__ import annotations

import re

import pytest
import torch

from psflow.data.dataset import BatchIterator, Dataset
from psflow.errors import ConfigError


def _ds(n: int = 10) -> Dataset:
    return Dataset(torch.arange(n * 2, dtype=torch.float32).reshape(n, 2), torch.arange(n))


def _all(it: BatchIterator) -> list[list[int]]:
    return [y.tolist() for _, y in it]


def test_dataset_names_both_types_when_either_is_not_a_tensor() -> None:
    with pytest.raises(ConfigError, match=r"needs torch tensors\. Received: x list, y Tensor\."):
        Dataset([1, 2], torch.arange(2))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"Received: x Tensor, y list\."):
        Dataset(torch.arange(2), [1, 2])  # type: ignore[arg-type]


def test_dataset_takes_one_dimensional_x_and_refuses_a_scalar_x() -> None:
    assert len(Dataset(torch.arange(3.0), torch.arange(3))) == 3
    with pytest.raises(ConfigError, match=r"x of shape \(N, \.\.\.\)"):
        Dataset(torch.tensor(1.0), torch.arange(1))


def test_repr_shows_count_dtypes_and_shape_without_the_torch_prefix() -> None:
    ds = Dataset(torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64))
    assert repr(ds) == "Dataset(n=4, x=float32[4, 3], y=int64[4])"


def test_shard_of_an_object_without_num_shards_is_refused_naming_what_is_needed() -> None:
    class HalfTask:
        shard_index = 0

    with pytest.raises(ConfigError, match=r"needs \(index, count\) or a task with shard_index and num_shards\. "
                                          r"Received: .*HalfTask.* and count=None\."):
        _ds().shard(HalfTask())


@pytest.mark.parametrize("index,count,message", [
    ("0", 2, "Shard index must be an integer. Received: '0'."),
    (0, 2.0, "Shard count must be an integer. Received: 2.0."),
    (True, 2, "Shard index must be an integer. Received: True."),
    (2, 2, "Shard index 2 of 2 is out of range. Use 0 <= index < count and count >= 1."),
    (0, 11, "Cannot split 10 examples into 11 shards: some would be empty. Use fewer workers or more data."),
])
def test_bad_shards_are_refused_with_the_value_and_what_to_do(index: object, count: object, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        _ds().shard(index, count)  # type: ignore[arg-type]


def test_defaults_are_one_shuffled_epoch_seed_0_keeping_the_last_partial_batch() -> None:
    ds = _ds(10)
    explicit = _all(BatchIterator(ds, 3, epochs=1, shuffle=True, seed=0, drop_last=False))
    assert _all(BatchIterator(ds, 3)) == explicit
    assert _all(ds.batches(3)) == explicit
    order = [i for batch in explicit for i in batch]
    assert len(explicit) == 4 and sorted(order) == list(range(10))
    assert order != list(range(10))  # shuffled


def test_batches_passes_its_settings_to_the_iterator() -> None:
    ds = _ds(10)
    assert _all(ds.batches(4, shuffle=False)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert _all(ds.batches(4, epochs=2, seed=5, drop_last=True)) == _all(
        BatchIterator(ds, 4, epochs=2, shuffle=True, seed=5, drop_last=True))


@pytest.mark.parametrize("kwargs,message", [
    ({"batch_size": 2.5}, "batch_size must be an integer. Received: 2.5."),
    ({"batch_size": 2, "epochs": "1"}, "epochs must be an integer. Received: '1'."),
    ({"batch_size": 2, "seed": None}, "seed must be an integer. Received: None."),
    ({"batch_size": 0}, ("batches() needs batch_size >= 1, epochs >= 1 and seed >= 0. "
                         "Received: batch_size=0, epochs=1, seed=0.")),
    ({"batch_size": 11, "drop_last": True}, ("batches(11, drop_last=True) of 10 examples yields no batch. "
                                             "Use a smaller batch_size or drop_last=False.")),
])
def test_bad_batch_settings_name_the_setting_and_value(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        _ds().batches(**kwargs)  # type: ignore[arg-type]


def test_state_dict_is_plain_ints_under_stable_names() -> None:
    """The position is saved in checkpoints: its keys are a file format."""
    it = _ds(5).batches(2, seed=3, shuffle=True, drop_last=True)
    next(it)
    assert it.state_dict() == {"epoch": 0, "batch_index": 1, "seed": 3, "batch_size": 2, "num_examples": 5,
                               "shuffle": 1, "drop_last": 1}
    assert _ds(5).batches(2, shuffle=False).state_dict()["shuffle"] == 0


def test_a_state_missing_keys_or_with_other_settings_is_refused_saying_what_to_pass() -> None:
    it = _ds().batches(2)
    with pytest.raises(ConfigError) as missing:
        it.load_state_dict({"epoch": 0, "seed": 0})
    assert str(missing.value) == ("Iterator state lacks ['batch_index', 'batch_size', 'drop_last', 'num_examples', 'shuffle']. "
                                  "Received: {'epoch': 0, 'seed': 0}. Pass a mapping returned by BatchIterator.state_dict().")
    with pytest.raises(ConfigError, match=re.escape("Iterator state 'epoch' must be an integer. Received: 'x'.")):
        it.load_state_dict({**it.state_dict(), "epoch": "x"})
    other = {**it.state_dict(), "seed": 9}
    with pytest.raises(ConfigError, match=re.escape(
            "Iterator state was saved with other settings: {name: (saved, this)} = {'seed': (9, 0)}. "
            "Create the iterator over the same shard with the same batch_size, seed, shuffle and drop_last.")):
        it.load_state_dict(other)


@pytest.mark.parametrize("epoch,batch_index,ok", [
    (0, 0, True), (1, 4, True), (2, 0, True),  # 2 epochs of 5 batches; (2, 0) is exhausted
    (1, 5, False), (2, 1, False), (3, 0, False), (-1, 0, False), (0, -1, False),
])
def test_resume_accepts_exactly_the_positions_the_iterator_can_be_in(epoch: int, batch_index: int, ok: bool) -> None:
    it = _ds().batches(2, epochs=2)
    state = {**it.state_dict(), "epoch": epoch, "batch_index": batch_index}
    if ok:
        it.load_state_dict(state)
        assert len(_all(it)) == (2 - epoch) * 5 - batch_index
    else:
        with pytest.raises(ConfigError, match=re.escape(
                f"Iterator position (epoch={epoch}, batch_index={batch_index}) is outside epochs=2 x "
                "steps_per_epoch=5.")):
            it.load_state_dict(state)
