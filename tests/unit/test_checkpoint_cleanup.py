"""Cleanup after commits, and the messages about unusable checkpoints: a directory that cannot be
deleted is renamed out of the way, reported, and removed by a later commit; a corrupt checkpoint's
error lists every problem and says what to do."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest
import torch

from psflow.checkpoint import (
    NoWholeCheckpointError,
    commit,
    read_checkpoint,
    write_shard,
)
from psflow.checkpoint.format import TRASH_RE
from psflow.errors import CheckpointError


def _commit(root: Path, step: int, num_shards: int = 1) -> Path:
    recs = [write_shard(root, step, k, num_shards, {f"w{k}": torch.ones(3)}) for k in range(num_shards)]
    return commit(root, step, recs, meta={})


def test_a_stale_partial_that_cannot_be_deleted_is_set_aside_reported_and_removed_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    write_shard(tmp_path, 1, 0, 1, {"w": torch.ones(3)})  # a crashed save: ckpt-...1.partial
    real_rmtree = shutil.rmtree

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(shutil, "rmtree", refuse)
    with caplog.at_level(logging.WARNING, logger="psflow.checkpoint"):
        _commit(tmp_path, 2)
    partial = tmp_path / "ckpt-0000000001.partial"
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"Could not delete old checkpoint directory {partial}: ")
               and "Permission denied" in m and m.endswith(". Delete it by hand.") for m in messages), messages
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 2 and left[1] == "ckpt-0000000002"
    assert re.fullmatch(r"ckpt-0000000001\.trash-[0-9a-f]{8}", left[0]) and TRASH_RE.fullmatch(left[0])
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    _commit(tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000000002", "ckpt-0000000003"]


def test_a_corrupt_checkpoint_lists_every_problem_and_says_what_to_do(tmp_path: Path) -> None:
    directory = _commit(tmp_path, 5, num_shards=2)
    for f in directory.glob("shard-*"):
        f.write_bytes(f.read_bytes()[:-1] + b"x")
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(directory)
    text = str(e.value)
    assert text.startswith(f"Checkpoint {directory} is not usable: shard file {directory}/shard-00000-of-00002")
    assert f".; shard file {directory}/shard-00001-of-00002" not in text  # problems are joined by "; "
    assert f"; shard file {directory}/shard-00001-of-00002" in text
    assert text.endswith(". Restore from an older checkpoint or delete this directory.")


def test_no_whole_checkpoint_lists_each_directory_with_its_problems(tmp_path: Path) -> None:
    err = NoWholeCheckpointError(tmp_path, [(tmp_path / "a", ["bad size", "bad hash"]), (tmp_path / "b", ["no manifest"])])
    assert f"{tmp_path / 'a'}: bad size, bad hash; {tmp_path / 'b'}: no manifest. Nothing was restored." in str(err)
