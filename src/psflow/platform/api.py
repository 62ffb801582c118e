"""The HTTP API of ``psflow ui``: JSON over the job store, and the requests that start, stop and
restart runs. FastAPI serves its OpenAPI schema at ``/openapi.json`` (no /docs pages: they load
scripts from a CDN). :func:`create_app` puts together its routers, by who may call them:

- ``health_routes``: ``GET /api/health``;
- ``read_routes``: the store: ``/api/summary``, ``/api/runs?state=&q=&limit=&before=&after=`` (newest
  first, paged by the keys each page gives), ``/api/runs/{run}`` (tasks, attempts, events ``?after=``,
  controls, and ``failure``: its root cause in words once it failed), its ``metrics`` (charts: a bounded
  number of points per series, ``?cursor=``: only what is new), ``stragglers``, ``summary``, ``ps``;
- ``run_page_routes``: a run's files and views: ``tasks/{task}/log``, ``placement``, ``checkpoints``
  (``.../{name}/export``: safetensors), ``stacks`` (the last dump, grouped);
- ``change_routes`` (POST): start a run (``/api/runs``: 422 naming what was wrong), ``stop``,
  ``restart``, ``scale`` ``{"workers": N}``, ``dump``, ``checkpoints/{name}/restore``; a start,
  restart or restore answers at once (202, the run recorded ``pending`` while its launcher starts);
- ``stream_routes``: ``/api/runs/{run}/stream`` (Server-Sent Events, :mod:`psflow.platform.livestream`)
  and ``/metrics`` (Prometheus).

Security: every request, reads included, must name the dashboard in its ``Host`` header
(:mod:`psflow.platform.hosts`), or it gets a 400 (DNS rebinding). Every POST needs the token
(``Authorization: Bearer TOKEN`` or ``X-Psflow-Token``, compared with :func:`hmac.compare_digest`);
with ``auth_reads`` (a non-loopback bind) every read needs it too. A body is strict JSON
(:mod:`psflow.platform.jsonbody`: NaN or infinity is a 422 naming the field). A started run's script must be a
``.py`` file under one of ``script_roots``; its arguments are argv (no shell). Files are served
through :mod:`psflow.platform.runfiles` only: nothing outside a run's log directory.

The API only reads the store and writes control requests; the runs it starts are launcher processes
of their own session (:func:`psflow.platform.launching.start_detached`), so they outlive it. Served by
:mod:`psflow.platform.uiserver`.
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask

from psflow.errors import ConfigError, PsflowError
from psflow.home import ALERT_STALL_ENV, ALERT_WEBHOOK_ENV, HOME_ENV, JOBS_DB, UI_TOKEN_ENV
from psflow.platform import apimodels as answers
from psflow.platform.hosts import LOOPBACK_NAMES, HostAllowlist
from psflow.platform.jobstore import RUN_STATES, JobStore, JobStoreError
from psflow.platform.jsonbody import FiniteJsonRoute
from psflow.platform.runfiles import RunFileError, checkpoint_path, checkpoints, log_path, read_log

STATIC = Path(__file__).parent / "static"
_HIDDEN = ("launcher", "launch")  # the launcher's process identity and relaunch data: not the page's business


@dataclass(frozen=True)
class UiSettings:
    """What the API serves and allows.

    Args:
        home: the psflow home whose ``jobs.db`` is read (the launchers it starts record there too).
        token: the secret every changing request must carry.
        script_roots: a started run's script must lie under one of these directories.
        runs_root: where the log directories of runs started here go (``runs_root/<run id>``; default
            ``runs`` under the current directory, as ``psflow run``'s ``runs/<run id>``).
        auth_reads: every request needs the token, reads too (a dashboard reachable off this machine).
        stop_wait_s: a restart's longest wait for the old run to stop.
        alert_webhook: where alerts go (failed, stalled, restarted; :mod:`psflow.platform.alerts`), if anywhere.
        alert_stall_s: how long a running run's global step may stand still before it is a stall.
        stream_poll_s: how often an open live stream (``/api/runs/{run}/stream``) reads the store.
        allowed_hosts: the names a request's ``Host`` header may give (:func:`psflow.platform.hosts.allowed_hosts`).
    """

    home: Path
    token: str
    script_roots: tuple[Path, ...] = field(default_factory=lambda: (Path.cwd(),))
    runs_root: Path | None = None
    auth_reads: bool = False
    stop_wait_s: float = 120.0
    alert_webhook: str | None = None
    alert_stall_s: float = 300.0
    stream_poll_s: float = 1.0
    allowed_hosts: tuple[str, ...] = LOOPBACK_NAMES

    @property
    def db_path(self) -> Path:
        return self.home / JOBS_DB

    @property
    def logdirs(self) -> Path:
        return self.runs_root or Path.cwd() / "runs"


class StartRun(BaseModel):
    """The start-a-run form (``POST /api/runs``)."""

    model_config = ConfigDict(extra="forbid")

    script: str = Field(min_length=1, max_length=4096, description="a .py file under one of the allowed directories")
    args: list[Annotated[str, Field(max_length=4096)]] = Field(default_factory=list, max_length=256,
                                                               description="the script's arguments, as a list")
    ps: int = Field(1, ge=0, le=64, description="parameter-server tasks")
    workers: int = Field(2, ge=0, le=256, description="worker tasks")
    chief: bool = False
    evaluator: bool = False
    mode: Literal["async", "sync", "ssp"] = "async"
    strategy: Literal["ps", "allreduce"] = "ps"
    backend: Literal["local", "slurm", "ssh", "k8s"] = "local"
    restart: str = Field("never", max_length=200, description="psflow run --restart syntax: on-failure, worker=always,...")
    max_restarts: int = Field(3, ge=0, le=1000)
    gpus_per_worker: int = Field(0, ge=0, le=64, description="GPUs each chief and worker sees (local: refused when "
                                                              "this machine has fewer; k8s: nvidia.com/gpu per pod)")
    # each backend's own fields (psflow.platform.startform says which backend takes which)
    nodes: int | None = Field(None, ge=1, le=10_000, description="slurm: nodes to allocate (default 1)")
    coordinator_host: str | None = Field(None, max_length=253, description="slurm, ssh: the address the nodes reach "
                                                                           "the launcher at")
    hosts: str | None = Field(None, max_length=4096, description="ssh (required): HOST:SLOTS,..., filled in order")
    sbatch_args: str | None = Field(None, max_length=4096, description="slurm: more #SBATCH options, as on sbatch's "
                                                                       "command line: --partition=gpu --time=02:00:00")
    image: str | None = Field(None, max_length=1024, description="k8s (required): the container image")
    namespace: str | None = Field(None, max_length=253, description="k8s: the namespace (default 'default')")
    volume_claim: str | None = Field(None, max_length=253, description="k8s: a ReadWriteMany claim for the log dir")


class RestartSettings(BaseModel):
    """A restart's backend settings in place of those its run was recorded with (``POST /api/runs/{id}/restart``,
    optional: without a body the recorded ones stand)."""

    model_config = ConfigDict(extra="forbid")

    nodes: int | None = Field(None, ge=1, le=10_000, description="slurm: nodes to allocate")
    coordinator_host: str | None = Field(None, max_length=253, description="slurm, ssh: the address the nodes reach "
                                                                           "the launcher at")
    hosts: str | None = Field(None, max_length=4096, description="ssh: HOST:SLOTS,..., filled in order")
    sbatch_args: str | None = Field(None, max_length=4096, description="slurm: #SBATCH options in place of the recorded "
                                                                       "ones: --partition=gpu --time=02:00:00")
    image: str | None = Field(None, max_length=1024, description="k8s: the container image")
    namespace: str | None = Field(None, max_length=253, description="k8s: the namespace")
    volume_claim: str | None = Field(None, max_length=253, description="k8s: a ReadWriteMany claim for the log dir")


def _store(request: Request) -> Iterator[JobStore]:
    """The job store for one request (its own connection: requests run on a thread pool)."""
    try:
        db = JobStore(request.app.state.settings.db_path, check_same_thread=False)  # opened and used on two threads
    except JobStoreError as e:
        raise HTTPException(503, detail=str(e)) from e
    with db:
        yield db


Db = Annotated[JobStore, Depends(_store)]


class ScaleRun(BaseModel):
    """A scale request (``POST /api/runs/{run}/scale``): the number of workers the run should have."""

    model_config = ConfigDict(extra="forbid")

    workers: int = Field(description="worker tasks from now on (1..256; the chief not counted)")


def _unprocessable(field_name: str, message: str) -> HTTPException:
    """A 422 in FastAPI's own shape, naming the form field."""
    return HTTPException(422, detail=[{"loc": ["body", field_name], "msg": message, "type": "value_error"}])


