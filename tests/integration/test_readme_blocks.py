"""The README's shell blocks run as written, in order, in one fresh directory: what a newcomer does.

The directory holds the checkout's ``.venv``, ``examples`` and ``tools`` (symlinks), so every
relative path in the README resolves as in the checkout, and the runs the blocks make (``runs/``,
``model.safetensors``) stay out of it; ``PSFLOW_HOME`` is a temporary one. A block that needs what
this machine cannot be assumed to have is skipped, saying why: ``make`` (the set-up and the whole
suite, which CI runs) and Slurm (tests/integration/test_slurm.py runs a script under the user's own
srun on a throw-away Slurm). Then the README's claims about what the blocks left are checked: the two
by-hand runs, started the same way one after the other, each wrote a logdir of its own, and the
second ``--logdir runs/mine`` run resumed the first.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, task_env

from psflow import checkpoint

pytestmark = pytest.mark.timeout(240)

README = ROOT / "README.md"
BLOCK_TIMEOUT_S = 120
SKIPPED = {  # a word in the block -> why it is not run here
    "make ": "make demo / make test set up the venv and run the whole suite (CI runs both)",
    "srun ": "needs a Slurm cluster (tests/integration/test_slurm.py runs a script under srun on a throw-away one)",
}


def readme_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.DOTALL)


def why_skipped(block: str) -> str | None:
    return next((why for word, why in SKIPPED.items() if word in block), None)


def test_every_readme_block_is_run_or_skipped_for_a_stated_reason():
    blocks = readme_blocks()
    run = [b for b in blocks if why_skipped(b) is None]
    assert len(run) >= 5, blocks  # the template, a mode, by hand, checkpoints, several machines, 中文
    assert any("--job_name=ps" in b for b in run) and any("--logdir runs/mine" in b for b in run)


@pytest.mark.slow  # about a minute on a quiet 2-core machine: six runs, each a few seconds
def test_the_readme_shell_blocks_run_in_order_as_written(tmp_path: Path):
    for name in (".venv", "examples", "tools"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = task_env(PSFLOW_HOME=str(tmp_path / "home"))
    outputs: list[str] = []
    for i, block in enumerate(readme_blocks()):
        if why_skipped(block) is not None:
            continue
        try:
            done = subprocess.run(["bash", "-e", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=BLOCK_TIMEOUT_S, start_new_session=True)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"README block {i} ran past {BLOCK_TIMEOUT_S} s:\n{block}\n{e.stdout}") from e
        out = done.stdout + done.stderr
        assert done.returncode == 0, f"README block {i} failed (exit {done.returncode}):\n{block}\n{out[-4000:]}"
        outputs.append(out)
    everything = "\n".join(outputs)

    by_hand = sorted(p.name for p in (tmp_path / "runs").glob("mnist_softmax-*"))
    assert len(by_hand) == 2, by_hand  # the English and the 中文 by-hand blocks: a logdir each
    for name in by_hand:
        assert f"worker:0: logdir runs/{name} (this run's own" in everything
    mine = tmp_path / "runs" / "mine"
    assert f"worker:0: restored from {mine.resolve() / 'checkpoints' / 'ckpt-0000000128'} at step 128" in everything
    assert checkpoint.list_checkpoints(mine / "checkpoints")[0].name == "ckpt-0000000256"  # two more epochs
    assert (tmp_path / "model.safetensors").is_file()
