"""Tests of psflow.checkpoint: the sharded format, atomic commit, corruption fallback, pruning."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from psflow.checkpoint import (
    Checkpoint,
    NoWholeCheckpointError,
    ShardRecord,
    commit,
    export_state_dict,
    latest_checkpoint,
    list_checkpoints,
    manifest_checksum,
    read_checkpoint,
    reader,
    write_shard,
    writer,
)
from psflow.errors import CheckpointError, ConfigError

torch.set_num_threads(1)

_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]


def _random_tensor(seed: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs and infinities included) of the given dtype and shape."""
    gen = torch.Generator().manual_seed(seed)
    numel = 1
    for dim in shape:
        numel *= dim
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _shard_tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(6, 8, generator=gen)
    return {
        f"fc{seed}.weight": base,
        f"fc{seed}.weight#0:3": base[:3],  # a view of another tensor in the same shard
        f"fc{seed}.bias": torch.randn(8, generator=gen).to(torch.bfloat16),
        f"opt/fc{seed}.weight/exp_avg": base.t(),  # non-contiguous
        f"step{seed}": torch.tensor(seed, dtype=torch.int64),  # 0-dim
        f"empty{seed}": torch.empty(0, 4),
        f"nan{seed}": torch.tensor([float("nan"), -0.0, float("inf")]),
    }


def _bits(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], bytes]:
    flat = t.resolve_conj().contiguous().reshape(-1)
    return t.dtype, tuple(t.shape), bytes(flat.view(torch.uint8).tolist()) if flat.numel() else b""


def _assert_bitwise_equal(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name in want:
        assert _bits(got[name]) == _bits(want[name]), name


def _save(
    root: Path,
    step: int,
    shards: list[dict[str, torch.Tensor]],
    *,
    keep: int = 5,
    meta: dict[str, Any] | None = None,
) -> Path:
    records = [write_shard(root, step, k, len(shards), t) for k, t in enumerate(shards)]
    return commit(root, step, records, meta=meta or {"global_step": step}, keep=keep)


def _steps(root: Path) -> list[int]:
    return [read_checkpoint(p).step for p in list_checkpoints(root)]


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------- round trip


def test_two_committed_shards_load_back_bit_for_bit(tmp_path: Path) -> None:
    shards = [_shard_tensors(0), _shard_tensors(1)]
    final = _save(tmp_path, 100, shards, meta={"global_step": 100, "data": {"worker:0": 7}})

    ckpt = latest_checkpoint(tmp_path, warn=pytest.fail)

    assert ckpt is not None
    assert ckpt.path == final == tmp_path / "ckpt-0000000100"
    assert (ckpt.step, ckpt.num_shards) == (100, 2)
    assert ckpt.meta == {"global_step": 100, "data": {"worker:0": 7}}
    assert sorted(p.name for p in final.iterdir()) == [
        "manifest.json",
        "shard-00000-of-00002.safetensors",
        "shard-00001-of-00002.safetensors",
    ]
    assert not (tmp_path / "ckpt-0000000100.partial").exists()
    _assert_bitwise_equal(ckpt.load_shard(1), shards[1])
    _assert_bitwise_equal(ckpt.load_all(), {**shards[0], **shards[1]})


def test_manifest_lists_every_shard_with_checksum_and_size(tmp_path: Path) -> None:
    final = _save(tmp_path, 3, [_shard_tensors(0), _shard_tensors(1)])

    manifest = json.loads((final / "manifest.json").read_text())

    assert (manifest["format"], manifest["version"], manifest["step"]) == ("psflow-checkpoint", 2, 3)
    assert manifest["num_shards"] == 2 and isinstance(manifest["created_unix"], float)
    assert manifest["manifest_sha256"] == manifest_checksum(manifest)
    for k, entry in enumerate(manifest["shards"]):
        record = ShardRecord.from_dict(entry)
        assert record.shard == k
        assert record.size_bytes == (final / record.file).stat().st_size
        assert set(record.tensor_names) == set(_shard_tensors(k))


@settings(max_examples=20, deadline=None)
@given(
    st.dictionaries(
        st.text(max_size=12).filter(lambda s: s != "__metadata__"),
        st.tuples(
            st.integers(0, 2**31),
            st.sampled_from(_DTYPES),
            st.lists(st.integers(0, 4), max_size=3).map(tuple),
        ),
        max_size=6,
    ),
    st.integers(1, 3),
)
def test_any_named_tensors_round_trip_bit_for_bit(
    specs: dict[str, tuple[int, torch.dtype, tuple[int, ...]]], num_shards: int
) -> None:
    tensors = {name: _random_tensor(*spec) for name, spec in specs.items()}
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(num_shards)]
    for i, (name, tensor) in enumerate(tensors.items()):
        shards[i % num_shards][name] = tensor
    with tempfile.TemporaryDirectory() as root:
        _save(Path(root), 5, shards)
        ckpt = latest_checkpoint(root, warn=pytest.fail)
        assert ckpt is not None
        _assert_bitwise_equal(ckpt.load_all(), tensors)


