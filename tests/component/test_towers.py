"""Component tests of in-graph towers (psflow.train.towers) alone and inside the Trainer.

What is proven, always against a single-device reference computed on the same full batch:

- 2 and 3 CPU replicas give the single-device gradients and loss (also for an uneven split, per-
  replica batches, and more replicas than examples), and training with them gives the same
  parameters as training on one device;
- the gradient average is taken in replica order with the replicas' example shares as weights;
- replicas follow the master after ``refresh`` and the master takes replica 0's buffers;
- a missing ``cuda:3`` falls back to the CPU with a warning, and the placement is printable;
- ``Trainer(..., devices=[...])`` against a real in-process ps pushes the same gradients as a
  single-device Trainer, so the parameters match after several steps; the same ``step`` line
  works with and without devices.

Tolerance: the towers sum partial means, which reorders float32 additions, so values agree to
ATOL = 1e-6 absolute / RTOL = 1e-5 relative rather than bit for bit (the per-element difference
observed is ~3e-8).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from inproc import InprocCluster

from psflow import optim
from psflow.config import TrainConfig
from psflow.devices import SoftPlacementWarning
from psflow.errors import ConfigError
from psflow.train.towers import Towers, run_step_closure, split_batch

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)

ATOL, RTOL = 1e-6, 1e-5


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def make_batch(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def loss_fn(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m(x), y)


def reference(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    """The single-device loss and gradients of the full batch (model's grads left untouched)."""
    m = copy.deepcopy(model)
    loss = loss_fn(m, x, y)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in m.parameters()]


def assert_grads_close(model: torch.nn.Module, expected: list[torch.Tensor]) -> None:
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("n", [2, 3])
def test_towers_on_n_cpus_match_single_device_gradients_and_loss(n: int) -> None:
    model = make_model()
    x, y = make_batch(12)
    ref_loss, ref_grads = reference(model, x, y)
    towers = Towers(model, ["cpu"] * n)
    loss = towers.compute_gradients(loss_fn, batch=(x, y))
    assert loss == pytest.approx(ref_loss, rel=RTOL)
    assert_grads_close(model, ref_grads)


def test_mean_of_per_tower_mean_losses_equals_full_batch_mean_for_an_even_split() -> None:
    model = make_model()
    x, y = make_batch(12)
    with torch.no_grad():
        per_tower = [float(loss_fn(model, xs, ys)) for xs, ys in split_batch((x, y), 3)]
        full = float(loss_fn(model, x, y))
    assert sum(per_tower) / 3 == pytest.approx(full, rel=RTOL)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(min_value=1, max_value=5), size=st.integers(min_value=1, max_value=13))
def test_any_split_even_or_not_matches_the_full_batch(n: int, size: int) -> None:
    model = make_model()
    x, y = make_batch(size, seed=size)
    ref_loss, ref_grads = reference(model, x, y)
    loss = Towers(model, ["cpu"] * n).compute_gradients(loss_fn, batch=(x, y))
    assert loss == pytest.approx(ref_loss, rel=RTOL)
    assert_grads_close(model, ref_grads)


def test_one_batch_per_replica_is_weighted_by_its_size() -> None:
    model = make_model()
    (x1, y1), (x2, y2) = make_batch(3, seed=2), make_batch(5, seed=3)
    _, ref_grads = reference(model, torch.cat([x1, x2]), torch.cat([y1, y2]))
    Towers(model, ["cpu", "cpu"]).compute_gradients(loss_fn, batches=[(x1, y1), (x2, y2)])
    assert_grads_close(model, ref_grads)


def test_average_is_taken_in_replica_order_as_tf_average_gradients() -> None:
    # A loss that depends on the replica's index only through its data: tower i sees x = i + 1.
    model = torch.nn.Linear(1, 1, bias=False)
    towers = Towers(model, ["cpu", "cpu", "cpu"])
    x = torch.tensor([[1.0], [2.0], [3.0]])
    towers.compute_gradients(lambda m, xb: m(xb).sum(), batch=(x,))
    # d/dw of w * x is x; mean over towers of (1, 2, 3) = 2.
    assert model.weight.grad.item() == pytest.approx(2.0)


def test_training_with_towers_equals_training_on_one_device() -> None:
    single, master = make_model(), make_model()
    towers = Towers(master, ["cpu", "cpu", "cpu"])
    opt_single = torch.optim.SGD(single.parameters(), lr=0.5, momentum=0.9)
    opt_master = torch.optim.SGD(master.parameters(), lr=0.5, momentum=0.9)
    for step in range(5):
        x, y = make_batch(9, seed=10 + step)
        opt_single.zero_grad()
        loss_fn(single, x, y).backward()
        opt_single.step()
        opt_master.zero_grad()
        towers.compute_gradients(loss_fn, batch=(x, y))
        opt_master.step()
        towers.refresh()
    for a, b in zip(single.parameters(), master.parameters()):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


def test_refresh_copies_the_master_into_every_replica() -> None:
    model = make_model()
    towers = Towers(model, ["cpu", "cpu"])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert not torch.equal(towers.replicas[1][0].weight, model[0].weight)
    towers.refresh()
    for r in towers.replicas:
        for a, b in zip(r.parameters(), model.parameters()):
            assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()


