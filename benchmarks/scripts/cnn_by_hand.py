"""``cnn_steps.py`` started by hand (no launcher): the task runs, then prints what it would have
reported (its ``bench`` window and its trainer's counters) as one JSON line on stdout.

Used by ``bench_compress.py``'s two-namespace part, which starts the ps in one network namespace
and the workers in another with the seed's flags (``--ps_hosts ... --job_name ... --task_index``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cnn_steps  # noqa: E402  (a sibling script, not a package)

if __name__ == "__main__":
    from psflow.task import current_task

    cnn_steps.main()
    task = current_task()
    task.finish()  # closes the trainer (PS_DONE) and records its counters
    print(json.dumps({"task": str(task.task_id), **{k: v for k, v in task.reports.items() if k in ("bench", "trainer")}}),
          flush=True)
