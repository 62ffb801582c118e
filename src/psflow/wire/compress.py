"""Gradient compression on the wire: fewer bytes per push (and per pull) on slow links.

Owns the setting's grammar (``none``, ``fp16``, ``bf16``, ``topk:RATIO``), the worker-side encoder
(with top-k's error feedback) and the ps-side decoder, which checks everything a compressed push
claims before a byte of it reaches the optimizer. Called by :class:`psflow.ps.client.PsClient`'s
users (the trainer encodes each shard's gradients) and by :class:`psflow.ps.service.PsService`
(which decodes a push whose meta names its ``compress`` kind, and casts pulled values to the
``pull_dtype`` a request asks for).

What travels (the frame format itself is unchanged: named raw tensors, nothing pickled):

- ``fp16`` / ``bf16``: each gradient under its own name, cast to that dtype (half the bytes);
- ``topk:R``: for each gradient ``key`` of ``n`` elements, the ``k = ceil(R * n)`` entries of
  largest magnitude as two 1-D tensors ``key#i`` (int32 indices into the flattened gradient) and
  ``key#v`` (their float32 values); ``8k`` bytes instead of ``4n``. Above ``SAMPLED_ABOVE``
  elements the threshold comes from a random sample (Lin et al.'s trick; ``torch.topk`` of 1.6 M
  entries costs ~30 ms on one core): about ``k`` entries are sent, never more than ``2k``.

Error feedback (top-k): what a step does not send is not lost. The worker keeps, per gradient, the
residual ``r`` (initially 0); each step it compresses ``a = g + r`` and keeps ``r = a - sent(a)``,
so the sum of what was sent over steps plus the residual equals the sum of the true gradients
(Stich et al., "Sparsified SGD with Memory", 2018; Lin et al., "Deep Gradient Compression", 2018).

Invariants: the decoder accepts exactly the tensors the shard's parameters call for (names, 1-D
shapes, equal lengths, at most ``n`` entries, indices in ``[0, n)``, the declared dtypes) and
refuses anything else with a :class:`~psflow.wire.frame.FrameError` naming the tensor, the value
received and what was expected; the ps answers that with an ERROR reply and keeps serving.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from psflow.errors import ConfigError
from psflow.wire.frame import FrameError

if TYPE_CHECKING:
    import torch

KINDS = ("none", "fp16", "bf16", "topk")
HALF_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}  # kind -> wire dtype name
INDEX_SUFFIX, VALUE_SUFFIX = "#i", "#v"
SAMPLED_ABOVE = 1 << 16  # topk of a larger gradient picks its threshold from a sample of SAMPLE entries
SAMPLE = 1 << 14


@dataclass(frozen=True)
class Compression:
    """A parsed ``--compress`` setting.

    Example:
        >>> Compression.parse("topk:0.01")
        Compression(kind='topk', ratio=0.01)
    """

    kind: str = "none"
    ratio: float = 1.0  # topk: the share of each gradient's entries sent

    @classmethod
    def parse(cls, text: str) -> Compression:
        """``none``, ``fp16``, ``bf16`` or ``topk:RATIO`` (0 < RATIO <= 1). Raises ConfigError."""
        allowed = "Allowed: none, fp16, bf16, topk:RATIO with 0 < RATIO <= 1 (e.g. topk:0.01)."
        if not isinstance(text, str):
            raise ConfigError(f"compress must be a string; received {text!r}. {allowed}")
        kind, sep, rest = text.strip().lower().partition(":")
        if kind in ("none", "fp16", "bf16") and not sep:
            return cls(kind)
        if kind == "topk" and sep:
            try:
                ratio = float(rest)
            except ValueError:
                ratio = math.nan
            if math.isfinite(ratio) and 0 < ratio <= 1:
                return cls("topk", ratio)
            raise ConfigError(f"compress={text!r}: the top-k ratio must be a number in (0, 1]; received {rest!r}. {allowed}")
        raise ConfigError(f"Unknown compress setting {text!r}. {allowed}")

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def pull_dtype(self) -> str | None:
        """The wire dtype of pulled values when they come back in the gradients' precision (fp16/bf16)."""
        return HALF_DTYPES.get(self.kind)

    def k_of(self, numel: int) -> int:
        """How many entries top-k sends of a gradient of ``numel`` (at least 1 of a non-empty one)."""
        return min(numel, max(1, math.ceil(self.ratio * numel))) if numel else 0


