"""The launch-backend seam: one small ABC that every way of starting tasks implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from psflow.launch.plan import LaunchPlan


@dataclass
class RunResult:
    exit_code: int
    summary: dict[str, Any] = field(default_factory=dict)
    root_cause: str | None = None


class Backend(ABC):
    """Carries out a :class:`LaunchPlan`: start every task, watch them, stop them all at the end."""

    @abstractmethod
    def run(self, plan: LaunchPlan) -> RunResult:
        """Run the plan to completion (or failure) and return its result."""
