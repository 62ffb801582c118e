"""User mistakes read as one clear line, never a traceback: a script run by hand with a bad cluster
configuration (psflow.init), and a --logdir that names a file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from psflow.config import check_logdir
from psflow.errors import ConfigError

SCRIPT = "import psflow\ntask = psflow.init()\nprint('started', task.task_id)\n"


def env_without_psflow(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSFLOW_", "TF_CONFIG"))}
    return {**env, **extra}


@pytest.mark.parametrize("args,extra,expected", [
    ([], {"TF_CONFIG": "{bad"}, "TF_CONFIG is not valid JSON"),
    (["--ps_hosts=localhost:2222", "--worker_hosts=localhost:2223", "--job_name=worker", "--task_index=5"], {},
     "worker:5 is out of range"),
    (["--ps_hosts=", "--worker_hosts=localhost:2223", "--job_name=worker", "--task_index=0"], {}, "no 'ps' task"),
    (["--ps_hosts=localhost:99999", "--worker_hosts=localhost:2223", "--job_name=worker", "--task_index=0"], {},
     "Port 99999"),
])
def test_by_hand_configuration_error_is_one_line_without_traceback(tmp_path: Path, args, extra, expected):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120,
                       env=env_without_psflow(**extra))
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("psflow: error:") and expected in lines[0], r.stderr


def test_caught_configuration_errors_still_raise(monkeypatch):
    import psflow

    with pytest.raises(ConfigError, match="not valid JSON"):
        psflow.init([], env={"TF_CONFIG": "{bad"})


def test_logdir_that_is_a_file_is_refused_naming_it(tmp_path: Path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"--logdir '.*afile' is a file, not a directory"):
        check_logdir(f)
    with pytest.raises(ConfigError, match=r"cannot be created: .*afile is a file"):
        check_logdir(f / "run")
    check_logdir(tmp_path / "new" / "run")  # missing directories are fine: they are created


def test_psflow_run_with_a_file_as_logdir_is_a_usage_error(tmp_path: Path):
    from click.testing import CliRunner

    from psflow.cli import main

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    (tmp_path / "afile").write_text("x")
    r = CliRunner().invoke(main, ["run", "--logdir", str(tmp_path / "afile"), str(script)])
    assert r.exit_code == 2 and "is a file, not a directory" in r.output, r.output
