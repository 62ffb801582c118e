"""Where psflow keeps its own state on this machine: ``PSFLOW_HOME`` (default ``~/.psflow``).

The one place that reads ``PSFLOW_HOME``. Tasks never read it (it is the launcher's and the CLI's,
not part of the launcher->task contract in :mod:`psflow.taskenv`). Holds ``jobs.db``, the job
store (:mod:`psflow.platform.jobstore`), and the launcher's locks and staging directories of URL
logdirs (:mod:`psflow.logdirlock`, :mod:`psflow.launch.urllogdir`): so it lies below both
launch/ and platform/. Also reads ``PSFLOW_UI_TOKEN`` (the dashboard's token) and
``PSFLOW_ALERT_WEBHOOK`` (where the launcher sends a run's alerts).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

HOME_ENV = "PSFLOW_HOME"
UI_TOKEN_ENV = "PSFLOW_UI_TOKEN"
JOBS_DB = "jobs.db"
ALERT_WEBHOOK_ENV = "PSFLOW_ALERT_WEBHOOK"
ALERT_STALL_ENV = "PSFLOW_ALERT_STALL_S"

# The variables the launcher and the CLI read for themselves (a task's are psflow.taskenv.ENV).
ENV = {HOME_ENV: "where psflow keeps its own state, the job store jobs.db among it (default ~/.psflow)",
       UI_TOKEN_ENV: "the dashboard's token for requests that change anything (default: a fresh one, printed at start)",
       ALERT_WEBHOOK_ENV: "a webhook the launcher tells when its run fails, stalls or restarts a task (psflow run "
                          "--alert-webhook sets it)",
       ALERT_STALL_ENV: "seconds a run's global step may stand still before the launcher alerts a stall (default 300)",
       "PSFLOW_PROCESS_TAG": "set by the launcher on every task it starts (launcher pid, run, task, attempt) and read back "
                             "from /proc by the launcher alone: what a task's helpers inherit, so they end with the run"}


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


def alert_settings(env: Mapping[str, str] | None = None) -> tuple[str | None, float]:
    """``($PSFLOW_ALERT_WEBHOOK or None, $PSFLOW_ALERT_STALL_S or 300)``: the launcher's alerts.

    Raises:
        ConfigError: a stall setting that is not a positive number.
    """
    from psflow.errors import ConfigError

    e = os.environ if env is None else env
    url = e.get(ALERT_WEBHOOK_ENV, "").strip() or None
    raw = e.get(ALERT_STALL_ENV, "").strip()
    try:
        stall_s = float(raw) if raw else 300.0
    except ValueError:
        stall_s = -1.0
    if not stall_s > 0:
        raise ConfigError(f"{ALERT_STALL_ENV}={raw!r} is not a positive number of seconds. Unset it for 300.")
    return url, stall_s
