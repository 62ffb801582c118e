"""The ssh backend's pure parts: --hosts, placement, the ssh command (no secret, no task on it), the
agent's first line, the route to a host; and the agent itself (python -m psflow.launch.sshagent) as a
real process without ssh: the task it starts, its relayed output, exit code and error report, the
signals it forwards, and the end of its session ending the task."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner

from psflow.cli import main
from psflow.errors import ConfigError
from psflow.launch.plan import TaskPlan
from psflow.launch.ssh import Host, agent_header, parse_hosts, place, route_address, ssh_argv
from psflow.launch.sshagent import MARK, task_env


def test_hosts_are_host_colon_slots_with_one_slot_by_default():
    assert parse_hosts("h1:2, h2 ,10.0.0.3:1") == [Host("h1", 2), Host("h2", 1), Host("10.0.0.3", 1)]


@pytest.mark.parametrize("spec, message", [
    ("", "--hosts needs at least one HOST:SLOTS"),
    ("h1:0", r"'h1:0' is not HOST or HOST:SLOTS"),
    ("h1:two", r"'h1:two' is not HOST or HOST:SLOTS"),
    ("h1:1,h1:2", "h1 is given twice"),
])
def test_bad_hosts_are_refused_saying_what_is_wrong(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_hosts(spec)


def test_tasks_fill_the_hosts_in_order_and_too_many_tasks_is_an_error():
    tasks = ["ps:0", "worker:0", "worker:1"]
    assert place(tasks, parse_hosts("a:1,b:2")) == {"ps:0": "a", "worker:0": "b", "worker:1": "b"}
    with pytest.raises(ConfigError, match=r"--hosts gives 2 slot\(s\) \(a:1, b:1\) for 3 tasks"):
        place(tasks, parse_hosts("a,b"))


def test_loopback_beside_other_hosts_is_refused_because_they_could_not_reach_it():
    assert place(["ps:0", "worker:0"], parse_hosts("localhost:2")) == {"ps:0": "localhost", "worker:0": "localhost"}
    with pytest.raises(ConfigError, match="names localhost beside other hosts.*Name this host by an address"):
        place(["ps:0", "worker:0"], parse_hosts("localhost:1,node2:1"))


def test_the_ssh_command_starts_the_agent_and_carries_no_task_and_no_secret():
    argv = ssh_argv("node2", "/opt/venv/bin/python", config="/etc/psflow/ssh_config")
    assert argv == ["ssh", "-F", "/etc/psflow/ssh_config", "-T", "-o", "BatchMode=yes", "node2",
                    "/opt/venv/bin/python -m psflow.launch.sshagent"]


def test_the_agents_first_line_carries_the_secret_and_the_task_binds_its_host():
    task = TaskPlan("worker:1", ("/py", "-u", "train.py"), (("PSFLOW_TASK", "worker:1"),))
    env = {"PSFLOW_TASK": "worker:1", "PSFLOW_SECRET_FILE": "/launcher/.secret", "PSFLOW_NUM_THREADS": "2"}
    header = json.loads(agent_header(task, env, host="node2", secret="s" * 64, cwd="/work"))
    assert header["secret"] == "s" * 64 and header["argv"] == ["/py", "-u", "train.py"] and header["cwd"] == "/work"
    assert header["env"]["PSFLOW_BIND_HOST"] == "node2" and header["env"]["OMP_NUM_THREADS"] == "2"
    assert "PSFLOW_SECRET_FILE" not in header["env"] and "PSFLOW_SECRET" not in header["env"]


def test_on_the_host_the_secret_replaces_the_launchers_secret_file():
    env = task_env({"PATH": "/bin"}, {"PSFLOW_SECRET_FILE": "/launcher/.secret", "PSFLOW_TASK": "ps:0"}, "k" * 32, "/tmp/e.json")
    assert env == {"PATH": "/bin", "PSFLOW_TASK": "ps:0", "PSFLOW_SECRET": "k" * 32, "PSFLOW_ERROR_FILE": "/tmp/e.json"}


def test_route_to_loopback_is_loopback_and_an_unknown_host_says_so():
    assert route_address("localhost") == "127.0.0.1"
    with pytest.raises(ConfigError, match="cannot find a route to 'no-such-host.invalid'"):
        route_address("no-such-host.invalid")


def test_cli_hosts_goes_with_the_default_backend_only():
    r = CliRunner().invoke(main, ["run", "--hosts", "a:3", "--backend", "slurm", "examples/mnist_softmax.py"])
    assert r.exit_code == 2 and "--hosts starts the tasks over ssh; it does not go with --backend slurm" in r.output


# -- the agent, as a real process -------------------------------------------------------------------

def agent(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "psflow.launch.sshagent"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    p.stdin.write(json.dumps({"argv": argv, "env": env or {}, "cwd": "/", "secret": "t" * 40}) + "\n")
    p.stdin.flush()
    return p


def test_agent_runs_the_task_with_the_secret_relays_its_output_and_says_its_exit_and_report():
    code = ("import json, os, sys\n"
            "print('secret ok' if os.environ['PSFLOW_SECRET'] == 't' * 40 else 'secret missing', flush=True)\n"
            "json.dump({'task': 'worker:0', 'exception': 'ValueError', 'message': 'bad'}, open(os.environ['PSFLOW_ERROR_FILE'], 'w'))\n"
            "sys.exit(3)\n")
    p = agent([sys.executable, "-c", code])
    out = p.stdout.read()  # stdin stays open: its end would be the launcher gone, and the task ended
    p.stdin.close()
    p.wait(timeout=30)
    lines = out.rstrip("\n").split("\n")  # not splitlines(): it cuts at the record separator too
    assert lines[0] == "secret ok"
    assert lines[-2].startswith(MARK + "report ") and json.loads(lines[-2][len(MARK + "report "):])["message"] == "bad"
    assert lines[-1] == MARK + "exit 3" and p.returncode == 3


def test_agent_forwards_term_and_says_the_task_died_of_it():
    p = agent([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"])
    assert p.stdout.readline() == "up\n"
    p.stdin.write("TERM\n")
    p.stdin.flush()
    out, _ = p.communicate(timeout=30)
    assert out.rstrip("\n").split("\n")[-1] == MARK + "exit -15" and p.returncode == 128 + 15


def test_the_end_of_the_session_ends_the_task():
    p = agent([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"])
    child = int(p.stdout.readline())
    p.stdin.close()  # the launcher went away
    out = p.stdout.read()
    assert p.wait(timeout=30) == 128 + 15 and out.rstrip("\n").split("\n")[-1] == MARK + "exit -15"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().split()[2] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the task {child} outlived its session")


def test_agent_forwards_usr1_to_the_task_alone_whose_stacks_come_back_through_the_session():
    code = ("import faulthandler, signal, time\n"
            "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
            "def waiting_here():\n"
            "    print('up', flush=True)\n"
            "    time.sleep(60)\n"
            "waiting_here()\n")
    p = agent([sys.executable, "-c", code])
    assert p.stdout.readline() == "up\n"
    p.stdin.write("USR1\n")
    p.stdin.flush()
    seen = []
    deadline = threading.Timer(30, p.kill)  # a dump that never comes ends the read, and the test fails below
    deadline.start()
    for line in p.stdout:  # the dump, read until the frame the task waits in shows
        seen.append(line)
        if "waiting_here" in line:
            break
    deadline.cancel()
    p.stdin.write("TERM\n")
    p.stdin.flush()
    out = p.stdout.read()
    p.wait(timeout=30)
    assert any("most recent call first" in s for s in seen) and any("waiting_here" in s for s in seen), seen
    assert out.rstrip("\n").split("\n")[-1] == MARK + "exit -15"  # USR1 did not end it; TERM did
