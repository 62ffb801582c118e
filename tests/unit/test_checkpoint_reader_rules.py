"""What the checkpoint reader refuses, and says: a shard index out of range, a shard file that is
not what its record says, a manifest that is not whole; each message names the file and what to do."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from psflow.checkpoint import (
    Checkpoint,
    NoWholeCheckpointError,
    ShardRecord,
    commit,
    latest_checkpoint,
    manifest_checksum,
    read_checkpoint,
    write_shard,
)
from psflow.errors import CheckpointError, ConfigError

_FIX = "Restore from an older checkpoint (latest_checkpoint skips corrupt ones)."


def _two_shards(root: Path, step: int = 5) -> Path:
    records = [write_shard(root, step, k, 2, {f"t{k}": torch.full((2,), float(k))}) for k in range(2)]
    return commit(root, step, records, meta={"global_step": step})


def _forged(final: Path, file_bytes: bytes, names: tuple[str, ...]) -> Checkpoint:
    """A checkpoint whose only shard file holds ``file_bytes`` and whose record matches its size
    and sha256 (so only the file's content can be what is wrong)."""
    name = "shard-00000-of-00001.safetensors"
    (final / name).write_bytes(file_bytes)
    record = ShardRecord(0, 1, name, hashlib.sha256(file_bytes).hexdigest(), len(file_bytes), names)
    return Checkpoint(final, 5, 1, (record,), {})


@pytest.mark.parametrize("shard", [-1, 2, True, "0"])
def test_a_shard_index_outside_the_checkpoint_is_refused_naming_it(tmp_path: Path, shard: Any) -> None:
    final = _two_shards(tmp_path)

    with pytest.raises(ConfigError, match=re.escape(f"shard must be in [0, 2) for checkpoint {final}. Received: {shard!r}.")):
        read_checkpoint(final).load_shard(shard)


def test_a_shard_file_safetensors_cannot_read_is_refused_naming_it(tmp_path: Path) -> None:
    ckpt = _forged(tmp_path, b"not a safetensors file", ("w",))

    with pytest.raises(CheckpointError) as caught:
        ckpt.load_shard(0)
    message = str(caught.value)
    assert message.startswith(f"Cannot load shard 0 of checkpoint {tmp_path}: shard file {tmp_path / ckpt.shards[0].file} "
                              "cannot be read by safetensors: ")
    assert message.endswith(f". {_FIX}")


def test_a_shard_file_holding_other_tensors_than_its_record_is_refused(tmp_path: Path) -> None:
    final = _two_shards(tmp_path)
    data = (final / "shard-00001-of-00002.safetensors").read_bytes()  # holds t1
    ckpt = _forged(tmp_path, data, ("t0",))

    with pytest.raises(CheckpointError, match=re.escape(
            f"Cannot load shard 0 of checkpoint {tmp_path}: shard file {tmp_path / ckpt.shards[0].file} holds tensors "
            f"that differ from its manifest record. {_FIX}")):
        ckpt.load_shard(0)


def test_a_tensor_name_on_two_shards_names_the_checkpoint(tmp_path: Path) -> None:
    final = _two_shards(tmp_path)
    ckpt = read_checkpoint(final)
    clash = ShardRecord.from_dict(ckpt.shards[1].to_dict() | {"tensor_names": ["t0"]})
    forged = Checkpoint(final, 5, 2, (ckpt.shards[0], clash), {})

    with pytest.raises(CheckpointError, match=re.escape(f"Tensor name 't0' is in both shard 0 and shard 1 of checkpoint {final}.")):
        forged.load_all()


def _rewrite(final: Path, change: Any) -> Path:
    """Changes the manifest and gives it a checksum that matches: only the change can be refused."""
    path = final / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    manifest["manifest_sha256"] = manifest_checksum(manifest)
    path.write_text(json.dumps(manifest))
    return path


def _not_usable(final: Path, problems: str) -> str:
    return re.escape(f"Checkpoint {final} is not usable: {problems}. Restore from an older checkpoint or delete this directory.")


@pytest.mark.parametrize("key, value, kind", [("step", "5", "int"), ("num_shards", True, "int"), ("version", 2.0, "int"),
                                              ("shards", {}, "list"), ("meta", [], "dict")])
def test_a_manifest_field_of_the_wrong_type_is_refused_naming_it(tmp_path: Path, key: str, value: Any, kind: str) -> None:
    final = _two_shards(tmp_path)
    path = _rewrite(final, lambda m: m.update({key: value}))

    with pytest.raises(CheckpointError, match=_not_usable(final, f"manifest {path} has {key}={value!r}, expected {kind}")):
        read_checkpoint(final)


@pytest.mark.parametrize("change, problem", [
    (lambda m: m.update(version=1), "has version 1; this psflow reads version 2 (use the psflow release that wrote it)"),
    (lambda m: m.update(step=6), "says step 6, its directory name does not"),
    (lambda m: m.update(shards=m["shards"][::-1]), "does not list shards 0..1 in order; it lists [1, 0]"),
    (lambda m: m.update(shards=m["shards"][:1]), "does not list shards 0..1 in order; it lists [0]"),
])
def test_a_manifest_that_contradicts_itself_or_its_directory_is_refused(tmp_path: Path, change: Any, problem: str) -> None:
    final = _two_shards(tmp_path)
    path = _rewrite(final, change)

    with pytest.raises(CheckpointError, match=_not_usable(final, f"manifest {path} {problem}")):
        read_checkpoint(final)


def test_a_manifest_of_another_format_is_refused(tmp_path: Path) -> None:
    final = _two_shards(tmp_path)
    path = _rewrite(final, lambda m: m.update(format="other-format"))

    with pytest.raises(CheckpointError, match=re.escape(f"{path} is not a psflow-checkpoint manifest, it holds {{'format': 'other-format'")):
        read_checkpoint(final)


def test_an_invalid_shard_entry_is_refused_with_the_records_own_complaint(tmp_path: Path) -> None:
    final = _two_shards(tmp_path)
    path = _rewrite(final, lambda m: m["shards"][1].update(size_bytes=-1))

    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(final)
    message = str(caught.value)
    assert f"manifest {path} has an invalid shard entry: A shard record: size_bytes must be >= 0; received -1" in message
    assert message.endswith("ShardRecord.from_dict). Restore from an older checkpoint or delete this directory.")


def test_a_manifest_holding_nan_has_no_checksum_and_is_refused(tmp_path: Path) -> None:
    final = _two_shards(tmp_path)
    path = final / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["meta"]["loss"] = float("nan")  # what a tool that writes NaN would leave; commit never does
    manifest["manifest_sha256"] = "0" * 64
    path.write_text(json.dumps(manifest))

    with pytest.raises(CheckpointError, match=_not_usable(final, (
            f"manifest {path} does not match its own checksum (manifest_sha256 '{'0' * 64}', the content hashes to None): "
            "it was changed or damaged after it was written"))):
        read_checkpoint(final)


def test_a_checkpoint_copied_under_another_name_still_reads(tmp_path: Path) -> None:
    final = _two_shards(tmp_path / "root")
    copy = tmp_path / "backup-of-step-5"
    shutil.copytree(final, copy)

    ckpt = read_checkpoint(copy)

    assert (ckpt.path, ckpt.step, ckpt.num_shards, ckpt.meta) == (copy, 5, 2, {"global_step": 5})
    assert torch.equal(ckpt.load_all()["t1"], torch.full((2,), 1.0))


def _truncate_both(final: Path) -> list[str]:
    problems = []
    for k in range(2):
        shard = final / f"shard-0000{k}-of-00002.safetensors"
        size = shard.stat().st_size
        os.truncate(shard, 10)
        problems.append(f"shard file {shard} has 10 bytes, the manifest says {size}")
    return problems


def test_every_bad_shard_of_a_checkpoint_is_named(tmp_path: Path) -> None:
    final = _two_shards(tmp_path)
    problems = _truncate_both(final)

    with pytest.raises(CheckpointError, match=_not_usable(final, "; ".join(problems))):
        read_checkpoint(final)


def test_latest_checkpoint_warns_once_per_checkpoint_skipped_naming_every_bad_file(tmp_path: Path) -> None:
    older = _two_shards(tmp_path, 5)
    newest = _two_shards(tmp_path, 6)
    problems = _truncate_both(newest)
    warnings: list[str] = []

    assert latest_checkpoint(tmp_path, warn=warnings.append).path == older  # type: ignore[union-attr]

    assert warnings == [f"Skipping checkpoint {newest}: {'; '.join(problems)}. Falling back to the previous checkpoint."]


def test_strict_latest_checkpoint_names_the_root_and_every_problem_of_every_checkpoint(tmp_path: Path) -> None:
    older = _two_shards(tmp_path, 5)
    newest = _two_shards(tmp_path, 6)
    newest_problems = _truncate_both(newest)
    (older / "manifest.json").unlink()
    older_problem = f"checkpoint {older} has no manifest.json"

    with pytest.raises(NoWholeCheckpointError) as caught:
        latest_checkpoint(str(tmp_path), warn=lambda m: None, strict=True)

    assert caught.value.root == tmp_path
    assert caught.value.problems == [(newest, newest_problems), (older, [older_problem])]
    assert str(caught.value) == (
        f"None of the 2 checkpoint(s) under {tmp_path} is whole, so the training they hold cannot be resumed: "
        f"{newest}: {', '.join(newest_problems)}; {older}: {older_problem}. Nothing was restored. To start fresh on "
        f"purpose, use another checkpoint root, or move {tmp_path} away.")


def test_a_symlinked_checkpoint_directory_is_refused_naming_where_it_points(tmp_path: Path) -> None:
    elsewhere = _two_shards(tmp_path / "other")
    link = tmp_path / "root" / "ckpt-0000000005"
    link.parent.mkdir()
    link.symlink_to(elsewhere, target_is_directory=True)

    with pytest.raises(CheckpointError, match=_not_usable(link, (
            f"checkpoint directory {link} is a symlink (to {str(elsewhere)!r}); checkpoints are refused unless they "
            "are real directories under the checkpoint root"))):
        read_checkpoint(link)


def test_a_symlinked_shard_is_refused_naming_where_it_points(tmp_path: Path) -> None:
    final = _two_shards(tmp_path / "root")
    shard = final / "shard-00001-of-00002.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)

    with pytest.raises(CheckpointError, match=_not_usable(final, (
            f"{shard} is a symlink (to {str(outside)!r}); a checkpoint holds only regular files, so it is refused"))):
        read_checkpoint(final)
