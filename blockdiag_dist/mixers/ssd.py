"""Mamba2's SSD (Nemotron-H, Bamba, Granite-4 hybrids, Mamba2) per document, across CP ranks.

Per head a state ``S [Dh, N]``; per token ``S = exp(dt A) S + (dt x) B^T``, ``y = S C + D x``, as transformers'
``mamba2_chunk_scan`` computes it (``dt`` already through ``softplus(dt + dt_bias)`` and the time-step clamp,
``A = -exp(A_log)`` one number per head, ``B`` and ``C`` shared by the heads of a group). A piece of a document
maps its entering state affinely: ``S_out = M S_in + C`` with ``M = exp(sum_t dt_t A)`` one number per head (the
``"scalar"`` transition) and ``C`` the state it leaves from zero ``[H, Dh, N]``: the summary
:func:`blockdiag_dist.mixers.recurrence.run_recurrence` exchanges, ``H * Dh * N`` numbers per continuing piece,
plus ``H`` for a piece that itself continues its document.

Computed in float32, or float64 for float64 inputs (transformers casts x, B, C and dt to float32 whatever the
model's dtype), with autocast off; summaries exchanged and folded in the same dtype unless ``state_dtype`` says
otherwise (float32 or float64 only).

Shape legend: B rows, L rows of a rank, T = B * L, H heads, Dh head dim, G groups, N state size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels.chunks import ChunkMeta, plan_chunks
from ..kernels.ssd import SSD_CHUNK, chunk_ssd
from .recurrence import STATE_DTYPES, Recurrence, run_recurrence

__all__ = ["SSD", "DecayScan", "DecayScanMeta", "prepare_ssd", "ssd"]


@dataclass(frozen=True, eq=False)
class DecayScanMeta:
    """The chunk layout of a pass and the piece of each packed token (for the transitions' sums)."""

    chunks: ChunkMeta
    piece: Tensor  # int64 [T']


class DecayScan(Recurrence):
    """A :class:`~blockdiag_dist.mixers.recurrence.Recurrence` whose chunked kernel (class attribute ``kernel``,
    called ``kernel(*inputs, chunks, initial, want_final=)``) scans packed pieces and whose transition over a piece
    is ``exp`` of the sum of its log decays (input number ``decay_input``): Mamba2's SSD, one factor per head, and
    Mamba1's selective scan, one per channel and state entry."""

    kernel = staticmethod(chunk_ssd)
    default_chunk = SSD_CHUNK
    decay_input = 1

    def __init__(self, chunk: int | None = None) -> None:
        self.chunk = self.default_chunk if chunk is None else chunk

    def meta_key(self) -> tuple:
        return ("decay_scan", self.chunk)  # the meta depends on the pieces and the chunk size only

    def prepare(self, cu, device):
        lens = torch.as_tensor(list(cu), dtype=torch.int64).diff()
        piece = torch.repeat_interleave(torch.arange(lens.numel()), lens)
        return DecayScanMeta(plan_chunks(cu, self.chunk, device), piece.to(device))

    def scan(self, inputs, meta, initial, want_final):
        return self.kernel(*inputs, meta.chunks, initial, want_final=want_final)

    def summarize(self, inputs, meta):
        """``M = exp(sum of the log decays)`` per piece; ``C`` the leaving state of a scan from zero."""
        _, final = self.kernel(*inputs, meta.chunks, None, want_final=True)
        la = inputs[self.decay_input]
        total = la.new_zeros(meta.chunks.num_pieces, *la.shape[1:]).index_add(0, meta.piece, la)
        return total.exp(), final


class SSD(DecayScan):
    """Mamba2's SSD as a :class:`DecayScan`: inputs ``(x, a, B, C)`` token-major, ``x [T, H, Dh]`` already times
    ``dt``, ``a = dt A [T, H]`` the log decay, ``B, C [T, H, N]`` expanded to the heads; state ``[H, Dh, N]``;
    transition ``[H]``, one factor per head."""

    transition = "scalar"
    name = "ssd"

    def shapes(self, inputs):
        x, _, B, _ = inputs
        return (x.shape[1], x.shape[2], B.shape[2]), (x.shape[1],)


def _check(x, dt, A, B, C, D, state, state_dtype) -> None:
    from ._common import check_shard

    for name, t, nd in (("x", x, 4), ("dt", dt, 3), ("B", B, 4), ("C", C, 4)):
        check_shard("ssd", name, t, state, nd)
    for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D)):
        if t is not None and not (isinstance(t, Tensor) and t.is_floating_point()):
            raise ValueError(f"ssd: {name} expected a floating tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    H = x.shape[2]
    if tuple(dt.shape[2:]) != (H,):
        raise ValueError(f"ssd: dt expected [B, L, H] with H={H}, got {tuple(dt.shape)}")
    for name, t in (("A", A), ("D", D)):
        if t is not None and tuple(t.shape) != (H,):
            raise ValueError(f"ssd: {name} expected [H] = [{H}], got {tuple(t.shape)}")
    if C.shape != B.shape:
        raise ValueError(f"ssd: expected C shaped like B {tuple(B.shape)}, got {tuple(C.shape)}")
    if H % B.shape[2]:
        raise ValueError(f"ssd: expected the heads a multiple of the groups, got H={H}, G={B.shape[2]}")
    if state_dtype is not None and state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"ssd: state_dtype expected one of {[str(d) for d in STATE_DTYPES]} (states are exchanged and merged in "
            f"float32 or better), got {state_dtype}"
        )