def test_tied_and_lazily_conjugated_tensors_are_saved_by_value(tmp_path: Path) -> None:
    tied = torch.arange(12.0)
    z = torch.complex(torch.arange(3.0), torch.ones(3))
    tensors = {"embed.weight": tied, "head.weight": tied, "head.view": tied[2:5], "z.conj": z.conj()}

    record = write_shard(tmp_path, 1, 0, 1, tensors)
    commit(tmp_path, 1, [record], meta={})

    _assert_bitwise_equal(read_checkpoint(tmp_path / "ckpt-0000000001").load_all(), tensors)


@settings(max_examples=50)
@given(
    st.integers(1, 99_999).flatmap(lambda n: st.tuples(st.integers(0, n - 1), st.just(n))),
    st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
    st.integers(0, 2**40),
    st.lists(st.text(max_size=8), unique=True, max_size=5),
)
def test_shard_record_survives_a_json_round_trip(
    index: tuple[int, int], sha256: str, size: int, names: list[str]
) -> None:
    shard, n = index
    record = ShardRecord(shard, n, f"shard-{shard:05d}-of-{n:05d}.safetensors", sha256, size, tuple(names))

    assert ShardRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record


@pytest.mark.parametrize(
    "change, complaint",
    [
        ({"file": "../../etc/passwd"}, "file must be 'shard-00001-of-00002.safetensors'"),
        ({"shard": 2}, "shard must be an int in [0, 2)"),
        ({"sha256": "xyz"}, "sha256 must match pattern '^[0-9a-f]{64}$'; received 'xyz' (64 lowercase hex digits"),
        ({"size_bytes": -1}, "size_bytes must be >= 0; received -1"),
        ({"shard": True}, "shard must be a valid integer; received True"),
        ({"tensor_names": ["a", "a"]}, "tensor_names repeats ['a']"),
        ({"extra": 1}, "A shard record has no setting 'extra' (received 1). Known: shard, num_shards, file"),
    ],
)
def test_shard_record_from_dict_rejects_bad_fields_by_name(change: dict[str, Any], complaint: str) -> None:
    good = {
        "shard": 1,
        "num_shards": 2,
        "file": "shard-00001-of-00002.safetensors",
        "sha256": "0" * 64,
        "size_bytes": 10,
        "tensor_names": ["a"],
    }

    with pytest.raises(CheckpointError, match=re.escape(complaint)):
        ShardRecord.from_dict({**good, **change})


# --------------------------------------------------------------------------- crashes and corruption


def test_shard_cut_mid_write_never_yields_a_whole_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, 100, [_shard_tensors(0), _shard_tensors(1)])
    first = write_shard(tmp_path, 200, 0, 2, _shard_tensors(2))

    with pytest.raises(CheckpointError, match="injected crash"):
        write_shard(tmp_path, 200, 1, 2, _shard_tensors(3), _crash_after_bytes=100)

    partial = tmp_path / "ckpt-0000000200.partial"
    leftovers = [p for p in partial.iterdir() if p.name.endswith(".tmp")]
    assert [p.stat().st_size for p in leftovers] == [100]
    assert not (partial / "shard-00001-of-00002.safetensors").exists()
    assert list_checkpoints(tmp_path) == [tmp_path / "ckpt-0000000100"]
    with pytest.raises(CheckpointError, match=r"no record for shard 1 of 2 \(shard-00001-of-00002"):
        commit(tmp_path, 200, [first], meta={})
    ckpt = latest_checkpoint(tmp_path, warn=pytest.fail)
    assert ckpt is not None and ckpt.step == 100