def create_app(settings: UiSettings) -> FastAPI:
    """The dashboard's application: the API's routers, ``/metrics`` and the static page."""
    # no /docs or /redoc: FastAPI's pages load their scripts from a CDN, and nothing here may
    app = FastAPI(title="psflow", summary="Runs, tasks, metrics and logs of psflow's job store; start, stop, restart.",
                  version="1", docs_url=None, redoc_url=None)
    app.add_middleware(HostAllowlist, allowed=settings.allowed_hosts)  # before any route, reads included
    app.state.settings = settings
    app.state.launchers = []  # the launcher processes started here (reaped by a thread each)
    app.state.closing = threading.Event()  # set by psflow ui's shutdown: open streams end
    app.add_exception_handler(RunFileError, _refused_file)
    for router in (health_routes, read_routes, run_page_routes, change_routes, stream_routes):
        app.include_router(router)
    app.mount("/", StaticFiles(directory=STATIC, html=True), name="static")
    app.openapi = lambda: _openapi(app, settings)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI, settings: UiSettings) -> dict[str, Any]:
    """FastAPI's schema, saying that a read may go without the token where this dashboard allows it
    (an empty security requirement: no ``auth_reads``)."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        if not settings.auth_reads:
            for operations in schema["paths"].values():
                get = operations.get("get") or {}
                if get.get("security"):
                    get["security"].append({})
    return app.openapi_schema or {}


# -- who may ask ------------------------------------------------------------------------------------
def _settings(request: Request) -> UiSettings:
    settings: UiSettings = request.app.state.settings
    return settings


Settings = Annotated[UiSettings, Depends(_settings)]


# The token's two ways in, declared in /openapi.json as alternatives (the checks below read them).
_bearer = HTTPBearer(auto_error=False, scheme_name="token", description="the dashboard's token: printed by psflow ui "
                     f"at start (#token=...) or set in {UI_TOKEN_ENV}")
_token_header = APIKeyHeader(name="X-Psflow-Token", auto_error=False, scheme_name="token_header",
                             description="the same token, in a header of its own")
Bearer = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
TokenHeader = Annotated[str | None, Depends(_token_header)]


def _authorized(settings: UiSettings, bearer: HTTPAuthorizationCredentials | None, header: str | None) -> bool:
    given = bearer.credentials.strip() if bearer is not None else (header or "")
    return hmac.compare_digest(given.encode(), settings.token.encode())


def need_token(settings: Settings, bearer: Bearer, header: TokenHeader) -> None:
    """Every request that changes something carries the token."""
    if not _authorized(settings, bearer, header):
        raise HTTPException(401, detail=f"This request changes something: it needs the dashboard's token "
                                        f"(Authorization: Bearer TOKEN), printed by psflow ui at start or set in "
                                        f"{UI_TOKEN_ENV}.")


def need_token_to_read(settings: Settings, bearer: Bearer, header: TokenHeader) -> None:
    """With ``auth_reads`` (a dashboard reachable off this machine), reads carry it too (/openapi.json
    says a read may go without it otherwise: :func:`_openapi`)."""
    if settings.auth_reads:
        need_token(settings, bearer, header)


def the_run(db: JobStore, run_id: str, *, metrics: bool = False) -> dict[str, Any]:
    """Run ``run_id``'s record, or a 404."""
    run = db.run(run_id, metrics=metrics)  # each task's latest metrics: a query over the run's points, when asked
    if run is None:
        raise HTTPException(404, detail=f"No run {run_id!r} in the job store {db.path}.")
    return run


