"""Each launched task's torch threads: the host's cores shared by its tasks, set before the script
runs, in a forked task and in a fresh interpreter alike; --threads overrides it; a script's own
torch.set_num_threads still wins. Real processes through the real LocalBackend."""

from __future__ import annotations

from pathlib import Path

import pytest

from psflow.launch.local import LocalBackend
from psflow.launch.plan import make_plan
from psflow.launch.runner import Runner

pytestmark = pytest.mark.timeout(180)

SCRIPT = """\
import os, sys
import torch
if len(sys.argv) > 1:
    torch.set_num_threads(int(sys.argv[1]))
print("threads", os.environ["PSFLOW_TASK"], torch.get_num_threads(), flush=True)
"""


def task_threads(tmp_path: Path, *, preload: bool, args: tuple[str, ...] = (), **plan_kw: int) -> dict[str, int]:
    tmp_path.mkdir(exist_ok=True)
    script = tmp_path / "threads.py"
    script.write_text(SCRIPT)
    lines: list[str] = []
    plan = make_plan(str(script), list(args), num_ps=1, num_workers=2, logdir=str(tmp_path / f"run-{preload}"), **plan_kw)
    result = Runner(LocalBackend(echo=lines.append, preload=preload)).run(plan)
    assert result.exit_code == 0, "\n".join(lines)
    found = {}
    for log in (tmp_path / f"run-{preload}" / "logs").glob("*-?.log"):
        for line in log.read_text().splitlines():
            if line.startswith("threads "):
                _, task, n = line.split()
                found[task] = int(n)
    return found


# Forked: 16 cores, 3 tasks: 5 threads each. Fresh: 3 cores, 3 tasks: 1 each (a fresh torch caps
# OMP_NUM_THREADS at this machine's cores). Torch's default would be one per core of this machine.
@pytest.mark.parametrize("preload,cores,share", [(True, 16, 5), (False, 3, 1)])
def test_each_task_gets_its_share_of_the_cores(tmp_path: Path, preload: bool, cores: int, share: int) -> None:
    assert task_threads(tmp_path, preload=preload, cores=cores) == {"ps:0": share, "worker:0": share, "worker:1": share}


def test_threads_override_and_the_scripts_own_call_wins(tmp_path: Path) -> None:
    assert task_threads(tmp_path, preload=True, threads=3) == {"ps:0": 3, "worker:0": 3, "worker:1": 3}
    assert task_threads(tmp_path / "own", preload=True, args=("1",), cores=16) == {"ps:0": 1, "worker:0": 1, "worker:1": 1}
