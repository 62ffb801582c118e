"""benchmarks/chaos_visits.py's rule: where each restarted attempt had to resume its data (pure; no run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def visits():
    spec = importlib.util.spec_from_file_location("chaos_visits", ROOT / "benchmarks" / "chaos_visits.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("chaos_visits", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("applied", "resumed"), [
    ([200], []),                      # never restarted
    ([50, 30, 120], [50, 80]),        # each restart resumed after the batches applied before it
    ([0, 0, 200], []),                # killed before its first push, twice: starts at the beginning
    ([50, 0, 30, 120], [50, 80]),     # attempt 1 died before it was ready: no line, nothing applied
    ([50, 0, 30, 120], [50, 50, 80]), # attempt 1 said where it resumed, then died before a push
])
def test_resumes_where_the_earlier_attempts_ended(visits, applied, resumed):
    assert visits._resumes_match(applied, resumed)


@pytest.mark.parametrize(("applied", "resumed"), [
    ([50, 30, 120], [49, 80]),   # resumed one batch early: a batch applied twice
    ([50, 30, 120], [51, 80]),   # one batch late: a batch skipped
    ([50, 30, 120], [50]),       # attempt 2 applied batches without resuming where attempt 1 ended
    ([50, 150], [50, 60]),       # a line no attempt accounts for
])
def test_a_skipped_or_repeated_batch_is_caught(visits, applied, resumed):
    assert not visits._resumes_match(applied, resumed)