def _refused_file(request: Request, e: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(e)}, status_code=404)


health_routes = APIRouter(route_class=FiniteJsonRoute)  # open to every request the Host allowlist admits
read_routes = APIRouter(route_class=FiniteJsonRoute, dependencies=[Depends(need_token_to_read)])  # the store, read
run_page_routes = APIRouter(route_class=FiniteJsonRoute, dependencies=[Depends(need_token_to_read)])  # a run's files and views
change_routes = APIRouter(route_class=FiniteJsonRoute, dependencies=[Depends(need_token)])  # start, stop, restart, scale, dump, restore
stream_routes = APIRouter(route_class=FiniteJsonRoute, dependencies=[Depends(need_token_to_read)])  # live: the run page's stream, /metrics


# -- reads ------------------------------------------------------------------------------------------
@health_routes.get("/api/health", response_model=answers.Health)
def health(settings: Settings) -> dict[str, Any]:
    return {"ok": True, "job_store": str(settings.db_path)}


@read_routes.get("/api/summary", response_model=answers.StoreSummary)
def summary_of_store(db: Db) -> dict[str, Any]:
    counts = dict.fromkeys(RUN_STATES, 0)
    for row in db.conn.execute("SELECT state, COUNT(*) FROM runs GROUP BY state"):  # type: ignore[union-attr]
        counts[row[0]] = int(row[1])
    return {"runs": sum(counts.values()), "by_state": counts}