def test_master_takes_replica_0s_buffers() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    towers = Towers(model, ["cpu", "cpu"])
    x = torch.randn(8, 4) * 3 + 5
    towers.compute_gradients(lambda m, xb: m(xb).pow(2).mean(), batch=(x,))
    bn = model[1]
    assert torch.equal(bn.running_mean, towers.replicas[0][1].running_mean)
    assert not torch.equal(bn.running_mean, torch.zeros(4))


def test_more_replicas_than_examples_leaves_the_extra_towers_idle() -> None:
    model = make_model()
    x, y = make_batch(2)
    _, ref_grads = reference(model, x, y)
    Towers(model, ["cpu"] * 4).compute_gradients(loss_fn, batch=(x, y))
    assert_grads_close(model, ref_grads)


def test_missing_cuda_3_falls_back_to_cpu_with_a_warning_and_the_placement_shows_it() -> None:
    if torch.cuda.device_count() > 3:
        pytest.skip("this machine has a cuda:3")
    with pytest.warns(SoftPlacementWarning, match="cuda:3"):
        towers = Towers(make_model(), ["cuda:3", "/cpu:0"])
    assert towers.devices[1] == torch.device("cpu")
    text = towers.format_placement("worker:0")
    assert "replica 0:" in text and "(requested cuda:3; soft placement)" in text
    assert "worker:0 replica 1: cpu" in text


def test_missing_device_without_soft_placement_fails() -> None:
    with pytest.raises(ConfigError, match="cuda:999"):
        Towers(make_model(), ["cuda:999"], soft_placement=False)


@pytest.mark.parametrize("devices", [[], "cpu"])
def test_towers_need_a_list_of_devices(devices: object) -> None:
    with pytest.raises(ConfigError, match="one device per replica"):
        Towers(make_model(), devices)  # type: ignore[arg-type]


def test_towers_accept_a_function_that_builds_the_model() -> None:
    towers = Towers(make_model, ["cpu", "cpu"])
    assert len(towers) == 2 and isinstance(towers.master, torch.nn.Sequential)


def test_bad_batches_are_rejected_with_what_was_received() -> None:
    towers = Towers(make_model(), ["cpu", "cpu"])
    x, y = make_batch(4)
    with pytest.raises(ConfigError, match=r"\[\(4, 6\), \(3,\)\]"):
        towers.compute_gradients(loss_fn, batch=(x, y[:3]))
    with pytest.raises(ConfigError, match="one batch per replica \\(2\\); received 1"):
        towers.compute_gradients(loss_fn, batches=[(x, y)])
    with pytest.raises(ConfigError, match="not both"):
        towers.compute_gradients(loss_fn, batch=(x, y), batches=[(x, y), (x, y)])


def test_a_loss_that_is_not_one_number_is_rejected_naming_what_came_back() -> None:
    x, y = make_batch(4)
    per_example = lambda m, xb, yb: F.cross_entropy(m(xb), yb, reduction="none")  # noqa: E731
    with pytest.raises(ConfigError, match=r"The loss function must return a scalar tensor; received Tensor\(2,\)\."):
        Towers(make_model(), ["cpu", "cpu"]).compute_gradients(per_example, batch=(x, y))
    with pytest.raises(ConfigError, match=r"closure must return the loss as a scalar tensor; received float\."):
        run_step_closure(lambda m, xb, yb: 0.5, make_model(), batch=(x, y))


# -- inside the Trainer, against a real in-process parameter server ---------------------------


def train_against_ps(devices: list[str] | None, steps: int = 4) -> list[torch.Tensor]:
    model = make_model()
    with InprocCluster(1, 1, TrainConfig(mode="sync")) as cluster:
        trainer = cluster.trainer(0, model, optim.SGD(lr=0.3, momentum=0.5), devices=devices)
        for step in range(steps):
            x, y = make_batch(10, seed=20 + step)
            trainer.step(lambda m, xb, yb: F.cross_entropy(m(xb), yb), batch=(x, y))
        trainer.pull()
        assert trainer.examples == 10 * steps
        trainer.close()
    return [p.detach().clone() for p in model.parameters()]


def test_trainer_with_devices_matches_single_device_trainer_against_a_ps() -> None:
    single = train_against_ps(None)
    towers = train_against_ps(["cpu", "cpu", "cpu"])
    initial = list(make_model().parameters())
    assert not torch.allclose(single[0], initial[0])  # it trained
    for a, b in zip(single, towers):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


def test_trainer_with_devices_needs_the_batch_to_split() -> None:
    model = make_model()
    with InprocCluster(1, 1) as cluster:
        trainer = cluster.trainer(0, model, optim.SGD(lr=0.1), devices=["cpu", "cpu"])
        x, y = make_batch(4)
        with pytest.raises(ConfigError, match="batch=\\(x, y\\)"):
            trainer.step(lambda: F.cross_entropy(model(x), y))
        trainer.close()
