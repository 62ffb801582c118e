"""The ``psflow`` command: parse -> config -> call. One small function per subcommand, a module per
group of them:

- :mod:`psflow.cli.run`: ``psflow run`` (every backend);
- :mod:`psflow.cli.chaos`: ``psflow chaos``;
- :mod:`psflow.cli.jobs`: the job store's ``runs``, ``status``, ``logs``, ``stop``, ``scale``, ``restart``, ``ui``;
- :mod:`psflow.cli.files`: a run's ``summary``, ``export``, ``checkpoints``;
- :mod:`psflow.cli.k8s`: ``psflow k8s tfjob``.

Each module adds its commands to :data:`psflow.cli.group.main` (the console script ``psflow``) when imported.
"""

from psflow.cli import chaos, files, jobs, k8s, run  # noqa: F401 (each adds its commands to main)
from psflow.cli.chaos import _seconds
from psflow.cli.group import main

__all__ = ["main", "_seconds"]
