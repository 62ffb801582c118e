"""Run every psflow benchmark and collect their reports in ``bench-results/latest.md``.

``make bench`` calls this. Each benchmark runs as its own process (``python benchmarks/<name>.py``),
one after the other, so they do not compete for the two cores; their markdown reports (stdout) are
concatenated under one header, and their progress (stderr) goes to the terminal. A benchmark that
fails is reported as failed in the file and makes this script exit non-zero, after the others ran.

Flags: ``--quick`` is passed to every benchmark (a smoke run of a few minutes in all). The checkpoint,
CNN and placement benchmarks always run with ``--quick`` (the checkpoint one's small model, the CNN's
few steps per round, the placement one's single async round; the failover one's single round and
30 s of faults per chaos run) so that ``make bench`` stays within about a quarter of an hour; run
``benchmarks/bench_cnn.py``, ``benchmarks/bench_checkpoint.py``, ``benchmarks/bench_placement.py``
and ``benchmarks/bench_failover.py`` without it for the full figures. The compression benchmark runs
only its 100 Mbit/s link part (``--quick --parts link``); ``benchmarks/bench_compress.py`` alone runs
all of it. The hangs benchmark runs with ``--quick`` (2 runs per hang kind, 45 s of training
under contention); ``benchmarks/bench_hangs.py`` alone runs 8 of each and 5 minutes. The multi-host
benchmark runs with ``--quick`` too (a single round of 1-2 workers); ``benchmarks/bench_multihost.py``
alone runs all of it.

Run: ``.venv/bin/python benchmarks/run_all.py [--quick] [--only transport,training]``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import harness
from harness import REPO, log

HERE = Path(__file__).resolve().parent
# name -> extra flags always passed; the order is the order of the report.
BENCHMARKS: dict[str, list[str]] = {
    "transport": [],
    "overlap": [],  # the most overlapping the ps's update with the transfer could win (raw sockets): ~1 min
    "training": [],
    "apply": ["--quick"],  # the ps's optimizer step, fused against for-loop kernels: seconds
    "checkpoint": ["--quick"],
    "s3_checkpoint": ["--quick"],  # a 1 MB checkpoint to moto's S3 against a local directory: seconds
    "cnn": ["--quick"],
    "placement": ["--quick"],
    "ui": ["--quick"],
    "compress": ["--quick", "--parts", "link"],  # the 100 Mbit/s link (needs root; says so otherwise); ~2 min
    "failover": ["--quick"],
    "multihost": ["--quick"],  # skips its parts, saying why, where namespaces, sshd or Slurm cannot be made
    "hangs": ["--quick"],  # 2 runs per hang kind and 45 s under contention: about a minute and a half
}
TIMEOUT_S = 900


def run_one(name: str, quick: bool) -> tuple[str, bool, float]:
    """Run ``bench_<name>.py``; returns (its markdown report or a failure note, success, seconds)."""
    script = HERE / f"bench_{name}.py"
    flags = list(BENCHMARKS[name])
    if quick and "--quick" not in flags:
        flags.append("--quick")
    cmd = [sys.executable, str(script), *flags]
    log(f"== {name}: {' '.join(cmd)}")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"## {name}\n\nFAILED: no result after {TIMEOUT_S} s (`{' '.join(cmd)}`).\n", False, time.perf_counter() - t0
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        return (
            f"## {name}\n\nFAILED with exit code {proc.returncode} (`{' '.join(cmd)}`); its stderr is above in the "
            f"terminal.\n\n{proc.stdout}\n",
            False,
            elapsed,
        )
    return proc.stdout, True, elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    p.add_argument("--out", default=str(REPO / "bench-results" / "latest.md"), help="where the report goes")
    args = p.parse_args()
    names = [n for n in BENCHMARKS if (HERE / f"bench_{n}.py").exists()]
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        unknown = sorted(set(wanted) - set(BENCHMARKS))
        if unknown:
            raise SystemExit(f"--only names unknown benchmarks {unknown}. Known: {', '.join(BENCHMARKS)}.")
        names = [n for n in names if n in wanted]
    header = harness.machine()
    t0 = time.perf_counter()
    sections, failed, timings = [], [], []
    for name in names:
        text, ok, elapsed = run_one(name, args.quick)
        sections.append(text.rstrip() + "\n")
        timings.append(f"{name} {elapsed:.0f} s")
        if not ok:
            failed.append(name)
    total = time.perf_counter() - t0
    doc = "\n".join([
        "# psflow benchmark results",
        "",
        f"`{harness.command_line()}`  ",
        f"{header}  ",
        f"Took {total:.0f} s ({', '.join(timings)}). Figures of one run compare with each other; across runs and "
        "machines only the ratios mean something. See BENCHMARKS.md for what each benchmark measures.",
        "",
        *sections,
    ])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc)
    print(doc)
    log(f"report written to {out}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
