"""psflow run --logdir s3://...: the tasks write into a local staging directory, the launcher uploads
it (DONE last) and the checkpoints go to <url>/checkpoints, against an S3-compatible server started
by the test (moto's, on loopback: no real object store can run here); a second run with the same URL
restores from them; an unreachable endpoint fails before any task starts, with one clear message."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time

import pytest
from conftest import PSFLOW, ROOT, SOFTMAX, task_env

pytest.importorskip("s3fs", reason="a logdir on s3:// needs s3fs (pip install 'psflow[s3]')")
pytest.importorskip("moto.server", reason="the S3 stand-in is moto's server (pip install 'moto[server]')")

pytestmark = pytest.mark.timeout(300)
URL = "s3://psflow-runs/url-run"



def objects(prefix: str) -> dict[str, bytes]:
    import boto3

    s3 = boto3.client("s3")
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="psflow-runs", Prefix=prefix)
            for o in page.get("Contents", [])]
    out = {}
    for k in keys:  # an object listed may be gone when read (the launcher's write probe, deleted at once)
        try:
            out[k[len(prefix):]] = s3.get_object(Bucket="psflow-runs", Key=k)["Body"].read()
        except s3.exceptions.NoSuchKey:
            continue
    return out


def psflow(args: list[str], env: dict[str, str], timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([PSFLOW, *args], capture_output=True, text=True, timeout=timeout_s, env=task_env(**env), cwd=ROOT)


def train(epochs: int, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    return psflow(["run", "--no-live", "--ps", "1", "--workers", "2", "--logdir", URL, *extra, SOFTMAX, "--",
                   "--epochs", str(epochs), "--init", "zeros", "--batch_size", "300"], env)


def train_watching_the_url(env: dict[str, str]) -> tuple[subprocess.CompletedProcess, dict]:
    """``train(1, --timeline)``, and the status.json first seen on the URL while the run was going on."""
    # each worker step 80 ms: the run outlasts the syncer's first pass (5 s) on a quiet machine too
    cmd = [PSFLOW, "run", "--no-live", "--ps", "1", "--workers", "2", "--logdir", URL, "--timeline",
           "--slow", "worker:0=0.08s,worker:1=0.08s", SOFTMAX, "--",
           "--epochs", "1", "--init", "zeros", "--batch_size", "300"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=task_env(**env), cwd=ROOT)
    seen: dict = {}
    deadline = time.monotonic() + 200
    try:
        while proc.poll() is None and not seen and time.monotonic() < deadline:
            files = objects("url-run/")
            if "status.json" in files:
                seen = {"status": json.loads(files["status.json"]), "files": sorted(files)}
            time.sleep(0.2)
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), seen


@pytest.mark.long  # two runs through the S3 stand-in, ~80 s: make test-long
def test_a_run_with_its_logdir_on_s3_puts_every_file_there_and_a_second_run_restores_from_its_checkpoints(s3_env):
    r, seen = train_watching_the_url(s3_env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # Uploaded while the run went on (every 5 s), DONE not yet: it goes last, at the end.
    assert seen and seen["status"]["state"] == "running" and "DONE" not in seen["files"], seen
    assert f"summary: {URL}/summary.json" in r.stdout
    files = objects("url-run/")
    status, summary = json.loads(files["status.json"]), json.loads(files["summary.json"])
    assert status["state"] == "succeeded" and summary["status"] == "succeeded" and summary["global_step"] == 200
    for log in ("ps-0", "worker-0", "worker-1"):  # whole, as at the end of the run
        assert b"final accuracy" in files[f"logs/{log}.log"] or log == "ps-0", files[f"logs/{log}.log"][-500:]
    assert "DONE" in files and "timeline.json" in files and "events.jsonl" in files
    assert any(re.fullmatch(r"summaries/worker-0/events\.out\.tfevents\..+", k) for k in files), sorted(files)
    assert "checkpoints/ckpt-0000000200/manifest.json" in files  # written there by the tasks, manifest last
    assert ".secret" not in files and not any(k.startswith(".psflow-probe") for k in files)

    # The staging directory is the run's local copy; the job store has the URL.
    staging = re.search(r"files staged in (\S+),", r.stdout).group(1)
    from pathlib import Path

    assert (Path(staging) / "summary.json").read_bytes() == files["summary.json"]
    st = psflow(["status", URL], s3_env, timeout_s=60)
    assert st.returncode == 0 and "succeeded" in st.stdout and "worker:1" in st.stdout, st.stdout + st.stderr
    lg = psflow(["logs", URL, "--task", "worker:0"], s3_env, timeout_s=60)
    assert lg.returncode == 0 and "final accuracy" in lg.stdout, lg.stdout + lg.stderr
    ck = psflow(["checkpoints", URL], s3_env, timeout_s=60)  # a URL logdir, as a local one: its checkpoints/
    assert ck.returncode == 0 and re.match(r"ckpt-0000000200  step=200  shards=1 .* ok$", ck.stdout), ck.stdout + ck.stderr
    ex = psflow(["export", URL, str(Path(staging) / "model.safetensors")], s3_env, timeout_s=60)
    assert ex.returncode == 0 and "of step 200 from" in ex.stdout, ex.stdout + ex.stderr
    runs = json.loads(psflow(["runs", "--json"], s3_env, timeout_s=60).stdout)
    assert any((run.get("launch") or {}).get("logdir_url") == URL and run["logdir"] == staging for run in runs), runs

    r = train(2, s3_env)  # the same URL: its checkpoints are restored
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"worker:0: restored from \S+/ckpt-0000000200 at step 200", r.stdout), r.stdout[-3000:]
    assert f"saved checkpoint {URL}/checkpoints/ckpt-0000000400 at step 400" in r.stdout, r.stdout[-3000:]
    summary = json.loads(objects("url-run/")["summary.json"])
    assert summary["global_step"] == 400 and summary["test_accuracy"] >= 0.8, summary

    # psflow restart (the dashboard's "restart" too) keeps the URL: checkpoints read there, files uploaded.
    r = psflow(["restart", summary["run_id"], "--no-live"], s3_env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"worker:0: restored from \S+/ckpt-0000000400 at step 400", r.stdout), r.stdout[-3000:]
    again = json.loads(objects("url-run/")["summary.json"])
    assert again["run_id"] != summary["run_id"] and again["global_step"] == 400, again


def test_status_of_a_url_with_no_run_record_reads_the_url(s3_env, tmp_path):
    """A run launched elsewhere: psflow status URL downloads its status.json."""
    import boto3

    state = {"run_id": "elsewhere-1", "state": "succeeded", "mode": "async", "tasks": {"worker:0": {
        "state": "exited", "exit_code": 0, "progress": {"global_step": 7}, "exits": []}}}
    boto3.client("s3").put_object(Bucket="psflow-runs", Key="other/status.json", Body=json.dumps(state).encode())
    r = psflow(["status", "s3://psflow-runs/other"], s3_env, timeout_s=60)
    assert r.returncode == 0 and "elsewhere-1" in r.stdout and "worker:0" in r.stdout, r.stdout + r.stderr
    r = psflow(["status", "s3://psflow-runs/nothing-here"], s3_env, timeout_s=60)
    assert r.returncode == 1 and "holds no status.json" in r.stderr, r.stdout + r.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case", ["unreachable endpoint", "missing bucket"])
def test_a_logdir_url_that_cannot_be_written_fails_before_any_task_starts(s3_env, case):
    env = dict(s3_env)
    url = URL
    if case == "unreachable endpoint":
        env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    else:
        url = "s3://no-such-bucket/run"
    t0 = time.monotonic()
    r = psflow(["run", "--no-live", "--ps", "1", "--workers", "1", "--logdir", url, SOFTMAX], env, timeout_s=120)
    took_s = time.monotonic() - t0
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"--logdir {url!r} cannot be written" in r.stderr and "No task was started" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "psflow: run " not in r.stdout, r.stdout + r.stderr
    assert took_s < 60, f"failing took {took_s:.0f} s"  # a deadline, not a timing claim: retries would take minutes


def test_a_failed_run_on_a_url_has_its_error_report_and_no_done_there(s3_env):
    r = psflow(["run", "--no-live", "--ps", "1", "--workers", "1", "--logdir", "s3://psflow-runs/failed",
                "--fail-at", "worker:0@step=3", SOFTMAX, "--", "--epochs", "1", "--init", "zeros"], s3_env)
    assert r.returncode == 1 and "Root cause: worker:0" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    files = objects("failed/")
    report = json.loads(files["errors/worker-0.json"])
    assert report["task"] == "worker:0" and "injected" in report["message"].lower(), report
    assert json.loads(files["status.json"])["state"] == "failed" and json.loads(files["summary.json"])["root_cause"] == "worker:0"
    assert "DONE" not in files  # the chief never finished training
