"""Every task the Supervisor is given is a SupervisedTask: psflow's Task derives it and sets each
member, so the Supervisor reads a task's members directly and never asks a task what it has (the
tests' stand-ins define each member too: test_supervisor_units.fake_task, inproc.InprocTask)."""

from __future__ import annotations

import inspect
import re

from psflow.task import SupervisedTask, Task

MEMBERS = sorted(n for n, v in vars(SupervisedTask).items()
                 if (inspect.isfunction(v) or isinstance(v, property)) and not n.startswith("_"))
ATTRIBUTES = sorted(SupervisedTask.__annotations__)


def test_the_supervisor_asks_no_task_what_it_has():
    import psflow.supervisor as supervisor

    source = inspect.getsource(supervisor)
    assert not re.findall(r"(hasattr|getattr)\((self\.)?task\b", source)


def test_the_protocol_holds_what_the_supervisor_uses_of_a_task():
    import psflow.supervisor as supervisor

    used = set(re.findall(r"\btask\.(\w+)", inspect.getsource(supervisor.Supervisor)))
    assert used and used - set(MEMBERS) - set(ATTRIBUTES) == set()


def test_the_task_defines_every_member_the_supervisor_uses():
    assert SupervisedTask in Task.__mro__  # explicitly, not only by shape
    stubs = [m for m in MEMBERS if getattr(Task, m) is vars(SupervisedTask)[m]]
    assert not stubs, f"Task leaves {stubs} to the protocol's empty stubs"
    source = inspect.getsource(Task.__init__)
    unset = [a for a in ATTRIBUTES if not re.search(rf"self\.{a}\b\s*(:[^=\n]+)?=[^=]", source)]
    assert not unset, f"Task never sets {unset}"
