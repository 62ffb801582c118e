"""Unit tests of psflow.devices: device names, soft placement, placement listing.

Availability is passed explicitly (``available=``) wherever the answer depends on the machine, so
these tests mean the same on a laptop and on a box with GPUs.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from psflow.devices import (
    SoftPlacementWarning,
    available_devices,
    format_device_placement,
    parse_device,
    resolve_device,
)
from psflow.errors import ConfigError

CPU = torch.device("cpu")
CPU_ONLY = [CPU]
TWO_GPUS = [CPU, torch.device("cuda", 0), torch.device("cuda", 1)]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("cpu", CPU),
        ("/cpu:0", CPU),
        ("/cpu:3", CPU),  # TensorFlow: every CPU is one device
        ("CPU", CPU),
        ("cuda", torch.device("cuda", 0)),
        ("cuda:1", torch.device("cuda", 1)),
        ("/gpu:1", torch.device("cuda", 1)),
        ("gpu:2", torch.device("cuda", 2)),
        ("/device:GPU:1", torch.device("cuda", 1)),
        ("/job:worker/replica:0/task:1/gpu:3", torch.device("cuda", 3)),
        ("/job:localhost/replica:0/task:0/cpu:0", CPU),
        ("mps", torch.device("mps", 0)),
        (" /gpu:0 ", torch.device("cuda", 0)),
        (torch.device("cuda", 2), torch.device("cuda", 2)),
        (torch.device("cpu"), CPU),
    ],
)
def test_torch_and_tensorflow_names_parse_to_the_same_device(name: object, expected: torch.device) -> None:
    assert parse_device(name) == expected  # type: ignore[arg-type]


@given(st.integers(min_value=0, max_value=10_000))
def test_tf_gpu_and_torch_cuda_names_agree_for_any_index(i: int) -> None:
    assert parse_device(f"/gpu:{i}") == parse_device(f"cuda:{i}") == parse_device(f"/device:GPU:{i}") == torch.device("cuda", i)
    assert parse_device(f"/cpu:{i}") == CPU


@pytest.mark.parametrize("bad", ["", "tpu:0", "/gpu:-1", "cuda:x", "gpu0", "/job:worker", 3])
def test_unreadable_name_is_a_config_error_naming_it(bad: object) -> None:
    with pytest.raises(ConfigError) as e:
        parse_device(bad)  # type: ignore[arg-type]
    assert repr(bad) in str(e.value)


def test_unreadable_name_is_an_error_even_with_soft_placement() -> None:
    with pytest.raises(ConfigError, match="'gpu-1'"):
        resolve_device("gpu-1", soft_placement=True, available=CPU_ONLY)


def test_existing_device_is_returned_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_device("/gpu:1", available=TWO_GPUS) == torch.device("cuda", 1)
        assert resolve_device("/cpu:0", available=CPU_ONLY) == CPU


def test_missing_gpu_falls_back_to_cpu_with_a_warning_naming_both() -> None:
    with pytest.warns(SoftPlacementWarning) as record:
        got = resolve_device("cuda:3", available=CPU_ONLY)
    assert got == CPU
    message = str(record[0].message)
    assert "cuda:3" in message and "using cpu" in message


def test_missing_gpu_index_falls_back_to_gpu_0_when_gpus_exist() -> None:
    with pytest.warns(SoftPlacementWarning, match=r"/gpu:7 \(cuda:7\).*using cuda:0"):
        assert resolve_device("/gpu:7", available=TWO_GPUS) == torch.device("cuda", 0)


def test_missing_device_without_soft_placement_names_it_and_the_available_ones() -> None:
    with pytest.raises(ConfigError) as e:
        resolve_device("cuda:3", soft_placement=False, available=TWO_GPUS)
    msg = str(e.value)
    assert "cuda:3" in msg and "cpu, cuda:0, cuda:1" in msg


def test_this_machine_always_has_the_cpu_and_an_absent_gpu_falls_back() -> None:
    assert available_devices()[0] == CPU
    with pytest.warns(SoftPlacementWarning):
        got = resolve_device("cuda:999")
    assert got in available_devices()


def test_placement_lists_every_replica_and_marks_soft_placed_ones() -> None:
    replicas = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), "cpu"]
    text = format_device_placement(replicas, requested=["cpu", "cuda:3", "/cpu:0"], task="worker:1")
    lines = text.splitlines()
    assert lines[0] == "Device placement (3 replicas):"
    assert lines[1] == "  worker:1 replica 0: cpu"
    assert lines[2] == "  worker:1 replica 1: cpu  (requested cuda:3; soft placement)"
    assert lines[3] == "  worker:1 replica 2: cpu"


def test_placement_of_a_module_without_tensors_says_so() -> None:
    assert "(no tensors)" in format_device_placement([torch.nn.ReLU()])


def test_placement_with_a_requested_list_of_the_wrong_length_is_rejected() -> None:
    with pytest.raises(ConfigError, match="2 devices for 1 replicas"):
        format_device_placement(["cpu"], requested=["cpu", "cpu"])
