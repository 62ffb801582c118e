"""A run's files: ``psflow summary``, ``export``, ``checkpoints``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from psflow.cli.group import main
from psflow.errors import PsflowError
from psflow.rundir import RunDir


def _live_status(logdir: str) -> dict:
    """LOGDIR's status as ``psflow status LOGDIR`` shows it (:func:`psflow.platform.views.status_of`),
    or a ClickException."""
    from psflow.platform import views

    try:
        return views.status_of(views.RunRef(Path(logdir), None))
    except PsflowError as e:
        raise click.ClickException(str(e)) from e


@main.command()
@click.argument("summary", type=click.Path(exists=True, dir_okay=True))
def summary(summary: str) -> None:
    """Print a run's summary (LOGDIR or LOGDIR/summary.json). A run still going (or abandoned) has
    no summary yet: its live status is shown instead."""
    from pathlib import Path

    p = Path(summary)
    p = RunDir(p).summary if p.is_dir() else p
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        _no_summary(p, "the launcher writes it when the run ends")
        return
    except (OSError, ValueError) as e:
        _no_summary(p, f"it cannot be read ({e}); the run's logs are in {RunDir(p.parent).logs}")
        return
    if not isinstance(data, dict):
        _no_summary(p, f"it holds a JSON {type(data).__name__}, not the launcher's summary")
        return
    for k in ("run_id", "status", "mode", "global_step", "examples_per_sec", "wall_s"):
        click.echo(f"{k:>18}: {data.get(k)}")
    for k, v in (data.get("metrics") or {}).items():  # the script's own, as it named them
        click.echo(f"{k:>18}: {v}")
    step = (data.get("timeline") or {}).get("step") if isinstance(data.get("timeline"), dict) else None
    if isinstance(step, dict) and step:  # psflow run --timeline: where the workers' step time went
        click.echo(f"{'step time':>18}: " + ", ".join(f"{p} {v:.0%}" for p, v in step.items() if isinstance(v, (int, float))))
        click.echo(f"{'timeline':>18}: {p.parent / 'timeline.json'} (open in ui.perfetto.dev or chrome://tracing)")
    for t in data.get("tasks") or []:  # what the watchdog caught, and where the stacks are
        for x in t.get("exits") or [] if isinstance(t, dict) else []:
            if isinstance(x, dict) and isinstance(x.get("hang"), dict):
                then = "restarted" if x.get("restarted") else "not restarted"
                click.echo(f"{'hang':>18}: {t.get('task')} attempt {x.get('attempt')}: {x['hang'].get('cause')}; {then}")


def _no_summary(path: Path, why: str) -> None:
    """No usable summary.json: say so, show the live status if there is one, exit 1."""
    from rich.console import Console

    from psflow.launch.status import render

    click.echo(f"psflow: no summary at {path}: {why}.", err=True)
    try:
        state = _live_status(str(path.parent))
    except click.ClickException:
        sys.exit(1)
    click.echo(f"psflow: the run is {state.get('state')}; its status (psflow status {path.parent}):", err=True)
    Console().print(render(state))
    sys.exit(1)


class _LogdirOrUrl(click.Path):
    """An existing directory, or a URL (``s3://bucket/run``: a URL logdir, or a --checkpoint-dir)."""

    def __init__(self) -> None:
        super().__init__(exists=True, file_okay=False)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and "://" in value:
            return value
        return super().convert(value, param, ctx)


@main.command()
@click.argument("logdir", type=_LogdirOrUrl())
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--averages/--values", default=None,
              help="Export the moving averages (or the values); default: what the run chose (ema_for_export).")
def export(logdir: str, out: str, averages: bool | None) -> None:
    """Write the newest checkpoint of LOGDIR as OUT.safetensors: a plain PyTorch state dict.

    LOGDIR may be local or a URL (s3://bucket/run: a URL logdir or a --checkpoint-dir), and also a
    checkpoints/ directory or one ckpt-<step> directory. Load it with
    torch + safetensors alone: model.load_state_dict(safetensors.torch.load_file(OUT)).
    """
    from psflow.checkpoint import export_checkpoint

    try:
        path, ckpt, used_averages = export_checkpoint(logdir, out, averages=averages,
                                                      warn=lambda m: click.echo(f"psflow: warning: {m}", err=True))
    except PsflowError as e:
        raise click.ClickException(str(e)) from e
    names = [p["name"] for p in ckpt.meta["placement"]["params"]]
    click.echo(f"psflow: exported {len(names)} tensors ({'moving averages' if used_averages else 'values'}) "
               f"of step {ckpt.step} from {ckpt.path} to {path}")


@main.command()
@click.argument("logdir", type=_LogdirOrUrl())
def checkpoints(logdir: str) -> None:
    """List the checkpoints of LOGDIR (a local or URL logdir, a checkpoints/ directory, or a
    --checkpoint-dir URL), newest first, verified."""
    from psflow import checkpoint

    try:
        root = checkpoint.find_root(logdir)
    except PsflowError as e:
        raise click.ClickException(str(e)) from e
    found = checkpoint.list_checkpoints(root)
    if not found:
        click.echo(f"psflow: no checkpoints under {root}")
        return
    for path in found:
        try:
            ckpt = checkpoint.read_checkpoint(path)
        except PsflowError as e:
            click.echo(f"{path.name}  CORRUPT: {e}")
            continue
        size = sum(r.size_bytes for r in ckpt.shards)
        click.echo(f"{path.name}  step={ckpt.step}  shards={ckpt.num_shards}  {size / 1e6:.2f} MB  ok")
