"""Every task the Supervisor or the evaluator is given is a SupervisedTask: psflow's Task derives it
and sets each member, so they read a task's members directly and never ask a task what it has (the
tests' stand-ins define each member too: test_supervisor_units.fake_task, inproc.InprocTask)."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap

import pytest

from psflow.task import SupervisedTask, Task

MEMBERS = sorted(n for n, v in vars(SupervisedTask).items()
                 if (inspect.isfunction(v) or isinstance(v, property)) and not n.startswith("_"))
ATTRIBUTES = sorted(SupervisedTask.__annotations__)


def users():
    """The modules given a SupervisedTask, and the part of each that reads it."""
    import psflow.evaluator as evaluator
    import psflow.supervisor as supervisor

    return [(supervisor, supervisor.Supervisor), (evaluator, evaluator)]


def is_task(node: ast.AST) -> bool:
    """``task`` or ``self.task``: the code's names for the task it was given."""
    return (isinstance(node, ast.Name) and node.id == "task") or (isinstance(node, ast.Attribute) and node.attr == "task")


def tree_of(obj: object) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(obj)))  # code only: a docstring's example is no use of a task


@pytest.mark.parametrize("module, reader", users(), ids=["supervisor", "evaluator"])
def test_no_user_of_a_supervised_task_asks_it_what_it_has(module, reader):
    asks = [ast.unparse(n) for n in ast.walk(tree_of(module)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id in ("getattr", "hasattr") and n.args and is_task(n.args[0])]
    assert not asks


@pytest.mark.parametrize("module, reader", users(), ids=["supervisor", "evaluator"])
def test_the_protocol_holds_what_each_user_reads_of_a_task(module, reader):
    used = {n.attr for n in ast.walk(tree_of(reader)) if isinstance(n, ast.Attribute) and is_task(n.value)}
    assert used and used - set(MEMBERS) - set(ATTRIBUTES) == set()


def test_the_task_defines_every_member_the_supervisor_uses():
    assert SupervisedTask in Task.__mro__  # explicitly, not only by shape
    stubs = [m for m in MEMBERS if getattr(Task, m) is vars(SupervisedTask)[m]]
    assert not stubs, f"Task leaves {stubs} to the protocol's empty stubs"
    source = inspect.getsource(Task.__init__)
    unset = [a for a in ATTRIBUTES if not re.search(rf"self\.{a}\b\s*(:[^=\n]+)?=[^=]", source)]
    assert not unset, f"Task never sets {unset}"