def prepare_ssd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """Token-major, ``dtype`` inputs of :class:`SSD` from ``[B, L, ...]`` ones (discretised as transformers does:
    ``x dt``, ``dt A``; B and C repeated to the heads)."""
    Bsz, L, H, Dh = x.shape
    G, N = B.shape[2], B.shape[3]
    T = Bsz * L
    dt = dt.to(dtype).reshape(T, H)
    Bh, Ch = (t.to(dtype).repeat_interleave(H // G, dim=2).reshape(T, H, N) for t in (B, C))
    return x.to(dtype).reshape(T, H, Dh) * dt[..., None], dt * A.to(dtype), Bh, Ch


def ssd(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    *,
    state_dtype: torch.dtype | None = None,
    chunk: int = SSD_CHUNK,
    state=None,
) -> Tensor:
    """Mamba2's SSD per document over this rank's rows: ``x [B, L, H, Dh]``, ``dt [B, L, H]`` (the time step, after
    its softplus and clamp), ``A [H]`` (negative), ``B, C [B, L, G, N]``, ``D [H]`` (the skip, optional) ->
    ``y [B, L, H, Dh]`` in the computed dtype (float32, float64 for float64 inputs; transformers' ``mamba2_chunk_scan``
    returns float32 too); padding rows 0. A document continuing from other ranks enters with the state their
    pieces left. ``state`` defaults to the active step's.

    Raises ``ValueError`` naming expected vs got (before any collective) for tensors that are not this rank's
    shard, non-floating inputs, heads that the groups do not divide, a ``state_dtype`` below float32, and (with the
    consensus check) ranks that call it with different sizes (``PlanMismatchError``).
    """
    from ._common import active_state, bind

    state = active_state(state, x, "ssd")
    _check(x, dt, A, B, C, D, state, state_dtype)
    compute = torch.float32
    for t in (x, dt, A, B, C) + (() if D is None else (D,)):
        compute = torch.promote_types(compute, t.dtype)
    sdt = compute if state_dtype is None else torch.promote_types(compute, state_dtype)
    state.agree_mixer(f"ssd x{tuple(x.shape[2:])} B{tuple(B.shape[2:])} {compute} state {sdt} chunk {chunk}")
    Bsz, L, H, Dh = x.shape
    with torch.autocast(x.device.type, enabled=False):
        inputs = prepare_ssd(x, dt, A, B, C, compute)
        y = run_recurrence(SSD(chunk), inputs, state, state_dtype=sdt).view(Bsz, L, H, Dh)
        if D is not None:
            real = (state.docs.doc_index >= 0).to(compute)[..., None, None]
            y = y + D.to(compute)[:, None] * x.to(compute) * real
    bind(y, (x, dt, A, B, C) + (() if D is None else (D,)), state)
    return y
