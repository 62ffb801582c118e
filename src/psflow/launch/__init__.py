"""Launching runs: a plan (pure data) carried out by a runner, under a controller's rules, on a backend
(local processes; Slurm and Kubernetes next)."""

from psflow.launch.backend import Backend, RunResult
from psflow.launch.controller import RestartPolicy, RunController
from psflow.launch.local import LocalBackend
from psflow.launch.plan import LaunchPlan, TaskPlan, make_plan
from psflow.launch.runner import Runner

__all__ = ["Backend", "LaunchPlan", "LocalBackend", "RestartPolicy", "RunController", "RunResult", "Runner", "TaskPlan",
           "make_plan"]
