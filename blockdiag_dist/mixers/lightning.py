"""Lightning attention (MiniMax-Text-01 / M1: ``MiniMaxLightningAttention``) per document, across CP ranks.

Per head a state ``S [K, V]`` and a fixed decay rate ``slope`` (transformers' ``slope_rate``: one number per head
and layer, set at init, not learned); per token ``S = exp(-slope) S + k v^T`` and ``o = q S``. That is Mamba2's
SSD (:mod:`.ssd`) with ``x = v``, ``B = k``, ``C = q`` and a log decay ``-slope`` on every token, so the scan is
:func:`blockdiag_dist.kernels.ssd.chunk_ssd`'s and the exchange :func:`~blockdiag_dist.mixers.recurrence.run_recurrence`'s.
What differs: the transition of a piece is known from its length alone, ``M = exp(-slope * n)`` per head
(:meth:`Lightning.summarize` computes it so, not as a sum over the tokens). The summary of a continuing piece is
``H * K * V`` numbers (``C``) plus ``H`` (``M``, for a piece whose document started on an earlier rank), whatever
its length.

Computed in float32, or float64 for float64 inputs (transformers computes the core in the model's dtype: bf16 for
a bf16 model), with autocast off; summaries exchanged and folded in the same dtype unless ``state_dtype`` says
otherwise (float32 or float64 only). The output is in the computed dtype.

Shape legend: B rows, L rows of a rank, T = B * L, H heads, K key / query dim, V value dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.ssd import SSD_CHUNK
from .recurrence import STATE_DTYPES, run_recurrence
from .ssd import SSD

__all__ = ["Lightning", "lightning_attention", "prepare_lightning"]


class Lightning(SSD):
    """Lightning attention as a :class:`~blockdiag_dist.mixers.recurrence.Recurrence`: :class:`SSD`'s scan on inputs
    ``(v [T, H, V], a [T, H], k [T, H, K], q [T, H, K])`` with ``a = -slope`` on every token; state ``[H, V, K]``
    (SSD's ``[Dh, N]``: the transpose of MiniMax's ``k^T v``); transition ``[H]``, ``exp(-slope * n)`` for a
    piece of ``n`` tokens."""

    name = "lightning_attention"

    def __init__(self, slope: Tensor, chunk: int = SSD_CHUNK) -> None:
        super().__init__(chunk)
        self.slope = slope  # [H], the computed dtype

    def summarize(self, inputs, meta):
        """``M = exp(-slope * n)`` per piece of ``n`` tokens and head; ``C`` the leaving state of a scan from zero."""
        _, final = self.kernel(*inputs, meta.chunks, None, want_final=True)
        n = torch.bincount(meta.piece, minlength=meta.chunks.num_pieces).to(self.slope.dtype)
        return torch.exp(-n[:, None] * self.slope[None, :]), final


def prepare_lightning(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """Token-major, ``dtype`` inputs of :class:`Lightning` from ``[B, L, H, .]`` ones and ``slope [H]``."""
    B, L, H, K = q.shape
    T = B * L
    a = (-slope.to(dtype).reshape(1, H)).expand(T, H)
    return v.to(dtype).reshape(T, H, -1), a, k.to(dtype).reshape(T, H, K), q.to(dtype).reshape(T, H, K)


def _check(q, k, v, slope, state, state_dtype) -> None:
    from ._common import check_shard

    what = "lightning_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_shard(what, name, t, state, 4)
        if not t.is_floating_point():
            raise ValueError(f"{what}: {name} expected a floating dtype, got {t.dtype}")
    if k.shape != q.shape:
        raise ValueError(f"{what}: expected k shaped like q {tuple(q.shape)}, got {tuple(k.shape)}")
    H = q.shape[2]
    if v.shape[2] != H:
        raise ValueError(f"{what}: v expected [B, L, H, V] with H={H} (q's heads), got {tuple(v.shape)}")
    if not isinstance(slope, Tensor) or not slope.is_floating_point() or slope.numel() != H:
        got = (f"{slope.dtype} {tuple(slope.shape)}" if isinstance(slope, Tensor) else type(slope).__name__)
        raise ValueError(f"{what}: slope expected a floating tensor of H={H} decay rates (one per head), got {got}")
    if slope.device != q.device:
        raise ValueError(f"{what}: slope expected on q's device {q.device}, got {slope.device}")
    if state_dtype is not None and state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"{what}: state_dtype expected one of {[str(d) for d in STATE_DTYPES]} (states are exchanged and merged in "
            f"float32 or better), got {state_dtype}"
        )


def lightning_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    slope: Tensor,
    *,
    state_dtype: torch.dtype | None = None,
    chunk: int = SSD_CHUNK,
    state=None,
) -> Tensor:
    """Lightning attention per document over this rank's rows: ``q, k [B, L, H, K]``, ``v [B, L, H, V]``, ``slope``
    (``H`` decay rates, e.g. ``MiniMaxLightningAttention.slope_rate [H, 1, 1]``) -> ``o [B, L, H, V]`` in the
    computed dtype (float32, float64 for float64 inputs); padding rows 0. A document continuing from other ranks
    enters with the state their pieces left. ``state`` defaults to the active step's.

    Raises ``ValueError`` naming expected vs got (before any collective) for tensors that are not this rank's
    shard, non-floating inputs, heads that differ, a slope that is not one number per head, a ``state_dtype``
    below float32, and (with the consensus check) ranks that call it with different sizes (``PlanMismatchError``).
    """
    from ._common import active_state, bind

    state = active_state(state, q, "lightning_attention")
    _check(q, k, v, slope, state, state_dtype)
    compute = torch.float32
    for t in (q, k, v, slope):
        compute = torch.promote_types(compute, t.dtype)
    sdt = compute if state_dtype is None else torch.promote_types(compute, state_dtype)
    state.agree_mixer(f"lightning_attention q{tuple(q.shape[2:])} v{tuple(v.shape[2:])} {compute} state {sdt} "
                      f"chunk {chunk}")
    B, L, H, V = v.shape
    with torch.autocast(q.device.type, enabled=False):
        s = slope.to(compute).reshape(H)
        inputs = prepare_lightning(q, k, v, s, compute)
        out = run_recurrence(Lightning(s, chunk), inputs, state, state_dtype=sdt).view(B, L, H, V)
    bind(out, (q, k, v), state)
    return out
