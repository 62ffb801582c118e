"""psflow on a real Slurm: the launcher's ``--backend slurm``, and a script under the user's own srun.

The cluster is Debian's slurmctld, three slurmd "nodes" named 127.0.0.1-3 (each its own loopback
address) and munge, brought up in a temporary directory by ``tools/slurm_cluster.sh`` (installed with
apt where missing and root). Where Slurm cannot be had, every test here skips and says what is
missing. Each test runs in well under a minute; every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PSFLOW, ROOT, SOFTMAX, log_tails, pid_alive, read_summary, task_env

pytestmark = pytest.mark.timeout(120)

CLUSTER_SCRIPT = ROOT / "tools" / "slurm_cluster.sh"
NODES = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]


@pytest.fixture(scope="module")
def slurm_conf() -> Iterator[str]:
    """SLURM_CONF of a three-node cluster, up for this module's tests."""
    if shutil.which("bash") is None:
        pytest.skip("Slurm tests need bash to start the cluster (tools/slurm_cluster.sh)")
    cluster_dir = tempfile.mkdtemp(prefix="psflow-slurm-")  # short: munge's socket path has a length limit
    up = subprocess.run(["bash", str(CLUSTER_SCRIPT), "up", cluster_dir, "3"], capture_output=True, text=True, timeout=900)
    try:
        if up.returncode == 2:
            pytest.skip(f"no Slurm here: {up.stderr.strip().splitlines()[-1]}")
        assert up.returncode == 0, f"the Slurm cluster did not come up:\n{up.stderr[-3000:]}"
        yield str(Path(cluster_dir) / "slurm.conf")
    finally:
        subprocess.run(["bash", str(CLUSTER_SCRIPT), "down", cluster_dir], capture_output=True, timeout=120)
        shutil.rmtree(cluster_dir, ignore_errors=True)


def slurm_env(conf: str, **extra: str) -> dict[str, str]:
    return task_env(SLURM_CONF=conf, **extra)


def slurm(conf: str, *argv: str) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=slurm_env(conf))
    return r.stdout


def job_state(conf: str, job_id: str) -> str:
    m = re.search(r"JobState=(\S+)", slurm(conf, "scontrol", "-o", "show", "job", job_id))
    return m.group(1) if m else "UNKNOWN"