def test_retried_shard_after_crash_commits_and_leaves_no_tmp_files(tmp_path: Path) -> None:
    first = write_shard(tmp_path, 200, 0, 2, _shard_tensors(2))
    with pytest.raises(CheckpointError, match="injected crash"):
        write_shard(tmp_path, 200, 1, 2, _shard_tensors(3), _crash_after_bytes=0)

    second = write_shard(tmp_path, 200, 1, 2, _shard_tensors(3))
    final = commit(tmp_path, 200, [second, first], meta={})

    assert not [p for p in final.iterdir() if p.name.endswith(".tmp")]
    _assert_bitwise_equal(read_checkpoint(final).load_shard(1), _shard_tensors(3))


def test_flipped_byte_in_a_shard_falls_back_with_a_warning_naming_the_file(tmp_path: Path) -> None:
    _save(tmp_path, 100, [_shard_tensors(0), _shard_tensors(1)])
    newest = _save(tmp_path, 200, [_shard_tensors(2), _shard_tensors(3)])
    bad = newest / "shard-00001-of-00002.safetensors"
    _flip_byte(bad, bad.stat().st_size - 5)  # in the tensor data: the header still parses
    warnings: list[str] = []

    ckpt = latest_checkpoint(tmp_path, warn=warnings.append)

    assert ckpt is not None and ckpt.step == 100
    assert len(warnings) == 1
    assert str(bad) in warnings[0] and "sha256" in warnings[0]
    _assert_bitwise_equal(ckpt.load_all(), {**_shard_tensors(0), **_shard_tensors(1)})


def test_any_flipped_byte_of_a_shard_is_detected(tmp_path: Path) -> None:
    final = _save(tmp_path, 1, [{"w": torch.arange(16, dtype=torch.float32)}])
    shard = final / "shard-00000-of-00001.safetensors"
    original = shard.read_bytes()

    @settings(max_examples=40, deadline=None)
    @given(st.integers(0, len(original) - 1), st.integers(1, 255))
    def check(offset: int, mask: int) -> None:
        data = bytearray(original)
        data[offset] ^= mask
        shard.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=re.escape(str(shard))):
            read_checkpoint(final)

    check()
    shard.write_bytes(original)
    assert read_checkpoint(final).step == 1


def _truncate_manifest(final: Path) -> Path:
    manifest = final / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:40])
    return manifest


def _delete_shard(final: Path) -> Path:
    shard = final / "shard-00001-of-00002.safetensors"
    shard.unlink()
    return shard


def _truncate_shard(final: Path) -> Path:
    shard = final / "shard-00000-of-00002.safetensors"
    os.truncate(shard, 20)
    return shard


def _delete_manifest(final: Path) -> Path:
    (final / "manifest.json").unlink()
    return final


@pytest.mark.parametrize("damage", [_truncate_manifest, _delete_shard, _truncate_shard, _delete_manifest])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, damage: Any) -> None:
    _save(tmp_path, 100, [_shard_tensors(0), _shard_tensors(1)])
    newest = _save(tmp_path, 200, [_shard_tensors(2), _shard_tensors(3)])
    bad = damage(newest)
    warnings: list[str] = []

    ckpt = latest_checkpoint(tmp_path, warn=warnings.append)

    assert ckpt is not None and ckpt.step == 100
    assert len(warnings) == 1 and str(bad) in warnings[0]
    with pytest.raises(CheckpointError, match=re.escape(str(bad))):
        read_checkpoint(newest)


def test_commit_interrupted_before_the_directory_rename_is_not_whole(tmp_path: Path) -> None:
    _save(tmp_path, 100, [_shard_tensors(0)])
    newest = _save(tmp_path, 200, [_shard_tensors(1)])
    partial = newest.with_name("ckpt-0000000200.partial")
    newest.rename(partial)  # shards and manifest written, final rename never happened

    ckpt = latest_checkpoint(tmp_path, warn=pytest.fail)

    assert ckpt is not None and ckpt.step == 100
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        read_checkpoint(partial)


