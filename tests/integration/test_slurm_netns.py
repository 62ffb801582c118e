"""psflow on a Slurm whose nodes are other hosts, and what a lost node does to a run.

``tools/slurm_cluster.sh up DIR 3 --netns``: slurmctld, three slurmd nodes (10.78.0.1-3, named by
their addresses) and a login node (10.78.0.200) each in a network namespace of its own, joined by a
bridge; each host's loopback is its own, so a coordinator on loopback is out of the nodes' reach. The
launcher and Slurm's commands run in the login node's namespace (nsenter). Where namespaces or Slurm
cannot be had (not root, no iproute2), every test here skips and says why. Nodes are lost with
``scontrol update nodename=N state=down``, as an administrator or a failed health check would.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PSFLOW, ROOT, SOFTMAX, log_tails, pid_alive, read_summary, task_env

pytestmark = pytest.mark.timeout(180)

CLUSTER_SCRIPT = ROOT / "tools" / "slurm_cluster.sh"
NODES = ["10.78.0.1", "10.78.0.2", "10.78.0.3"]
LOGIN = "10.78.0.200"


class NetnsSlurm:
    def __init__(self, cluster_dir: str) -> None:
        self.conf = str(Path(cluster_dir) / "slurm.conf")
        self.login = (Path(cluster_dir) / "login.netns").read_text().strip()

    def argv(self, *argv: str) -> list[str]:
        """``argv`` run in the login node's network namespace."""
        return ["nsenter", f"--net=/run/netns/{self.login}", *argv]

    def call(self, *argv: str) -> str:
        return subprocess.run(self.argv(*argv), capture_output=True, text=True, timeout=30, env=self.env()).stdout

    def env(self) -> dict[str, str]:
        return task_env(SLURM_CONF=self.conf)

    def set_node(self, node: str, state: str) -> None:
        subprocess.run(self.argv("scontrol", "update", f"nodename={node}", f"state={state}",
                                 *(["reason=psflow-test"] if state == "down" else [])),
                       check=True, timeout=30, env=self.env(), capture_output=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[NetnsSlurm]:
    if shutil.which("bash") is None or shutil.which("nsenter") is None:
        pytest.skip("the namespace Slurm needs bash and nsenter (tools/slurm_cluster.sh --netns)")
    cluster_dir = tempfile.mkdtemp(prefix="psflow-ns-")  # short: munge's socket path has a length limit
    up = subprocess.run(["bash", str(CLUSTER_SCRIPT), "up", cluster_dir, "3", "--netns"], capture_output=True,
                        text=True, timeout=900)
    try:
        if up.returncode == 2:
            pytest.skip(f"no namespace Slurm here: {up.stderr.strip().splitlines()[-1]}")
        assert up.returncode == 0, f"the namespace Slurm did not come up:\n{up.stderr[-3000:]}"
        yield NetnsSlurm(cluster_dir)
    finally:
        subprocess.run(["bash", str(CLUSTER_SCRIPT), "down", cluster_dir], capture_output=True, timeout=120)
        shutil.rmtree(cluster_dir, ignore_errors=True)


@pytest.fixture
def slurm(cluster: NetnsSlurm) -> Iterator[NetnsSlurm]:
    """The cluster, every node up again after the test."""
    yield cluster
    for node in NODES:
        if "down" in cluster.call("sinfo", "-h", "-n", node, "-o", "%T"):
            cluster.set_node(node, "resume")


def psflow_run(slurm: NetnsSlurm, logdir: Path, *args: str) -> list[str]:
    return slurm.argv(PSFLOW, "run", "--backend", "slurm", "--nodes", "3", "--logdir", str(logdir), *args)


def job_id_of(output: str) -> str:
    m = re.search(r"Slurm job (\d+) submitted", output)
    assert m, output[-3000:]
    return m.group(1)


def wait_until_gone(slurm: NetnsSlurm, job_id: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while slurm.call("squeue", "-h", "-j", job_id).strip():
        assert time.monotonic() < deadline, f"Slurm job {job_id} still listed after {timeout_s} s"
        time.sleep(0.2)


def assert_nothing_left(slurm: NetnsSlurm, summary: dict) -> None:
    assert not slurm.call("squeue", "-h", "-s").strip(), "a job step outlived the run"
    assert not any(pid_alive(t["pid"]) for t in summary["tasks"] if t.get("pid")), "an srun client outlived the run"


def test_mnist_softmax_trains_on_three_nodes_that_are_other_hosts(slurm, tmp_path):
    logdir = tmp_path / "run"
    r = subprocess.run(psflow_run(slurm, logdir, SOFTMAX, "--", "--epochs", "2", "--init", "zeros"),
                       capture_output=True, text=True, timeout=150, env=slurm.env(), cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:] + log_tails(logdir)
    assert f"the coordinator listens on {LOGIN} (the nodes' network" in r.stdout
    s = read_summary(logdir)
    assert s["status"] == "succeeded" and s["global_step"] == 1200, s
    assert sorted(t["address"].rsplit(":", 1)[0] for t in s["tasks"]) == NODES  # each task on its own host
    wait_until_gone(slurm, job_id_of(r.stdout))
    assert_nothing_left(slurm, s)


def start_long_run(slurm: NetnsSlurm, logdir: Path, *args: str, epochs: int = 200) -> tuple[subprocess.Popen, list[str]]:
    """A run of ``epochs``, once worker:1 (on 10.78.0.3) trains: the launcher and its lines so far."""
    p = subprocess.Popen(psflow_run(slurm, logdir, *args, SOFTMAX, "--", "--init", "zeros", "--print_every", "1",
                                    "--epochs", str(epochs)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=slurm.env(), cwd=ROOT)
    lines: list[str] = []
    deadline = time.monotonic() + 90
    assert p.stdout is not None
    for line in p.stdout:  # the pipe ends if the launcher dies, so this loop ends too
        lines.append(line)
        if "[worker:1] worker=1,epoch=0" in line or time.monotonic() > deadline:
            break
    assert any("[worker:1] worker=1,epoch=0" in line for line in lines), "".join(lines)[-3000:]
    return p, lines


def finish(p: subprocess.Popen, lines: list[str], timeout_s: float = 90) -> str:
    try:
        out, _ = p.communicate(timeout=timeout_s)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
    return "".join(lines) + out


def test_a_lost_node_fails_the_run_naming_the_node_and_its_task_as_root_cause(slurm, tmp_path):
    logdir = tmp_path / "lost"
    p, lines = start_long_run(slurm, logdir)
    slurm.set_node("10.78.0.3", "down")
    out = finish(p, lines)
    assert p.returncode == 1, out[-3000:]
    job_id = job_id_of(out)
    root_line = out.index("Root cause: worker:1")
    assert f"node 10.78.0.3 (psflow-test) failed; Slurm job {job_id} goes on without it" in out[root_line:], out[-3000:]
    s = read_summary(logdir)
    assert s["status"] == "failed" and s["root_cause"] == "worker:1", s
    wait_until_gone(slurm, job_id)
    assert_nothing_left(slurm, s)


def test_with_restart_on_failure_the_lost_nodes_task_restarts_on_a_node_left(slurm, tmp_path):
    logdir = tmp_path / "moved"
    p, lines = start_long_run(slurm, logdir, "--restart", "on-failure", "--restart-backoff", "0.2", epochs=3)
    slurm.set_node("10.78.0.3", "down")
    out = finish(p, lines, timeout_s=150)
    assert p.returncode == 0, out[-3000:] + log_tails(logdir)
    assert "node 10.78.0.3 (psflow-test) failed" in out and "its tasks restart on 10.78.0.1, 10.78.0.2" in out
    s = read_summary(logdir)
    tasks = {t["task"]: t for t in s["tasks"]}
    assert s["status"] == "succeeded" and tasks["worker:1"]["attempts"] == 2, s
    assert tasks["worker:1"]["address"].rsplit(":", 1)[0] in NODES[:2]  # it moved off the lost node
    assert tasks["ps:0"]["attempts"] == 1 and tasks["worker:0"]["attempts"] == 1  # the others ran on
    wait_until_gone(slurm, job_id_of(out))
    assert_nothing_left(slurm, s)


def test_losing_the_batch_host_ends_the_allocation_and_fails_the_run_at_once(slurm, tmp_path):
    logdir = tmp_path / "batchhost"
    p, lines = start_long_run(slurm, logdir, "--restart", "on-failure")
    slurm.set_node("10.78.0.1", "down")  # the batch script's node, and ps:0's
    out = finish(p, lines)
    assert p.returncode == 1, out[-3000:]
    job_id = job_id_of(out)
    assert re.search(rf"node 10\.78\.0\.1 \(psflow-test\) failed; Slurm job {job_id} ended \(\w+\)", out), out[-3000:]
    assert "restarting it as attempt" not in out  # no restart can mend a lost allocation
    s = read_summary(logdir)
    assert s["status"] == "failed" and s["root_cause"] == "ps:0", s
    wait_until_gone(slurm, job_id)
    assert_nothing_left(slurm, s)


def test_a_psflow_script_under_the_users_own_srun_trains_across_the_hosts(slurm, tmp_path):
    # Off loopback every task needs the job's secret; srun passes the environment to each task.
    env = task_env(SLURM_CONF=slurm.conf, PSFLOW_SECRET="7f" * 16, PSFLOW_BASE_PORT="23456", PSFLOW_CONNECT_TIMEOUT_S="30")
    r = subprocess.run(slurm.argv("srun", "--nodes=3", "--ntasks=3", "--unbuffered", str(Path(PSFLOW).parent / "python"),
                                  "-u", SOFTMAX, "--epochs", "1", "--init", "zeros", "--logdir", str(tmp_path / "byhand")),
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "worker=0, final accuracy = " in r.stdout and "worker=1, final accuracy = " in r.stdout
    assert (tmp_path / "byhand" / "checkpoints").is_dir(), "the chief (worker:0) saved no checkpoint"