@read_routes.get("/api/runs", response_model=None, responses={200: {"model": answers.RunList}})
def list_runs(db: Db, state: Literal[RUN_STATES] | None = None,  # type: ignore[valid-type]
              q: Annotated[str | None, Query(max_length=200)] = None,
              limit: Annotated[int, Query(ge=1, le=500)] = 50, offset: Annotated[int, Query(ge=0)] = 0,
              before: Annotated[str | None, Query(max_length=400, description="the `older` of a page: the page after it")] = None,
              after: Annotated[str | None, Query(max_length=400, description="the `newer` of a page: the page before it")] = None,
              ) -> JSONResponse:
    from psflow.platform.jobstore import run_key

    keys = {k: _run_key(k, v) for k, v in (("before", before), ("after", after)) if v is not None}
    runs, total = db.run_page(state=state, search=q, limit=limit + 1, offset=offset, **keys)
    more = len(runs) > limit  # another page beyond this one, the way it was read
    runs = runs[1:] if more and after is not None else runs[:limit]
    if runs and keys:
        offset = db.runs_newer(run_key(runs[0]), state=state, search=q)
    older = more or after is not None
    return JSONResponse({  # plain JSON already: FastAPI's encoder would walk it again (tens of ms for 100 rows)
        "runs": [_row(r) for r in runs], "total": total, "limit": limit, "offset": offset,
        "older": _key_text(run_key(runs[-1])) if runs and older and offset + len(runs) < total else None,
        "newer": _key_text(run_key(runs[0])) if runs and offset > 0 else None})


def _run_key(param: str, text: str) -> tuple[float, str]:
    """A runs-list key (``CREATED:ID``, as ``older``/``newer`` give them), or a 422 naming ``param``."""
    created, _, run_id = text.partition(":")
    try:
        return float(created), run_id
    except ValueError:
        raise HTTPException(422, detail=[{"loc": ["query", param], "type": "value_error",
                                          "msg": f"a runs-list key is CREATED:ID, as a page's older or newer gives it; "
                                                 f"received {text!r}"}]) from None


def _key_text(key: tuple[float, str]) -> str:
    return f"{key[0]!r}:{key[1]}"


@read_routes.get("/api/runs/{run_id}", response_model=None, responses={200: {"model": answers.RunPage}})
def get_run(run_id: str, db: Db, after: Annotated[int, Query(ge=0)] = 0) -> dict[str, Any]:
    run = the_run(db, run_id, metrics=True)
    events = db.events(run_id, after_id=after, last=2000)
    return {"run": _on_page(run), "attempts": db.attempts(run_id), "events": events,
            "controls": db.controls(run_id)}


@read_routes.get("/api/runs/{run_id}/metrics")
def get_metrics(run_id: str, db: Db, name: Annotated[list[str] | None, Query()] = None, task: str | None = None,
                x: Literal["time", "step"] = "time", lo: float | None = None, hi: float | None = None,
                max_points: Annotated[int, Query(ge=10, le=100_000)] = 1000,
                cursor: Annotated[int | None, Query(ge=0, description="live: only the points after it")] = None,
                after: float = 0.0) -> JSONResponse:
    """A run's chart data: per series at most ``max_points`` points with x (time or step) in
    ``[lo, hi]`` (default: all), min/max buckets; ``cursor`` (the answer's, or a stream message's):
    only the points written since, every one; ``after``: every point after that time."""
    from psflow.platform.livestream import new_points

    the_run(db, run_id)
    if cursor is not None:
        points, cursor = db.metrics_since(run_id, cursor, names=name)
        series = new_points(p for p in points if task is None or p["task"] == task)
    elif after:
        series = new_points(db.metrics(run_id, task=task, after_unix=after, names=name))
        series = {t: {k: _thin(v, max_points) for k, v in per.items()} for t, per in series.items()}
    else:
        series, cursor = db.chart(run_id, names=name, task=task, x=x, lo=lo, hi=hi, max_points=max_points)
    # numbers and names only: sent as they are (FastAPI's encoder took 60 ms over 6,000 points)
    return JSONResponse({"run_id": run_id, "series": series, "cursor": cursor, "x": x})