def test_default_warning_goes_to_the_checkpoint_logger(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save(tmp_path, 100, [_shard_tensors(0)])
    bad = _delete_manifest(_save(tmp_path, 200, [_shard_tensors(1)]))

    with caplog.at_level("WARNING", logger="psflow.checkpoint"):
        ckpt = latest_checkpoint(tmp_path)

    assert ckpt is not None and ckpt.step == 100
    assert [r.name for r in caplog.records] == ["psflow.checkpoint"]
    assert str(bad) in caplog.records[0].getMessage()


def test_latest_checkpoint_is_none_without_a_whole_checkpoint(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "missing", warn=pytest.fail) is None
    write_shard(tmp_path, 1, 0, 1, _shard_tensors(0))  # never committed
    assert latest_checkpoint(tmp_path, warn=pytest.fail) is None

    final = _save(tmp_path, 2, [_shard_tensors(0)])
    _truncate_manifest(final)
    warnings: list[str] = []
    assert latest_checkpoint(tmp_path, warn=warnings.append) is None
    assert len(warnings) == 1


def test_load_shard_of_a_corrupt_file_raises_naming_the_file(tmp_path: Path) -> None:
    final = _save(tmp_path, 100, [_shard_tensors(0), _shard_tensors(1)])
    ckpt = read_checkpoint(final)
    bad = final / "shard-00000-of-00002.safetensors"
    _flip_byte(bad, bad.stat().st_size - 1)

    with pytest.raises(CheckpointError, match=re.escape(str(bad))):
        ckpt.load_shard(0)
    with pytest.raises(CheckpointError, match=re.escape(str(bad))):
        ckpt.load_all()
    _assert_bitwise_equal(ckpt.load_shard(1), _shard_tensors(1))


def test_load_all_rejects_a_tensor_name_on_two_shards(tmp_path: Path) -> None:
    final = _save(tmp_path, 1, [{"a": torch.zeros(1)}, {"b": torch.ones(1)}])
    ckpt = read_checkpoint(final)
    clash = ckpt.shards[1].to_dict() | {"tensor_names": ["a"]}
    forged = Checkpoint(ckpt.path, ckpt.step, 2, (ckpt.shards[0], ShardRecord.from_dict(clash)), {})

    with pytest.raises(CheckpointError, match=r"'a' is in both shard 0 and shard 1"):
        forged.load_all()


# --------------------------------------------------------------------------- commit rules


def test_commit_with_a_missing_record_raises_naming_the_shard(tmp_path: Path) -> None:
    records = [write_shard(tmp_path, 7, k, 3, {f"t{k}": torch.zeros(2)}) for k in range(3)]

    with pytest.raises(CheckpointError, match=r"no record for shard 1 of 3 \(shard-00001-of-00003\.safetensors\)"):
        commit(tmp_path, 7, [records[2], records[0]], meta={})
    with pytest.raises(CheckpointError, match=r"shard 2 of 3 .* is reported twice"):
        commit(tmp_path, 7, [*records, records[2]], meta={})
    assert list_checkpoints(tmp_path) == []


def test_commit_rejects_a_shard_file_that_is_gone_or_resized(tmp_path: Path) -> None:
    records = [write_shard(tmp_path, 7, k, 2, {f"t{k}": torch.zeros(2)}) for k in range(2)]
    shard1 = tmp_path / "ckpt-0000000007.partial" / records[1].file
    data = shard1.read_bytes()

    shard1.write_bytes(data + b"x")
    with pytest.raises(CheckpointError, match=rf"shard 1 file {re.escape(str(shard1))} has {len(data) + 1} bytes"):
        commit(tmp_path, 7, records, meta={})
    shard1.unlink()
    with pytest.raises(CheckpointError, match=rf"shard 1 file {re.escape(str(shard1))} does not exist"):
        commit(tmp_path, 7, records, meta={})
    assert list_checkpoints(tmp_path) == []


def test_commit_rejects_a_tensor_name_on_two_shards(tmp_path: Path) -> None:
    records = [write_shard(tmp_path, 7, k, 2, {"same": torch.zeros(2)}) for k in range(2)]

    with pytest.raises(CheckpointError, match=r"'same' is in both shard 0 and shard 1"):
        commit(tmp_path, 7, records, meta={})


def test_keep_two_prunes_older_checkpoints_and_stale_partials(tmp_path: Path) -> None:
    write_shard(tmp_path, 50, 0, 1, {"w": torch.zeros(1)})  # abandoned, older than any commit
    write_shard(tmp_path, 900, 0, 1, {"w": torch.zeros(1)})  # in progress, newer: must survive
    for step in (100, 200, 300):
        _save(tmp_path, step, [{"w": torch.full((2,), float(step))}], keep=2)

    assert _steps(tmp_path) == [300, 200]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-0000000200",
        "ckpt-0000000300",
        "ckpt-0000000900.partial",
    ]


