"""A ps builds, updates, saves and loads its optimizer without importing ``torch._dynamo``.

That import (about 1.2 s of CPU) sat on PS_INIT, between the chief's start and every worker's first
step (psflow.ps.service.build_optimizers_without_dynamo says why it need not). Checked in a fresh
interpreter, the only place where "not imported" means something.
"""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys, torch
from psflow.optim import SGD, Adam
from psflow.ps.service import build_optimizers_without_dynamo
from psflow.ps.update import DirectStep

build_optimizers_without_dynamo()
values = torch.zeros(3)
sgd = SGD(lr=0.1).build([values])
update = DirectStep(sgd)
update([torch.ones(3)])
sgd.load_state_dict(sgd.state_dict())
sgd.zero_grad()
assert 'torch._dynamo' not in sys.modules, 'building, updating, saving or loading imported torch._dynamo'
assert update.direct_calls == 1 and torch.equal(values, torch.full((3,), -0.1)), values

moments = torch.zeros(3)
DirectStep(Adam(lr=0.1).build([moments]))([torch.ones(3)])  # Adam's first update: Optimizer.step()
assert torch.allclose(moments, torch.full((3,), -0.1)), moments
print('ok')
"""


def test_a_ps_optimizer_is_built_updated_saved_and_loaded_without_importing_dynamo():
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