NONE = Compression()  # gradients as they are


class GradientEncoder:
    """The worker's side: encodes each shard's gradients, keeping top-k's residuals between steps.

    Args:
        compression: the setting; ``none`` sends the gradients as they are.
    """

    def __init__(self, compression: Compression) -> None:
        self.compression = compression
        self.residuals: dict[str, torch.Tensor] = {}  # topk: key -> what earlier steps did not send (flat)
        self._abs: dict[str, torch.Tensor] = {}  # topk of a large gradient: its magnitudes' buffer
        self._gen: torch.Generator | None = None
        if compression.kind == "topk":
            import torch

            self._gen = torch.Generator().manual_seed(0)  # the sample's positions: reproducible runs

    def encode(self, grads: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The tensors to send for ``grads`` (contiguous CPU tensors, named by their ps keys)."""
        kind = self.compression.kind
        if kind == "none":
            return list(grads)
        if kind in HALF_DTYPES:
            import torch

            dtype = getattr(torch, HALF_DTYPES[kind])
            return [(k, g.to(dtype)) for k, g in grads]
        out: list[tuple[str, torch.Tensor]] = []
        for k, g in grads:
            idx, vals = self._topk(k, g)
            out += [(k + INDEX_SUFFIX, idx), (k + VALUE_SUFFIX, vals)]
        return out

    def _topk(self, key: str, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        flat = g.detach().reshape(-1).float()
        r = self.residuals.get(key)
        acc = flat.clone() if r is None else r.add_(flat)  # the residual buffer becomes g + r
        k = self.compression.k_of(acc.numel())
        if k == acc.numel():
            idx = torch.arange(acc.numel())
        elif acc.numel() <= SAMPLED_ABOVE:
            idx = torch.topk(acc.abs(), k, sorted=False).indices
        else:
            idx = self._sampled_topk(key, acc, k)
        vals = acc[idx]
        acc[idx] = 0  # what is left unsent carries over to the next step
        self.residuals[key] = acc
        return idx.to(torch.int32 if acc.numel() < 2**31 else torch.int64), vals.contiguous()

    def _sampled_topk(self, key: str, acc: torch.Tensor, k: int) -> torch.Tensor:
        """About the ``k`` largest magnitudes of a large tensor at a fraction of ``torch.topk``'s
        cost (Deep Gradient Compression's trick): the threshold is the top-k of a random sample,
        the entries at or above it are sent (exactly ``k`` where more than twice that many pass)."""
        import torch

        mag = self._abs.get(key)
        if mag is None or mag.shape != acc.shape:
            mag = self._abs[key] = torch.empty_like(acc)
        torch.abs(acc, out=mag)
        sample = mag[torch.randint(0, acc.numel(), (SAMPLE,), generator=self._gen)]
        threshold = torch.topk(sample, max(1, math.ceil(k * SAMPLE / acc.numel()))).values[-1]
        idx = (mag >= threshold).nonzero().squeeze(1)
        if idx.numel() > 2 * k:
            idx = idx[torch.topk(mag[idx], k, sorted=False).indices]
        return idx


def decode(kind: str, tensors: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor],
           out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ps's side: the dense gradients a push of ``kind`` encodes, one per key of ``like``.

    Args:
        kind: the push's ``compress`` field.
        tensors: the frame's tensors.
        like: the shard's parameters (the names, shapes and dtypes the gradients must have).
        out: dense buffers to write into, kept by the caller between pushes (filled as needed).

    Returns ``out``, holding exactly the keys of ``like``.

    Raises:
        FrameError: an unknown kind, or tensors that do not fit the shard's parameters (a missing or
            unexpected name, a wrong dtype, shape or length, an index out of range).
    """
    if kind not in KINDS or kind == "none":
        raise FrameError(f"A push names compress={kind!r}; this ps decodes {', '.join(k for k in KINDS if k != 'none')}. "
                         "Is the worker running the same psflow version as the ps?")
    expected = set(like) if kind != "topk" else {k + s for k in like for s in (INDEX_SUFFIX, VALUE_SUFFIX)}
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors))[:5], sorted(set(tensors) - expected)[:5]
        raise FrameError(f"A {kind} push does not carry the tensors of this shard's parameters (missing {missing}, "
                         f"unexpected {extra}). Every worker must build the same model with the same placement.")
    for key, p in like.items():
        dense = out.get(key)
        if dense is None or dense.shape != p.shape or dense.dtype != p.dtype:
            import torch

            dense = out[key] = torch.empty_like(p)
        if kind == "topk":
            _scatter(key, tensors[key + INDEX_SUFFIX], tensors[key + VALUE_SUFFIX], dense)
        else:
            _cast(key, kind, tensors[key], dense)
    return out