@read_routes.get("/api/runs/{run_id}/stragglers")
def get_stragglers(run_id: str, db: Db, windows: Annotated[int, Query(ge=1, le=100)] = 10,
                   span_s: Annotated[float, Query(gt=0)] = 300.0) -> dict[str, Any]:
    from psflow.platform.stragglers import StragglerRules, find_stragglers

    run = the_run(db, run_id)
    steps: dict[str, list[tuple[float, float]]] = {t: [] for t in run["tasks"] if t.startswith(("worker", "chief"))}
    end = db.latest_time(run_id, "local_step")  # only the span judged is read, not the run's history
    since = end - span_s - 1.0 if end is not None else None
    for p in db.metrics(run_id, name="local_step", after_unix=since):
        if p["task"] in steps and p["value"] is not None:
            steps[p["task"]].append((p["time_unix"], p["value"]))
    return {"run_id": run_id, **find_stragglers(steps, StragglerRules(windows=windows, span_s=span_s))}


@read_routes.get("/api/runs/{run_id}/summary", response_model=answers.RunSummary)
def get_summary(run_id: str, db: Db) -> dict[str, Any]:
    run = the_run(db, run_id)
    return {"run_id": run_id, "state": run["state"], "summary": run.get("summary")}


@read_routes.get("/api/runs/{run_id}/ps")
def get_ps(run_id: str, db: Db) -> dict[str, Any]:
    from psflow.platform.pshealth import ps_health

    return {"run_id": run_id, **ps_health(the_run(db, run_id))}


# -- a run's files and views --------------------------------------------------------------------------
@run_page_routes.get("/api/runs/{run_id}/tasks/{task}/log")
def get_log(run_id: str, task: str, db: Db, offset: Annotated[int | None, Query(ge=0)] = None,
            max_bytes: Annotated[int, Query(ge=1, le=4 << 20)] = 64 << 10) -> dict[str, Any]:
    return {"task": task, **read_log(log_path(the_run(db, run_id), task), offset=offset, max_bytes=max_bytes).to_dict()}


@run_page_routes.get("/api/runs/{run_id}/placement")
def get_placement(run_id: str, db: Db) -> dict[str, Any]:
    from psflow.platform.placementview import newest_placement

    found = newest_placement(Path(the_run(db, run_id)["logdir"]))
    if found is None:
        raise HTTPException(404, detail=f"Run {run_id} has no checkpoint yet: the placement is read from the "
                                        "newest checkpoint's manifest.")
    return {"run_id": run_id, **found}


@run_page_routes.get("/api/runs/{run_id}/checkpoints")
def get_checkpoints(run_id: str, db: Db) -> dict[str, Any]:
    return {"run_id": run_id, "checkpoints": checkpoints(the_run(db, run_id))}


@run_page_routes.get("/api/runs/{run_id}/checkpoints/{name}/export")
def export(run_id: str, name: str, db: Db) -> FileResponse:
    from psflow.checkpoint import export_checkpoint

    path = checkpoint_path(the_run(db, run_id), name)
    fd, out = tempfile.mkstemp(suffix=".safetensors", prefix="psflow-export-")
    os.close(fd)
    try:
        export_checkpoint(path, out)
    except PsflowError as e:
        os.unlink(out)
        raise HTTPException(409, detail=f"Checkpoint {name} cannot be exported: {e}") from e
    return FileResponse(out, media_type="application/octet-stream", filename=f"{run_id}-{name}.safetensors",
                        background=BackgroundTask(os.unlink, out))


@run_page_routes.get("/api/runs/{run_id}/stacks")
def get_stacks(run_id: str, db: Db, request: Annotated[int | None, Query(ge=1)] = None) -> dict[str, Any]:
    from psflow.platform.runfiles import dump_lines
    from psflow.platform.stacks import PROGRESS_NAMES, group_stacks, main_stack, making_progress, parse_dump

    run = the_run(db, run_id)
    asked = [c for c in db.controls(run_id) if c["kind"] == "dump" and (request is None or c["id"] == request)]
    if not asked:
        raise HTTPException(404, detail=f"Run {run_id} has no stack dump{'' if request is None else f' {request}'}; "
                                        f"POST /api/runs/{run_id}/dump asks for one.")
    control = asked[-1]
    tasks: dict[str, Any] = {}
    at: dict[str, float] = {}  # when each task's stacks were dumped: its progress then
    for e in db.events(run_id):
        data = e["data"]
        if e["kind"] == "stacks_dumped" and data.get("request") == control["id"]:
            threads = parse_dump(dump_lines(run, str(data["log"]), int(data["line"])))
            tasks[str(data["task"])] = {"attempt": data.get("attempt"), "line": data["line"], "threads": threads}
            at[str(data["task"])] = float(e["time_unix"])
    since = min(at.values(), default=control["requested_unix"]) - 60.0  # enough to tell moving, standing, unknown
    reported = [t for t, v in run["tasks"].items() if set(v.get("progress") or {}) & set(PROGRESS_NAMES)]
    moving = making_progress(db.metrics(run_id, names=PROGRESS_NAMES, after_unix=since), at, reported=reported)
    grouped = group_stacks({t: main_stack(v["threads"]) for t, v in tasks.items() if v["threads"]}, moving)
    return {"run_id": run_id, "request_id": control["id"], "state": control["state"], "answer": control["answer"],
            "tasks": tasks, "waiting_for": sorted(t for t, v in tasks.items() if not v["threads"]), **grouped}


