"""psflow run --checkpoint-dir s3://...: every ps uploads its own shard and the chief the manifest
last, to an S3-compatible server started by the test (moto's, on loopback: no real object store can
run here); a second run resumes from what the first left there."""

from __future__ import annotations

import re
import subprocess

import pytest
from conftest import PSFLOW, ROOT, SOFTMAX, log_tails, read_summary, task_env

pytest.importorskip("s3fs", reason="checkpoints on s3:// need s3fs (pip install 'psflow[s3]')")
pytest.importorskip("moto.server", reason="the S3 stand-in is moto's server (pip install 'moto[server]')")

pytestmark = pytest.mark.timeout(240)



def run(logdir, epochs: int, env) -> subprocess.CompletedProcess:
    return subprocess.run([PSFLOW, "run", "--no-live", "--ps", "2", "--workers", "2", "--logdir", str(logdir),
                           "--checkpoint-dir", "s3://psflow-runs/mnist", SOFTMAX, "--", "--epochs", str(epochs),
                           "--init", "zeros", "--batch_size", "300"], capture_output=True, text=True, timeout=200, env=task_env(**env), cwd=ROOT)


@pytest.mark.long  # two runs through the S3 stand-in, ~27 s: make test-long
def test_two_ps_write_their_shards_to_s3_the_chief_the_manifest_and_a_second_run_resumes_from_it(s3_env, tmp_path):
    from psflow import checkpoint

    logdir = tmp_path / "run"
    r = run(logdir, 1, s3_env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:] + log_tails(logdir)
    assert "saved checkpoint s3://psflow-runs/mnist/ckpt-0000000200 at step 200" in r.stdout
    assert not (logdir / "checkpoints").exists()  # nothing on the local disk
    ckpt = checkpoint.latest_checkpoint("s3://psflow-runs/mnist")
    assert ckpt is not None and ckpt.step == 200 and ckpt.num_shards == 2  # each ps its own shard, verified
    r = run(logdir, 2, s3_env)  # the same named logdir: continue
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:] + log_tails(logdir)
    assert re.search(r"worker:0: restored from \S+ at step 200", r.stdout), r.stdout[-3000:]
    s = read_summary(logdir)
    assert s["global_step"] == 400 and s["test_accuracy"] >= 0.8, s
    assert [u.name for u in checkpoint.list_checkpoints("s3://psflow-runs/mnist")][0] == "ckpt-0000000400"
    out = tmp_path / "model.safetensors"  # psflow export reads the URL, as it reads a logdir
    r = subprocess.run([PSFLOW, "export", "s3://psflow-runs/mnist", str(out)], capture_output=True, text=True,
                       timeout=120, env=task_env(**s3_env), cwd=ROOT)
    assert r.returncode == 0 and "of step 400" in r.stdout, r.stdout + r.stderr
    from safetensors.torch import load_file

    tensors = load_file(out)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {"w": (784, 10), "b": (10,)}  # the model's own, whole


def test_the_evaluator_task_evaluates_the_checkpoints_on_s3(s3_env, tmp_path):
    logdir = tmp_path / "eval"
    r = subprocess.run([PSFLOW, "run", "--no-live", "--ps", "1", "--workers", "2", "--evaluator", "--logdir", str(logdir),
                        "--checkpoint-dir", "s3://psflow-runs/eval", str(ROOT / "examples" / "mnist_softmax_supervised.py"),
                        "--", "--init", "zeros", "--epochs", "1", "--save_secs", "600", "--max_steps", "300",
                        "--save_steps", "100"], capture_output=True, text=True, timeout=200, env=task_env(**s3_env), cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:] + log_tails(logdir)
    s = read_summary(logdir)
    evaluated = s["reports"]["evaluator:0"]["eval"]
    assert evaluated["step"] == 300 and evaluated["accuracy"] > 0.7, evaluated  # the final checkpoint, read from S3
