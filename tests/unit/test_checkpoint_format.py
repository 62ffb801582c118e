"""The checkpoint format's pure rules: the manifest's checksum (of canonical JSON, without its own
entry), what counts as a step, a checkpoint root or a URL, and a shard record's checks and messages."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psflow.checkpoint import ShardRecord, manifest_checksum
from psflow.checkpoint.format import CHECKSUM_KEY, check_step, check_unique_names, checkpoint_root, is_int, is_url
from psflow.errors import CheckpointError, ConfigError

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
_MANIFESTS = st.dictionaries(st.text(max_size=6).filter(lambda k: k != CHECKSUM_KEY), _JSON, min_size=1, max_size=5)


@settings(max_examples=25, deadline=None)
@given(_MANIFESTS, st.text(max_size=64), st.randoms(use_true_random=False))
def test_the_manifest_checksum_is_the_sha256_of_its_canonical_json_without_its_own_entry(
    manifest: dict[str, Any], stored: str, rng: Any
) -> None:
    # Canonical JSON: sorted keys, no whitespace; so any tool can verify a manifest, and the
    # checksum does not depend on the order or layout the file was written in.
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    want = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    keys = list(manifest)
    rng.shuffle(keys)
    reordered = {k: manifest[k] for k in reversed(keys)}

    assert manifest_checksum(manifest) == want
    assert manifest_checksum({**reordered, CHECKSUM_KEY: stored}) == want


def test_the_manifest_checksum_covers_every_entry_but_its_own() -> None:
    manifest = {"step": 3, "meta": {"b": 1, "a": [1.5, "x"]}, CHECKSUM_KEY: "0" * 64}

    assert manifest_checksum(manifest) == hashlib.sha256(b'{"meta":{"a":[1.5,"x"],"b":1},"step":3}').hexdigest()
    assert manifest_checksum({**manifest, "step": 4}) != manifest_checksum(manifest)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_manifest_holding_nan_or_infinity_has_no_checksum(bad: float) -> None:
    # Not JSON: commit refuses such meta, and the reader refuses a manifest that holds one.
    with pytest.raises(ValueError):
        manifest_checksum({"meta": {"loss": bad}})


def test_is_int_means_an_int_that_is_not_a_bool() -> None:
    assert [is_int(v) for v in (0, -3, 2**70)] == [True, True, True]
    assert [is_int(v) for v in (True, False, 1.0, "1", None)] == [False] * 5


def test_a_url_root_has_a_scheme_and_a_path_object_is_never_one() -> None:
    assert is_url("s3://bucket/run/checkpoints") and is_url("file:///tmp/c")
    assert not is_url("runs/a/checkpoints") and not is_url(Path("s3:/b")) and not is_url(None)


def test_a_checkpoint_root_is_a_directory_or_not_there_yet(tmp_path: Path) -> None:
    assert checkpoint_root(str(tmp_path)) == tmp_path
    assert checkpoint_root(tmp_path / "missing") == tmp_path / "missing"
    (tmp_path / "afile").write_text("x")

    with pytest.raises(ConfigError) as e:
        checkpoint_root(tmp_path / "afile")
    assert str(e.value) == (f"The checkpoint root is not a directory. Received: {str(tmp_path / 'afile')!r}. "
                            "Pass a directory (it is created if missing).")


@pytest.mark.parametrize("step", [0, 1, 10**12])
def test_a_step_is_any_int_from_zero(step: int) -> None:
    check_step(step)


@pytest.mark.parametrize("step", [-1, True, 1.0, "3", None])
def test_anything_else_is_refused_as_a_step_naming_the_value(step: object) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"step must be an int >= 0. Received: {step!r}.")):
        check_step(step)


def _record(shard: int, names: tuple[str, ...], n: int = 2) -> ShardRecord:
    return ShardRecord(shard, n, f"shard-{shard:05d}-of-{n:05d}.safetensors", "a" * 64, 8, names)


@pytest.mark.parametrize("data, kind", [(["shard", 0], "list"), ("{}", "str"), (None, "NoneType")])
def test_a_shard_record_that_is_not_a_json_object_is_refused_naming_its_type(data: object, kind: str) -> None:
    with pytest.raises(CheckpointError, match=re.escape(f"A shard record must be a JSON object, received {kind}: {data!r}.")):
        ShardRecord.from_dict(data)  # type: ignore[arg-type]


def test_a_tensor_name_on_two_shards_is_refused_naming_both_shards() -> None:
    records = [_record(0, ("a", "b")), _record(1, ("c", "b"))]
    check_unique_names(records[:1] + [_record(1, ("c",))], "step 5")

    with pytest.raises(CheckpointError, match=re.escape(
            "Tensor name 'b' is in both shard 0 and shard 1 of step 5. Every tensor must live on exactly one shard.")):
        check_unique_names(records, "step 5")
