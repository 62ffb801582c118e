"""Helpers for integration tests: real processes on loopback, every wait with a deadline."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PSFLOW = str(Path(sys.executable).parent / "psflow")
SOFTMAX = str(ROOT / "examples" / "mnist_softmax.py")


@pytest.fixture(autouse=True, scope="session")
def _psflow_home(tmp_path_factory):
    """Every launcher of the tests records its runs in a job store of the session, not in ~/.psflow."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PSFLOW_HOME", str(tmp_path_factory.mktemp("psflow-home")))
        yield


def task_env(**extra: str) -> dict[str, str]:
    # PSFLOW_HOME is the launcher's (where it records runs), not a task variable: it is kept.
    env = {k: v for k, v in os.environ.items() if k == "PSFLOW_HOME" or not k.startswith(("PSFLOW_", "TF_CONFIG"))}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_psflow(args: list[str], *, timeout_s: float = 240) -> subprocess.CompletedProcess:
    """Run the `psflow` CLI to completion (deadline ``timeout_s``)."""
    return subprocess.run([PSFLOW, *args], capture_output=True, text=True, timeout=timeout_s, env=task_env(), cwd=ROOT)


def read_summary(logdir: Path) -> dict:
    return json.loads((logdir / "summary.json").read_text())


def log_tails(logdir: Path, n: int = 20) -> str:
    out = []
    for f in sorted((logdir / "logs").glob("*.log")):
        lines = f.read_text().splitlines()[-n:]
        out.append(f"--- {f.name}\n" + "\n".join(lines))
    return "\n".join(out)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def free_ports(n: int) -> list[int]:
    """Ports for by-hand launches, which need them in their flags before the tasks start.
    (The launcher itself never does this: its tasks bind port 0 and report.)"""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture
def procs():
    """Processes started by a test; killed (whole groups) at teardown."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)


@pytest.fixture(autouse=True, scope="session")
def _no_run_left_in_the_checkout():
    """A test that runs an example by hand without a logdir in the checkout leaves a new
    runs/<script>-<time>-<id> there: give its run a logdir under tmp_path, or run it in tmp_path."""
    def by_hand() -> set[Path]:  # supervisor.new_logdir's names; psflow run's runs/<run id> start with a digit
        return {p for p in (ROOT / "runs").glob("*-*-*-*") if re.fullmatch(r"\D.*-\d{8}-\d{6}-[0-9a-f]{6}", p.name)}

    before = by_hand()
    yield
    left = sorted(str(p) for p in by_hand() - before)
    assert not left, f"tests wrote {left}; give their runs a logdir under tmp_path"


@pytest.fixture
def s3_env(monkeypatch, tmp_path):
    """An S3 stand-in (moto's server on loopback) with the bucket ``psflow-runs``; the AWS_* environment
    that points at it, set here and returned for the tasks' environment."""
    server_mod = pytest.importorskip("moto.server", reason="the S3 stand-in is moto's server (pip install 'moto[server]')")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "psflow-test", "AWS_SECRET_ACCESS_KEY": "psflow-test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://{host}:{port}", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    import boto3

    boto3.client("s3").create_bucket(Bucket="psflow-runs")
    yield env
    server.stop()


def psflow_in(home: Path, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """``psflow ARGS`` with ``PSFLOW_HOME=home`` (its job store), from the checkout."""
    return subprocess.run([PSFLOW, *args], capture_output=True, text=True, timeout=timeout_s,
                          env=task_env(PSFLOW_HOME=str(home)), cwd=ROOT)


def wait_for_run(db: Path, check, *, what: str, timeout_s: float = 120.0, context=lambda: "") -> dict:
    """The first run in the job store ``db`` for which ``check(run)`` holds, within ``timeout_s``."""
    import time

    from psflow.platform.jobstore import JobStore

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if db.exists():
            with JobStore(db) as store:
                for run in store.runs(metrics=False):
                    if check(run):
                        return run
        time.sleep(0.2)  # a poll of the store, not a synchronisation
    raise AssertionError(f"no run {what} within {timeout_s} s\n{context()}")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "k8s: against a real Kubernetes API server ($KUBECONFIG); opt in with "
                                       "PSFLOW_K8S_TESTS=1 (tests/integration/test_k8s_cluster.py says what else)")
