"""The seed's asynchronous MNIST job, end to end, through the launcher and by hand."""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import PSFLOW, ROOT, SOFTMAX, free_ports, log_tails, pid_alive, read_summary, run_psflow, task_env

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("async") / "run"
    r = run_psflow(["run", "--ps", "1", "--workers", "2", "--logdir", str(logdir), SOFTMAX, "--",
                    "--epochs", "6", "--init", "zeros", "--print_every", "2"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:] + log_tails(logdir)
    return logdir, r, read_summary(logdir)


def test_async_job_converges(async_run):
    logdir, r, s = async_run
    assert s["status"] == "succeeded" and s["mode"] == "async"
    assert s["test_accuracy"] >= 0.88, s
    assert "[worker:0] worker=0,epoch=1,global_step=" in r.stdout
    assert "final accuracy = " in r.stdout


def test_the_readmes_checkpoint_commands_work_on_the_examples_run(async_run, tmp_path):
    # README: `psflow checkpoints LOGDIR`, `psflow export LOGDIR model.safetensors` after a run.
    logdir, _, s = async_run
    listed = run_psflow(["checkpoints", str(logdir)], timeout_s=60)
    assert listed.returncode == 0 and f"step={s['global_step']}  shards=1" in listed.stdout and " ok" in listed.stdout, listed.stdout
    out = tmp_path / "model.safetensors"
    exported = run_psflow(["export", str(logdir), str(out)], timeout_s=60)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    from safetensors.torch import load_file

    state = load_file(str(out))
    assert {k: tuple(v.shape) for k, v in state.items()} == {"w": (784, 10), "b": (10,)}


def test_global_step_counts_every_update_of_both_workers(async_run):
    _, _, s = async_run
    local = {t: rep["trainer"]["local_step"] for t, rep in s["reports"].items() if "trainer" in rep}
    assert set(local) == {"worker:0", "worker:1"} and all(v > 0 for v in local.values())
    ps = s["reports"]["ps:0"]
    assert ps["global_step"] == sum(local.values()) == s["global_step"]
    assert ps["ps_stats"]["applied_updates"] == ps["ps_stats"]["pushes"] == sum(local.values())


def test_ps_exits_by_itself_and_no_process_is_left(async_run):
    logdir, _, s = async_run
    assert (logdir / "logs" / "forkserver.log").exists()  # the default: tasks forked from the preloaded server
    codes = {t["task"]: t["exit_code"] for t in s["tasks"]}
    assert codes == {"ps:0": 0, "worker:0": 0, "worker:1": 0}
    assert not any(pid_alive(t["pid"]) for t in s["tasks"])
    assert s["examples_per_sec"] > 0 and s["wall_s"] > 0


def test_no_preload_starts_every_task_as_a_fresh_process(tmp_path):
    logdir = tmp_path / "run"
    r = run_psflow(["run", "--no-preload", "--ps", "1", "--workers", "1", "--logdir", str(logdir), SOFTMAX, "--",
                    "--epochs", "1", "--init", "zeros", "--print_every", "1"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:] + log_tails(logdir)
    assert not (logdir / "logs" / "forkserver.log").exists()
    s = read_summary(logdir)
    assert s["status"] == "succeeded" and s["global_step"] == 600 and s["test_accuracy"] > 0.8


def test_failing_worker_fails_the_job_with_its_error_first(tmp_path):
    logdir = tmp_path / "fail"
    r = run_psflow(["run", "--ps", "1", "--workers", "2", "--logdir", str(logdir), "--fail-at", "worker:1@step=5",
                    SOFTMAX, "--", "--epochs", "1", "--init", "zeros"])
    assert r.returncode == 1, r.stdout[-2000:]
    out = r.stdout
    root_line = out.index("Root cause: worker:1")
    assert "Injected failure in worker:1 at step 5" in out[root_line:]
    s = read_summary(logdir)
    assert s["status"] == "failed" and s["root_cause"] == "worker:1"
    assert not any(pid_alive(t["pid"]) for t in s["tasks"])


def test_sigterm_to_the_launcher_stops_every_task(tmp_path):
    logdir = tmp_path / "term"
    p = subprocess.Popen([PSFLOW, "run", "--ps", "1", "--workers", "2", "--logdir", str(logdir), SOFTMAX, "--",
                          "--epochs", "200", "--init", "zeros", "--print_every", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=task_env(), cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        for line in p.stdout:  # wait until training is under way
            if "global_step=" in line or time.monotonic() > deadline:
                break
        live = _wait_for_live_progress(logdir, deadline_s=30)  # status.json follows the run while it goes on
        assert live["state"] == "running" and live["tasks"]["worker:0"]["state"] == "running"
        shown = run_psflow(["status", str(logdir)], timeout_s=60)
        assert shown.returncode == 0 and "worker:1" in shown.stdout and "running" in shown.stdout, shown.stdout
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130
    s = read_summary(logdir)
    assert s["status"] == "stopped"
    assert not any(pid_alive(t["pid"]) for t in s["tasks"])
    final = json.loads((logdir / "status.json").read_text())
    assert final["state"] == "stopped" and all(t["exit_code"] is not None for t in final["tasks"].values())


def _wait_for_live_progress(logdir: Path, deadline_s: float) -> dict:
    """Poll status.json (bounded by the deadline) until the ps and both workers have reported progress."""
    end = time.monotonic() + deadline_s
    state: dict = {}
    while time.monotonic() < end:
        try:
            state = json.loads((logdir / "status.json").read_text())
        except (OSError, ValueError):
            state = {}
        tasks = state.get("tasks", {})
        if all(tasks.get(w, {}).get("progress", {}).get("global_step", 0) > 0 for w in ("ps:0", "worker:0", "worker:1")):
            return state
        time.sleep(0.05)  # polling a file another process writes, bounded by the deadline
    raise AssertionError(f"no live progress from every task within {deadline_s} s: {state}")


_BY_HAND_LOGDIRS: dict[int, str] = {}


def _by_hand(procs, ports, job, index, extra_env=None, args=("--epochs", "1", "--init", "zeros")):
    flags = [f"--ps_hosts=localhost:{ports[0]}", f"--worker_hosts=localhost:{ports[1]},localhost:{ports[2]}",
             f"--job_name={job}", f"--task_index={index}"]
    # One fresh logdir per job (its Supervisor checkpoints there), not the shared default in the repository.
    if ports[0] not in _BY_HAND_LOGDIRS:
        _BY_HAND_LOGDIRS[ports[0]] = tempfile.mkdtemp(prefix="psflow-by-hand-")
        atexit.register(shutil.rmtree, _BY_HAND_LOGDIRS[ports[0]], True)
    logdir = _BY_HAND_LOGDIRS[ports[0]]
    env = task_env(PSFLOW_LOGDIR=logdir, **(extra_env or {}))
    p = subprocess.Popen([sys.executable, SOFTMAX, *flags, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=env, cwd=ROOT, start_new_session=True)
    procs.append(p)
    return p


def _wait_for_port(port: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)  # polling a port that a separate process opens; bounded by the deadline
    raise AssertionError(f"nothing listened on port {port} within {timeout_s} s")


def test_by_hand_launch_with_the_seeds_flags(procs):
    ports = free_ports(3)
    ps = _by_hand(procs, ports, "ps", 0)
    workers = [_by_hand(procs, ports, "worker", i) for i in range(2)]
    outs = [w.communicate(timeout=180)[0] for w in workers]
    for i, (w, out) in enumerate(zip(workers, outs)):
        assert w.returncode == 0, out[-2000:]
        assert f"worker={i}, final accuracy = " in out
    ps_out = ps.communicate(timeout=60)[0]  # the ps exits by itself once both workers are done
    assert ps.returncode == 0, ps_out[-2000:]


def test_by_hand_supervised_job_with_a_killed_worker_ends_with_the_ps_naming_it(procs):
    """Issue 8, item 8, end to end with the example as a user runs it: worker:1 is SIGKILLed mid-run.
    The chief (a Supervisor, which waits for the other workers before its final checkpoint) does not
    wait for a worker the ps reports lost: it checkpoints and finishes; the ps then says whom it waits
    for and, after lost_worker_timeout_s, exits with an error naming worker:1, instead of both
    waiting for it forever."""
    ports = free_ports(3)
    cfg = {"PSFLOW_TRAIN_CONFIG": json.dumps({"lost_worker_timeout_s": 2.0})}
    ps = _by_hand(procs, ports, "ps", 0, cfg)
    chief = _by_hand(procs, ports, "worker", 0, cfg)
    killed = _by_hand(procs, ports, "worker", 1, {**cfg, "PSFLOW_FAIL_AT": "worker:1@step=20:kill"})
    killed.communicate(timeout=180)
    assert killed.returncode == -9
    out = chief.communicate(timeout=180)[0]
    assert chief.returncode == 0, out[-2000:]
    assert "not waiting for worker:1: lost" in out, out[-2000:]
    ps_out = ps.communicate(timeout=60)[0]
    assert ps.returncode == 1, ps_out[-2000:]
    assert re.search(r"ps:0: waiting for worker:1 to finish .*global step \d+", ps_out), ps_out
    assert re.search(r"ps:0 waited 2\.\d s for worker:1 to come back", ps_out), ps_out
    assert "Traceback" not in ps_out, ps_out


def test_garbage_and_wrong_secret_do_not_hurt_a_real_ps(procs):
    from psflow.errors import AuthError
    from psflow.wire.conn import connect

    ports = free_ports(3)
    secret = {"PSFLOW_SECRET": "right-secret"}
    ps = _by_hand(procs, ports, "ps", 0, secret)
    _wait_for_port(ports[0])
    for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\x00" * 64, bytes(range(256)) * 4):
        with socket.create_connection(("127.0.0.1", ports[0]), timeout=10) as s:
            s.sendall(junk)
            s.settimeout(10)
            try:
                while s.recv(4096):
                    pass
            except (TimeoutError, ConnectionResetError):
                pass
    with pytest.raises(AuthError, match="did not prove the job's secret"):
        connect(f"127.0.0.1:{ports[0]}", secret=b"wrong", task="worker:9", peer="ps:0", deadline_s=10)
    workers = [_by_hand(procs, ports, "worker", i, secret) for i in range(2)]
    for w in workers:
        out = w.communicate(timeout=180)[0]
        assert w.returncode == 0, out[-2000:]
    ps.communicate(timeout=60)
    assert ps.returncode == 0


def test_busy_port_is_one_clear_error(procs):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        ports = [port, *free_ports(2)]
        p = _by_hand(procs, ports, "ps", 0)
        out = p.communicate(timeout=60)[0]
    finally:
        holder.close()
    assert p.returncode != 0
    assert f"cannot listen on localhost:{port}" in out and "Pick a free port" in out


def test_a_spec_without_ps_is_one_clear_error(procs):
    p = subprocess.Popen([sys.executable, SOFTMAX, "--worker_hosts=localhost:2223", "--job_name=worker", "--task_index=0"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=task_env(), cwd=ROOT)
    procs.append(p)
    out = p.communicate(timeout=60)[0]
    assert p.returncode != 0
    assert "has no 'ps' task" in out and "localhost:2223" in out


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def test_killing_the_launcher_leaves_no_orphan_task(tmp_path):
    logdir = tmp_path / "kill"
    p = subprocess.Popen([PSFLOW, "run", "--ps", "1", "--workers", "2", "--logdir", str(logdir), SOFTMAX, "--",
                          "--epochs", "200", "--init", "zeros", "--print_every", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=task_env(), cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        for line in p.stdout:
            if "global_step=" in line or time.monotonic() > deadline:
                break
        # The fork server and the three tasks it forked (`psflow run --no-preload`: the tasks alone).
        kids = _children(p.pid)
        kids += [g for k in kids for g in _children(k)]
        assert len(kids) == 4, kids
        p.kill()  # SIGKILL: the launcher gets no chance to clean up
        p.wait(timeout=10)
        deadline = time.monotonic() + 30
        while any(pid_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling other processes' exit, bounded by the deadline
        assert not any(pid_alive(k) for k in kids)
    finally:
        if p.poll() is None:
            p.kill()


def test_on_a_terminal_the_launcher_keeps_a_live_table_of_the_tasks(tmp_path):
    import pty

    logdir = tmp_path / "tty"
    master, slave = pty.openpty()
    p = subprocess.Popen([PSFLOW, "run", "--ps", "1", "--workers", "1", "--logdir", str(logdir), SOFTMAX, "--",
                          "--epochs", "2", "--init", "zeros", "--print_every", "1"],
                         stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=task_env(COLUMNS="120"), cwd=ROOT)
    os.close(slave)
    chunks = []
    try:
        while True:  # read until the launcher exits and the terminal closes (EIO), bounded by the test timeout
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        p.wait(timeout=60)
    finally:
        os.close(master)
        if p.poll() is None:
            p.kill()
    out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode("utf-8", "replace"))  # no colours
    assert p.returncode == 0, out[-3000:]
    assert "global step" in out and "examples/s" in out  # the table's header
    assert "[worker:0] worker=0, final accuracy" in out  # the tasks' output still comes through
    assert "(succeeded, async)" in out  # the final table


@pytest.mark.long  # ~35 s: make test-long
def test_a_killed_ps_is_the_root_cause_and_the_summary_keeps_the_last_global_step(tmp_path):
    logdir = tmp_path / "pskill"
    p = subprocess.Popen([PSFLOW, "run", "--ps", "1", "--workers", "2", "--logdir", str(logdir), SOFTMAX, "--",
                          "--epochs", "200", "--init", "zeros", "--print_every", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=task_env(), cwd=ROOT)
    try:
        live = _wait_for_live_progress(logdir, deadline_s=120)
        os.kill(live["tasks"]["ps:0"]["pid"], signal.SIGKILL)
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1, out[-3000:]
    assert "Root cause: ps:0 exited with code -9" in out
    s = read_summary(logdir)
    assert s["status"] == "failed" and s["root_cause"] == "ps:0"
    assert s["global_step"] >= live["global_step"] > 0  # from the live progress: no final reports came
    assert not any(pid_alive(t["pid"]) for t in s["tasks"])
