"""The shapes of the HTTP API's answers, as pydantic models: what ``/openapi.json`` declares for the
main routes (:mod:`psflow.platform.api`).

The answers of changes and of small reads are checked against them (FastAPI's ``response_model``).
A run's record and the runs list keep every field the job store has (``extra="allow"``): the models
name the fields a client can count on. Those two answers are documented by the model but not
re-validated on the way out (``responses=``): they are the page's hot path, built for speed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

RunState = Literal["pending", "running", "succeeded", "failed", "stopped", "abandoned"]


class Health(BaseModel):
    ok: bool
    job_store: str = Field(description="the job store this dashboard reads")


class StoreSummary(BaseModel):
    runs: int = Field(description="runs in the job store")
    by_state: dict[str, int] = Field(description="runs per state")


class TaskBrief(BaseModel):
    model_config = ConfigDict(extra="allow")

    state: str | None = None
    attempt: int | None = None
    alive: bool | None = None
    exit_code: int | None = None


class RunRecord(BaseModel):
    """A run as the job store records it (more fields may come: ``extra`` allowed)."""

    model_config = ConfigDict(extra="allow")

    id: str
    state: RunState
    phase: str | None = Field(None, description="a running run's phase: running, draining, stopping, finished")
    script: str
    args: list[str] = []
    logdir: str
    mode: str | None = None
    strategy: str | None = None
    backend: str | None = None
    global_step: int | None = None
    examples_per_sec: float | None = None
    created_unix: float | None = None
    started_unix: float | None = None
    ended_unix: float | None = None
    restarted_from: str | None = None


class RunRow(RunRecord):
    """A row of the runs list: each task's state in brief, the workers' mean loss."""

    tasks: dict[str, TaskBrief] = {}
    loss: float | None = None


class RunList(BaseModel):
    runs: list[RunRow]
    total: int = Field(description="runs that match, on every page")
    limit: int
    offset: int = Field(description="runs newer than this page's first")
    older: str | None = Field(None, description="the next page, older runs: ?before=older")
    newer: str | None = Field(None, description="the page before, newer runs: ?after=newer")


class RunOnPage(RunRecord):
    """A run on its page: its tasks in full and, once it failed, its root cause in words."""

    tasks: dict[str, dict[str, Any]] = {}
    failure: dict[str, Any] | None = Field(None, description="exception, message, traceback_tail, task")
    scale_refusal: str | None = Field(None, description="why workers cannot join or leave it (None: they can)")


class RunPage(BaseModel):
    run: RunOnPage
    attempts: list[dict[str, Any]]
    events: list[dict[str, Any]] = Field(description="the newest 2,000, after ?after= when given")
    controls: list[dict[str, Any]] = Field(description="stop, scale and dump requests and their answers")


class RunSummary(BaseModel):
    run_id: str
    state: RunState
    summary: dict[str, Any] | None


class RunStarted(BaseModel):
    """A run asked to start: its launcher runs in the background; the run page shows it starting."""

    run_id: str
    logdir: str
    launcher_pid: int | None = None
    state: Literal["starting"] = Field("starting", description="recorded pending; its launcher is starting it")
    restores: str | None = Field(None, description="restore: the run whose checkpoint it starts from")
    checkpoint: str | None = Field(None, description="restore: that checkpoint")
    restarts: str | None = Field(None, description="restart: the run it starts again")


class ControlAsked(BaseModel):
    """A request handed to a run's launcher (stop, dump); its answer comes in the run's controls."""

    run_id: str
    request_id: int


class ScaleAsked(ControlAsked):
    workers: int
