"""Component tests of the worker's compute on CUDA (skipped on a machine without a CUDA GPU).

What is proven, against the same computation on the CPU:

- towers on ``cuda:0`` (one and several replicas of the one card) give the CPU's gradients and loss;
- ``Trainer(..., devices=["cuda:0"])`` and four towers on ``cuda:0`` against a real in-process ps
  train to the CPU trainer's parameters (the ps and its optimizer stay on the CPU; only the worker's
  forward and backward run on the GPU), and the model the user holds stays where they put it.

Tolerance: GPU kernels (cuDNN convolutions, TF32 off by default for float32 matmuls in PyTorch)
reorder float32 additions, so values agree to 1e-5 absolute / 1e-4 relative.
"""

from __future__ import annotations

import pytest
import torch
from test_towers import loss_fn, make_batch, make_model, reference, train_against_ps

from psflow.train.towers import Towers

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")]

ATOL, RTOL = 1e-5, 1e-4


@pytest.mark.parametrize("replicas", [1, 4])
def test_towers_on_cuda_match_the_cpu_gradients_and_loss(replicas: int) -> None:
    model = make_model()
    x, y = make_batch(40)
    ref_loss, ref_grads = reference(model, x, y)
    towers = Towers(model, ["cuda:0"] * replicas)
    loss = towers.compute_gradients(loss_fn, batch=(x, y))
    assert loss == pytest.approx(ref_loss, rel=RTOL, abs=ATOL)
    for p, g in zip(towers.master.parameters(), ref_grads):
        torch.testing.assert_close(p.grad.detach().cpu(), g, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("devices", [["cuda:0"], ["cuda:0"] * 4])
def test_a_cuda_trainer_against_a_ps_trains_to_the_cpu_trainers_parameters(devices: list[str]) -> None:
    cpu = train_against_ps(None)
    gpu = train_against_ps(devices)
    initial = list(make_model().parameters())
    assert not torch.allclose(cpu[0], initial[0])  # it trained
    for a, b in zip(cpu, gpu):
        torch.testing.assert_close(b.cpu(), a, atol=ATOL, rtol=RTOL)