def test_recommitting_a_step_after_a_rollback_replaces_it(tmp_path: Path) -> None:
    _save(tmp_path, 100, [{"w": torch.zeros(3)}])

    _save(tmp_path, 100, [{"w": torch.ones(3)}], meta={"attempt": 2})

    ckpt = latest_checkpoint(tmp_path, warn=pytest.fail)
    assert ckpt is not None and ckpt.meta == {"attempt": 2}
    _assert_bitwise_equal(ckpt.load_all(), {"w": torch.ones(3)})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-0000000100"]


def test_list_checkpoints_is_newest_first_and_ignores_partial_and_junk(tmp_path: Path) -> None:
    for step in (9, 10_000_000_000, 123):
        _save(tmp_path, step, [{"w": torch.zeros(1)}])
    write_shard(tmp_path, 500, 0, 1, {"w": torch.zeros(1)})
    (tmp_path / "ckpt-abc").mkdir()
    (tmp_path / "ckpt-0000000042").write_text("a file, not a directory")
    (tmp_path / "notes.txt").write_text("")

    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "ckpt-10000000000",
        "ckpt-0000000123",
        "ckpt-0000000009",
    ]


def test_bad_arguments_are_rejected_with_the_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"shard=2, num_shards=2"):
        write_shard(tmp_path, 1, 2, 2, {})
    with pytest.raises(ConfigError, match=r"step must be an int >= 0. Received: -1"):
        write_shard(tmp_path, -1, 0, 1, {})
    with pytest.raises(ConfigError, match=r"'__metadata__'"):
        write_shard(tmp_path, 1, 0, 1, {"__metadata__": torch.zeros(1)})
    with pytest.raises(ConfigError, match=r"Received: list"):
        write_shard(tmp_path, 1, 0, 1, {"w": [1.0]})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match=r"reserved keys \['psflow.step'\]"):
        write_shard(tmp_path, 1, 0, 1, {}, metadata={"psflow.step": "3"})
    record = write_shard(tmp_path, 1, 0, 1, {"w": torch.zeros(1)})
    with pytest.raises(ConfigError, match=r"keep must be an int >= 1. Received: 0"):
        commit(tmp_path, 1, [record], meta={}, keep=0)
    with pytest.raises(ConfigError, match=r"JSON-serialisable"):
        commit(tmp_path, 1, [record], meta={"model": torch.nn.Linear(1, 1)})
    assert list_checkpoints(tmp_path) == []


# --------------------------------------------------------------------------- export


def test_export_writes_a_file_that_safetensors_load_file_reads(tmp_path: Path) -> None:
    shards = [_shard_tensors(0), _shard_tensors(1)]
    ckpt = read_checkpoint(_save(tmp_path / "ckpts", 10, shards))

    out = export_state_dict(
        ckpt,
        tmp_path / "export" / "model.safetensors",
        rename=lambda name: None if name.startswith("opt/") else f"model.{name}",
    )

    loaded = load_file(out)
    want = {f"model.{n}": t for s in shards for n, t in s.items() if not n.startswith("opt/")}
    _assert_bitwise_equal(loaded, want)
    assert [p.name for p in out.parent.iterdir()] == ["model.safetensors"]


def test_export_rejects_a_rename_that_merges_two_tensors(tmp_path: Path) -> None:
    ckpt = read_checkpoint(_save(tmp_path, 10, [{"a": torch.zeros(1)}, {"b": torch.ones(1)}]))

    with pytest.raises(ConfigError, match=r"Received 'x' for 'b', already used for 'a'"):
        export_state_dict(ckpt, tmp_path / "out.safetensors", rename=lambda name: "x")
    with pytest.raises(ConfigError, match=r"rename dropped all 2 tensors"):
        export_state_dict(ckpt, tmp_path / "out.safetensors", rename=lambda name: None)
    assert not (tmp_path / "out.safetensors").exists()


# --------------------------------------------------------------------------- concurrent writers


def _seeded_shard(shard: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + shard)
    return {f"layer{shard}.weight": torch.randn(4, 4, generator=gen), f"layer{shard}.bias": torch.randn(4, generator=gen)}


def _write_in_child(root: str, shard: int, num_shards: int, barrier: Any, results: Any) -> None:
    torch.set_num_threads(1)
    tensors = _seeded_shard(shard)
    barrier.wait(timeout=60)  # every writer starts at once, into the same partial directory
    record = write_shard(root, 42, shard, num_shards, tensors)
    results.put(json.dumps(record.to_dict()))  # the ps sends its record to the chief as JSON


