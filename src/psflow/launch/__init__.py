"""Launching runs: a plan (pure data) carried out by a backend (local processes; Slurm and Kubernetes next)."""

from psflow.launch.backend import Backend, RunResult
from psflow.launch.local import LocalBackend
from psflow.launch.plan import LaunchPlan, TaskPlan, make_plan

__all__ = ["Backend", "LaunchPlan", "LocalBackend", "RunResult", "TaskPlan", "make_plan"]
