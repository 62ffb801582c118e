"""Every benchmark still runs against today's psflow (a smoke run each, its smallest form, no timing asserted):
benchmarks construct servers, clients, tasks and launches by hand, so an API change that leaves one behind
fails here, not in the next `make bench`. (bench_multihost's and bench_ui's are test_bench_*_runs.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, task_env

pytestmark = pytest.mark.long  # benchmarks' smoke runs: make test-long


def test_transport_benchmark_quick_run_completes_and_reports_every_size():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_transport.py"), "--quick", "--reps", "1",
                          "--placement", "one-core"],
                         capture_output=True, text=True, timeout=150, env=task_env(), cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "### Placement one-core: client on core [" in out.stdout, out.stdout[-3000:]
    assert "Placement two-cores" not in out.stdout, out.stdout[-3000:]
    for size in ("1 MiB", "16 MiB", "64 MiB", "small round trip"):
        assert size in out.stdout, out.stdout[-3000:]
    assert "| push_pull / (raw echo + step) |" in out.stdout, out.stdout[-3000:]


def test_transport_benchmark_refuses_two_cores_on_one():
    """Pinned to one core, the two-core placement cannot be measured: one clear error, nothing run."""
    out = subprocess.run(["taskset", "-c", "0", sys.executable, str(ROOT / "benchmarks" / "bench_transport.py"),
                          "--quick", "--placement", "two-cores"],
                         capture_output=True, text=True, timeout=60, env=task_env(), cwd=ROOT)
    assert out.returncode != 0
    assert "--placement two-cores needs two cores; this process may use 1." in out.stderr, out.stderr[-2000:]
    assert "bulk" not in out.stderr, out.stderr[-2000:]


def test_overlap_benchmark_quick_run_reports_every_mode_at_every_size():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_overlap.py"), "--quick", "--reps", "1"],
                         capture_output=True, text=True, timeout=120, env=task_env(), cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "terminate called" not in out.stderr, out.stderr[-2000:]
    assert "| raw ms | after ms | send-overlap ms | receive-overlap ms |" in out.stdout, out.stdout[-3000:]
    rows = [line.split("|")[1].strip() for line in out.stdout.splitlines() if line.startswith("| ") and "MiB |" in line]
    assert rows == ["1 MiB", "16 MiB", "64 MiB"], out.stdout[-3000:]


def test_apply_benchmark_quick_run_times_every_optimizer_fused_and_not():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_apply.py"), "--quick", "--reps", "1"],
                         capture_output=True, text=True, timeout=120, env=task_env(), cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and line.endswith("x |")]
    assert [r.split("|")[1].strip() for r in rows] == ["SGD", "SGD momentum=0.9", "Adagrad", "Adam"], out.stdout


def bench(script: str, *flags: str, timeout: float = 150) -> subprocess.CompletedProcess:
    """Run ``benchmarks/<script>`` with ``flags`` to completion; its exit status must be 0."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *flags],
                         capture_output=True, text=True, timeout=timeout, env=task_env(), cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return out


def assert_lines(stdout: str, *lines: str) -> None:
    missing = [line for line in lines if line not in stdout]
    assert not missing, f"missing {missing} in:\n{stdout[-3000:]}"


# The in-process benchmarks that take seconds each: (script, flags, lines of its report).
CHEAP = [
    ("bench_nonfinite.py", ["--quick", "--reps", "1"],
     ["### The ps's NaN/inf check per push", "| 1 MiB |", "| 16 MiB |", "| CNN 12.5 MiB |"]),
    ("bench_pslatency.py", ["--quick", "--reps", "1"],
     ["| 64 B | push |", "| 64 B | pull |", "| 1,048,576 B | push |", "| 1,048,576 B | pull |",
      "The timing's own cost per request"]),
    ("bench_s3_checkpoint.py", ["--quick", "--reps", "1"], ["| local |", "| s3 |", "S3 / local:"]),
]


@pytest.mark.parametrize("script, flags, lines", CHEAP, ids=[c[0] for c in CHEAP])
def test_cheap_benchmark_quick_run_reports_every_case(script, flags, lines):
    if script == "bench_s3_checkpoint.py":
        pytest.importorskip("moto", reason="bench_s3_checkpoint needs the dev extra (moto)")
    assert_lines(bench(script, *flags).stdout, *lines)


