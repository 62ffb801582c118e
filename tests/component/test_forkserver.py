"""Component tests of psflow.launch.forkserver: a forked task must be what `python -u SCRIPT` is.

A real fork server process (it imports torch once) forks real children; each test checks one part
of the contract a fresh interpreter gives a script: argv, environment, working directory,
``sys.path[0]``, ``__name__``, its own random seeds, exit codes from ``sys.exit``, an uncaught
exception (traceback, code 1) and a signal (-N), its own process group, and output through the
pipe it was given. Every wait has a deadline.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from psflow.launch.forkserver import ForkedTask, ForkServer

pytestmark = pytest.mark.timeout(120)
WAIT_S = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("forkserver") / "forkserver.log"
    fs = ForkServer(sys.executable, log_path=log)
    assert fs.wait_ready(90), log.read_text() if log.exists() else "no log"
    yield fs
    fs.close()


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "sub" / "task_script.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return str(path)


def _run(server: ForkServer, script: str, *args: str, env: dict[str, str] | None = None, cwd: str | None = None) -> tuple[int, str, ForkedTask]:
    task = server.spawn([sys.executable, "-u", script, *args], {**os.environ, **(env or {})}, cwd or os.getcwd())
    code = task.wait(WAIT_S)
    return code, task.stdout.read(), task


def test_a_forked_task_sees_its_argv_env_cwd_path_and_runs_as_main(server, tmp_path):
    script = _script(tmp_path, """
        import os, sys
        print("argv", sys.argv)
        print("env", os.environ.get("PSFLOW_TASK"))
        print("cwd", os.getcwd())
        print("path0", sys.path[0])
        print("name", __name__)
        print("group", os.getpgid(0) == os.getpid())
        sys.stderr.write("to stderr\\n")
    """)
    code, out, task = _run(server, script, "--epochs", "3", env={"PSFLOW_TASK": "worker:1"}, cwd=str(tmp_path))
    assert code == 0, out
    assert f"argv {[script, '--epochs', '3']!r}" in out
    assert "env worker:1" in out
    assert f"cwd {tmp_path}" in out
    assert f"path0 {Path(script).parent}" in out
    assert "name __main__" in out
    assert "group True" in out  # its own process group: the launcher signals the group
    assert "to stderr" in out
    assert task.poll() == 0


def test_exit_codes_exceptions_and_signals_end_the_task_as_in_a_fresh_interpreter(server, tmp_path):
    code, _, _ = _run(server, _script(tmp_path, "import sys\nsys.exit(3)\n"))
    assert code == 3
    code, out, _ = _run(server, _script(tmp_path, "raise ValueError('broken on purpose')\n"))
    assert code == 1
    assert "Traceback" in out and "ValueError: broken on purpose" in out
    sleeper = _script(tmp_path, "import signal\nprint('up', flush=True)\nsignal.pause()\n")  # until signalled
    task = server.spawn([sys.executable, "-u", sleeper], dict(os.environ), os.getcwd())
    assert task.stdout.readline().strip() == "up"
    os.killpg(task.pid, signal.SIGTERM)
    assert task.wait(WAIT_S) == -signal.SIGTERM


def test_tasks_that_exit_at_once_are_all_seen_exiting(server, tmp_path):
    script = _script(tmp_path, "import os\nos._exit(4)\n")
    tasks = [server.spawn([sys.executable, "-u", script], dict(os.environ), os.getcwd()) for _ in range(10)]
    assert [t.wait(WAIT_S) for t in tasks] == [4] * 10


def test_atexit_handlers_of_the_script_run(server, tmp_path):
    code, out, _ = _run(server, _script(tmp_path, "import atexit\natexit.register(lambda: print('bye', flush=True))\n"))
    assert code == 0 and "bye" in out


def test_every_task_gets_its_own_random_seeds(server, tmp_path):
    script = _script(tmp_path, """
        import random, numpy, torch
        print(torch.initial_seed(), numpy.random.randint(1 << 30), random.getrandbits(30))
    """)
    outs = [_run(server, script)[1].split() for _ in range(3)]
    for column in zip(*outs):
        assert len(set(column)) == 3, outs


def test_usable_only_for_python_scripts_with_only_psflow_variables_changed(server):
    base = {"PATH": "/bin", "HOME": "/root"}
    py = server.python
    assert server.usable_for([py, "-u", "train.py", "--x"], {**base, "PSFLOW_TASK": "ps:0"}, base)
    assert not server.usable_for([py, "-u", "train.py"], {**base, "OMP_NUM_THREADS": "1"}, base)  # read at import
    assert not server.usable_for([py, "-u", "train.py"], {"PATH": "/bin"}, base)  # a variable removed
    assert not server.usable_for(["/other/python", "-u", "train.py"], base, base)
    assert not server.usable_for([py, "-m", "module"], base, base)
