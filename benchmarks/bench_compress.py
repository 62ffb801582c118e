"""Gradient compression on the CNN: bytes per step, throughput with and without, on loopback and on
a 100 Mbit/s link, and the accuracy each setting reaches after one epoch.

Every configuration is the third seed's CNN (``examples/mnist_cnn.py``, 6.6 MB of parameters), 1 ps +
2 workers, async, launched by ``psflow run`` with one ``--compress`` setting:

1. **Loopback** (no rate limit): ``benchmarks/scripts/cnn_steps.py`` (``warmup`` untimed, ``steps``
   timed steps per worker; examples/sec as in ``bench_cnn.py``), the settings in interleaved rounds;
   bytes per step = a worker's ``bytes_sent`` and ``bytes_received`` (its connections' own counters,
   every frame and handshake) / its local steps.
2. **100 Mbit/s**: the same, with fewer steps, inside a network namespace of its own whose loopback
   is rate limited by ``tc qdisc add dev lo root tbf rate 100mbit burst 32kbit latency 400ms`` (MTU
   1500). Every byte between the tasks crosses that one queue, both directions included: one
   shared 100 Mbit/s link, not a link per host pair (the multi-host namespaces are another
   benchmark's). Needs root and iproute2; skipped with a note otherwise.
3. **Accuracy after one epoch**: ``examples/mnist_cnn.py`` (Adam, the learning-rate decay, moving
   averages: the example as a user runs it), one run per setting, on loopback; its test accuracy on
   ``--test_examples`` images and its wall time.

Run: ``.venv/bin/python benchmarks/bench_compress.py [--quick]`` (as root for part 2). The markdown
report goes to stdout, progress to stderr. Nothing here asserts on a timing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import harness
from harness import REPO, log, md_table, median, spread

TASK_SCRIPT = "benchmarks/scripts/cnn_steps.py"
EXAMPLE = "examples/mnist_cnn.py"
CHILD_TIMEOUT_S = 900
NETNS = "psflow-bench-100mbit"
SETTINGS: dict[str, list[str]] = {
    "none": [],
    "fp16": ["--compress", "fp16"],
    "fp16 + --compress-pull": ["--compress", "fp16", "--compress-pull"],
    "bf16 + --compress-pull": ["--compress", "bf16", "--compress-pull"],
    "topk:0.01": ["--compress", "topk:0.01"],
}


def psflow_run(flags: list[str], script: str, script_args: list[str], *, netns: str | None = None) -> dict[str, Any]:
    """One ``psflow run --ps 1 --workers 2 FLAGS SCRIPT -- ARGS`` (inside ``netns`` if given); its summary."""
    logdir = Path(tempfile.mkdtemp(prefix="psflow-compress-"))
    exe = str(Path(sys.executable).with_name("psflow"))
    cmd = [exe, "run", "--ps", "1", "--workers", "2", *flags, "--logdir", str(logdir), script, "--", *script_args]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    path = logdir / "summary.json"
    if proc.returncode != 0 or not path.exists():
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    summary = json.loads(path.read_text())
    shutil.rmtree(logdir, ignore_errors=True)
    return summary


def throughput_case(flags: list[str], warmup: int, steps: int, netns: str | None) -> dict[str, float]:
    s = psflow_run(flags, TASK_SCRIPT, ["--warmup", str(warmup), "--steps", str(steps)], netns=netns)
    workers = [r for r in s["reports"].values() if isinstance(r.get("bench"), dict)]
    windows = [r["bench"] for r in workers]
    span = max(w["end_unix"] for w in windows) - min(w["start_unix"] for w in windows)
    stats = [r["trainer"] for r in workers]
    return {
        "examples_per_sec": sum(w["examples"] for w in windows) / span,
        "sent_per_step": median([t["bytes_sent"] / t["local_step"] for t in stats]),
        "received_per_step": median([t["bytes_received"] / t["local_step"] for t in stats]),
    }


def throughput_table(results: dict[str, list[dict[str, float]]]) -> str:
    base = median([r["examples_per_sec"] for r in results["none"]])
    rows = []
    for name, runs in results.items():
        eps = [r["examples_per_sec"] for r in runs]
        rows.append([name, f"{median([r['sent_per_step'] for r in runs]) / 1e6:.3f}",
                     f"{median([r['received_per_step'] for r in runs]) / 1e6:.3f}",
                     f"{median(eps):.0f}", spread(eps, ".0f"), f"{median(eps) / base:.2f}"])
    return md_table(["--compress", "MB sent / worker step", "MB received / worker step", "examples/sec (median)",
                     "spread", "vs none"], rows)


def netns_up() -> str | None:
    """The rate-limited namespace, or None (with a log line) where it cannot be made."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        log("part 2 skipped: needs root, ip and tc")
        return None
    subprocess.run(["ip", "netns", "del", NETNS], capture_output=True, check=False)
    for cmd in (["ip", "netns", "add", NETNS], ["ip", "-n", NETNS, "link", "set", "lo", "mtu", "1500", "up"],
                ["ip", "netns", "exec", NETNS, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "100mbit",
                 "burst", "32kbit", "latency", "400ms"]):
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            log(f"part 2 skipped: `{' '.join(cmd)}` failed: {r.stderr.strip()}")
            return None
    return NETNS


def main() -> None:
    parser = harness.arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--parts", default="loopback,link,accuracy",
                        help="which parts to run, comma-separated: loopback, link, accuracy")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    reps = harness.reps_of(args, full=3, quick=1)
    steps, link_steps = (10, 4) if args.quick else (40, 10)
    test_examples = 2000 if args.quick else 10000
    print("## Gradient compression on the CNN (1 ps + 2 workers, async)\n")
    print(f"Machine: {harness.machine()}.  \nCommand: `{harness.command_line()}`\n")

    if "loopback" in parts:
        log(f"part 1: loopback, {reps} interleaved rounds of {steps} steps per worker")
        loop = harness.interleaved({n: (lambda f=f: throughput_case(f, 5, steps, None)) for n, f in SETTINGS.items()},
                                   reps, warmup=0)
        print(f"### Loopback, no rate limit ({reps} rounds, {steps} timed steps per worker)\n")
        print(throughput_table(loop) + "\n")

    ns = netns_up() if "link" in parts else None
    if ns is not None:
        try:
            log(f"part 2: 100 Mbit/s, {reps} interleaved rounds of {link_steps} steps per worker")
            link = harness.interleaved(
                {n: (lambda f=f: throughput_case(f, 2, link_steps, ns)) for n, f in SETTINGS.items()}, reps, warmup=0)
            print(f"### One shared 100 Mbit/s link (tc tbf on a namespace's loopback; {reps} rounds, "
                  f"{link_steps} timed steps per worker)\n")
            print(throughput_table(link) + "\n")
        finally:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
    elif "link" in parts:
        print("### One shared 100 Mbit/s link\n\nNot measured: making a network namespace needs root, ip and tc.\n")
    if "accuracy" not in parts:
        return
    log("part 3: one epoch of examples/mnist_cnn.py per setting")
    rows = []
    for name, flags in SETTINGS.items():
        s = psflow_run(flags, EXAMPLE, ["--epochs", "1", "--test_examples", str(test_examples)])
        rows.append([name, f"{s['test_accuracy']:.4f}", s["global_step"], f"{s['wall_s']:.0f}"])
        log(f"  {name}: accuracy {s['test_accuracy']:.4f}")
    print(f"### Accuracy after one epoch (examples/mnist_cnn.py, {test_examples} test images, one run each)\n")
    print(md_table(["--compress", "test accuracy", "global steps", "wall s"], rows))


if __name__ == "__main__":
    main()