@pytest.mark.slow  # three spawned interpreters each import torch: ~5-10 s on two busy cores
def test_shards_written_by_separate_processes_commit_without_clashing(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_write_in_child, args=(str(tmp_path), k, 3, barrier, results)) for k in range(3)]
    for proc in procs:
        proc.start()
    try:
        records = [ShardRecord.from_dict(json.loads(results.get(timeout=120))) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    assert [proc.exitcode for proc in procs] == [0, 0, 0]

    final = commit(tmp_path, 42, records, meta={"global_step": 42})

    ckpt = latest_checkpoint(tmp_path, warn=pytest.fail)
    assert ckpt is not None and ckpt.path == final
    assert [r.shard for r in ckpt.shards] == [0, 1, 2]
    _assert_bitwise_equal(ckpt.load_all(), {n: t for k in range(3) for n, t in _seeded_shard(k).items()})


# --------------------------------------------------------------------- every checkpoint corrupt


def test_strict_latest_checkpoint_raises_naming_every_corrupt_checkpoint_and_why(tmp_path: Path) -> None:
    first = _save(tmp_path, 100, [_shard_tensors(0), _shard_tensors(1)])
    second = _save(tmp_path, 200, [_shard_tensors(2), _shard_tensors(3)])
    shard = first / "shard-00001-of-00002.safetensors"
    _flip_byte(shard, shard.stat().st_size // 2)
    manifest = _truncate_manifest(second)

    with pytest.raises(NoWholeCheckpointError) as caught:
        latest_checkpoint(tmp_path, warn=lambda m: None, strict=True)

    message = str(caught.value)
    assert str(shard) in message and "sha256" in message
    assert str(manifest) in message and "cannot be parsed" in message
    assert "start fresh on purpose" in message
    assert [p for p, _ in caught.value.problems] == [second, first]
    # Not strict: the old answer (None) for callers that only look.
    assert latest_checkpoint(tmp_path, warn=lambda m: None) is None


def test_strict_latest_checkpoint_is_none_when_there_is_nothing_committed(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "missing", strict=True) is None
    write_shard(tmp_path, 1, 0, 1, _shard_tensors(0))  # a .partial only: no checkpoint was ever whole
    assert latest_checkpoint(tmp_path, warn=pytest.fail, strict=True) is None


# --------------------------------------------------------------------- the manifest's own checksum


def _rewrite_manifest(final: Path, change: Any, *, fix_checksum: bool) -> Path:
    path = final / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    if fix_checksum:
        manifest["manifest_sha256"] = manifest_checksum(manifest)
    path.write_text(json.dumps(manifest, indent=2))
    return path


def _bump_meta(m: dict[str, Any]) -> None:
    m["meta"]["global_step"] = 999


def _reorder_tensor_names(m: dict[str, Any]) -> None:
    m["shards"][0]["tensor_names"] = list(reversed(m["shards"][0]["tensor_names"]))


def _drop_checksum(m: dict[str, Any]) -> None:
    del m["manifest_sha256"]


@pytest.mark.parametrize("change", [_bump_meta, _reorder_tensor_names, _drop_checksum])
def test_a_manifest_changed_but_still_valid_json_is_refused(tmp_path: Path, change: Any) -> None:
    _save(tmp_path, 100, [_shard_tensors(0)])
    newest = _save(tmp_path, 200, [_shard_tensors(1)])
    path = _rewrite_manifest(newest, change, fix_checksum=False)
    warnings: list[str] = []

    ckpt = latest_checkpoint(tmp_path, warn=warnings.append)

    assert ckpt is not None and ckpt.step == 100
    assert len(warnings) == 1 and str(path) in warnings[0] and "checksum" in warnings[0]
    with pytest.raises(CheckpointError, match="does not match its own checksum"):
        read_checkpoint(newest)


# --------------------------------------------------------------------- nothing outside the directory


def test_a_shard_path_leading_out_of_the_checkpoint_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    final = _save(root, 100, [_shard_tensors(0)])
    (tmp_path / "x").write_bytes((final / "shard-00000-of-00001.safetensors").read_bytes())

    def escape(m: dict[str, Any]) -> None:
        m["shards"][0]["file"] = "../x"

    # A correct checksum: the path itself, not the checksum, must be what refuses it.
    path = _rewrite_manifest(final, escape, fix_checksum=True)

    with pytest.raises(CheckpointError, match=re.escape("'../x'")) as caught:
        read_checkpoint(final)
    assert str(path) in str(caught.value)
    assert latest_checkpoint(root, warn=lambda m: None) is None


def test_a_symlinked_shard_pointing_outside_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    final = _save(root, 100, [_shard_tensors(0)])
    shard = final / "shard-00000-of-00001.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)  # same bytes, same sha256: only the link gives it away
    warnings: list[str] = []

    assert latest_checkpoint(root, warn=warnings.append) is None

    assert len(warnings) == 1 and str(shard) in warnings[0] and "symlink" in warnings[0]
    with pytest.raises(CheckpointError, match="symlink"):
        read_checkpoint(final)
    with pytest.raises(CheckpointError, match="symlink"):
        reader._read_manifest(final).load_shard(0)  # the manifest itself is intact


def test_a_symlinked_manifest_or_checkpoint_directory_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    elsewhere = _save(tmp_path / "other", 100, [_shard_tensors(0)])
    root.mkdir()
    (root / "ckpt-0000000100").symlink_to(elsewhere, target_is_directory=True)
    final = _save(root, 200, [_shard_tensors(1)])
    manifest = final / "manifest.json"
    moved = tmp_path / "manifest.json"
    manifest.rename(moved)
    manifest.symlink_to(moved)
    warnings: list[str] = []

    assert latest_checkpoint(root, warn=warnings.append) is None

    assert len(warnings) == 2 and all("symlink" in w for w in warnings)
    assert str(manifest) in warnings[0] and str(root / "ckpt-0000000100") in warnings[1]


# --------------------------------------------------------------------- commit order


def test_a_failed_manifest_write_leaves_nothing_that_looks_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(tmp_path, 100, [_shard_tensors(0)])
    records = [write_shard(tmp_path, 200, 0, 1, _shard_tensors(1))]

    def disk_full(path: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "write_bytes_atomic", disk_full)
    with pytest.raises(CheckpointError, match="No space left"):
        commit(tmp_path, 200, records, meta={"global_step": 200})
    monkeypatch.undo()

    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-0000000100"]
    ckpt = latest_checkpoint(tmp_path, warn=pytest.fail)
    assert ckpt is not None and ckpt.step == 100
    # The shards stay in the .partial directory; a retried commit finishes the checkpoint.
    assert commit(tmp_path, 200, records, meta={"global_step": 200}) == tmp_path / "ckpt-0000000200"
    assert latest_checkpoint(tmp_path, warn=pytest.fail).step == 200  # type: ignore[union-attr]


def test_a_failed_recommit_of_a_step_keeps_the_old_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(tmp_path, 100, [{"w": torch.zeros(3)}], meta={"attempt": 1})
    records = [write_shard(tmp_path, 100, 0, 1, {"w": torch.ones(3)})]

    # The manifest write fails: the old checkpoint of step 100 is untouched.
    monkeypatch.setattr(writer, "write_bytes_atomic", lambda path, data: (_ for _ in ()).throw(OSError(5, "EIO")))
    with pytest.raises(CheckpointError):
        commit(tmp_path, 100, records, meta={"attempt": 2})
    monkeypatch.undo()
    ckpt = latest_checkpoint(tmp_path, warn=pytest.fail)
    assert ckpt is not None and ckpt.meta == {"attempt": 1}
    _assert_bitwise_equal(ckpt.load_all(), {"w": torch.zeros(3)})

    # The new directory cannot be renamed into place after the old one moved aside: the old one comes back.
    real_replace = os.replace

    def failing_replace(src: Any, dst: Any) -> None:
        if str(src).endswith(".partial"):
            raise OSError(5, "EIO")
        real_replace(src, dst)

    monkeypatch.setattr(writer.os, "replace", failing_replace)
    with pytest.raises(CheckpointError):
        commit(tmp_path, 100, records, meta={"attempt": 2})
    monkeypatch.undo()
    ckpt = latest_checkpoint(tmp_path, warn=pytest.fail)
    assert ckpt is not None and ckpt.meta == {"attempt": 1}
    _assert_bitwise_equal(ckpt.load_all(), {"w": torch.zeros(3)})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-0000000100"]
