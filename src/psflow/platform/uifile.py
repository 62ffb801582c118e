"""Where a running ``psflow ui`` serves: ``$PSFLOW_HOME/ui.json`` (url, pid, and its alerts' webhook
and stall when it has ``--alert-webhook``), written by :mod:`psflow.platform.uiserver` once it
listens and removed when it stops; read by ``psflow run`` to print where the dashboard is, and by
every run's alerts (:mod:`psflow.platform.runalerts`) to tell the dashboard's webhook. Light on
purpose (no web framework imported): the launcher reads it. Readable by its owner only (a webhook's
URL is often its credential).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from psflow.home import psflow_home

UI_FILE = "ui.json"


def write_ui(home: Path, url: str, *, alerts: Mapping[str, Any] | None = None) -> None:
    """Record that this process serves the dashboard of ``home`` at ``url`` (best effort); ``alerts``:
    where its runs' alerts go (``{"webhook": URL, "stall_s": S}``), if anywhere."""
    with contextlib.suppress(OSError):
        home.mkdir(parents=True, exist_ok=True)
        tmp = home / f".{UI_FILE}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"url": url, "pid": os.getpid(), **({"alerts": dict(alerts)} if alerts else {})}))
        tmp.replace(home / UI_FILE)


def remove_ui(home: Path) -> None:
    """Forget this process's record (another dashboard's is left alone)."""
    with contextlib.suppress(OSError):
        if read_ui(home).get("pid") == os.getpid():
            (home / UI_FILE).unlink()


def read_ui(home: Path) -> dict[str, Any]:
    try:
        data = json.loads((home / UI_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def running_dashboard(home: Path | None = None) -> dict[str, Any] | None:
    """The record of the dashboard serving this psflow home (``url``, ``pid``, ``alerts``), if one runs
    (its process is alive)."""
    data = read_ui(home or psflow_home())
    pid = data.get("pid")
    if not isinstance(pid, int) or not isinstance(data.get("url"), str):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return data


def running_ui(home: Path | None = None) -> str | None:
    """The URL of the dashboard serving this psflow home, if one runs (its process is alive)."""
    data = running_dashboard(home)
    return None if data is None else str(data["url"])
