"""Where psflow keeps its own state on this machine: ``PSFLOW_HOME`` (default ``~/.psflow``).

The one place that reads ``PSFLOW_HOME``. Tasks never read it (it is the launcher's and the CLI's,
not part of the launcher->task contract in :mod:`psflow.launch.contract`). Holds ``jobs.db``, the job
store (:mod:`psflow.platform.jobstore`). Also reads ``PSFLOW_UI_TOKEN`` (the dashboard's token).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

HOME_ENV = "PSFLOW_HOME"
UI_TOKEN_ENV = "PSFLOW_UI_TOKEN"
JOBS_DB = "jobs.db"

# The variables the launcher and the CLI read for themselves (a task's are launch.contract.ENV).
ENV = {HOME_ENV: "where psflow keeps its own state, the job store jobs.db among it (default ~/.psflow)",
       UI_TOKEN_ENV: "the dashboard's token for requests that change anything (default: a fresh one, printed at start)"}


def psflow_home(env: Mapping[str, str] | None = None) -> Path:
    """``$PSFLOW_HOME``, or ``~/.psflow`` where it is unset or blank (not created here).

    Example:
        >>> psflow_home({"PSFLOW_HOME": "/tmp/ps"})
        PosixPath('/tmp/ps')
    """
    raw = (os.environ if env is None else env).get(HOME_ENV, "").strip()
    return Path(raw).expanduser() if raw else Path.home() / ".psflow"


def jobs_db_path(env: Mapping[str, str] | None = None) -> Path:
    """The job store's database file: ``$PSFLOW_HOME/jobs.db``."""
    return psflow_home(env) / JOBS_DB


def ui_token(env: Mapping[str, str] | None = None) -> str | None:
    """``$PSFLOW_UI_TOKEN`` (None where unset or blank): the dashboard's token, if the user chose one."""
    raw = (os.environ if env is None else env).get(UI_TOKEN_ENV, "").strip()
    return raw or None