def test_gpu_benchmark_runs_on_a_gpu_or_says_it_was_skipped():
    import torch

    out = bench("bench_gpu.py", "--steps", "8", "--torch-steps", "8", timeout=300)
    if torch.cuda.is_available():
        assert_lines(out.stdout, "| torch single process, cuda:0, batch 100 |", "| psflow 1 ps + 1 worker, 1 tower, batch 100 |")
        assert "| exit " not in out.stdout, out.stdout[-3000:]  # no psflow run failed
    else:
        assert_lines(out.stdout, "Skipped: no CUDA GPU here (torch.cuda.is_available() is False)")


def test_checkpoint_benchmark_quick_run_saves_loads_and_restores_on_1_and_2_ps():
    out = bench("bench_checkpoint.py", "--quick", "--reps", "1")
    assert_lines(out.stdout, "| psflow, 1 ps | 100.7 |", "| psflow, 2 ps | 100.7 |", "| torch.save / torch.load, 1 process |")
    assert "restored from" in out.stderr, out.stderr[-3000:]  # the restore case really restored a checkpoint


def test_placement_benchmark_quick_run_reports_every_placement():
    out = bench("bench_placement.py", "--quick", "--reps", "1", "--warmup", "0", "--steps", "1")
    assert_lines(out.stdout, "### async", "| 1 ps |", "| 2 ps, round_robin (TensorFlow's) |", "| 2 ps, greedy + split_bytes 1 MiB |",
                 "| 2 ps, balanced (default) |", "| async: balanced 2 ps / round_robin 2 ps |")


def test_cnn_benchmark_quick_run_reports_every_configuration_and_the_slow_worker():
    out = bench("bench_cnn.py", "--quick", "--reps", "1", "--warmup", "0", "--steps", "1", "--target-step", "3", timeout=200)
    assert_lines(out.stdout, "| PyTorch single process, 2 threads (reference) |", "| psflow async, 1 ps + 2 workers |",
                 "| psflow sync, N = M = 2 |", "| psflow all-reduce, 2 workers |", "| raw DDP (gloo), 2 processes |",
                 "| sync N = M = 3 (no backup) |", "| sync N = 2 of M = 3 (1 backup) |", "Backup worker speed-up")


def test_training_benchmark_quick_run_reports_every_configuration():
    out = bench("bench_training.py", "--quick", "--reps", "1", timeout=240)
    assert_lines(out.stdout, "| psflow async (1 ps + 2 workers) |", "| psflow sync (N = M = 2) |",
                 "| PyTorch single process, 2 threads |", "| torch.distributed.rpc ps, 2 trainers |", "| DDP gloo, 2 processes |",
                 "Launch to 0.88")


def test_compress_benchmark_smoke_run_measures_every_setting_on_loopback():
    out = bench("bench_compress.py", "--smoke", "--parts", "loopback", timeout=240)
    assert_lines(out.stdout, "### Loopback, no rate limit", "| none |", "| fp16 |", "| fp16 + --compress-pull |",
                 "| bf16 + --compress-pull |", "| topk:0.01 |")


def test_hangs_benchmark_quick_false_positive_run_counts_detections_and_exits():
    """The false-positive part only: the detection part's one-epoch runs race the chief's end under load (a
    worker restarted after the chief's exit can find the ps gone, and the run fails), which a smoke run must not."""
    out = bench("bench_hangs.py", "--quick", "--parts", "fp", "--for", "8")
    assert_lines(out.stdout, "### False positives (8 s", "| hang detections | restarts |", "Exit after this job's end")


def test_failover_benchmark_quick_run_measures_the_replica_s_cost_and_a_ps_failover():
    """The worker-restart part is the ps part's chaos run with another target (left out: ~20 s more)."""
    out = bench("bench_failover.py", "--quick", "--parts", "cost,ps", "--epochs", "1", "--chaos-s", "4", timeout=240)
    assert_lines(out.stdout, "### Replication's cost", "| async |", "| sync |", "### Recovery after a SIGKILL",
                 "| ps failover (SIGKILL of a ps: primary of one shard, backup of the other) |")


def test_goodput_benchmark_quick_run_compares_a_faulted_and_a_fault_free_run():
    out = bench("bench_goodput.py", "--quick", "--job", "softmax", "--epochs", "3", "--every", "1", "--window", "2")
    assert_lines(out.stdout, "| 1 | fault-free | 1800 |", "| 1 | faulted | 1800 |", "| ratio of the medians (goal >= 0.90) |",
                 "| the same batches applied in every run (each batch once) |")


def test_nemesis_benchmark_short_run_reports_its_ledgers():
    out = bench("bench_nemesis.py", "--for", "5", "--epochs", "4")
    assert_lines(out.stdout, "### `psflow chaos` on the softmax, 2 ps x 2 copies + 3 workers, 5 s of faults, 4 epochs",
                 "| nemesis | succeeded |")
