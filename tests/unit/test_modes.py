"""The update modes (psflow.modes): one enum, each mode's rules on the ps, and a ps that asks them."""

from __future__ import annotations

import re
from pathlib import Path

from psflow.config import TrainConfig
from psflow.modes import Mode
from psflow.ps.rules import RuleSettings
from psflow.train.modes import MODES

PS = Path(__file__).resolve().parents[2] / "src" / "psflow" / "ps"


def test_each_mode_s_ps_rules_are_those_its_docstring_gives():
    rows = {m: (m.ps.applies_each_push, m.ps.waits_for_quorum, m.ps.keeps_clocks, m.ps.reads_in_place) for m in Mode}
    assert rows == {Mode.ASYNC: (True, False, False, True), Mode.SYNC: (False, True, False, False),
                    Mode.SSP: (True, False, True, False)}


def test_a_mode_is_its_text_wherever_it_is_given():
    assert TrainConfig(mode="sync").mode is Mode.SYNC and RuleSettings(mode="ssp").mode is Mode.SSP
    assert RuleSettings.of(TrainConfig(mode="async")).rules is Mode.ASYNC.ps
    assert set(MODES) == set(Mode) and all(MODES[m].name is m for m in Mode)


def test_the_ps_never_tests_a_mode_s_name():
    """The ps asks its mode's rules (Mode.ps) where the modes differ: a branch on a mode's name is
    a rule written twice."""
    tests = re.compile(r"""mode\s*([!=]=|is\b|in\b)|([!=]=|\bis|\bin)\s*(not\s+)?(["'](async|sync|ssp)["']|Mode\.)""")
    found = [f"{p.name}:{n}: {line.strip()}" for p in sorted(PS.glob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if tests.search(line)]
    assert not found, found
