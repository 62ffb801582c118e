"""Print the mutation score of the last `mutmut run` (called by `make mutate`), per module and in total.

score = killed / (killed + survived), where
  killed   = a test failed (or crashed) with the mutant in place, or the tests ran past their timeout
             (a mutant that makes the code hang is a bug the suite notices);
  survived = every selected test passed with the mutant in place, and also "no tests": a mutant in a
             function that no unit or component test calls is a bug no fast test would catch.
Exits non-zero when a mutant was left unchecked (an interrupted run), so a stale score is not read as
a fresh one.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from mutmut.stats import status_by_exit_code

KILLED = {"killed", "timeout", "segfault"}  # segfault: the tests crashed (or were killed) under the mutant
NOT_KILLED = {"survived", "no tests", "suspicious"}


def module_counts(meta: Path) -> Counter[str]:
    codes = json.loads(meta.read_text())["exit_code_by_key"].values()
    return Counter(status_by_exit_code[code] for code in codes)


def score_line(name: str, c: Counter[str]) -> str:
    killed = sum(c[s] for s in KILLED)
    total = killed + sum(c[s] for s in NOT_KILLED)
    pct = 100.0 * killed / total if total else 100.0
    return (f"{name:32s} {pct:6.1f}%  killed {c['killed']:4d}  timeout {c['timeout']:3d}  "
            f"survived {c['survived']:3d}  no tests {c['no tests']:3d}  other {c['suspicious']:3d}  "
            f"unchecked {c['not checked']:4d}")


def main(root: Path = Path("mutants")) -> int:
    metas = sorted(root.rglob("*.py.meta"))
    if not metas:
        print(f"no mutation results under {root}/: run `make mutate` first", file=sys.stderr)
        return 2
    total: Counter[str] = Counter()
    for meta in metas:
        c = module_counts(meta)
        total += c
        print(score_line(str(meta.relative_to(root)).removesuffix(".meta"), c))
    print(score_line("TOTAL", total))
    if total["not checked"]:
        print(f"{total['not checked']} mutants were not checked (interrupted run?)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
