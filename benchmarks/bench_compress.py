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
3. **Two hosts** (``pair``): two network namespaces joined by a bridge (``../shared/engines/``'s
   recipe, under names of its own), each host's link limited to 100 Mbit/s out by ``tc ... tbf``;
   the ps on one, both workers on the other, started by hand with the seed's flags and a job
   secret (``benchmarks/scripts/cnn_by_hand.py``): 100 Mbit/s each way, shared by the two workers.
4. **Accuracy after one epoch**: ``examples/mnist_cnn.py`` (Adam, the learning-rate decay, moving
   averages: the example as a user runs it), one run per setting, on loopback; its test accuracy on
   ``--test_examples`` images and its wall time.

Run: ``.venv/bin/python benchmarks/bench_compress.py [--quick | --smoke] [--parts loopback,link,pair,accuracy]`` (as
root for parts 2 and 3; ``--smoke``: one warm-up and one timed step per worker, a check that it runs). The markdown
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


PAIR_PREFIX, PAIR_NET = "psflow-bench", "10.79.0"
BY_HAND = "benchmarks/scripts/cnn_by_hand.py"


def pair_up() -> list[str] | None:
    """Two hosts as network namespaces (``PAIR_NET.1`` and ``.2`` on a bridge in a third), each
    host's link limited to 100 Mbit/s out (so 100 Mbit/s each way between them); None where they
    cannot be made. The recipe of ``../shared/engines/netns_up.sh``, with its own names."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        log("two-namespace part skipped: needs root, ip and tc")
        return None
    pair_down()
    sw, hosts = f"{PAIR_PREFIX}-sw", [f"{PAIR_PREFIX}-h1", f"{PAIR_PREFIX}-h2"]
    cmds = [["ip", "netns", "add", sw], ["ip", "-n", sw, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", sw, "link", "set", "br0", "up"]]
    for i, h in enumerate(hosts, start=1):
        cmds += [["ip", "netns", "add", h],
                 ["ip", "-n", sw, "link", "add", f"sw{i}", "type", "veth", "peer", "name", "eth0", "netns", h],
                 ["ip", "-n", sw, "link", "set", f"sw{i}", "master", "br0", "up"],
                 ["ip", "-n", h, "link", "set", "lo", "up"], ["ip", "-n", h, "addr", "add", f"{PAIR_NET}.{i}/24", "dev", "eth0"],
                 ["ip", "-n", h, "link", "set", "eth0", "up"],
                 ["ip", "netns", "exec", h, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "100mbit",
                  "burst", "32kbit", "latency", "400ms"]]
    for cmd in cmds:
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            log(f"two-namespace part skipped: `{' '.join(cmd)}` failed: {r.stderr.strip()}")
            pair_down()
            return None
    return hosts


def pair_down() -> None:
    for name in ("sw", "h1", "h2"):
        subprocess.run(["ip", "netns", "del", f"{PAIR_PREFIX}-{name}"], capture_output=True, check=False)


def pair_case(compress: list[str], hosts: list[str], warmup: int, steps: int) -> dict[str, float]:
    """The ps on host 1, two workers on host 2, started by hand with the seed's flags and a secret."""
    config: dict[str, Any] = {}
    if compress:
        config["compress"] = compress[1]
        config["compress_pull"] = "--compress-pull" in compress
    env = {**os.environ, "PSFLOW_SECRET": "bench-compress-two-hosts", "PSFLOW_TRAIN_CONFIG": json.dumps(config),
           "PYTHONUNBUFFERED": "1"}
    env = {k: v for k, v in env.items() if k not in ("PSFLOW_COORDINATOR", "PSFLOW_TASK", "PSFLOW_CLUSTER", "TF_CONFIG")}
    cluster = [f"--ps_hosts={PAIR_NET}.1:2222", f"--worker_hosts={PAIR_NET}.2:2223,{PAIR_NET}.2:2224"]
    procs = []
    for host, job, index in ((hosts[0], "ps", 0), (hosts[1], "worker", 0), (hosts[1], "worker", 1)):
        cmd = ["ip", "netns", "exec", host, sys.executable, BY_HAND, *cluster, f"--job_name={job}", f"--task_index={index}",
               "--warmup", str(warmup), "--steps", str(steps)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=CHILD_TIMEOUT_S)
            if p.returncode != 0:
                raise RuntimeError(f"a task failed ({p.returncode}): {err[-2000:]}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    workers = [o for o in outs if "bench" in o]
    windows = [o["bench"] for o in workers]
    span = max(w["end_unix"] for w in windows) - min(w["start_unix"] for w in windows)
    return {"examples_per_sec": sum(w["examples"] for w in windows) / span,
            "sent_per_step": median([o["trainer"]["bytes_sent"] / o["trainer"]["local_step"] for o in workers]),
            "received_per_step": median([o["trainer"]["bytes_received"] / o["trainer"]["local_step"] for o in workers])}


def main() -> None:
    parser = harness.arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--parts", default="loopback,link,pair,accuracy",
                        help="which parts to run, comma-separated: loopback, link, pair, accuracy")
    parser.add_argument("--smoke", action="store_true",
                        help="as --quick, with one warm-up and one timed step per worker: a check that it runs, no figure")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    reps = harness.reps_of(args, full=3, quick=1) if not args.smoke else 1
    steps, link_steps = (1, 1) if args.smoke else (10, 4) if args.quick else (40, 10)
    warmup, link_warmup = (1, 1) if args.smoke else (5, 2)
    test_examples = 2000 if args.quick or args.smoke else 10000
    print("## Gradient compression on the CNN (1 ps + 2 workers, async)\n")
    print(f"Machine: {harness.machine()}.  \nCommand: `{harness.command_line()}`\n")

    if "loopback" in parts:
        log(f"part 1: loopback, {reps} interleaved rounds of {steps} steps per worker")
        loop = harness.interleaved({n: (lambda f=f: throughput_case(f, warmup, steps, None)) for n, f in SETTINGS.items()},
                                   reps, warmup=0)
        print(f"### Loopback, no rate limit ({reps} rounds, {steps} timed steps per worker)\n")
        print(throughput_table(loop) + "\n")

    ns = netns_up() if "link" in parts else None
    if ns is not None:
        try:
            log(f"part 2: 100 Mbit/s, {reps} interleaved rounds of {link_steps} steps per worker")
            link = harness.interleaved(
                {n: (lambda f=f: throughput_case(f, link_warmup, link_steps, ns)) for n, f in SETTINGS.items()}, reps, warmup=0)
            print(f"### One shared 100 Mbit/s link (tc tbf on a namespace's loopback; {reps} rounds, "
                  f"{link_steps} timed steps per worker)\n")
            print(throughput_table(link) + "\n")
        finally:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
    elif "link" in parts:
        print("### One shared 100 Mbit/s link\n\nNot measured: making a network namespace needs root, ip and tc.\n")
    hosts = pair_up() if "pair" in parts else None
    if hosts is not None:
        try:
            log(f"two hosts: {reps} interleaved rounds of {link_steps} steps per worker")
            pair = harness.interleaved(
                {n: (lambda f=f: pair_case(f, hosts, link_warmup, link_steps)) for n, f in SETTINGS.items()}, reps, warmup=0)
            print(f"### Two hosts, 100 Mbit/s each way (the ps in one network namespace, both workers in another, "
                  f"tc tbf on each host's link; {reps} rounds, {link_steps} timed steps per worker)\n")
            print(throughput_table(pair) + "\n")
        finally:
            pair_down()
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