# -- changes ----------------------------------------------------------------------------------------
@change_routes.post("/api/runs/{run_id}/checkpoints/{name}/restore", status_code=202, response_model=answers.RunStarted,
                    response_model_exclude_none=True)
def restore_here(run_id: str, name: str, db: Db, request: Request, settings: Settings) -> dict[str, Any]:
    from psflow.platform.launching import plan_of, restore_spec, seed_checkpoint, start_detached

    run = the_run(db, run_id)
    source = checkpoint_path(run, name)
    try:
        spec = restore_spec(run, settings.logdirs)
        plan_of(spec)
    except ConfigError as e:
        raise HTTPException(409, detail=f"Run {run_id} cannot be started again: {e}") from e
    seed_checkpoint(source, Path(str(spec.logdir)))
    plan, proc = start_detached(spec, env=_launcher_env(settings))
    _starting(settings, request, spec, plan, proc)
    return {"run_id": plan.run_id, "state": "starting", "restores": run_id, "checkpoint": name, "logdir": plan.logdir,
            "launcher_pid": proc.pid}


@change_routes.post("/api/runs", status_code=202, response_model=answers.RunStarted, response_model_exclude_none=True)
def start_run(form: StartRun, request: Request, settings: Settings) -> dict[str, Any]:
    from psflow.launch.gpus import GpuRequestError
    from psflow.launch.restart import RestartPolicy
    from psflow.platform.launching import LaunchSpec, new_run_id, start_detached
    from psflow.platform.startform import FormError, field_of, launch_fields

    script = _allowed_script(form.script, settings.script_roots)
    try:
        backend = launch_fields(form.backend, form.model_dump(), form.gpus_per_worker)
    except FormError as e:
        raise _unprocessable(e.field, str(e)) from e
    try:
        policy = RestartPolicy.parse(form.restart, **({"max_restarts": form.max_restarts} if form.restart != "never" else {}))
    except ConfigError as e:
        raise _unprocessable("restart", str(e)) from e
    run_id = new_run_id()
    spec = LaunchSpec(script=str(script), args=tuple(form.args), num_ps=form.ps if form.strategy == "ps" else 0,
                      num_workers=form.workers, chief=form.chief, evaluator=form.evaluator, mode=form.mode,
                      strategy=form.strategy, backend=form.backend, restart_policy=dataclasses.asdict(policy),
                      run_id=run_id, logdir=str(settings.logdirs / run_id), **backend)
    try:
        plan, proc = start_detached(spec, env=_launcher_env(settings))
    except GpuRequestError as e:
        raise _unprocessable("gpus_per_worker", str(e)) from e
    except ConfigError as e:
        raise _unprocessable(field_of(str(e)), str(e)) from e
    _starting(settings, request, spec, plan, proc)
    return {"run_id": plan.run_id, "state": "starting", "logdir": plan.logdir, "launcher_pid": proc.pid}


@change_routes.post("/api/runs/{run_id}/stop", status_code=202, response_model=answers.ControlAsked)
def stop_run(run_id: str, db: Db) -> dict[str, Any]:
    from psflow.platform.runcontrol import ask_stop

    the_run(db, run_id)
    asked = ask_stop(db, run_id, source="api")
    if asked.request_id is None:
        raise HTTPException(409, detail=f"Run {run_id} has already ended ({asked.state}); there is nothing to stop.")
    return {"run_id": run_id, "request_id": asked.request_id}


