"""The placement table of a run: each parameter (or piece of one) and the ps shard that holds it,
with its bytes, and each shard's total, read from the manifest of the run's newest checkpoint (the
placement every ps and worker of the run used). Pure but for :func:`newest_placement`.

Called by :mod:`psflow.platform.api` (``GET /api/runs/{run}/placement``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from psflow.rundir import RunDir

_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1}


def placement_table(placement: Mapping[str, Any]) -> dict[str, Any]:
    """``{"rows": [{param, shard, rows, shape, dtype, bytes}], "shards": [{shard, bytes, pieces, share}]}``
    from a checkpoint manifest's ``placement`` (params with shape and dtype; pieces: param, shard, rows)."""
    params = {p["name"]: p for p in placement.get("params", [])}
    rows = []
    for piece in placement.get("pieces", []):
        p = params.get(piece["param"], {})
        shape = list(p.get("shape") or [])
        per_row = math.prod(shape[1:]) if len(shape) > 1 else 1
        span = piece.get("rows")
        count = (span[1] - span[0]) * per_row if span else math.prod(shape) if shape else 1
        rows.append({"param": piece["param"], "shard": piece["shard"], "rows": span, "shape": shape,
                     "dtype": p.get("dtype"), "bytes": count * _ITEMSIZE.get(str(p.get("dtype")), 4)})
    total = sum(r["bytes"] for r in rows) or 1
    shards = []
    for k in range(int(placement.get("num_shards") or 0)):
        mine = [r for r in rows if r["shard"] == k]
        size = sum(r["bytes"] for r in mine)
        shards.append({"shard": k, "bytes": size, "pieces": len(mine), "share": round(size / total, 4)})
    return {"rows": rows, "shards": shards}


def newest_placement(logdir: Path) -> dict[str, Any] | None:
    """The placement table of the newest checkpoint of ``logdir`` that verifies, with its step; None if none."""
    from psflow import checkpoint
    from psflow.errors import PsflowError

    for path in checkpoint.list_checkpoints(RunDir(logdir).checkpoints):
        try:
            ckpt = checkpoint.read_checkpoint(path)
        except PsflowError:
            continue
        return {"checkpoint": path.name, "step": ckpt.step, **placement_table(ckpt.meta.get("placement") or {})}
    return None
