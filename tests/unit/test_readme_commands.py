"""Every command in the shell blocks of the README and docs/ parses: the psflow options, the
scripts, their flags; and the README's template is examples/template.py as written.

A cheap guard that the pages stay runnable as written (tests/integration/test_readme_blocks.py runs
the README's blocks); it catches a renamed flag, a moved example or a placeholder.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from psflow.cli import main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


_OTHER_TOOLS = {".venv/bin/moto_server", ".venv/bin/tensorboard"}  # the S3 stand-in; viewing summaries copied down


def _commands() -> list[str]:
    blocks = [b for page in PAGES for b in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.DOTALL)]
    lines = [line.split("  #")[0].strip().removesuffix("&").strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith(".venv/bin/")]


def _example_parser(script: Path):
    spec = importlib.util.spec_from_file_location(f"readme_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # examples only define things at import (main() is guarded)
    return module.parse_args


def _check_script(script: str, args: list[str]) -> None:
    path = ROOT / script
    assert path.is_file(), f"README names {script}, which does not exist"
    parse = _example_parser(path)
    try:
        parse(args) if parse.__code__.co_argcount == 1 else parse(args, None)
    except SystemExit as e:  # argparse refused a flag
        raise AssertionError(f"{script} refuses the README's arguments {args}") from e


def test_the_readme_has_commands_and_no_placeholders():
    commands = _commands()
    assert len(commands) >= 10
    assert not [c for c in commands if "..." in c or "…" in c]


@pytest.mark.parametrize("command", _commands())
def test_each_readme_command_parses(command):
    words = shlex.split(command)
    if words[0] in _OTHER_TOOLS or words[:2] == [".venv/bin/python", "-c"]:
        return  # another package's command, or inline Python: nothing of psflow's to parse
    if words[0] == ".venv/bin/python":
        script, rest = words[1], words[2:]
        flags = [w for w in rest if not w.startswith(("--ps_hosts", "--worker_hosts", "--job_name", "--task_index"))]
        _check_script(script, flags)
        return
    assert words[0] == ".venv/bin/psflow"
    sub = main.get_command(None, words[1])  # type: ignore[arg-type]
    assert sub is not None, f"no `psflow {words[1]}`"
    if words[1] != "run":
        return
    ctx = sub.make_context("run", words[2:], resilient_parsing=False)
    script_args = [a for a in ctx.params["script_args"] if a != "--"]
    _check_script(ctx.params["script"], script_args)


def test_the_readme_shows_examples_template_as_written():
    template = (ROOT / "examples" / "template.py").read_text()
    shown = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert len(shown) == 1 and "pf.Supervisor" in shown[0]
    assert template.endswith(shown[0]) and template[: -len(shown[0])].rstrip().endswith('"""'), (
        "the README's python block must be examples/template.py after its docstring")