def wait_until_ended(conf: str, job_id: str, timeout_s: float = 30) -> str:
    """The job's final state, once squeue no longer lists it and it is no longer COMPLETING."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = job_state(conf, job_id)
        if not slurm(conf, "squeue", "-h", "-j", job_id).strip() and state not in ("RUNNING", "COMPLETING", "PENDING"):
            return state
        time.sleep(0.2)
    raise AssertionError(f"Slurm job {job_id} still listed after {timeout_s} s: {slurm(conf, 'squeue', '-h', '-s')}")


def free_base(n: int) -> int:
    """A base port whose next ``n`` ports were free on loopback a moment ago (held together, then released)."""
    for _ in range(50):
        held: list[socket.socket] = []
        try:
            held.append(socket.socket())
            held[0].bind(("127.0.0.1", 0))
            base = held[0].getsockname()[1]
            for port in range(base + 1, base + n):
                held.append(socket.socket())
                held[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {n} consecutive free loopback ports")


def job_id_of(output: str) -> str:
    m = re.search(r"Slurm job (\d+) submitted", output)
    assert m, output[-3000:]
    return m.group(1)


def run_on_slurm(conf: str, logdir: Path, *args: str, timeout_s: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([PSFLOW, "run", "--backend", "slurm", "--nodes", "3", "--logdir", str(logdir), *args],
                          capture_output=True, text=True, timeout=timeout_s, env=slurm_env(conf), cwd=ROOT)


def assert_nothing_left(conf: str, summary: dict) -> None:
    assert not slurm(conf, "squeue", "-h", "-s").strip(), "a job step outlived the run"
    assert not any(pid_alive(t["pid"]) for t in summary["tasks"] if t.get("pid")), "an srun client outlived the run"


def test_mnist_softmax_trains_on_three_slurm_nodes_to_its_accuracy(slurm_conf, tmp_path):
    logdir = tmp_path / "run"
    r = run_on_slurm(slurm_conf, logdir, SOFTMAX, "--", "--epochs", "6", "--init", "zeros", "--print_every", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:] + log_tails(logdir)
    s = read_summary(logdir)
    assert s["status"] == "succeeded" and s["global_step"] == 3600 and s["test_accuracy"] >= 0.88, s
    # One task per node, each listening on its node's own address.
    assert sorted(t["address"].rsplit(":", 1)[0] for t in s["tasks"]) == NODES
    assert "[worker:1] worker=1, final accuracy = " in r.stdout  # the steps' output streams through the launcher
    assert "final accuracy" in (logdir / "logs" / "worker-1.log").read_text()
    job_id = job_id_of(r.stdout)
    # the run's history (the job page) names the Slurm job and its nodes, whatever the backend
    events = [json.loads(line) for line in (logdir / "events.jsonl").read_text().splitlines()]
    noted = {e["event"]: e for e in events if e["event"].startswith("scheduler_")}
    assert noted["scheduler_submitted"]["job_id"] == job_id and noted["scheduler_running"]["job_id"] == job_id
    assert sorted(noted["scheduler_running"]["nodes"].split(",")) == NODES
    assert wait_until_ended(slurm_conf, job_id) == "COMPLETED"  # the launcher released the allocation
    assert_nothing_left(slurm_conf, s)


def test_a_failing_worker_fails_the_slurm_run_with_its_error_as_root_cause(slurm_conf, tmp_path):
    logdir = tmp_path / "fail"
    r = run_on_slurm(slurm_conf, logdir, "--fail-at", "worker:1@step=5", "--sbatch-arg=--time=00:07:00",
                     "--sbatch-arg=--comment=psflow \"sbatch-arg\"", SOFTMAX, "--", "--epochs", "1", "--init", "zeros")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    job = slurm(slurm_conf, "scontrol", "-o", "show", "job", job_id_of(r.stdout))  # --sbatch-arg reached sbatch
    assert "TimeLimit=00:07:00" in job and 'Comment=psflow "sbatch-arg"' in job, job
    root_line = r.stdout.index("Root cause: worker:1 exited with code 1")
    assert "Injected failure in worker:1 at step 5" in r.stdout[root_line:]
    s = read_summary(logdir)
    assert s["status"] == "failed" and s["root_cause"] == "worker:1"
    wait_until_ended(slurm_conf, job_id_of(r.stdout))
    assert_nothing_left(slurm_conf, s)


def test_a_killed_task_is_restarted_alone_as_a_new_step(slurm_conf, tmp_path, monkeypatch):
    from psflow.launch import RestartPolicy, Runner, make_plan
    from psflow.launch.slurm import SlurmBackend

    monkeypatch.setenv("SLURM_CONF", slurm_conf)
    lines: list[str] = []
    backend = SlurmBackend(nodes=3, echo=lines.append)
    plan = make_plan(SOFTMAX, ["--epochs", "6", "--init", "zeros", "--print_every", "1"], logdir=str(tmp_path / "restart"))
    killed: list[str] = []

    def kill_worker_1_once_it_trains() -> None:
        deadline = time.monotonic() + 60
        while not any("worker=1,epoch=0" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.1)
        step = backend.cli.steps(str(backend.job_id)).get("worker-1.a0")
        if step is not None:
            subprocess.run(["scancel", "--signal=KILL", step], timeout=30, capture_output=True)
            killed.append(step)

    killer = threading.Thread(target=kill_worker_1_once_it_trains, daemon=True)
    killer.start()
    result = Runner(backend, policy=RestartPolicy("on-failure", max_restarts=1, backoff_base_s=0.2)).run(plan)
    killer.join(timeout=10)
    out = "\n".join(lines)
    assert killed, out[-3000:]
    assert result.exit_code == 0, out[-3000:]
    tasks = {t["task"]: t for t in result.summary["tasks"]}
    assert tasks["worker:1"]["attempts"] == 2 and tasks["worker:1"]["exits"][0]["code"] == -9  # SIGKILL, as srun's 137
    assert tasks["ps:0"]["attempts"] == 1 and tasks["worker:0"]["attempts"] == 1  # the others ran on
    assert "worker=1, final accuracy" in out  # attempt 1 trained to the end
    assert_nothing_left(slurm_conf, result.summary)


def start_long_run(conf: str, logdir: Path) -> tuple[subprocess.Popen, str, list[str]]:
    """A run of 200 epochs, once training is under way: the launcher, its Slurm job id, its lines so far."""
    p = subprocess.Popen([PSFLOW, "run", "--backend", "slurm", "--nodes", "3", "--logdir", str(logdir), SOFTMAX, "--",
                          "--epochs", "200", "--init", "zeros", "--print_every", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=slurm_env(conf), cwd=ROOT)
    lines: list[str] = []
    deadline = time.monotonic() + 60
    assert p.stdout is not None
    for line in p.stdout:  # the pipe ends if the launcher dies, so this loop ends too
        lines.append(line)
        if "global_step=" in line or time.monotonic() > deadline:
            break
    assert any("global_step=" in line for line in lines), "".join(lines)[-3000:]
    return p, job_id_of("".join(lines)), lines


def finish(p: subprocess.Popen, lines: list[str], timeout_s: float = 60) -> str:
    try:
        out, _ = p.communicate(timeout=timeout_s)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
    return "".join(lines) + out


def test_scancel_of_the_job_stops_the_run_and_every_step(slurm_conf, tmp_path):
    logdir = tmp_path / "scancel"
    p, job_id, lines = start_long_run(slurm_conf, logdir)
    subprocess.run(["scancel", job_id], check=True, timeout=30, env=slurm_env(slurm_conf))
    out = finish(p, lines)
    assert p.returncode == 130, out[-3000:]
    assert f"Slurm job {job_id} ended while the run went on: CANCELLED" in out
    s = read_summary(logdir)
    assert s["status"] == "stopped"
    assert wait_until_ended(slurm_conf, job_id) == "CANCELLED"
    assert_nothing_left(slurm_conf, s)


def test_ctrl_c_stops_every_step_and_releases_the_allocation(slurm_conf, tmp_path):
    logdir = tmp_path / "ctrlc"
    p, job_id, lines = start_long_run(slurm_conf, logdir)
    p.send_signal(signal.SIGINT)
    out = finish(p, lines)
    assert p.returncode == 130, out[-3000:]
    assert "Ctrl-C: stopping every task" in out
    s = read_summary(logdir)
    assert s["status"] == "stopped" and all(t["exit_code"] is not None for t in s["tasks"])
    assert "stopped at step" in (logdir / "logs" / "worker-0.log").read_text()  # SIGTERM reached the task itself
    assert wait_until_ended(slurm_conf, job_id) == "COMPLETED"
    assert_nothing_left(slurm_conf, s)


def test_a_psflow_script_under_the_users_own_srun_needs_no_launcher(slurm_conf, tmp_path):
    base = free_base(3)  # the tasks listen on base + SLURM_PROCID, each on its node's address
    r = subprocess.run(["srun", "--nodes=3", "--ntasks=3", "--unbuffered", str(Path(PSFLOW).parent / "python"), "-u",
                        SOFTMAX, "--epochs", "1", "--init", "zeros", "--logdir", str(tmp_path / "byhand")],
                       capture_output=True, text=True, timeout=90, cwd=ROOT,
                       env=slurm_env(slurm_conf, PSFLOW_BASE_PORT=str(base), PSFLOW_CONNECT_TIMEOUT_S="30"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "worker=0, final accuracy = " in r.stdout and "worker=1, final accuracy = " in r.stdout
    assert (tmp_path / "byhand" / "checkpoints").is_dir(), "the chief (worker:0) saved no checkpoint"


# Each task prints what pf.init() builds from srun's environment: its rank, the node it runs on, the cluster.
_SHOW_CLUSTER = ("import json, os; from psflow.resolve.slurm import cluster_from_slurm_env as f; "
                 "s, t = f(os.environ, num_ps=1, base_port=int(os.environ['PSFLOW_BASE_PORT'])); "
                 "print(json.dumps([int(os.environ['SLURM_PROCID']), os.environ['SLURMD_NODENAME'], s.to_dict()]))")


@pytest.mark.parametrize("distribution", ["block", "cyclic", "plane=2"])
def test_under_the_users_srun_every_task_is_put_on_the_node_it_runs_on(slurm_conf, distribution):
    base = free_base(5)
    r = subprocess.run(["srun", "--nodes=3", "--ntasks=5", "-m", distribution, str(Path(PSFLOW).parent / "python"),
                        "-c", _SHOW_CLUSTER], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=slurm_env(slurm_conf, PSFLOW_BASE_PORT=str(base)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    seen = sorted(json.loads(line) for line in r.stdout.splitlines())
    clusters = {json.dumps(c) for _, _, c in seen}
    assert [rank for rank, _, _ in seen] == list(range(5)) and len(clusters) == 1, seen  # every task sees one cluster
    addresses = [*seen[0][2]["ps"], *seen[0][2]["worker"]]  # rank order
    assert addresses == [f"{node}:{base + rank}" for rank, node, _ in seen], (distribution, seen)


def test_under_srun_m_cyclic_uneven_the_by_hand_run_trains(slurm_conf, tmp_path):
    base = free_base(4)  # 4 tasks on 3 nodes: 127.0.0.1 holds ranks 0 and 3, not 0 and 1
    r = subprocess.run(["srun", "--nodes=3", "--ntasks=4", "-m", "cyclic", "--unbuffered", str(Path(PSFLOW).parent / "python"),
                        "-u", SOFTMAX, "--epochs", "1", "--init", "zeros", "--logdir", str(tmp_path / "cyclic")],
                       capture_output=True, text=True, timeout=90, cwd=ROOT,
                       env=slurm_env(slurm_conf, PSFLOW_BASE_PORT=str(base), PSFLOW_CONNECT_TIMEOUT_S="30"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert all(f"worker={i}, final accuracy = " in r.stdout for i in range(3)), r.stdout[-3000:]


def test_under_srun_m_arbitrary_a_task_refuses_saying_what_to_pass(slurm_conf, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.2\n127.0.0.1\n")
    r = subprocess.run(["srun", "--ntasks=2", "-m", "arbitrary", str(Path(PSFLOW).parent / "python"), "-c", _SHOW_CLUSTER],
                       capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=slurm_env(slurm_conf, PSFLOW_BASE_PORT="2222", SLURM_HOSTFILE=str(hostfile)))
    assert r.returncode != 0 and "SLURM_DISTRIBUTION=arbitrary" in r.stderr and "--ps_hosts/--worker_hosts" in r.stderr, \
        r.stdout[-2000:] + r.stderr[-2000:]


def _pid_of(task: str, job_id: str, logdir: Path, deadline_s: float = 30) -> int:
    """The pid of the psflow process running ``task`` in Slurm job ``job_id`` on this host (every
    node of the test cluster is this host): the one whose environment names all three (job ids
    alone repeat: test_slurm_netns.py runs a Slurm of its own beside this one, from job 1 too)."""
    want = {f"PSFLOW_TASK={task}".encode(), f"SLURM_JOB_ID={job_id}".encode(), f"PSFLOW_LOGDIR={logdir}".encode()}
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for d in Path("/proc").iterdir():
            try:
                env = set((d / "environ").read_bytes().split(b"\0"))
                cmd = (d / "cmdline").read_bytes()
            except (OSError, ValueError):
                continue
            if want <= env and b"mnist_softmax.py" in cmd and b"srun" not in cmd.split(b"\0")[0]:
                return int(d.name)
        time.sleep(0.1)
    raise AssertionError(f"no process of {task} in Slurm job {job_id} within {deadline_s} s")


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _wait_for(pred, what: str, timeout_s: float = 20) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


@pytest.mark.timeout(240)
def test_send_signal_freezes_and_resumes_a_step_and_a_frozen_task_dumps_its_stacks(slurm_conf, tmp_path, monkeypatch):
    from psflow.launch import Runner, make_plan
    from psflow.launch.slurm import SlurmBackend

    monkeypatch.setenv("SLURM_CONF", slurm_conf)
    lines: list[str] = []
    backend = SlurmBackend(nodes=3, echo=lines.append)
    logdir = tmp_path / "signals"
    plan = make_plan(SOFTMAX, ["--epochs", "4", "--init", "zeros", "--print_every", "1"], logdir=str(logdir))
    seen: dict[str, object] = {"at": "start"}

    def act() -> None:
        try:
            _wait_for(lambda: any("worker=1,epoch=0" in line for line in lines), "worker:1 trains", 60)
            pid = _pid_of("worker:1", str(backend.job_id), logdir)
            seen["at"] = f"pid {pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()!r}"
            assert backend.send_signal("worker:1", signal.SIGSTOP)
            _wait_for(lambda: _state(pid) == "T", "worker:1 stopped by SIGSTOP")
            seen["stopped"] = True
            where = backend.dump_stacks("worker:1")  # frozen: SIGUSR1, then SIGCONT so that it can dump
            assert where is not None and where.log == str(logdir / "logs" / "worker-1.log")
            seen["where"] = where
            _wait_for(lambda: _state(pid) != "T", "worker:1 resumed after the dump")
            assert backend.send_signal("worker:1", signal.SIGSTOP)
            _wait_for(lambda: _state(pid) == "T", "worker:1 stopped again")
            assert backend.send_signal("worker:1", signal.SIGCONT)
            _wait_for(lambda: _state(pid) != "T", "worker:1 resumed by SIGCONT")
            seen["resumed"] = True
        except BaseException as e:  # noqa: BLE001 - reported by the test's thread
            seen["error"] = e
            with contextlib.suppress(Exception):  # never leave it frozen: the run would wait for it
                backend.send_signal("worker:1", signal.SIGCONT)

    actor = threading.Thread(target=act, daemon=True)
    actor.start()
    result = Runner(backend).run(plan)
    actor.join(timeout=30)
    out = "\n".join(lines)
    assert "error" not in seen, f"{seen['error']!r} after {seen['at']}\n{out[-3000:]}"
    assert seen.get("stopped") and seen.get("resumed"), out[-3000:]
    assert result.exit_code == 0, out[-3000:]  # stopped and resumed, the run trained to its end
    where = seen["where"]
    dump = "".join((logdir / "logs" / "worker-1.log").read_text().splitlines(keepends=True)[where.line - 1:])  # type: ignore[attr-defined]
    assert re.search(r"^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):", dump, re.M), dump[:3000]
    assert re.search(r'File ".*mnist_softmax\.py", line \d+ in main', dump), dump[:3000]
    assert_nothing_left(slurm_conf, result.summary)


def test_a_running_slurm_run_is_scaled_up_with_one_more_step_and_back_down(slurm_conf, tmp_path):
    from conftest import psflow_in, wait_for_run

    home, logdir = tmp_path / "home", tmp_path / "scale"
    out_file = (tmp_path / "launcher.out").open("w")
    p = subprocess.Popen([PSFLOW, "run", "--backend", "slurm", "--nodes", "3", "--no-live", "--logdir", str(logdir), SOFTMAX,
                          "--", "--epochs", "200", "--init", "zeros"], stdout=out_file, stderr=subprocess.STDOUT, text=True,
                         env=slurm_env(slurm_conf, PSFLOW_HOME=str(home)), cwd=ROOT)
    try:
        def step(run: dict, task: str) -> int:
            return int(((run["tasks"].get(task) or {}).get("progress") or {}).get("local_step") or 0)

        run = wait_for_run(home / "jobs.db", lambda r: r["state"] == "running" and step(r, "worker:0") > 0,
                           what="training on Slurm", timeout_s=90, context=lambda: log_tails(logdir))
        up = psflow_in(home, "scale", run["id"], "--workers", "3")
        assert up.returncode == 0 and "2 -> 3 workers: adding worker:2" in up.stdout, up.stdout + up.stderr
        wait_for_run(home / "jobs.db", lambda r: step(r, "worker:2") >= 20, what="worker:2 training as a step",
                     timeout_s=90, context=lambda: log_tails(logdir))
        down = psflow_in(home, "scale", run["id"], "--workers", "2")
        assert down.returncode == 0 and "3 -> 2 workers: retiring worker:2" in down.stdout, down.stdout + down.stderr
        stop = psflow_in(home, "stop", run["id"])
        assert stop.returncode == 0, stop.stdout + stop.stderr
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
        out_file.close()
    summary = read_summary(logdir)
    w2 = next(t for t in summary["tasks"] if t["task"] == "worker:2")
    assert w2["exits"][0]["retired"] is True, w2  # left when asked: not failed, not restarted
    assert summary["status"] == "stopped" and summary["reports"]["ps:0"]["ps_stats"]["applied_by"]["2"], summary
    assert_nothing_left(slurm_conf, summary)
