"""Placement: which parameter-server shard holds each parameter (TF's ``replica_device_setter``).

This module owns the mapping from a model's trainable parameters to ps shards. It is pure data
and arithmetic: no I/O, no network, no global state. The chief computes a :class:`Placement`
with :func:`place`, ships it as JSON (:meth:`Placement.to_dict`) to every task, and both sides
use :func:`split_tensor` / :func:`assemble` to cut full tensors into pieces and glue them back.

Invariants of a :class:`Placement` (checked on construction, so ``from_dict`` inherits them):

* every parameter has at least one piece; parameter names are unique;
* a parameter is either one whole piece (``rows is None``) or split along dim 0 into pieces whose
  row ranges are contiguous, non-empty, in order, and cover ``[0, shape[0])`` exactly once;
* the pieces of one split parameter live on distinct shards, each in ``[0, num_shards)``;
* ``pieces`` is ordered by parameter (in ``params`` order), then by first row.

The strategies (round-robin, greedy by bytes, balanced, splitting large tensors) and why each:
``docs/design/ps-placement.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from psflow.errors import ConfigError
from psflow.validation import validate

STRATEGIES: tuple[str, ...] = ("balanced", "round_robin", "greedy", "contiguous")
DEFAULT_STRATEGY = "balanced"
# ``balanced`` leaves tensors of at most this many bytes whole unless ``split_bytes`` says otherwise:
# cutting a bias into pieces of a few bytes adds a piece for no balance worth having.
BALANCED_SPLIT_BYTES = 16 * 1024
# The chief warns when one shard holds more than this times its fair share of the bytes...
IMBALANCE_RATIO = 1.5
# ...and at least this many bytes beyond it: a model of a few KiB keeps no ps busy either way.
IMBALANCE_MIN_EXCESS_BYTES = 64 * 1024


class ImbalancedPlacementWarning(UserWarning):
    """One ps shard holds most of the parameter bytes (see :func:`imbalance`)."""


def _dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named like ``"float32"``; ConfigError if unknown."""
    candidate = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(candidate, torch.dtype):
        raise ConfigError(
            f"Unknown parameter dtype. Received: {dtype!r}. "
            "Use a torch dtype name such as 'float32', 'float16' or 'bfloat16'."
        )
    return candidate.itemsize


