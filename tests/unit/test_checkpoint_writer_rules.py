"""What the checkpoint writer refuses, and says, before anything is on disk; what a shard file's
header records; how many checkpoints a root keeps; re-committing a step leaves nothing behind."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from psflow.checkpoint import commit, read_checkpoint, write_shard, writer
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


@pytest.mark.parametrize("shard,num_shards", [(0, 0), ("0", 2), (2, 2), (-1, 2), (0, True), (0, 2.0)])
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


def test_a_damaged_checkpoint_does_not_count_towards_keep(tmp_path: Path) -> None:
    for step in (1, 2):
        commit(tmp_path, step, [write_shard(tmp_path, step, 0, 1, _T)], meta={})
    (tmp_path / "ckpt-0000000002" / "manifest.json").write_text("{")  # step 2 is no longer whole

    commit(tmp_path, 3, [write_shard(tmp_path, 3, 0, 1, _T)], meta={}, keep=2)

    # Two whole ones are kept (3 and 1): pruning must not delete step 1 for the damaged step 2.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000000001", "ckpt-0000000002", "ckpt-0000000003"]


@pytest.mark.parametrize("crash", [-1, "10", 1.5])
def test_an_injected_crash_offset_must_be_a_byte_count(tmp_path: Path, crash) -> None:
    with pytest.raises(ConfigError, match=_msg(f"_crash_after_bytes must be an int >= 0. Received: {crash!r}.")):
        write_shard(tmp_path, 1, 0, 1, _T, _crash_after_bytes=crash)


def test_a_shard_file_that_cannot_be_written_is_reported_and_leaves_no_tmp_file(tmp_path: Path, monkeypatch) -> None:
    def disk_full(tensors, path, metadata) -> None:
        Path(path).write_bytes(b"half")  # what a failed write leaves
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "save_file", disk_full)
    tensors = {f"t{i}": torch.zeros(1) for i in range(9)}
    with pytest.raises(CheckpointError) as caught:
        write_shard(tmp_path, 1, 0, 1, tensors)

    partial = tmp_path / "ckpt-0000000001.partial"
    assert re.fullmatch(
        _msg(f"Could not write shard file {partial}/shard-00000-of-00001.safetensors.") + r"\d+-[0-9a-f]{8}\.tmp"
        + _msg(f": [Errno 28] No space left on device. Received 9 tensors named {[f't{i}' for i in range(8)]!r}. "
               "Check free disk space and the tensors' dtypes."), str(caught.value))
    assert list(partial.iterdir()) == []


def test_a_shard_whose_partial_directory_cannot_be_made_is_reported(tmp_path: Path) -> None:
    (tmp_path / "ckpt-0000000001.partial").write_text("a file in the way")
    final = tmp_path / "ckpt-0000000001.partial" / "shard-00000-of-00001.safetensors"

    with pytest.raises(CheckpointError, match=_msg(f"Could not write shard 0 of step 1 to {final}: [Errno 17] File exists: ")) as caught:
        write_shard(tmp_path, 1, 0, 1, _T)
    assert str(caught.value).endswith(". Check that the checkpoint root is writable and has free space.")


def test_a_commit_before_any_shard_was_written_says_who_must_write_first(tmp_path: Path) -> None:
    rec = write_shard(tmp_path / "elsewhere", 2, 0, 1, _T)

    with pytest.raises(CheckpointError, match=_msg(
            f"Cannot commit step 2: {tmp_path / 'ckpt-0000000002.partial'} does not exist. "
            "Every ps task must call write_shard(root, 2, ...) before the chief commits.")):
        commit(tmp_path, 2, [rec], meta={})


def test_a_commit_that_cannot_write_its_manifest_says_what_to_check(tmp_path: Path, monkeypatch) -> None:
    rec = write_shard(tmp_path, 2, 0, 1, _T)

    def disk_full(path: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "write_bytes_atomic", disk_full)
    with pytest.raises(CheckpointError, match=_msg(
            f"Could not commit the checkpoint of step 2 at {tmp_path / 'ckpt-0000000002'}: [Errno 28] No space left on "
            "device. Check that the checkpoint root is writable and has free space.")):
        commit(tmp_path, 2, [rec], meta={})


def test_the_manifest_holds_the_documented_fields(tmp_path: Path) -> None:
    rec = write_shard(tmp_path, 2, 0, 1, _T)
    before = time.time()
    final = commit(tmp_path, 2, [rec], meta={"global_step": 2})

    manifest = json.loads((final / "manifest.json").read_text())
    assert set(manifest) == {"format", "version", "step", "num_shards", "shards", "meta", "created_unix", "manifest_sha256"}
    assert (manifest["format"], manifest["version"], manifest["step"], manifest["num_shards"]) == ("psflow-checkpoint", 2, 2, 1)
    assert manifest["shards"] == [rec.to_dict()] and manifest["meta"] == {"global_step": 2}
    assert before <= manifest["created_unix"] <= time.time()


def test_a_partial_of_the_newest_step_is_kept_while_an_older_step_commits(tmp_path: Path) -> None:
    # After a rollback the job commits step 2 while ckpt-3 (from before) exists and step 3 is
    # being written again: only partials older than the newest whole checkpoint are stale.
    for step in (1, 3):
        commit(tmp_path, step, [write_shard(tmp_path, step, 0, 1, _T)], meta={})
    write_shard(tmp_path, 3, 0, 1, _T)

    commit(tmp_path, 2, [write_shard(tmp_path, 2, 0, 1, _T)], meta={})

    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-0000000001", "ckpt-0000000002", "ckpt-0000000003", "ckpt-0000000003.partial"]


def test_a_commit_whose_final_rename_fails_reports_it_and_publishes_nothing(tmp_path: Path, monkeypatch) -> None:
    rec = write_shard(tmp_path, 2, 0, 1, _T)
    real_replace = os.replace

    def failing_replace(src, dst) -> None:
        if str(src).endswith(".partial"):
            raise OSError(5, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(writer.os, "replace", failing_replace)
    with pytest.raises(CheckpointError, match=_msg(
            f"Could not commit the checkpoint of step 2 at {tmp_path / 'ckpt-0000000002'}: [Errno 5] Input/output error.")):
        commit(tmp_path, 2, [rec], meta={})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-0000000002.partial"]


def test_a_leftover_trash_directory_that_cannot_be_removed_does_not_fail_a_commit(tmp_path: Path, monkeypatch) -> None:
    trash = tmp_path / "ckpt-0000000001.trash-0123abcd"
    trash.mkdir()

    def refused(*args, **kwargs) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "rmdir", refused)  # the sweep is best effort: the new checkpoint is published
    final = commit(tmp_path, 2, [write_shard(tmp_path, 2, 0, 1, _T)], meta={})

    assert sorted(p.name for p in tmp_path.iterdir()) == [trash.name, final.name]


def test_a_recommit_leaves_no_trash_behind(tmp_path: Path) -> None:
    for value in (1.0, 2.0):
        final = commit(tmp_path, 4, [write_shard(tmp_path, 4, 0, 1, {"a": torch.full((1,), value)})], meta={"v": value})
    assert [p.name for p in tmp_path.iterdir()] == [final.name]
    assert json.loads((final / "manifest.json").read_text())["meta"] == {"v": 2.0}


def test_pruning_a_root_where_no_checkpoint_is_whole_removes_nothing(tmp_path: Path) -> None:
    commit(tmp_path, 5, [write_shard(tmp_path, 5, 0, 1, _T)], meta={})
    (tmp_path / "ckpt-0000000005" / "manifest.json").write_text("{")
    write_shard(tmp_path, 0, 0, 1, _T)  # a first checkpoint still being written

    writer._prune(tmp_path, keep=1)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000000000.partial", "ckpt-0000000005"]


def test_tensors_sharing_memory_at_any_offset_and_size_are_saved_by_value(tmp_path: Path) -> None:
    base = torch.arange(12.0)
    tensors = {"w": base, "tail": base[8:], "last": base[11], "empty": base[4:4], "pair": base[2:4]}

    commit(tmp_path, 1, [write_shard(tmp_path, 1, 0, 1, tensors)], meta={})

    loaded = read_checkpoint(tmp_path / "ckpt-0000000001").load_all()
    assert {k: v.tolist() for k, v in loaded.items()} == {k: v.tolist() for k, v in tensors.items()}


def test_a_tensor_name_on_two_shards_is_refused_naming_the_step(tmp_path: Path) -> None:
    records = [write_shard(tmp_path, 7, k, 2, {"same": torch.zeros(2)}) for k in range(2)]

    with pytest.raises(CheckpointError, match=_msg(
            "Tensor name 'same' is in both shard 0 and shard 1 of step 7. Every tensor must live on exactly one shard.")):
        commit(tmp_path, 7, records, meta={})