@change_routes.post("/api/runs/{run_id}/scale", status_code=202, response_model=answers.ScaleAsked)
def scale_run(run_id: str, form: ScaleRun, db: Db) -> dict[str, Any]:
    from psflow.launch.control import check_workers
    from psflow.platform.runcontrol import ScaleRefused, ask_scale

    the_run(db, run_id)
    try:
        check_workers(form.workers)
    except ValueError as e:
        raise _unprocessable("workers", str(e)) from e
    try:
        request_id = ask_scale(db, run_id, form.workers, source="api")
    except ScaleRefused as e:
        raise HTTPException(409, detail=str(e)) from e
    return {"run_id": run_id, "request_id": request_id, "workers": form.workers}


@change_routes.post("/api/runs/{run_id}/dump", status_code=202, response_model=answers.ControlAsked)
def dump_run(run_id: str, db: Db) -> dict[str, Any]:
    the_run(db, run_id)
    try:
        request_id = db.request_control(run_id, "dump", source="api")
    except JobStoreError as e:
        raise HTTPException(409, detail=str(e)) from e
    return {"run_id": run_id, "request_id": request_id}


@change_routes.post("/api/runs/{run_id}/restart", status_code=202, response_model=answers.RunStarted,
                    response_model_exclude_none=True)
def restart_run(run_id: str, db: Db, request: Request, settings: Settings,
                form: RestartSettings | None = None) -> dict[str, Any]:
    from psflow.logdirlock import run_lock
    from psflow.platform.launching import plan_of, spec_of_run, start_detached
    from psflow.platform.runcontrol import ask_stop
    from psflow.platform.startform import FormError, restart_overrides

    run = the_run(db, run_id)
    try:
        overrides = restart_overrides(str(run.get("backend") or "local"), form.model_dump() if form else {})
    except FormError as e:
        raise _unprocessable(e.field, str(e)) from e
    try:
        spec = spec_of_run(run, overrides)
        plan_of(spec)  # refused now, not in the background, if it cannot start again
        # ... or if another run holds its logdir, or another restart of it waits (one logdir, one live run)
        run_lock(str(spec.logdir), spec.logdir_url, str(spec.run_id)).check(after_run=run_id)
    except ConfigError as e:
        raise HTTPException(409, detail=f"Run {run_id} cannot be started again: {e}") from e
    # The stop is asked here; the new run's launcher, a process of its own session, waits for the
    # old run's end before it starts, so the restart survives this dashboard going down meanwhile.
    asked = ask_stop(db, run_id, source="api")
    if asked.request_id is not None:
        spec = dataclasses.replace(spec, after_run=run_id, after_request=asked.request_id,
                                   after_timeout_s=settings.stop_wait_s)
    try:
        plan, proc = start_detached(spec, env=_launcher_env(settings))
    except ConfigError as e:  # another restart got there between the look above and now
        raise HTTPException(409, detail=f"Run {run_id} cannot be started again: {e}") from e
    _starting(settings, request, spec, plan, proc)
    return {"run_id": plan.run_id, "state": "starting", "restarts": run_id, "logdir": plan.logdir, "launcher_pid": proc.pid}


# -- live -------------------------------------------------------------------------------------------
@stream_routes.get("/api/runs/{run_id}/stream", response_class=StreamingResponse,
                   responses={200: {"content": {"text/event-stream": {}}, "description": "Server-Sent Events"}})
def stream_run(run_id: str, request: Request, db: Db, settings: Settings,
               name: Annotated[list[str] | None, Query()] = None,
               cursor: Annotated[int | None, Query(ge=0, description="only the points after it (no history)")] = None,
               ) -> StreamingResponse:
    from psflow.platform.livestream import Look, new_points, run_stream

    the_run(db, run_id)  # a 404 now, not an empty stream
    try:  # a reconnecting EventSource names the last metrics message it got: its cursor
        cursor = int(request.headers.get("last-event-id") or "") if request.headers.get("last-event-id") else cursor
    except ValueError:
        pass

    def look(since: int | None) -> Look:
        with JobStore(settings.db_path) as store:
            run = store.run(run_id, metrics=True)
            if run is None:
                return None, {}, since or 0
            page = {"run": _on_page(run), "attempts": store.attempts(run_id),
                    "events": store.events(run_id, last=2000), "controls": store.controls(run_id)}
            if since is None:  # the first look: the history, a bounded chart of each series
                history, newest = store.chart(run_id, names=name)
                return page, history, newest
            points, newest = store.metrics_since(run_id, since, names=name)
            return page, new_points(points), newest

    body = run_stream(look, cursor=cursor, is_disconnected=request.is_disconnected, closing=request.app.state.closing,
                      poll_s=settings.stream_poll_s)
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


