"""psflow across hosts: three network namespaces with their own addresses (10.79.0.1-3, joined by a
bridge) and an OpenSSH server in each, made by ``tools/netns_hosts.sh`` with a throw-away key. The
launcher runs in the first host and starts the tasks over ssh (``psflow run --hosts``): ps on one host,
workers on the others, trained with the job secret required (their addresses are not loopback).

Skipped, saying why, where namespaces or sshd cannot be made (not root, no iproute2, no sshd and no
apt). Every wait has a deadline.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import PSFLOW, ROOT, SOFTMAX, log_tails, read_summary, task_env

pytestmark = pytest.mark.timeout(180)

SCRIPT = ROOT / "tools" / "netns_hosts.sh"
NET = "10.79.0"
ADDRS = [f"{NET}.{i}" for i in (1, 2, 3)]


@dataclass(frozen=True)
class Hosts:
    prefix: str
    dir: Path

    @property
    def ssh_config(self) -> str:
        return str(self.dir / "ssh_config")

    def ns(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        """``argv`` in host ``i`` (ip netns exec execs it: the pid is the command's)."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns(i), *argv], env=kw.pop("env", task_env()), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)

    def pids(self, i: int) -> set[int]:
        out = subprocess.run(["ip", "netns", "pids", self.ns(i)], capture_output=True, text=True, timeout=10).stdout
        return {int(p) for p in out.split()}


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    if shutil.which("bash") is None or shutil.which("ip") is None:
        pytest.skip("multi-host tests need bash and iproute2 (ip netns)")
    h = Hosts(f"pfs{os.getpid() % 100000}", Path(tempfile.mkdtemp(prefix="psflow-hosts-")))
    try:
        for cmd in (["up", h.prefix, "3", NET], ["sshd", h.prefix, "3", str(h.dir)]):
            r = subprocess.run(["bash", str(SCRIPT), *cmd], capture_output=True, text=True, timeout=600)
            if r.returncode == 2:
                pytest.skip(f"no network-namespace hosts here: {r.stderr.strip().splitlines()[-1]}")
            assert r.returncode == 0, f"tools/netns_hosts.sh {' '.join(cmd)} failed:\n{r.stderr[-3000:]}"
        yield h
    finally:
        subprocess.run(["bash", str(SCRIPT), "down", h.prefix, str(h.dir)], capture_output=True, timeout=60)
        shutil.rmtree(h.dir, ignore_errors=True)


def sshd_pids(h: Hosts) -> set[int]:
    return {int((h.dir / f"sshd-{i}.pid").read_text()) for i in (1, 2, 3)}


def launcher(h: Hosts, logdir: Path, *args: str) -> subprocess.Popen:
    return h.popen(1, [PSFLOW, "run", "--no-live", "--hosts", ",".join(f"{a}:1" for a in ADDRS), "--ssh-config",
                       h.ssh_config, "--logdir", str(logdir), *args], cwd=ROOT)


def finish(p: subprocess.Popen, timeout_s: float = 150) -> str:
    try:
        out, _ = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate(timeout=10)
        raise AssertionError(f"the launcher did not finish within {timeout_s} s:\n{out[-3000:]}") from None
    return out


def cmdlines() -> list[bytes]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                out.append((d / "cmdline").read_bytes())
            except OSError:
                pass
    return out


def test_mnist_softmax_trains_with_ps_and_workers_on_three_hosts_and_the_secret_never_on_a_command_line(hosts, tmp_path):
    logdir = tmp_path / "run"
    p = launcher(hosts, logdir, SOFTMAX, "--", "--epochs", "1", "--init", "zeros")
    samples_with_agents = 0
    deadline = time.monotonic() + 150
    while p.poll() is None and time.monotonic() < deadline:  # sample every command line while the run goes on
        secret_file = logdir / ".secret"
        secret = secret_file.read_bytes().strip() if secret_file.exists() else b""
        lines = cmdlines()
        if secret and any(b"psflow.launch.sshagent" in c for c in lines):
            samples_with_agents += 1
            assert not any(secret in c for c in lines), "the job secret is on a command line"
        time.sleep(0.2)
    out = finish(p)
    assert p.returncode == 0, out[-3000:] + log_tails(logdir)
    assert samples_with_agents >= 3, "the command lines were never sampled while the tasks ran"
    s = read_summary(logdir)
    assert s["status"] == "succeeded" and s["global_step"] == 600 and s["test_accuracy"] >= 0.80, s  # one epoch: 0.85-0.86, trained (chance is 0.1)
    where = {t["task"]: t["address"].rsplit(":", 1)[0] for t in s["tasks"]}
    assert where == {"ps:0": ADDRS[0], "worker:0": ADDRS[1], "worker:1": ADDRS[2]}  # each on its host's own address
    assert "[worker:1] worker=1, final accuracy = " in out  # output streams back through ssh
    assert "final accuracy" in (logdir / "logs" / "worker-1.log").read_text()
    for i in (2, 3):
        assert hosts.pids(i) <= sshd_pids(hosts), f"a process outlived the run in host {i}"


def test_without_the_secret_a_task_off_loopback_will_not_start_and_a_peer_that_lacks_it_is_refused(hosts, tmp_path):
    python, flags = sys.executable, [f"--ps_hosts={ADDRS[1]}:2222", f"--worker_hosts={ADDRS[2]}:2222", "--job_name=ps",
                                     "--task_index=0"]
    bare = hosts.popen(2, [python, SOFTMAX, *flags], cwd=tmp_path)
    out = finish(bare, 60)
    assert bare.returncode != 0 and "No job secret, and the cluster has tasks off loopback (10.79.0.2, 10.79.0.3)" in out, out
    ps = hosts.popen(2, [python, SOFTMAX, *flags], cwd=tmp_path, env=task_env(PSFLOW_SECRET="the-right-secret-123456"))
    try:
        probe = ("from psflow.wire.conn import connect\n"
                 "import sys\n"
                 "try:\n"
                 f"    connect('{ADDRS[1]}:2222', secret=b'a-wrong-secret-000000', task='worker:0', deadline_s=30)\n"
                 "except Exception as e:\n"
                 "    print(type(e).__name__, e); sys.exit(3)\n")
        r = hosts.popen(3, [python, "-c", probe])
        out = finish(r, 60)
        assert r.returncode == 3 and "AuthError" in out and "did not prove the job's secret" in out, out
    finally:
        ps.send_signal(signal.SIGKILL)
        ps.communicate(timeout=10)


def test_a_killed_worker_is_restarted_over_ssh_and_the_run_finishes(hosts, tmp_path):
    logdir = tmp_path / "restart"
    p = launcher(hosts, logdir, "--restart", "on-failure", "--restart-backoff", "0", "--fail-at", "worker:1@step=100:kill",
                 SOFTMAX, "--", "--epochs", "1", "--init", "zeros")
    out = finish(p)
    assert p.returncode == 0, out[-3000:] + log_tails(logdir)
    s = read_summary(logdir)
    w1 = next(t for t in s["tasks"] if t["task"] == "worker:1")
    assert w1["attempts"] == 2 and w1["exits"][0]["cause"] == "killed (SIGKILL)", w1  # the agent said which signal
    assert w1["address"].startswith(ADDRS[2] + ":")  # restarted on its own host
    assert s["status"] == "succeeded" and s["global_step"] == 600, s


def test_a_failing_task_reports_its_error_back_through_ssh_as_the_root_cause(hosts, tmp_path):
    logdir = tmp_path / "fail"
    p = launcher(hosts, logdir, "--fail-at", "worker:0@step=5", SOFTMAX, "--", "--epochs", "1", "--init", "zeros")
    out = finish(p)
    assert p.returncode == 1, out[-3000:]
    assert "Root cause: worker:0 exited with code" in out, out[-3000:]
    assert (logdir / "errors" / "worker-0.json").exists()  # written by the launcher from the agent's report line


def test_sigterm_to_the_launcher_ends_every_remote_task(hosts, tmp_path):
    logdir = tmp_path / "stop"
    p = launcher(hosts, logdir, SOFTMAX, "--", "--epochs", "200", "--init", "zeros")
    deadline = time.monotonic() + 90
    log = logdir / "logs" / "worker-1.log"
    while time.monotonic() < deadline and not (log.exists() and "parameters ready" in log.read_text()):
        assert p.poll() is None, finish(p)
        time.sleep(0.2)
    assert log.exists() and "parameters ready" in log.read_text(), "worker:1 did not start training in 90 s"
    p.send_signal(signal.SIGTERM)
    out = finish(p, 60)
    assert p.returncode == 130, out[-3000:]
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(not hosts.pids(i) <= sshd_pids(hosts) for i in (2, 3)):
        time.sleep(0.2)
    for i in (2, 3):
        assert hosts.pids(i) <= sshd_pids(hosts), f"a task outlived the stopped run in host {i}"


def test_a_host_ssh_cannot_reach_fails_the_run_with_sshs_own_message(tmp_path, monkeypatch):
    """No namespaces needed: an "ssh" that fails as ssh does (exit 255, its message on stderr)."""
    from psflow.launch.plan import make_plan
    from psflow.launch.runner import Runner
    from psflow.launch.runstore import file_store
    from psflow.launch.ssh import SshBackend

    monkeypatch.chdir(tmp_path)
    failing_ssh = ("sh", "-c", "echo 'ssh: connect to host node9 port 22: Connection refused' >&2; exit 255")
    said: list[str] = []
    backend = SshBackend("node8:1,node9:2", ssh=failing_ssh, coordinator_host="127.0.0.1", echo=said.append,
                         live=False)
    plan = make_plan(SOFTMAX, ["--epochs", "1"], num_ps=1, num_workers=2, logdir=str(tmp_path / "unreachable"))
    result = Runner(backend, store=file_store, register_timeout_s=30).run(plan)
    assert result.exit_code == 1 and result.root_cause in plan.task_names()
    assert "Connection refused" in (tmp_path / "unreachable" / "logs" / f"{result.root_cause.replace(':', '-')}.log").read_text()
    assert any("ssh to" in line and "failed (exit 255)" in line for line in said), said


def test_a_rate_limited_link_makes_its_worker_the_straggler_whose_late_gradients_sync_drops(hosts, tmp_path):
    """tc tbf on worker:1's host (host 3) at 8 Mbit/s; sync mode with one backup worker (1 of 2
    gradients per step): the ps drops the straggler's late gradients, not the other worker's."""
    logdir = tmp_path / "straggler"
    limit = subprocess.run(["bash", str(SCRIPT), "limit", hosts.prefix, "3", "8mbit"], capture_output=True, text=True,
                           timeout=30)
    assert limit.returncode == 0, limit.stderr
    try:
        qdisc = subprocess.run(["ip", "netns", "exec", hosts.ns(3), "tc", "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True, timeout=10).stdout
        assert "tbf" in qdisc and "8Mbit" in qdisc, qdisc
        p = launcher(hosts, logdir, "--mode", "sync", "--replicas-to-aggregate", "1", "--total-num-replicas", "2",
                     SOFTMAX, "--", "--epochs", "1", "--init", "zeros", "--batch_size", "300")  # 100 steps a worker
        out = finish(p)
    finally:
        subprocess.run(["ip", "netns", "exec", hosts.ns(3), "tc", "qdisc", "del", "dev", "eth0", "root"],
                       capture_output=True, timeout=10)
    assert p.returncode == 0, out[-3000:] + log_tails(logdir)
    s = read_summary(logdir)
    dropped = s["reports"]["ps:0"]["ps_stats"]["stale_by_worker"]
    assert dropped.get("1", 0) > dropped.get("0", 0), dropped  # worker:1, behind the slow link, is the straggler
    assert s["status"] == "succeeded" and s["test_accuracy"] >= 0.75, s


def test_a_hung_worker_on_another_host_gets_its_stacks_dumped_through_ssh_and_is_restarted(hosts, tmp_path):
    """The watchdog's dump (SIGUSR1) reaches the task through its agent; the stacks come back in its log."""
    logdir = tmp_path / "hang"
    p = launcher(hosts, logdir, "--hang-at", "worker:1@step=20", "--hang-timeout", "3", "--restart", "on-failure",
                 "--restart-backoff", "0.5", SOFTMAX, "--", "--epochs", "1", "--init", "zeros")
    out = finish(p)
    assert p.returncode == 0, out[-3000:] + log_tails(logdir)
    s = read_summary(logdir)
    first = next(t for t in s["tasks"] if t["task"] == "worker:1")["exits"][0]
    assert first["restarted"] and first["cause"].startswith("hung: no progress for "), first
    log = logdir / "logs" / "worker-1.log"
    dump = "".join(log.read_text().splitlines(keepends=True)[first["hang"]["stacks"]["line"] - 1:])
    assert "(most recent call first):" in dump and "fault.py" in dump and "in inject" in dump, dump[:3000]


def test_a_run_over_ssh_is_scaled_onto_a_free_host_slot_and_back_and_more_than_the_slots_is_refused(hosts, tmp_path):
    from conftest import psflow_in, wait_for_run

    home, logdir = tmp_path / "home", tmp_path / "scale"
    p = hosts.popen(1, [PSFLOW, "run", "--no-live", "--hosts", f"{ADDRS[0]}:1,{ADDRS[1]}:1,{ADDRS[2]}:2", "--ssh-config",
                        hosts.ssh_config, "--logdir", str(logdir), SOFTMAX, "--", "--epochs", "500", "--init", "zeros"],
                    cwd=ROOT, env=task_env(PSFLOW_HOME=str(home)))  # 500 epochs: it outlasts the scalings, then is stopped
    try:
        def step(run: dict, task: str) -> int:
            return int(((run["tasks"].get(task) or {}).get("progress") or {}).get("local_step") or 0)

        run = wait_for_run(home / "jobs.db", lambda r: r["state"] == "running" and step(r, "worker:0") > 0,
                           what="training over ssh", timeout_s=120, context=lambda: log_tails(logdir))
        assert run["backend"] == "ssh"
        too_many = psflow_in(home, "scale", run["id"], "--workers", "4")  # 4 slots: ps:0 and at most 3 workers
        assert too_many.returncode != 0 and "ask for at most 3 workers" in too_many.stdout + too_many.stderr, too_many
        up = psflow_in(home, "scale", run["id"], "--workers", "3")
        assert up.returncode == 0 and "2 -> 3 workers: adding worker:2" in up.stdout, up.stdout + up.stderr
        wait_for_run(home / "jobs.db", lambda r: step(r, "worker:2") >= 20, what="worker:2 training",
                     timeout_s=120, context=lambda: log_tails(logdir))
        down = psflow_in(home, "scale", run["id"], "--workers", "2")
        assert down.returncode == 0 and "3 -> 2 workers: retiring worker:2" in down.stdout, down.stdout + down.stderr
        stop = psflow_in(home, "stop", run["id"])
        assert stop.returncode == 0, stop.stdout + stop.stderr
        out = finish(p, 120)
    finally:
        if p.poll() is None:
            p.kill()
    assert f"psflow: over ssh: worker:2@{ADDRS[2]}" in out, out[-3000:]  # the free slot: the third host's second
    s = read_summary(logdir)
    w2 = next(t for t in s["tasks"] if t["task"] == "worker:2")
    assert w2["exits"][0]["retired"] is True, w2  # left when asked: not failed, not restarted
    assert (logdir / "logs" / "worker-2.log").stat().st_size > 0  # its output came back through ssh
    assert s["status"] == "stopped" and s["reports"]["ps:0"]["ps_stats"]["applied_by"]["2"], s

