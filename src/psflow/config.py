"""Training configuration that travels from the launcher (or the script) to every task and the ps.

``TrainConfig`` is the single source of truth for the update mode; the launcher writes it into the
task's environment as JSON (read in psflow.task), the trainer sends it to the ps with the initial values.

Modes:
- ``async``: every pushed gradient is applied at once (seed 001, first half);
- ``sync``: each step the ps averages ``replicas_to_aggregate`` (N) fresh gradients out of
  ``total_num_replicas`` (M) workers; stale gradients are dropped; M > N gives M - N backup workers;
- ``ssp``: asynchronous updates, but no worker runs more than ``staleness`` steps ahead of the slowest.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass

from psflow.errors import ConfigError
from psflow.modes import Mode
from psflow.validation import checked

MODES = tuple(Mode)
STRATEGIES = ("ps", "allreduce")
# psflow.ps.placement.STRATEGIES (not imported: this module stays free of torch); the first is the default.
PLACEMENTS = ("balanced", "round_robin", "greedy", "contiguous")
# What a ps does with a push holding NaN or inf (psflow.ps.finite): the first is the default.
NONFINITE = ("refuse", "fail", "apply")

Count = Annotated[int, Field(ge=1)]
# ssp with the pipeline: a step's push reply brings the values the step two later computes from, so
# the clock that precedes the push counts two steps past it against the bound (psflow.train.pipeline).
PIPELINE_SSP_AHEAD = 2


def _seconds(default: float, meaning: str) -> Any:
    return Field(default, gt=0, allow_inf_nan=False, description=f"seconds: {meaning}")


# strict: a value of the wrong type is refused, not converted (True is no count, "3" no number).
# A field's description says what it means; a refused value's ConfigError quotes it (psflow.validation).
@checked
@dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid"))
class TrainConfig:
    mode: Mode = Field(Mode.ASYNC, strict=False)  # text or a Mode
    strategy: Literal[STRATEGIES] = "ps"  # type: ignore[valid-type]
    replicas_to_aggregate: Count | None = Field(None, description=(
        "sync: N, the gradients averaged each step; None for every worker"))
    total_num_replicas: Count | None = Field(None, description=(
        "sync: M, the workers that push each step (M - N are backups); None for every worker"))
    staleness: int = Field(4, ge=0, description="ssp: how many steps a worker may run ahead of the slowest")
    sync_timeout_s: float = _seconds(60.0, "sync/ssp: the longest wait for a step before the job fails")
    # equal bytes per ps shard; "round_robin" is TensorFlow's layout
    placement: Literal[PLACEMENTS] = "balanced"  # type: ignore[valid-type]
    split_bytes: int | None = Field(None, ge=0, description=(
        "tensors above this many bytes are split across ps shards; None: never"))
    ready_timeout_s: float = _seconds(120.0, "non-chief: the longest wait for the chief to initialize the ps")
    lost_worker_timeout_s: float = _seconds(300.0, (
        "ps: once every worker is done or lost, how long it waits for a lost one to come back before it fails"))
    progress_every_s: float = _seconds(1.0, "trainers: how often a task sends its counters to the launcher's live status")
    heartbeat_every_s: float = _seconds(1.0, (
        "every launched task: how often its heartbeat thread tells the launcher it lives"))
    log_placement: bool = False
    # 2: shard s's primary ps:s forwards every applied update to its backup ps:(s+1 mod P) and
    # acknowledges a push once the backup holds it (psflow.ps.replication)
    ps_replicas: int = Field(1, ge=1, le=2, description="copies of each shard: 1, or 2 for a backup on the next ps")
    primary_failover_s: float = _seconds(2.0, (
        "ps_replicas=2, clients: a shard's serving ps that does not answer again within this routes the shard to "
        "the other copy"))
    backup_failover_s: float = _seconds(5.0, (
        "ps_replicas=2, ps: a backup that does not answer for this long leaves its shard to go on with one copy"))
    allow_unauthenticated_allreduce: bool = Field(False, description=(
        "true or false: all-reduce off loopback, where gloo's store and connections are not covered by the job secret"))
    push_ledger: bool = Field(False, description=(
        "trainers: keep LOGDIR/ledger/<task>.<attempt> (pushes sent and acknowledged), for psflow chaos"))
    # Gradients on the wire: "none", "fp16", "bf16" or "topk:RATIO" (with error feedback on the worker;
    # psflow.wire.compress); checked by _settings_agree.
    compress: str = "none"
    compress_pull: bool = Field(False, description="true or false: pulled values come back in fp16/bf16 too")
    pipeline: bool = Field(False, description=(
        "true or false, async or ssp (staleness >= 2): a worker computes its next step while this step's gradients "
        "and values travel (from values one own update old; psflow.train.pipeline)"))
    timeline: bool = Field(False, description=(
        "true or false: every task records where its time goes, merged into LOGDIR/timeline.json"))
    # The same check covers the chief's initial values (psflow.ps.finite).
    nonfinite: Literal[NONFINITE] = Field("refuse", description=(  # type: ignore[valid-type]
        "what the ps does with a pushed gradient holding NaN or inf. refuse: not applied, counted and logged per "
        "worker; fail: the run fails, naming the worker and step; apply: applied as any other, no check"))
    nonfinite_limit: int = Field(10, ge=1, description=(
        "nonfinite=refuse: a worker whose pushes to a shard are refused this many times in a row fails the run"))

    @model_validator(mode="after")
    def _settings_agree(self) -> TrainConfig:
        """The rules between fields (each raises its own ConfigError)."""
        from psflow.wire.compress import Compression

        compression = Compression.parse(self.compress)  # raises ConfigError naming the forms allowed
        if self.compress_pull and compression.pull_dtype() is None:
            raise ConfigError(f"compress_pull sends the parameters back in the gradients' precision, which compress="
                              f"{self.compress!r} does not have. Use compress fp16 or bf16 with it, or drop compress_pull.")
        if self.pipeline and (self.mode == Mode.SYNC or self.strategy != "ps"):
            raise ConfigError(f"pipeline computes a step from values that lack the worker's previous update, which "
                              f"only async or ssp mode with parameter servers allows; received mode={self.mode.value!r}, "
                              f"strategy={self.strategy!r}. Drop --pipeline, or use --mode async|ssp --strategy ps.")
        if self.pipeline and self.mode == Mode.SSP and self.staleness < PIPELINE_SSP_AHEAD:
            raise ConfigError(f"pipeline under ssp counts {PIPELINE_SSP_AHEAD} steps against the staleness bound (a step "
                              "computes from the values that came back with the push two steps before it), so it needs "
                              f"staleness >= {PIPELINE_SSP_AHEAD}; received staleness={self.staleness}. Raise --staleness, "
                              "or drop --pipeline.")
        if self.compress != "none" and self.strategy != "ps":
            raise ConfigError(f"compress={self.compress!r} applies to --strategy ps (gradients pushed to parameter "
                              "servers); all-reduce sends them uncompressed. Drop --compress, or use --strategy ps.")
        return self

    def resolved(self, num_workers: int) -> TrainConfig:
        """Fill N and M from the worker count and check them against it."""
        m = self.total_num_replicas or num_workers
        n = self.replicas_to_aggregate or m
        if m > num_workers:
            raise ConfigError(
                f"total_num_replicas={m} exceeds the {num_workers} workers of the cluster. "
                "Set it to at most the number of workers."
            )
        if n > m:
            raise ConfigError(
                f"replicas_to_aggregate={n} exceeds total_num_replicas={m}. N gradients are averaged out of M workers, so N <= M."
            )
        return replace(self, replicas_to_aggregate=n, total_num_replicas=m)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mode": self.mode.value}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """Raises ConfigError naming a setting that is unknown or invalid."""
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"Training config is not valid JSON ({e}). Received: {text[:80]!r}.") from e
        if not isinstance(d, dict):
            raise ConfigError(f"Training config must be a JSON object; received {text[:80]!r}.")
        return cls.from_dict(d)


def check_launch_settings(config: TrainConfig, given: set[str], *, num_replicas: int, num_ps: int) -> None:
    """Check a launch's settings against each other and the cluster before any task starts.

    Args:
        config: the run's configuration.
        given: the settings the user gave explicitly (``"staleness"``, ``"replicas_to_aggregate"``,
            ``"num_ps"``, ...): a setting left at its default is never an error.
        num_replicas: the tasks that train (workers, plus the chief if it is a task of its own).
        num_ps: the parameter-server tasks asked for.

    Raises:
        ConfigError: a setting that does not apply to the chosen mode or strategy, or counts the
            cluster cannot meet (the message names the option, the value and the fix).
    """
    if config.strategy == "allreduce":
        if "num_ps" in given and num_ps > 0:
            raise ConfigError(f"--ps {num_ps} with --strategy allreduce: all-reduce has no parameter servers. "
                              "Drop --ps, or use --strategy ps.")
        if config.mode != "sync":
            raise ConfigError(f"--mode {config.mode} with --strategy allreduce: all-reduce steps are synchronous. "
                              "Drop --mode, or use --strategy ps for async or ssp training.")
    if config.ps_replicas == 2 and (config.strategy != "ps" or num_ps < 2):
        why = ("all-reduce has no parameter servers" if config.strategy != "ps" else
               f"this run has {num_ps} ps, and a shard's backup must live on another ps task")
        raise ConfigError(f"--ps-replicas 2: {why}. Use --ps 2 or more with --strategy ps, or drop --ps-replicas "
                          "(with one ps, a dead ps rolls back to the newest checkpoint).")
    if "nonfinite" in given and config.strategy != "ps":
        raise ConfigError(f"--nonfinite {config.nonfinite} applies to --strategy ps (the ps checks each pushed gradient); "
                          "all-reduce has no ps. Drop --nonfinite, or use --strategy ps.")
    if "nonfinite_limit" in given and config.nonfinite != "refuse":
        raise ConfigError(f"--nonfinite-limit {config.nonfinite_limit} applies to --nonfinite refuse (refusals in a row); "
                          f"this run is --nonfinite {config.nonfinite}. Drop --nonfinite-limit, or use --nonfinite refuse.")
    if "staleness" in given and config.mode != "ssp":
        raise ConfigError(f"--staleness {config.staleness} applies to --mode ssp only; this run is --mode {config.mode}. "
                          "Add --mode ssp, or drop --staleness.")
    for name in ("replicas_to_aggregate", "total_num_replicas"):
        if name in given and config.mode != "sync":
            raise ConfigError(f"--{name.replace('_', '-')} applies to --mode sync only; this run is --mode {config.mode}. "
                              "Add --mode sync, or drop it.")
    if config.mode == "sync":
        resolved = config.resolved(num_replicas)  # raises when N or M exceed the replicas
        if config.strategy == "allreduce" and resolved.replicas_to_aggregate != num_replicas:
            raise ConfigError(f"--replicas-to-aggregate {resolved.replicas_to_aggregate} of {num_replicas} replicas: "
                              "all-reduce averages every replica's gradient each step (no backup workers). "
                              "Use --strategy ps for backup workers.")


def check_logdir(logdir: str | os.PathLike[str], *, what: str = "--logdir") -> None:
    """Check that ``logdir`` is, or can be created as, a directory: the path and every existing
    parent must be directories (a file there would fail deep inside a task with NotADirectoryError).

    Raises:
        ConfigError: naming the path, the file in the way, and what to do.
    """
    path = Path(logdir)
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                where = "is a file" if p == path else f"cannot be created: {p} is a file"
                raise ConfigError(f"{what} {str(logdir)!r} {where}, not a directory. Give a directory "
                                  "(it is created if missing), or move that file away.")
            return