@stream_routes.get("/metrics")
def metrics(settings: Settings) -> Response:
    from psflow.platform.prometheus import CONTENT_TYPE, exposition

    return Response(exposition(settings.db_path), media_type=CONTENT_TYPE)


def _allowed_script(script: str, roots: tuple[Path, ...]) -> Path:
    """``script`` resolved (relative to the first root), if it is an existing ``.py`` file under a root."""
    path = Path(script)
    path = (path if path.is_absolute() else roots[0] / path).resolve()
    shown = ", ".join(str(r) for r in roots)
    if not any(path == r.resolve() or r.resolve() in path.parents for r in roots):
        raise _unprocessable("script", f"Script {script!r} is not under an allowed directory ({shown}); psflow ui "
                                       f"--scripts DIR allows another.")
    if path.suffix != ".py":
        raise _unprocessable("script", f"Script {script!r} is not a Python file (.py).")
    if not path.is_file():
        raise _unprocessable("script", f"Script {script!r} does not exist (looked at {path}).")
    return path


def _launcher_env(settings: UiSettings) -> dict[str, str]:
    """The environment of a launcher started here: records into this store; never sees the token."""
    env = {k: v for k, v in os.environ.items() if k != UI_TOKEN_ENV}
    env[HOME_ENV] = str(settings.home)
    if settings.alert_webhook and not env.get(ALERT_WEBHOOK_ENV):  # the run alerts with the dashboard down too
        env[ALERT_WEBHOOK_ENV] = settings.alert_webhook
        env[ALERT_STALL_ENV] = f"{settings.alert_stall_s:g}"  # and the dashboard's stall
    return env


def _starting(settings: UiSettings, request: Request, spec: Any, plan: Any, proc: Any) -> None:
    """A launcher just started: its run is recorded ``pending`` now (its page exists at once; the
    launcher takes the record over), and a thread waits for the launcher, so that it leaves no zombie
    and a launcher that ended before it recorded the run leaves the run ``failed`` with its last words."""
    from psflow.platform.launching import record_launch_failure, record_starting

    try:
        record_starting(settings.db_path, plan, spec, proc.pid)
    except (JobStoreError, sqlite3.Error):
        pass  # the store is locked or unwritable: the launcher records the run itself once it can (its page waits)

    def watch() -> None:
        code = proc.wait()
        for _ in range(30):  # a store locked for a while: try again
            try:
                record_launch_failure(settings.db_path, plan.run_id, plan.logdir, code)
                return
            except (JobStoreError, sqlite3.Error):
                time.sleep(1.0)  # a retry interval, not a synchronisation

    request.app.state.launchers.append(proc)
    threading.Thread(target=watch, daemon=True, name=f"psflow-launcher-{proc.pid}").start()


def _thin(points: list[list[Any]], max_points: int) -> list[list[Any]]:
    """At most ``max_points`` points, evenly spaced, the last one kept (a chart's resolution)."""
    if len(points) <= max_points:
        return points
    stride = len(points) / max_points
    out = [points[int(i * stride)] for i in range(max_points - 1)]
    return [*out, points[-1]]


def _shown(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k not in _HIDDEN}


def _on_page(run: dict[str, Any]) -> dict[str, Any]:
    """A run as its page shows it: its record, its root cause in words once it failed (``failure``:
    :func:`psflow.platform.runfiles.root_cause_of`), and why it cannot be scaled, if it cannot
    (``scale_refusal``: :func:`psflow.platform.runcontrol.scale_refusal`)."""
    from psflow.platform.runcontrol import scale_refusal
    from psflow.platform.runfiles import root_cause_of

    return {**_shown(run), "failure": root_cause_of(run), "scale_refusal": scale_refusal(run)}


def _row(run: dict[str, Any]) -> dict[str, Any]:
    """A run as the runs list shows it: its record less the summary, and each task's state in brief."""
    out = {k: v for k, v in _shown(run).items() if k not in ("summary", "tasks")}
    out["tasks"] = {name: {"state": t.get("state"), "attempt": t.get("attempt"), "alive": t.get("alive"),
                           "exit_code": t.get("exit_code")} for name, t in run["tasks"].items()}
    loss = [t["progress"]["loss"] for t in run["tasks"].values()
            if isinstance((t.get("progress") or {}).get("loss"), (int, float))]
    out["loss"] = sum(loss) / len(loss) if loss else None
    return out
