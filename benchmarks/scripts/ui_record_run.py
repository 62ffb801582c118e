"""One MNIST softmax run through the real launcher, recorded in the job store or in its files only;
prints its summary's figures as JSON (bench_ui.py's recording-cost case).

Run: ``python benchmarks/scripts/ui_record_run.py jobstore|files LOGDIR_PARENT EPOCHS``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from psflow.launch import LocalBackend, make_plan
from psflow.launch.runner import Runner
from psflow.launch.runstore import file_store
from psflow.platform.recording import recording

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    store, parent, epochs = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    plan = make_plan(str(REPO / "examples" / "mnist_softmax.py"), ["--epochs", epochs, "--init", "zeros"], num_ps=1,
                     num_workers=2, logdir=str(parent / "run"))
    backend = LocalBackend(live=False, echo=lambda line: None)
    runner = Runner(backend, store=file_store if store == "files" else recording(backend))
    result = runner.run(plan)
    if result.exit_code != 0:
        raise SystemExit(f"the run failed: {result.root_cause}")
    print(json.dumps({"examples_per_sec": result.summary["examples_per_sec"], "wall_s": result.summary.get("wall_s")}))


if __name__ == "__main__":
    main()