def push_bytes(kind: str, name: str, sizes: Mapping[str, tuple[int, int]]) -> tuple[int, bool] | None:
    """What a push's tensor ``name`` may declare on a shard whose parameters are ``sizes`` (key ->
    (elements, bytes)): ``(bytes, exact)``, where ``exact`` says the declaration must be that size,
    not at most that. None: ``name`` is none of the tensors a push of ``kind`` carries for it.

    Read from a frame's tensor list before its payload is received, so that a peer cannot make the
    ps hold more memory for a push than the shard's own gradients take (``decode`` checks the rest).

    Example:
        >>> push_bytes("topk", "w#i", {"w": (7850, 31400)})
        (62800, False)
    """
    if kind == "topk":
        key, suffix = name[:-2], name[-2:]
        size = sizes.get(key) if suffix in (INDEX_SUFFIX, VALUE_SUFFIX) else None
        # at most one entry per element: int64 (or int32) indices, float32 values
        return None if size is None else (size[0] * (8 if suffix == INDEX_SUFFIX else 4), False)
    size = sizes.get(name)
    if size is None:
        return None
    return (size[0] * 2, True) if kind in HALF_DTYPES else (size[1], True)


def _cast(key: str, kind: str, t: torch.Tensor, dense: torch.Tensor) -> None:
    want = HALF_DTYPES[kind]
    if str(t.dtype).removeprefix("torch.") != want or t.shape != dense.shape:
        raise FrameError(f"Gradient {key!r} of a {kind} push is {str(t.dtype).removeprefix('torch.')} of shape "
                         f"{list(t.shape)}; expected {want} of shape {list(dense.shape)}.")
    dense.copy_(t)


def _scatter(key: str, idx: torch.Tensor, vals: torch.Tensor, dense: torch.Tensor) -> None:
    import torch

    n = dense.numel()
    if idx.dtype not in (torch.int32, torch.int64) or vals.dtype != torch.float32:
        raise FrameError(f"Top-k gradient {key!r} has indices of {idx.dtype} and values of {vals.dtype}; expected "
                         "int32 (or int64) indices and float32 values.")
    if idx.dim() != 1 or vals.dim() != 1 or idx.numel() != vals.numel():
        raise FrameError(f"Top-k gradient {key!r} has indices of shape {list(idx.shape)} and values of shape "
                         f"{list(vals.shape)}; expected two 1-D tensors of the same length.")
    if idx.numel() > n:
        raise FrameError(f"Top-k gradient {key!r} has {idx.numel()} entries; its parameter has only {n} elements.")
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise FrameError(f"Top-k gradient {key!r} has index {bad}, out of range for a parameter of {n} elements "
                             f"(indices must be in 0..{n - 1}).")
    flat = dense.view(-1)
    flat.zero_()
    flat.index_put_((idx.long(),), vals.to(dense.dtype), accumulate=True)


def cast_values(values: Sequence[tuple[str, torch.Tensor]], dtype_name: str | None) -> list[tuple[str, torch.Tensor]]:
    """Pulled values in ``dtype_name`` (``float16``/``bfloat16``), or as they are for None.

    Raises:
        FrameError: a dtype other than the two half precisions.
    """
    if dtype_name is None:
        return list(values)
    if dtype_name not in HALF_DTYPES.values():
        raise FrameError(f"A pull asks for values in {dtype_name!r}; a ps sends them in float16 or bfloat16 "
                         "(or as they are, without pull_dtype).")
    import torch

    dtype = getattr(torch, dtype_name)
    return [(k, v.to(dtype) if v.is_floating_point() else v) for k, v in values]
