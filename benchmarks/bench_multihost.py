"""Multi-host benchmark (issue 11): psflow over ssh across network-namespace hosts with 100 Mbit/s links.

Hosts: ``tools/netns_hosts.sh`` makes five network namespaces ``PREFIX-h1..h5`` (10.78.0.1-5, joined
by a bridge) with an OpenSSH server in each; the launcher runs inside ``PREFIX-h1`` (``ip netns exec``)
and starts every task over ssh (``psflow run --hosts A1:1,A2:1,...``), one task per host, the ps
first: ps:0 on h1 (beside the launcher), ps:1 on h2 when there are two, then the workers. Every
host's link is limited with ``tc ... tbf rate 100mbit`` (``netns_hosts.sh limit``: egress of the
host's eth0, so a ps's link limits what it sends, the pulled parameters, and a worker's link what it
pushes, its gradients). The namespaces share this machine's two cores: the links are the only thing
that differs between hosts.

The model is the third seed's CNN (``examples/mnist_cnn.py``'s network, 6.65 MB of float32
parameters), timed by ``bench_cnn.py``'s loop (``scripts/cnn_steps.py``: batch 100 per worker, Adam
lr 1e-3, warm-up steps, then timed steps). Not the softmax: its 31 KB of parameters cross a 100 Mbit/s
link in 2.5 ms, so the links would not matter; the CNN's pull and push take ~0.53 s each on one.

1. **Throughput**: 1, 2 and 3 workers against 1 and 2 ps (async, the default ``balanced`` placement:
   3.33 / 3.32 MB per ps), interleaved rounds; examples/sec = examples of every worker / the span of
   their timed windows; the ratio 2 ps / 1 ps for each worker count. With every link limited, a
   worker's own link carries its whole 6.65 MB push whatever the ps count, so a second ps can only
   halve the pull; ``--ps-links-only 3`` (the default without ``--quick``) adds 3 workers with only
   the ps hosts' links limited: the case where the ps link alone is the bottleneck.
2. **Straggler**: 3 workers + 1 ps, sync; worker:2's host limited further to ``--slow-rate``
   (10 Mbit/s: its push takes ~5 s); sync N = M = 3 against sync N = 2 of M = 3 (one backup
   worker): the chief's time from global step ``start`` to ``target`` (a fixed number of steps,
   not time to 0.98: see BENCHMARKS.md) and the test accuracy there, interleaved.
3. **Launch to first step**: the same job (1 ps + 2 workers, the CNN loop with 0 warm-up and 1
   timed step) on the local backend, on Slurm (``tools/slurm_cluster.sh up``, 3 nodes) and over ssh
   (3 namespace hosts, links not limited), interleaved: the time from just before the ``psflow run``
   process is started to the end of the first worker's first step (``end_unix`` of that worker's
   one-step window, reported to the summary; every process runs on this machine's one clock).

Skips a part, saying why in the report, where namespaces and sshd cannot be made (not root, no
iproute2, no sshd and no apt) or Slurm cannot be brought up. Every namespace, sshd and Slurm daemon
it starts is stopped on exit (also on Ctrl-C or an error).

Run: ``.venv/bin/python benchmarks/bench_multihost.py [--quick] [--reps N] [--parts throughput,straggler,launch]
[--workers 1,2,3] [--ps-links-only 3] [--steps S] [--target G] [--backends local,slurm,ssh] [--ab-push-thread]
[--ab-pipeline]`` (``--ab-push-thread``: each throughput configuration also with its pushes sent on the
training thread, interleaved, the reference for the push thread of ``psflow.train.sender``;
``--ab-pipeline``: also with the async pipeline of ``psflow.train.pipeline``, interleaved).
The markdown report goes to stdout, progress to stderr. Nothing here asserts on a timing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
from bench_cnn import throughput
from harness import REPO, log, md_table, median

NETNS_SCRIPT = REPO / "tools" / "netns_hosts.sh"
SLURM_SCRIPT = REPO / "tools" / "slurm_cluster.sh"
TASK_SCRIPT = "benchmarks/scripts/cnn_steps.py"
NET = "10.78.0"
NUM_HOSTS = 5
PARTS = ("throughput", "straggler", "launch")
BACKENDS = ("local", "slurm", "ssh")
CHILD_TIMEOUT_S = 420
CNN_BYTES = 6_653_480


class Unavailable(Exception):
    """A part cannot run here (the reason is its message)."""


@dataclass(frozen=True)
class Hosts:
    """Namespace hosts PREFIX-h1..hN with sshd; ``dir`` holds their ssh config and key."""

    prefix: str
    dir: Path
    n: int

    def addr(self, i: int) -> str:
        return f"{NET}.{i}"

    def ns(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def limit(self, i: int, rate: str) -> None:
        script(NETNS_SCRIPT, "limit", self.prefix, str(i), rate)

    def unlimit(self) -> None:
        for i in range(1, self.n + 1):
            subprocess.run(["ip", "netns", "exec", self.ns(i), "tc", "qdisc", "del", "dev", "eth0", "root"],
                           capture_output=True, timeout=10, check=False)

    def qdisc(self, i: int) -> str:
        return subprocess.run(["ip", "netns", "exec", self.ns(i), "tc", "qdisc", "show", "dev", "eth0"],
                              capture_output=True, text=True, timeout=10, check=False).stdout.strip()


def script(path: Path, *argv: str, timeout_s: float = 900) -> subprocess.CompletedProcess[str]:
    """``bash path argv``; exit 2 (not possible here) raises :class:`Unavailable`, other failures RuntimeError."""
    r = subprocess.run(["bash", str(path), *argv], capture_output=True, text=True, timeout=timeout_s, check=False)
    if r.returncode == 2:
        raise Unavailable((r.stderr.strip().splitlines() or ["exit 2"])[-1])
    if r.returncode != 0:
        raise RuntimeError(f"`{path.name} {' '.join(argv)}` failed with code {r.returncode}:\n{r.stderr[-3000:]}")
    return r


@contextmanager
def namespace_hosts(n: int) -> Iterator[Hosts]:
    """``n`` namespace hosts with sshd, torn down on exit (namespaces deleted, sshd stopped by pid)."""
    if shutil.which("ip") is None:
        raise Unavailable("no iproute2 (ip netns) here")
    if os.geteuid() != 0:
        raise Unavailable("network namespaces need root")
    h = Hosts(f"pfb{os.getpid() % 100000}", Path(tempfile.mkdtemp(prefix="psflow-mh-")), n)
    try:
        script(NETNS_SCRIPT, "up", h.prefix, str(n), NET)
        script(NETNS_SCRIPT, "sshd", h.prefix, str(n), str(h.dir))
        yield h
    finally:
        subprocess.run(["bash", str(NETNS_SCRIPT), "down", h.prefix, str(h.dir)], capture_output=True, timeout=60,
                       check=False)
        shutil.rmtree(h.dir, ignore_errors=True)


@contextmanager
def slurm_cluster(nodes: int) -> Iterator[str]:
    """SLURM_CONF of a throw-away cluster (``tools/slurm_cluster.sh``), brought down on exit."""
    d = tempfile.mkdtemp(prefix="psflow-mhs-")  # short: munge's socket path has a length limit
    try:
        script(SLURM_SCRIPT, "up", d, str(nodes))
        yield str(Path(d) / "slurm.conf")
    finally:
        subprocess.run(["bash", str(SLURM_SCRIPT), "down", d], capture_output=True, timeout=120, check=False)
        shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- one run


def psflow_exe() -> str:
    return str(Path(sys.executable).with_name("psflow"))


def run_job(launch: list[str], script_args: list[str], workdir: Path, *, netns: str | None = None,
            env: dict[str, str] | None = None, timeout_s: float = CHILD_TIMEOUT_S) -> dict[str, Any]:
    """One ``psflow run LAUNCH cnn_steps.py -- SCRIPT_ARGS`` (inside ``netns`` if given).

    Returns ``{"workers": {task: bench report}, "start_unix": just before the process started,
    "wall_s": the command's whole wall time}``.
    """
    logdir = Path(tempfile.mkdtemp(prefix="run-", dir=workdir))
    cmd = [psflow_exe(), "run", "--no-live", *launch, "--logdir", str(logdir), TASK_SCRIPT, "--", *script_args]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    start_unix, t0 = time.time(), time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher stops its tasks on SIGTERM
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=10)
        raise RuntimeError(f"`{' '.join(cmd)}` took over {timeout_s:.0f} s:\n{out[-3000:]}") from None
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM: the run (its own session) goes too
        os.killpg(proc.pid, signal.SIGTERM)
        raise
    wall_s = time.perf_counter() - t0
    summary_path = logdir / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        raise RuntimeError(f"`{' '.join(cmd)}` failed with code {proc.returncode}:\n{out[-3000:]}")
    s = json.loads(summary_path.read_text())
    shutil.rmtree(logdir, ignore_errors=True)
    benches = {t: r["bench"] for t, r in s["reports"].items() if isinstance(r.get("bench"), dict)}
    return {"workers": benches, "start_unix": start_unix, "wall_s": wall_s}


def hosts_flag(h: Hosts, count: int) -> list[str]:
    """``--hosts`` with hosts 1..count, one slot each, and the ssh config."""
    return ["--hosts", ",".join(f"{h.addr(i)}:1" for i in range(1, count + 1)), "--ssh-config", str(h.dir / "ssh_config")]


# --------------------------------------------------------------------------- 1. throughput


PS_ONLY = " (only the ps links limited)"
INLINE = " [pushes on the training thread]"
PIPELINED = " [pipeline]"
VARIANT_FLAGS = {"": [], INLINE: ["--push_inline"], PIPELINED: ["--pipeline"]}  # cnn_steps.py's flags per variant


def config_name(ps: int, workers: int, ps_links_only: bool = False, variant: str = "") -> str:
    return (f"{ps} ps, {workers} worker{'s' if workers > 1 else ''}" + (PS_ONLY if ps_links_only else "")
            + variant)


def rate_bits(rate: str) -> float:
    """tc's ``100mbit`` as bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if m is None:
        raise SystemExit(f"--rate takes a tc rate such as 100mbit or 50mbit; received {rate!r}.")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def link_use(examples_per_sec: float, ps: int, workers: int, ps_links_only: bool, rate: str) -> float:
    """The busiest limited link's bits per second over its rate: a ps's link carries its share of
    every worker's pull (the parameters split evenly: balanced placement), a worker's its own push."""
    steps_per_s = examples_per_sec / 100  # batch 100 per worker step
    ps_link = steps_per_s * CNN_BYTES / ps * 8
    worker_link = 0.0 if ps_links_only else steps_per_s / workers * CNN_BYTES * 8
    return max(ps_link, worker_link) / rate_bits(rate)


def part_throughput(h: Hosts, worker_counts: list[int], ps_only_counts: list[int], reps: int, warmup: int, steps: int,
                    rate: str, workdir: Path, *, variants: tuple[str, ...] = ("",)) -> dict[str, list[dict[str, Any]]]:
    """Every (ps, workers) configuration, interleaved; each run's links set just before it starts.
    Each runs once per variant in every round: ``""`` as is, ``INLINE`` with its pushes sent on the
    training thread (the push thread's reference), ``PIPELINED`` with the async pipeline."""

    def case(ps: int, workers: int, ps_links_only: bool, variant: str = "") -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            h.unlimit()
            for i in range(1, (ps if ps_links_only else h.n) + 1):
                h.limit(i, rate)
            t0 = time.monotonic()
            r = run_job(["--ps", str(ps), "--workers", str(workers), *hosts_flag(h, ps + workers)],
                        ["--warmup", str(warmup), "--steps", str(steps), *VARIANT_FLAGS[variant]],
                        workdir, netns=h.ns(1))
            out = throughput(list(r["workers"].values()))
            log(f"  {config_name(ps, workers, ps_links_only, variant)}: {out['examples_per_sec']:,.1f} ex/s "
                f"({time.monotonic() - t0:.0f} s)")
            return out
        return run

    h.limit(1, rate)
    log(f"throughput: links at {rate}: {h.qdisc(1)}")
    cases = {config_name(ps, w, False, v): case(ps, w, False, v) for w in worker_counts for v in variants for ps in (1, 2)}
    cases.update({config_name(ps, w, True, v): case(ps, w, True, v)
                  for w in ps_only_counts for v in variants for ps in (1, 2)})
    try:
        return harness.interleaved(cases, reps, warmup=0)
    finally:
        h.unlimit()


def report_throughput(res: dict[str, list[dict[str, Any]]], worker_counts: list[int], ps_only_counts: list[int],
                      settings: dict[str, Any]) -> str:
    eps = {name: median([r["examples_per_sec"] for r in runs]) for name, runs in res.items()}
    step = {name: median([r["per_worker_step_s"] for r in runs]) for name, runs in res.items()}
    shape = {config_name(ps, w, only, v): (ps, w, only) for w in {*worker_counts, *ps_only_counts}
             for only in (False, True) for v in VARIANT_FLAGS for ps in (1, 2)}
    rows = [[name, f"{eps[name]:,.0f}", harness.spread([r["examples_per_sec"] for r in runs], ",.0f"),
             f"{median([r['median_step_ex_per_sec'] for r in runs]):,.0f}", f"{step[name] * 1000:,.0f}",
             f"{link_use(eps[name], *shape[name], settings['rate']):.0%}"]
            for name, runs in res.items()]

    def ratio(w: int, ps_links_only: bool, variant: str = "") -> list[str]:
        one, two = config_name(1, w, ps_links_only, variant), config_name(2, w, ps_links_only, variant)
        return [f"{w} worker{'s' if w > 1 else ''}{PS_ONLY if ps_links_only else ''}{variant}: "
                "2 ps / 1 ps", f"{eps[two] / eps[one]:.2f}", f"{step[one] / step[two]:.2f}"]

    variants = settings.get("variants", ("",))
    ratios = [ratio(w, False, v) for w in worker_counts for v in variants]
    ratios += [ratio(w, True, v) for w in ps_only_counts for v in variants]
    plain = [name for name in res if not name.endswith((INLINE, PIPELINED))]
    if INLINE in variants:
        ratios += [[f"{name}: pushes on their own thread / on the training thread", f"{eps[name] / eps[name + INLINE]:.2f}",
                    f"{step[name + INLINE] / step[name]:.2f}"] for name in plain]
    if PIPELINED in variants:
        ratios += [[f"{name}: with the pipeline / without", f"{eps[name + PIPELINED] / eps[name]:.2f}",
                    f"{step[name] / step[name + PIPELINED]:.2f}"] for name in plain]
    return "\n".join([
        f"### Throughput: {', '.join(map(str, worker_counts))} worker(s) against 1 and 2 ps, every link at {settings['rate']}",
        "",
        (f"{settings['reps']} interleaved round(s); async, default placement (balanced: 3,331,840 / 3,321,640 bytes "
         f"per ps); per worker {settings['warmup']} warm-up + {settings['steps']} timed steps of batch 100, 1 torch "
         "thread; one task per namespace host, ps first (ps:0 on h1 with the launcher). Every host's link is limited "
         "unless the row says only the ps links are. examples/sec = examples of every worker / span of their timed "
         "windows; \"median step\" = sum over workers of 100 / the worker's median step time; medians over rounds. "
         f"Link use: the busiest limited link's bits per second over {settings['rate']} (a ps's link carries its "
         "share of every pull, a worker's its own push)."),
        "",
        md_table(["configuration", "examples/sec", "spread", "ex/s (median step)", "median ms/step per worker",
                  "link use"], rows),
        "",
        md_table(["ratio (same run)", "examples/sec", "median step time"], ratios),
        "",
    ])


# --------------------------------------------------------------------------- 2. straggler


NO_BACKUP = "sync N = M = 3 (no backup)"
BACKUP = "sync N = 2 of M = 3 (1 backup)"


def part_straggler(h: Hosts, reps: int, start: int, target: int, rate: str, slow_rate: str, test_examples: int,
                   workdir: Path) -> dict[str, list[dict[str, Any]]]:
    for i in range(1, 5):
        h.limit(i, slow_rate if i == 4 else rate)  # ps:0 on h1, worker:0-2 on h2-h4: worker:2 is the straggler
    log(f"straggler: links at {rate}, worker:2's host at {slow_rate}: {h.qdisc(4)}")
    flags = {NO_BACKUP: ["--mode", "sync"], BACKUP: ["--mode", "sync", "--replicas-to-aggregate", "2"]}

    def case(name: str) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            r = run_job(["--ps", "1", "--workers", "3", *flags[name], *hosts_flag(h, 4)],
                        ["--target_step", str(target), "--start_step", str(start), "--test_examples", str(test_examples)],
                        workdir, netns=h.ns(1))
            chief = r["workers"]["worker:0"]
            slow, fast = r["workers"]["worker:2"], [r["workers"][f"worker:{i}"] for i in (0, 1)]
            out = {"time_s": chief["time_s"], "accuracy": chief["test_accuracy"], "wall_s": r["wall_s"],
                   "slow_steps": slow["local_steps"],
                   "slow_vs_fast": slow["median_step_s"] / median([f["median_step_s"] for f in fast])}
            log(f"  {name}: steps {start}-{target} in {out['time_s']:.1f} s, accuracy {out['accuracy']:.4f}")
            return out
        return run

    try:
        return harness.interleaved({name: case(name) for name in flags}, reps, warmup=0)
    finally:
        h.unlimit()


def report_straggler(res: dict[str, list[dict[str, Any]]], settings: dict[str, Any]) -> str:
    t = {name: median([r["time_s"] for r in runs]) for name, runs in res.items()}
    rows = [[name, f"{t[name]:.1f}", harness.spread([r["time_s"] for r in runs], ".1f"),
             f"{median([r['accuracy'] for r in runs]):.4f}", f"{median([r['slow_vs_fast'] for r in runs]):.1f}x",
             f"{median([r['slow_steps'] for r in runs]):.0f}", f"{median([r['wall_s'] for r in runs]):.1f}"]
            for name, runs in res.items()]
    return "\n".join([
        f"### Straggler: sync with and without a backup worker, worker:2's link at {settings['slow_rate']}",
        "",
        (f"CNN, 1 ps (h1) + 3 workers (h2-h4), every link at {settings['rate']} but worker:2's at "
         f"{settings['slow_rate']}. Measured: the chief's time from global step {settings['start']} to global step "
         f"{settings['target']} (a fixed number of steps, NOT time to 0.98 accuracy), and the test accuracy of the "
         f"parameters there on {settings['test_examples']:,} test images. {settings['reps']} interleaved round(s), medians."),
        "",
        md_table(["configuration", f"time to step {settings['target']} (s)", "spread", "test accuracy",
                  "slow worker step / fast", "slow worker's steps", "launcher wall (s)"], rows),
        "",
        f"Backup worker speed-up (no-backup time / backup time, same run): {t[NO_BACKUP] / t[BACKUP]:.2f}x.",
        "",
    ])


def part_time_to_accuracy(h: Hosts, reps: int, accuracy: float, settings: dict[str, Any],
                          workdir: Path) -> dict[str, list[dict[str, Any]]]:
    """The straggler setting again, timed to a test accuracy (``cnn_steps.py --target_accuracy``)."""
    for i in range(1, 5):
        h.limit(i, settings["slow_rate"] if i == 4 else settings["rate"])
    log(f"time to accuracy {accuracy}: links at {settings['rate']}, worker:2's host at {settings['slow_rate']}")
    flags = {NO_BACKUP: ["--mode", "sync"], BACKUP: ["--mode", "sync", "--replicas-to-aggregate", "2"]}

    def case(name: str) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            stop_file = Path(tempfile.mkdtemp(prefix="stop-", dir=workdir)) / "reached"
            r = run_job(["--ps", "1", "--workers", "3", *flags[name], *hosts_flag(h, 4)],
                        ["--target_accuracy", str(accuracy), "--start_step", "1", "--eval_every", str(settings["eval_every"]),
                         "--max_step", str(settings["max_step"]), "--test_examples", str(settings["test_examples"]),
                         "--stop_file", str(stop_file)], workdir, netns=h.ns(1), timeout_s=settings["timeout_s"])
            chief = r["workers"]["worker:0"]
            reached = chief.get("reached")
            out = {"reached": reached, "evals": chief["evals"], "eval_s": chief["eval_s"], "wall_s": r["wall_s"],
                   "steps_during_eval": chief["steps_during_eval"], "slow_steps": r["workers"]["worker:2"]["local_steps"]}
            log(f"  {name}: " + (f"{accuracy} at global step {reached['global_step']} after {reached['train_s']:.1f} s"
                                 if reached else f"not reached by step {settings['max_step']}")
                + f"; evals (global step, train s, accuracy) {json.dumps([list(e.values()) for e in chief['evals']])}")
            return out
        return run

    try:
        return harness.interleaved({name: case(name) for name in flags}, reps, warmup=0)
    finally:
        h.unlimit()


def first_reaching(evals: list[dict[str, Any]], accuracy: float) -> dict[str, Any] | None:
    """The first evaluation at ``accuracy`` or above (a lower threshold read from the same run)."""
    return next((e for e in evals if e["accuracy"] >= accuracy), None)


def report_time_to_accuracy(res: dict[str, list[dict[str, Any]]], accuracy: float, settings: dict[str, Any]) -> str:
    lower = [a for a in settings["also"] if a < accuracy]
    sections = [_accuracy_table(res, accuracy, settings, measured=True)]
    for a in lower:
        again = {name: [{**r, "reached": first_reaching(r["evals"], a)} for r in runs] for name, runs in res.items()}
        sections.append(_accuracy_table(again, a, settings, measured=False))
    return "\n".join(sections)


def _accuracy_table(res: dict[str, list[dict[str, Any]]], accuracy: float, settings: dict[str, Any], *,
                    measured: bool) -> str:
    def cell(runs: list[dict[str, Any]], key: str, fmt: str) -> tuple[str, str]:
        vals = [r["reached"][key] for r in runs if r["reached"]]
        missed = len(runs) - len(vals)
        if not vals:
            return "not reached", ""
        return f"{median(vals):{fmt}}" + (f" ({missed} run(s) did not reach it)" if missed else ""), harness.spread(vals, fmt)
    rows = []
    for name, runs in res.items():
        t, ts = cell(runs, "train_s", ".1f")
        g, gs = cell(runs, "global_step", ".0f")
        rows.append([name, t, ts, g, gs, f"{median([r['steps_during_eval'] for r in runs]):.0f}",
                     f"{median([r['eval_s'] for r in runs]):.1f}", f"{median([r['slow_steps'] for r in runs]):.0f}",
                     f"{median([r['wall_s'] for r in runs]):.1f}"])
    t = {name: [r["reached"]["train_s"] for r in runs if r["reached"]] for name, runs in res.items()}
    speedup = (f"Backup worker speed-up to {accuracy} (median no-backup time / median backup time): "
               f"{median(t[NO_BACKUP]) / median(t[BACKUP]):.2f}x." if t[NO_BACKUP] and t[BACKUP] else "")
    if not measured:
        return "\n".join([f"#### Time to {accuracy}, read from the same runs' evaluations", "",
                          md_table(["configuration", f"time to {accuracy} (s)", "spread", "global step", "spread"],
                                   [row[:5] for row in rows]), "", speedup, ""])
    return "\n".join([
        f"### Time to test accuracy {accuracy}: sync with and without a backup worker, worker:2's link at "
        f"{settings['slow_rate']}",
        "",
        (f"CNN, 1 ps (h1) + 3 workers (h2-h4), every link at {settings['rate']} but worker:2's at "
         f"{settings['slow_rate']}. The chief evaluates the live parameters on {settings['test_examples']:,} test "
         f"images every {settings['eval_every']} global steps; measured: its training time from global step 1 "
         f"to the first evaluation at >= {accuracy} (evaluation pauses excluded), capped at step "
         f"{settings['max_step']}. {settings['reps']} interleaved round(s), medians."),
        "",
        md_table(["configuration", f"time to {accuracy} (s)", "spread", "global step", "spread",
                  "steps taken during evals", "eval pauses (s)", "slow worker's steps", "launcher wall (s)"], rows),
        "",
        speedup,
        "",
        "Every evaluation: " + "; ".join(f"{name} run {i}: " + ", ".join(f"{e['global_step']}:{e['accuracy']:.3f}"
                                                                       for e in r["evals"])
                                        for name, runs in res.items() for i, r in enumerate(runs)),
        "",
    ])


# --------------------------------------------------------------------------- 3. launch to first step


def part_launch(h: Hosts | None, slurm_conf: str | None, reps: int, workdir: Path) -> dict[str, list[float]]:
    one_step = ["--warmup", "0", "--steps", "1"]

    def first_step(r: dict[str, Any]) -> float:
        return min(b["end_unix"] for b in r["workers"].values()) - r["start_unix"]

    cases: dict[str, Callable[[], float]] = {
        "local": lambda: first_step(run_job(["--ps", "1", "--workers", "2"], one_step, workdir)),
    }
    if slurm_conf:
        cases["slurm"] = lambda: first_step(run_job(["--backend", "slurm", "--nodes", "3"], one_step, workdir,
                                                    env={"SLURM_CONF": slurm_conf}))
    if h:
        h.unlimit()
        cases["ssh"] = lambda: first_step(run_job(["--ps", "1", "--workers", "2", *hosts_flag(h, 3)], one_step, workdir,
                                                  netns=h.ns(1)))

    def logged(name: str, fn: Callable[[], float]) -> Callable[[], float]:
        def run() -> float:
            s = fn()
            log(f"  {name}: first step {s:.2f} s after launch")
            return s
        return run

    return harness.interleaved({name: logged(name, fn) for name, fn in cases.items()}, reps, warmup=0)


def report_launch(res: dict[str, list[float]], skipped: dict[str, str], reps: int) -> str:
    local = median(res["local"])
    rows = [[name, f"{median(v):.2f}", harness.spread(v, ".2f"), f"{median(v) / local:.2f}"] for name, v in res.items()]
    rows += [[name, "skipped", why, "-"] for name, why in skipped.items()]
    return "\n".join([
        "### Launch to first step: local, Slurm, ssh",
        "",
        ("The same job, 1 ps + 2 workers, the CNN loop with 0 warm-up and 1 timed step: local (`--ps 1 --workers 2`), "
         "Slurm (`--backend slurm --nodes 3` on a 3-node `tools/slurm_cluster.sh` cluster), ssh (`--hosts` over 3 "
         "namespace hosts, links not limited, the launcher in h1). Measured: from just before the `psflow run` "
         "process starts to the end of the first worker's first training step (its window's `end_unix`). "
         f"{reps} interleaved repetition(s), medians."),
        "",
        md_table(["backend", "launch to first step (s)", "spread", "vs local"], rows),
        "",
    ])


# --------------------------------------------------------------------------- main


def main() -> None:
    """Parse the flags, bring up the hosts, run the parts, print the report."""
    p = harness.arg_parser(__doc__.splitlines()[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {','.join(PARTS)} (default: all)")
    p.add_argument("--workers", default=None, help="worker counts for the throughput part (default 1,2,3; quick 1,2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per worker (default 3, quick 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per worker (default 12, quick 3)")
    p.add_argument("--ps-links-only", default=None,
                   help="worker counts also run with only the ps hosts' links limited (default 3; quick none)")
    p.add_argument("--rate", default="100mbit", help="every host's link (tc tbf rate; default 100mbit)")
    p.add_argument("--ab-push-thread", action="store_true",
                   help="throughput part: each configuration also with its pushes sent on the training thread (A/B)")
    p.add_argument("--ab-pipeline", action="store_true",
                   help="throughput part: each configuration also with the async pipeline (psflow run --pipeline; A/B)")
    p.add_argument("--slow-rate", default="10mbit", help="the straggler's link (default 10mbit)")
    p.add_argument("--target", type=int, default=None, help="straggler part: global step to reach (default 14, quick 4)")
    p.add_argument("--accuracy", type=float, default=None,
                   help="straggler part: time to this test accuracy instead of to --target (e.g. 0.98)")
    p.add_argument("--also", default="0.95", help="with --accuracy: lower thresholds read from the same runs")
    p.add_argument("--test-examples", type=int, default=1000, help="with --accuracy: test images per evaluation")
    p.add_argument("--eval-every", type=int, default=5, help="with --accuracy: global steps between evaluations")
    p.add_argument("--max-step", type=int, default=300, help="with --accuracy: give up at this global step")
    p.add_argument("--backends", default=",".join(BACKENDS), help="launch part: comma list of local,slurm,ssh")
    args = p.parse_args()
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    backends = [x.strip() for x in args.backends.split(",") if x.strip()]
    if not parts or set(parts) - set(PARTS):
        raise SystemExit(f"--parts takes a comma list of {', '.join(PARTS)}; received {args.parts!r}.")
    if "local" not in backends or set(backends) - set(BACKENDS):
        raise SystemExit(f"--backends takes a comma list of {', '.join(BACKENDS)} that includes local (the reference); "
                         f"received {args.backends!r}.")
    try:
        worker_counts = [int(x) for x in (args.workers or ("1,2" if args.quick else "1,2,3")).split(",")]
    except ValueError:
        raise SystemExit(f"--workers takes a comma list of worker counts 1-3; received {args.workers!r}.") from None
    if not worker_counts or not all(1 <= w <= NUM_HOSTS - 2 for w in worker_counts):
        raise SystemExit(f"--workers takes worker counts from 1 to {NUM_HOSTS - 2}; received {args.workers!r}.")
    try:
        ps_only_counts = [int(x) for x in (args.ps_links_only if args.ps_links_only is not None else ("" if args.quick else "3")).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--ps-links-only takes a comma list of worker counts 1-3; received {args.ps_links_only!r}.") from None
    if not all(1 <= w <= NUM_HOSTS - 2 for w in ps_only_counts):
        raise SystemExit(f"--ps-links-only takes worker counts from 1 to {NUM_HOSTS - 2}; received {args.ps_links_only!r}.")
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    steps = args.steps if args.steps is not None else (3 if args.quick else 12)
    target = args.target if args.target is not None else (4 if args.quick else 14)
    start = 1 if target < 6 else 2
    if warmup < 0 or steps < 1 or target < 2:
        raise SystemExit(f"--warmup must be >= 0, --steps >= 1 and --target >= 2; received {warmup}, {steps}, {target}.")
    reps = harness.reps_of(args, full=2, quick=1)
    launch_reps = harness.reps_of(args, full=3, quick=1)
    test_examples = 1000 if args.quick else 10000
    # Ctrl-C and SIGTERM both unwind through the finally blocks that stop the hosts, sshd and Slurm.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    header = harness.machine()
    sections = [
        "## Multi-host (issue 11): ssh across network-namespace hosts, links limited with tc tbf",
        "",
        f"`{harness.command_line()}`  ",
        header,
        "",
    ]
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="psflow-bench-mh-") as d:
        workdir = Path(d)
        hosts_cm = namespace_hosts(NUM_HOSTS)
        try:
            h: Hosts | None = hosts_cm.__enter__()
            no_hosts = ""
        except Unavailable as e:
            h, no_hosts = None, str(e)
            log(f"no namespace hosts: {e}")
        try:
            if "throughput" in parts:
                if h is None:
                    sections += ["### Throughput", "", f"Skipped: no network-namespace hosts here ({no_hosts}).", ""]
                else:
                    log(f"throughput: workers {worker_counts} x ps 1,2, {reps} round(s), {warmup} + {steps} steps")
                    variants = ("", *([INLINE] if args.ab_push_thread else []), *([PIPELINED] if args.ab_pipeline else []))
                    res = part_throughput(h, worker_counts, ps_only_counts, reps, warmup, steps, args.rate, workdir,
                                          variants=variants)
                    sections.append(report_throughput(res, worker_counts, ps_only_counts, {
                        "reps": reps, "warmup": warmup, "steps": steps, "rate": args.rate, "variants": variants}))
            if "straggler" in parts:
                if h is None:
                    sections += ["### Straggler", "", f"Skipped: no network-namespace hosts here ({no_hosts}).", ""]
                elif args.accuracy is not None:
                    acc_settings = {"reps": reps, "rate": args.rate, "slow_rate": args.slow_rate,
                                    "eval_every": args.eval_every, "max_step": args.max_step,
                                    "test_examples": args.test_examples, "timeout_s": 60 + 12 * args.max_step,
                                    "also": [float(a) for a in args.also.split(",") if a.strip()]}
                    res4 = part_time_to_accuracy(h, reps, args.accuracy, acc_settings, workdir)
                    sections.append(report_time_to_accuracy(res4, args.accuracy, acc_settings))
                else:
                    log(f"straggler: sync vs sync + 1 backup, steps {start}-{target}, {reps} round(s)")
                    res2 = part_straggler(h, reps, start, target, args.rate, args.slow_rate, test_examples, workdir)
                    sections.append(report_straggler(res2, {"reps": reps, "start": start, "target": target,
                                                            "rate": args.rate, "slow_rate": args.slow_rate,
                                                            "test_examples": test_examples}))
            if "launch" in parts:
                skipped: dict[str, str] = {}
                if "ssh" in backends and h is None:
                    skipped["ssh"] = f"no network-namespace hosts here ({no_hosts})"
                if "slurm" in backends:
                    log("launch: bringing up a 3-node Slurm cluster (tools/slurm_cluster.sh)")
                    try:
                        with slurm_cluster(3) as conf:
                            res3 = part_launch(h if "ssh" in backends else None, conf, launch_reps, workdir)
                    except Unavailable as e:
                        skipped["slurm"] = f"no Slurm here: {e}"
                        res3 = part_launch(h if "ssh" in backends else None, None, launch_reps, workdir)
                else:
                    res3 = part_launch(h if "ssh" in backends else None, None, launch_reps, workdir)
                sections.append(report_launch(res3, skipped, launch_reps))
        finally:
            if h is not None:
                hosts_cm.__exit__(None, None, None)
    sections.append(f"Took {time.monotonic() - t_all:.0f} s; load average at the end "
                    f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}.")
    print("\n".join(sections))


if __name__ == "__main__":
    main()
