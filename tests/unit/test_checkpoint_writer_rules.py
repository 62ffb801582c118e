"""What the checkpoint writer refuses, and says, before anything is on disk; what a shard file's
header records; how many checkpoints a root keeps; re-committing a step leaves nothing behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from psflow.checkpoint import commit, write_shard
from psflow.errors import CheckpointError, ConfigError

_T = {"a": torch.zeros(1)}


def _msg(text: str) -> str:
    return re.escape(text)


@pytest.mark.parametrize("tensors,message", [
    ([1], "tensors must be a mapping of name -> torch.Tensor. Received: list."),
    ({"a": torch.zeros(3).to_sparse()}, ("Tensor 'a' must be a dense torch.Tensor with data. Received: torch.sparse_coo "
                                        "on cpu. Convert sparse tensors with .to_dense(); materialise meta tensors first.")),
    ({"a": torch.empty(2, device="meta")}, "Tensor 'a' must be a dense torch.Tensor with data. Received: torch.strided on meta."),
    ({"a": 3}, "Tensor 'a' must be a dense torch.Tensor with data. Received: int."),
])
def test_tensors_that_cannot_be_saved_are_refused_naming_what_was_received(tmp_path: Path, tensors, message) -> None:
    with pytest.raises(ConfigError, match=_msg(message)):
        write_shard(tmp_path, 1, 0, 1, tensors)


@pytest.mark.parametrize("metadata,bad,reserved", [
    ({"k": 2}, "{'k': 2}", "[]"), ({2: "v"}, "{2: 'v'}", "[]"), ({"psflow.step": "9"}, "{}", "['psflow.step']"),
])
def test_metadata_must_be_str_to_str_outside_psflows_prefix(tmp_path: Path, metadata, bad, reserved) -> None:
    with pytest.raises(ConfigError, match=_msg(
            f"metadata must map str to str and not use the 'psflow.' prefix. Received non-str entries {bad} "
            f"and reserved keys {reserved}.")):
        write_shard(tmp_path, 1, 0, 1, _T, metadata=metadata)


def test_a_shard_files_header_records_the_users_metadata_and_its_step_and_shard(tmp_path: Path) -> None:
    rec = write_shard(tmp_path, 7, 1, 2, _T, metadata={"model": "mlp"})
    with safe_open(str(tmp_path / "ckpt-0000000007.partial" / rec.file), "pt") as f:
        assert f.metadata() == {"model": "mlp", "psflow.step": "7", "psflow.shard": "1", "psflow.num_shards": "2"}


@pytest.mark.parametrize("shard,num_shards", [(0, 0), ("0", 2), (2, 2), (-1, 2)])
def test_a_shard_index_outside_the_shards_is_refused(tmp_path: Path, shard, num_shards) -> None:
    with pytest.raises(ConfigError, match=_msg(
            f"shard must be in [0, num_shards) with num_shards >= 1. Received: shard={shard!r}, num_shards={num_shards!r}.")):
        write_shard(tmp_path, 1, shard, num_shards, _T)


def test_bad_records_are_refused_saying_what_to_do(tmp_path: Path) -> None:
    one = write_shard(tmp_path, 1, 0, 1, _T)
    other = write_shard(tmp_path, 1, 0, 2, _T)
    cases = [
        ([], ("Cannot commit step 1: records must be a non-empty sequence of ShardRecord. Received: []. "
             "Collect one record per ps shard first.")),
        ("ab", "records must be a non-empty sequence of ShardRecord. Received: 'ab'."),
        ([one.to_dict()], ("Cannot commit step 1: records must be ShardRecord objects. Received: dict. "
                          "Rebuild them with ShardRecord.from_dict.")),
        ([one, {}], "records must be ShardRecord objects. Received: dict."),
        ([one, one], ("Cannot commit step 1: shard 0 of 1 (shard-00000-of-00001.safetensors) is reported twice. "
                     "Send each ps shard's record once.")),
        ([one, other], ("Cannot commit step 1: the records disagree on num_shards: [1, 2]. "
                       "Every ps task must write with the same num_shards.")),
    ]
    for records, message in cases:
        with pytest.raises(CheckpointError, match=_msg(message)):
            commit(tmp_path, 1, records, meta={})


def test_a_missing_shard_file_names_the_file_and_who_must_write_it(tmp_path: Path) -> None:
    rec = write_shard(tmp_path, 3, 0, 1, _T)
    path = tmp_path / "ckpt-0000000003.partial" / rec.file
    path.unlink()
    with pytest.raises(CheckpointError, match=_msg(
            f"Cannot commit step 3: shard 0 file {path} does not exist. The ps task that reported it must write it again.")):
        commit(tmp_path, 3, [rec], meta={})


def test_meta_must_be_json_with_str_keys_and_no_nan(tmp_path: Path) -> None:
    rec = write_shard(tmp_path, 1, 0, 1, _T)
    with pytest.raises(ConfigError, match=_msg("meta must be a mapping with str keys. Received: {1: 2}.")):
        commit(tmp_path, 1, [rec], meta={1: 2})
    with pytest.raises(ConfigError, match=_msg("meta must be a mapping with str keys. Received: [].")):
        commit(tmp_path, 1, [rec], meta=[])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=_msg("meta must be JSON-serialisable: ")):
        commit(tmp_path, 1, [rec], meta={"x": float("nan")})


def test_a_root_keeps_five_checkpoints_by_default_and_as_few_as_one(tmp_path: Path) -> None:
    for step in range(1, 8):
        commit(tmp_path / "default", step, [write_shard(tmp_path / "default", step, 0, 1, _T)], meta={})
        commit(tmp_path / "one", step, [write_shard(tmp_path / "one", step, 0, 1, _T)], meta={}, keep=1)
    assert sorted(p.name for p in (tmp_path / "default").iterdir()) == [f"ckpt-{s:010d}" for s in range(3, 8)]
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["ckpt-0000000007"]
    with pytest.raises(ConfigError, match=_msg("keep must be an int >= 1. Received: 0.")):
        commit(tmp_path, 8, [write_shard(tmp_path, 8, 0, 1, _T)], meta={}, keep=0)


def test_recommitting_a_step_leaves_only_the_new_checkpoint(tmp_path: Path) -> None:
    for value in (1.0, 2.0):
        commit(tmp_path, 4, [write_shard(tmp_path, 4, 0, 1, {"a": torch.full((1,), value)})], meta={})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-0000000004"]