@dataclass(frozen=True)
class ParamInfo:
    """Name, shape and dtype of one trainable parameter; all placement needs to know.

    Attributes:
        name: The parameter's name as in ``Module.named_parameters()``, e.g. ``"fc1.weight"``.
        shape: Its shape.
        dtype: A torch dtype name without the ``torch.`` prefix, e.g. ``"float32"``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(
                f"A parameter name must be a non-empty string. Received: {self.name!r}."
            )
        if isinstance(self.shape, (str, bytes)) or not isinstance(self.shape, Sequence):
            raise ConfigError(
                f"Parameter {self.name!r} has an invalid shape. Received: {self.shape!r}. "
                "Pass a sequence of non-negative ints."
            )
        shape = tuple(self.shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ConfigError(
                f"Parameter {self.name!r} has an invalid shape. Received: {self.shape!r}. "
                "Pass a sequence of non-negative ints."
            )
        object.__setattr__(self, "shape", shape)
        _dtype_itemsize(self.dtype)

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.numel * _dtype_itemsize(self.dtype)

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> list[ParamInfo]:
        """Describe the trainable parameters of ``module`` in ``named_parameters()`` order.

        Args:
            module: Any ``torch.nn.Module``.

        Returns:
            One :class:`ParamInfo` per parameter with ``requires_grad=True``.

        Example:
            >>> [p.name for p in ParamInfo.from_module(torch.nn.Linear(3, 2))]
            ['weight', 'bias']
        """
        return [
            cls(name=name, shape=tuple(p.shape), dtype=str(p.dtype).removeprefix("torch."))
            for name, p in module.named_parameters()
            if p.requires_grad
        ]


@dataclass(frozen=True)
class Piece:
    """One unit of placement: a whole parameter, or a range of its rows (dim 0).

    Attributes:
        param: Name of the parameter.
        shard: Index of the ps shard that holds this piece.
        rows: ``None`` for the whole tensor, else the half-open row range ``(start, stop)``.
    """

    param: str
    shard: int
    rows: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.rows is not None:
            # Accept a JSON list; keep the dataclass hashable.
            object.__setattr__(self, "rows", tuple(self.rows))

    @property
    def key(self) -> str:
        """Unique name of the piece: ``param`` if whole, else ``"param#start:stop"``."""
        if self.rows is None:
            return self.param
        return f"{self.param}#{self.rows[0]}:{self.rows[1]}"

    def describe_rows(self) -> str:
        """``"all"`` or ``"start:stop"``, for tables and messages."""
        return "all" if self.rows is None else f"{self.rows[0]}:{self.rows[1]}"


@dataclass(frozen=True)
class Placement:
    """Where every piece of every parameter lives. Validated on construction.

    Attributes:
        num_shards: Number of ps shards (``len(cluster["ps"])``).
        params: The parameters, in model order.
        pieces: Every piece, ordered by parameter then by first row.
    """

    num_shards: int
    params: tuple[ParamInfo, ...]
    pieces: tuple[Piece, ...]

    def __post_init__(self) -> None:
        _check_num_shards(self.num_shards)
        object.__setattr__(self, "params", tuple(self.params))
        object.__setattr__(self, "pieces", tuple(self.pieces))
        _check_unique_names(self.params)
        by_param: dict[str, list[Piece]] = {p.name: [] for p in self.params}
        for piece in self.pieces:
            if piece.param not in by_param:
                raise ConfigError(
                    f"Placement has a piece of an unknown parameter. Received: {piece!r}. "
                    f"Known parameters: {sorted(by_param)}."
                )
            if not _is_int(piece.shard) or not 0 <= piece.shard < self.num_shards:
                raise ConfigError(
                    f"Piece {piece.key!r} is on shard {piece.shard!r}, outside "
                    f"[0, {self.num_shards}). Each shard index must name a ps task."
                )
            by_param[piece.param].append(piece)
        for info in self.params:
            _check_cover(info, by_param[info.name])

    def pieces_on(self, shard: int) -> list[Piece]:
        """The pieces held by ``shard``, in placement order."""
        return [p for p in self.pieces if p.shard == shard]

    def pieces_of(self, param: str) -> list[Piece]:
        """The pieces of parameter ``param``, ordered by row."""
        return [p for p in self.pieces if p.param == param]

    def param_info(self, param: str) -> ParamInfo:
        """The :class:`ParamInfo` named ``param``; ConfigError if there is none."""
        for info in self.params:
            if info.name == param:
                return info
        raise ConfigError(
            f"Placement has no parameter {param!r}. Known: {[p.name for p in self.params]}."
        )

    def piece_shape(self, piece: Piece) -> tuple[int, ...]:
        """Shape of the tensor that ``piece`` holds."""
        shape = self.param_info(piece.param).shape
        if piece.rows is None:
            return shape
        return (piece.rows[1] - piece.rows[0],) + shape[1:]

    def piece_bytes(self, piece: Piece) -> int:
        """Size of ``piece`` in bytes."""
        info = self.param_info(piece.param)
        return math.prod(self.piece_shape(piece)) * _dtype_itemsize(info.dtype)

    def shard_bytes(self) -> list[int]:
        """Bytes held by each shard, indexed by shard."""
        totals = [0] * self.num_shards
        for piece in self.pieces:
            totals[piece.shard] += self.piece_bytes(piece)
        return totals

    def format_table(self) -> str:
        """A table like TF's ``log_device_placement``: one row per piece, then per-shard totals.

        Example:
            >>> table = place([ParamInfo("w", (2, 3))], 1).format_table()
            >>> print(table)  # doctest: +NORMALIZE_WHITESPACE
            parameter  shape   bytes  shard  rows
            w          (2, 3)  24     ps:0   all
            total: ps:0 24 bytes
        """
        header = ("parameter", "shape", "bytes", "shard", "rows")
        rows = [
            (
                piece.param,
                str(self.piece_shape(piece)),
                str(self.piece_bytes(piece)),
                f"ps:{piece.shard}",
                piece.describe_rows(),
            )
            for piece in self.pieces
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
        totals = "  ".join(f"ps:{i} {b} bytes" for i, b in enumerate(self.shard_bytes()))
        lines.append(f"total: {totals}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; :meth:`from_dict` inverts it."""
        return {
            "num_shards": self.num_shards,
            "params": [
                {"name": p.name, "shape": list(p.shape), "dtype": p.dtype} for p in self.params
            ],
            "pieces": [
                {
                    "param": p.param,
                    "shard": p.shard,
                    "rows": None if p.rows is None else [p.rows[0], p.rows[1]],
                }
                for p in self.pieces
            ],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Placement:
        """Rebuild a placement from :meth:`to_dict` output, validating every field.

        Raises:
            ConfigError: A key is missing or unknown, a value has the wrong type, or the pieces
                break an invariant listed in the module docstring.
        """
        doc: _PlacementDoc = validate(_PlacementDoc, d, what="Placement")
        params = tuple(ParamInfo(p.name, p.shape, p.dtype) for p in doc.params)  # type: ignore[arg-type]
        pieces = tuple(Piece(p.param, p.shard, None if p.rows is None else (p.rows[0], p.rows[1])) for p in doc.pieces)
        return cls(doc.num_shards, params, pieces)


class _ParamDoc(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str
    shape: list[int]
    dtype: str


class _PieceDoc(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    param: str
    shard: int
    rows: Annotated[list[int], Field(min_length=2, max_length=2)] | None = Field(
        description="null for the whole tensor, else [start, stop] of its rows")


class _PlacementDoc(BaseModel):
    """The JSON form of a placement (:meth:`Placement.to_dict`), as stored beside a checkpoint."""

    model_config = ConfigDict(strict=True, extra="forbid")
    num_shards: int
    params: list[_ParamDoc]
    pieces: list[_PieceDoc]


def place(
    params: Sequence[ParamInfo],
    num_shards: int,
    *,
    strategy: str = DEFAULT_STRATEGY,
    split_bytes: int | None = None,
) -> Placement:
    """Assign every parameter (or piece of one) to a ps shard.

    Args:
        params: The trainable parameters in model order (see :meth:`ParamInfo.from_module`).
        num_shards: Number of ps shards, at least 1.
        strategy: ``"balanced"`` (the default: model order cut into equal byte runs, splitting
            the tensors the cuts fall in; balance and overlap with backward), ``"round_robin"``
            (TF's default), ``"greedy"`` (least bytes first) or ``"contiguous"`` (model order in
            about equal runs of whole tensors). See the module docstring.
        split_bytes: For ``balanced``: tensors of at most this many bytes are never cut (None:
            :data:`BALANCED_SPLIT_BYTES`). For the others: if set, a parameter larger than this
            many bytes with ``shape[0] >= 2`` is split along dim 0 into ``min(num_shards,
            shape[0])`` nearly equal row ranges on distinct shards (TF's
            ``fixed_size_partitioner``); the first ranges get the extra rows.

    Returns:
        The :class:`Placement`.

    Raises:
        ConfigError: Unknown strategy, ``num_shards < 1``, negative ``split_bytes`` or duplicate
            parameter names.

    Example:
        >>> pl = place([ParamInfo("a", (4,)), ParamInfo("b", (4,)), ParamInfo("c", (4,))], 2,
        ...            strategy="round_robin")
        >>> [p.shard for p in pl.pieces]
        [0, 1, 0]
        >>> pl = place([ParamInfo("w", (64, 256)), ParamInfo("b", (64,))], 2)
        >>> [(p.key, p.shard) for p in pl.pieces], pl.shard_bytes()
        ([('w#0:32', 0), ('w#32:64', 1), ('b', 1)], [32768, 33024])
    """
    _check_num_shards(num_shards)
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"Unknown placement strategy. Received: {strategy!r}. Allowed: {list(STRATEGIES)}."
        )
    if split_bytes is not None and (not _is_int(split_bytes) or split_bytes < 0):
        raise ConfigError(
            f"split_bytes must be None or an int >= 0. Received: {split_bytes!r}."
        )
    params = tuple(params)
    for p in params:
        if not isinstance(p, ParamInfo):
            raise ConfigError(f"place() takes ParamInfo objects. Received: {p!r}.")
    _check_unique_names(params)
    if strategy == "balanced":
        return Placement(num_shards, params, _balanced(params, num_shards, split_bytes))

    # Each unit is (param, rows) to be placed; split params yield several units that must land
    # on distinct shards.
    units = {p.name: _row_ranges(p, num_shards, split_bytes) for p in params}
    if strategy == "round_robin":
        assigned = _round_robin(params, units, num_shards)
    elif strategy == "contiguous":
        assigned = _contiguous(params, units, num_shards)
    else:
        assigned = _greedy(params, units, num_shards)
    pieces = tuple(
        Piece(p.name, shard, rows)
        for p in params
        for rows, shard in zip(units[p.name], assigned[p.name])
    )
    return Placement(num_shards, params, pieces)


def _row_ranges(
    p: ParamInfo, num_shards: int, split_bytes: int | None
) -> list[tuple[int, int] | None]:
    if split_bytes is None or p.nbytes <= split_bytes or len(p.shape) == 0 or p.shape[0] < 2:
        return [None]
    k = min(num_shards, p.shape[0])
    if k == 1:
        return [None]
    base, extra = divmod(p.shape[0], k)
    ranges: list[tuple[int, int] | None] = []
    start = 0
    for i in range(k):
        stop = start + base + (1 if i < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


def _round_robin(
    params: Sequence[ParamInfo], units: Mapping[str, list[Any]], num_shards: int
) -> dict[str, list[int]]:
    counter = 0
    assigned: dict[str, list[int]] = {}
    for p in params:
        n = len(units[p.name])
        # n <= num_shards consecutive indices mod num_shards are distinct.
        assigned[p.name] = [(counter + i) % num_shards for i in range(n)]
        counter += n
    return assigned


def _contiguous(
    params: Sequence[ParamInfo], units: Mapping[str, list[Any]], num_shards: int
) -> dict[str, list[int]]:
    total = sum(p.nbytes for p in params) or 1
    done = 0
    assigned: dict[str, list[int]] = {}
    for p in params:
        home = min(num_shards - 1, int((done + p.nbytes / 2) * num_shards / total))
        # A split parameter's pieces need distinct shards: consecutive ones from its home shard.
        assigned[p.name] = [(home + i) % num_shards for i in range(len(units[p.name]))]
        done += p.nbytes
    return assigned


def _balanced(params: Sequence[ParamInfo], num_shards: int, split_bytes: int | None) -> tuple[Piece, ...]:
    min_cut = BALANCED_SPLIT_BYTES if split_bytes is None else split_bytes
    total = sum(p.nbytes for p in params)
    pieces: list[Piece] = []
    offset = 0  # bytes of the parameters before p, in model order
    for p in params:
        # A cuttable tensor has >= 2 rows and more than min_cut >= 0 bytes, so its rows are not empty.
        if total == 0 or len(p.shape) == 0 or p.shape[0] < 2 or p.nbytes <= min_cut:
            pieces.append(Piece(p.name, _shard_of(2 * offset + p.nbytes, num_shards, total)))
        else:
            pieces += _cut_rows(p, offset, num_shards, total)
        offset += p.nbytes
    return tuple(pieces)


def _shard_of(twice_mid: int, num_shards: int, total: int) -> int:
    """The shard whose byte range ``[k * total / n, (k + 1) * total / n)`` holds the midpoint.

    Integer arithmetic on twice the midpoint (a unit's start plus its end), so no rounding decides."""
    return 0 if total == 0 else min(num_shards - 1, twice_mid * num_shards // (2 * total))


def _cut_rows(p: ParamInfo, offset: int, num_shards: int, total: int) -> list[Piece]:
    """Each row of ``p`` (at ``offset`` bytes) to the shard of its midpoint; one piece per shard."""
    rows, row_bytes = p.shape[0], p.nbytes // p.shape[0]
    first = _shard_of(2 * offset + row_bytes, num_shards, total)
    last = _shard_of(2 * offset + (2 * rows - 1) * row_bytes, num_shards, total)
    if first == last:
        return [Piece(p.name, first)]
    # Row i is on shard >= k iff (2 * offset + (2i + 1) * row_bytes) * n >= 2 * k * total.
    den = 2 * row_bytes * num_shards
    starts = [0] + [
        min(rows, max(0, -((num_shards * (2 * offset + row_bytes) - 2 * k * total) // den)))
        for k in range(first + 1, last + 1)
    ] + [rows]
    # A shard whose range falls between two rows gets no piece; the others stay in order.
    return [
        Piece(p.name, first + i, (starts[i], starts[i + 1]))
        for i in range(last - first + 1)
        if starts[i] < starts[i + 1]
    ]


def imbalance(placement: Placement) -> tuple[int, float] | None:
    """The shard that holds most of the bytes, if one does: ``(shard, its share of the bytes)``.

    A shard counts when it holds more than :data:`IMBALANCE_RATIO` times its fair share
    (``1 / num_shards`` of the bytes) and at least :data:`IMBALANCE_MIN_EXCESS_BYTES` beyond it.
    None with one shard, or when no shard does.

    Example:
        >>> params = [ParamInfo("w", (512, 3136)), ParamInfo("b", (512,))]
        >>> shard, share = imbalance(place(params, 2, strategy="round_robin"))
        >>> shard, round(share, 4)
        (0, 0.9997)
        >>> imbalance(place(params, 2)) is None
        True
    """
    loads = placement.shard_bytes()
    total = sum(loads)
    # One shard holds exactly its fair share, as does every shard of a model without bytes: no check needed.
    heavy = max(range(placement.num_shards), key=lambda s: (loads[s], -s))
    fair = total / placement.num_shards
    if loads[heavy] > IMBALANCE_RATIO * fair and loads[heavy] - fair >= IMBALANCE_MIN_EXCESS_BYTES:
        return heavy, loads[heavy] / total
    return None


def imbalance_message(placement: Placement, strategy: str) -> str | None:
    """The warning for :func:`imbalance`: the shard, its share, the strategy and what to change."""
    found = imbalance(placement)
    if found is None:
        return None
    shard, share = found
    loads = placement.shard_bytes()
    head = (
        f"Unbalanced ps shards: ps:{shard} holds {loads[shard]:,} of the {sum(loads):,} parameter bytes "
        f"({share:.2%}; a fair share with {placement.num_shards} ps is {1 / placement.num_shards:.1%}) "
        f"under --placement {strategy}, so it does most of the work while the other ps wait. "
    )
    if strategy != "balanced":
        return head + (
            "Use --placement balanced (the default), which cuts the model into equal byte runs and "
            "splits the large tensors they fall in; keep round_robin only for TensorFlow's layout."
        )
    return head + (
        "Its tensors cannot be cut finer (one row, or at most split_bytes bytes): use fewer ps, "
        "or lower split_bytes."
    )


def _greedy(
    params: Sequence[ParamInfo], units: Mapping[str, list[Any]], num_shards: int
) -> dict[str, list[int]]:
    loads = [0] * num_shards
    assigned: dict[str, list[int]] = {}
    # sorted() is stable, so equal-sized parameters keep model order: the result is deterministic.
    for p in sorted(params, key=lambda q: q.nbytes, reverse=True):
        ranges = units[p.name]
        row_bytes = p.nbytes // p.shape[0] if ranges[0] is not None else 0
        sizes = [p.nbytes if r is None else (r[1] - r[0]) * row_bytes for r in ranges]
        shards: list[int] = []
        # Pieces are in decreasing size order (extra rows go first), so "largest first" holds.
        for size in sizes:
            shard = min(
                (s for s in range(num_shards) if s not in shards), key=lambda s: (loads[s], s)
            )
            loads[shard] += size
            shards.append(shard)
        assigned[p.name] = shards
    return assigned


def split_tensor(t: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The view of the full tensor ``t`` that ``piece`` holds (``t`` itself if whole).

    Raises:
        ConfigError: ``t`` has no dim 0 or too few rows for the piece.
    """
    if piece.rows is None:
        return t
    start, stop = piece.rows
    if t.dim() == 0 or t.shape[0] < stop:
        raise ConfigError(
            f"Cannot take rows {start}:{stop} of {piece.param!r}: the tensor has shape "
            f"{tuple(t.shape)}. Pass the full tensor that the placement was computed for."
        )
    return t[start:stop]


def assemble(
    params: Sequence[ParamInfo],
    pieces_tensors: Mapping[str, torch.Tensor],
    placement: Placement,
) -> dict[str, torch.Tensor]:
    """Glue pieces back into full tensors; the inverse of :func:`split_tensor` over a placement.

    Args:
        params: The parameters to rebuild.
        pieces_tensors: Piece key (:attr:`Piece.key`) to tensor. Extra keys are ignored.
        placement: The placement the pieces came from.

    Returns:
        Parameter name to full tensor, in ``params`` order. A whole piece is returned as is;
        split pieces are concatenated into a new tensor.

    Raises:
        ConfigError: A piece is missing or a tensor has the wrong shape.
    """
    out: dict[str, torch.Tensor] = {}
    for info in params:
        pieces = placement.pieces_of(info.name)
        if not pieces:
            raise ConfigError(
                f"Placement has no pieces of parameter {info.name!r}. "
                "Compute the placement from the same model."
            )
        tensors = []
        for piece in pieces:
            if piece.key not in pieces_tensors:
                raise ConfigError(
                    f"Missing piece {piece.key!r} (held by ps:{piece.shard}) while assembling "
                    f"{info.name!r}. Received keys: {sorted(pieces_tensors)}."
                )
            t = pieces_tensors[piece.key]
            expected = placement.piece_shape(piece)
            if tuple(t.shape) != expected:
                raise ConfigError(
                    f"Piece {piece.key!r} has shape {tuple(t.shape)}, expected {expected}."
                )
            tensors.append(t)
        whole = len(tensors) == 1 and pieces[0].rows is None
        out[info.name] = tensors[0] if whole else torch.cat(tensors)
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_num_shards(num_shards: object) -> None:
    if not _is_int(num_shards) or num_shards < 1:  # type: ignore[operator]
        raise ConfigError(
            f"num_shards must be an int >= 1 (the number of ps tasks). Received: {num_shards!r}."
        )


def _check_unique_names(params: Sequence[ParamInfo]) -> None:
    seen: set[str] = set()
    for p in params:
        if p.name in seen:
            raise ConfigError(
                f"Duplicate parameter name {p.name!r}. Each parameter needs a unique name."
            )
        seen.add(p.name)


def _check_cover(info: ParamInfo, pieces: list[Piece]) -> None:
    if not pieces:
        raise ConfigError(f"Placement has no piece of parameter {info.name!r}.")
    if len(pieces) == 1 and pieces[0].rows is None:
        return
    if any(p.rows is None for p in pieces) or not info.shape:
        raise ConfigError(
            f"Parameter {info.name!r} of shape {info.shape} has inconsistent pieces: "
            f"{[p.key for p in pieces]}. Use one whole piece or row ranges covering dim 0."
        )
    expected_start = 0
    for p in pieces:
        start, stop = p.rows  # type: ignore[misc]
        if not (_is_int(start) and _is_int(stop)) or start != expected_start or stop <= start:
            raise ConfigError(
                f"Pieces of {info.name!r} must cover rows [0, {info.shape[0]}) in order, each "
                f"once. Received: {[q.key for q in pieces]}."
            )
        expected_start = stop
    if expected_start != info.shape[0]:
        raise ConfigError(
            f"Pieces of {info.name!r} must cover rows [0, {info.shape[0]}) in order, each "
            f"once. Received: {[q.key for q in pieces]}."
        )
    shards = [p.shard for p in pieces]
    if len(set(shards)) != len(shards):
        raise ConfigError(
            f"Pieces of {info.name!r} must be on distinct shards. Received shards: {shards}."
        )


