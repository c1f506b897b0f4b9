"""Mamba1's selective scan over pieces, chunked, each piece entering with its own state (plain torch, autograd).

Per channel ``i`` and state entry ``n`` a scalar state; per token ``h = a h + b`` with ``a = exp(dt A)`` (the
caller passes the log decay ``la = dt A``) and ``b = dt x B``, and ``y = sum_n h C``: a diagonal linear recurrence,
as transformers' ``mamba_selective_scan`` computes it on its torch path (a loop over tokens). Here the tokens of
many pieces are packed one piece after another (the chunk layout of
:func:`~blockdiag_dist.kernels.chunks.plan_chunks`: each piece padded to whole chunks on its own, padded
tokens with ``la = 0``, ``b = 0``: they leave the state unchanged); inside a chunk the states from zero and the
decay products come from a doubling scan (``log2(chunk)`` elementwise steps over every chunk at once, products of
decays only: nothing is divided, nothing overflows); the chunks are then chained over ``max(chunks per piece)``
steps, each adding ``decay product x entering state``.

**An initial state without a kernel that takes one** (mamba_ssm's CUDA ``selective_scan_fn`` starts every sequence
from zero): the recurrence is diagonal, so a piece entering with ``S`` has, at its token ``t``,
``h_t = h_t(from zero) + P_t S`` with ``P_t = exp(A cumsum(dt)_t)`` the decay product from the piece's start, and
``y_t = y_t(from zero) + sum_n C_t P_t S``: :func:`initial_state_correction`, exact, elementwise, differentiable in
``S``, and its leaving state ``h_T(from zero) + P_T S``. :func:`scan_from_zero_then_correct` is that route with
this module's own scan standing in for the kernel; the tests hold it equal to the direct one.

Shape legend: T packed tokens, P pieces, I channels, N state size, G groups of channels sharing ``B, C``,
NC chunks of all pieces, Cl chunk length.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .chunks import ChunkMeta, carry_chunks, to_chunks

__all__ = ["SCAN_CHUNK", "chunk_selective_scan", "initial_state_correction", "scan_from_zero_then_correct"]

SCAN_CHUNK = 64  # the doubling scan's span: log2(64) = 6 elementwise steps per chunk


def _doubling_scan(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Inclusive scan of ``h_t = a_t h_{t-1} + b_t`` from zero along dim 1 of ``a, b [NC, Cl, ...]``: ``(h, P)`` with
    ``P_t = a_1 ... a_t`` (Hillis-Steele: each step combines every position with the one ``k`` before it)."""
    Cl, k = a.shape[1], 1
    while k < Cl:
        b = torch.cat([b[:, :k], b[:, k:] + a[:, k:] * b[:, :-k]], 1)
        a = torch.cat([a[:, :k], a[:, k:] * a[:, :-k]], 1)
        k *= 2
    return b, a


def _output(h: Tensor, C: Tensor) -> Tensor:
    """``y [.., I] = sum_n h [.., I, N] * C [.., G, N]`` (group ``g`` of ``C`` serves channels ``g I / G ...``)."""
    *lead, I, N = h.shape
    G = C.shape[-2]
    return (h.reshape(*lead, G, I // G, N) * C.unsqueeze(-2)).sum(-1).reshape(*lead, I)


def chunk_selective_scan(la: Tensor, b: Tensor, C: Tensor, meta: ChunkMeta, initial: Tensor | None = None, *,
                         want_final: bool = True) -> tuple[Tensor, Tensor | None]:
    """The selective scan over packed pieces: ``la [T, I, N]`` (log decay ``dt A``), ``b [T, I, N]`` (``dt x B``),
    ``C [T, G, N]``, ``initial [P, I, N]`` (None: zero) -> ``(y [T, I], final [P, I, N] | None)``, without the
    ``D`` skip. Every tensor in one dtype, the one computed in. Differentiable in every input."""
    P, Cl = meta.num_pieces, meta.chunk
    I, N = la.shape[1], la.shape[2]
    if meta.num_chunks == 0:
        final = None if not want_final else (la.new_zeros(P, I, N) if initial is None else initial)
        return la.new_zeros(0, I), final
    ac, bc = (to_chunks(t, meta).transpose(1, 2) for t in (la, b))  # [NC, Cl, I, N]
    h0, prod = _doubling_scan(ac.exp(), bc)

    def step(sl: slice, S_run: Tensor) -> tuple[Tensor, Tensor]:
        h = h0[sl] + prod[sl] * S_run[:, None]
        return h, h[:, -1]

    S0 = la.new_zeros(P, I, N) if initial is None else initial.index_select(0, meta.order)
    hs, S = carry_chunks(meta, S0, step)  # [NC, Cl, I, N]
    h = hs.reshape(meta.num_chunks * Cl, I, N).index_select(0, meta.dest)
    return _output(h, C), (S.index_select(0, meta.inverse) if want_final else None)


def initial_state_correction(la: Tensor, C: Tensor, piece: Tensor, cu: Tensor, initial: Tensor
                             ) -> tuple[Tensor, Tensor]:
    """What entering with ``initial [P, I, N]`` adds to a scan from zero, exactly (the recurrence is diagonal):
    ``(dy [T, I], dfinal [P, I, N])`` with ``dy_t = sum_n C_t P_t S`` and ``dfinal = P_last S``, ``P_t = exp(sum of
    la over the piece's tokens up to t)``. ``piece [T]``: the piece of each packed token, ``cu [P + 1]`` the
    boundaries (on the device)."""
    T = la.shape[0]
    # the sums from the piece's start as differences of one running sum, taken in float64: in float32 the running
    # sum over earlier pieces would cost the short sums of later ones their digits
    run = la.to(torch.float64).cumsum(0)
    start = cu[:-1].index_select(0, piece)  # first packed token of each token's piece
    before = torch.cat([run.new_zeros(1, *run.shape[1:]), run]).index_select(0, start)  # the sum before the piece
    decay = (run - before).to(la.dtype).exp()  # [T, I, N]: the decay product from the piece's start, through t
    carried = decay * initial.index_select(0, piece)
    last = cu[1:] - 1
    return _output(carried, C), carried.index_select(0, last) if T else initial


def scan_from_zero_then_correct(la: Tensor, b: Tensor, C: Tensor, meta: ChunkMeta, initial: Tensor | None = None, *,
                                want_final: bool = True, kernel=None) -> tuple[Tensor, Tensor | None]:
    """:func:`chunk_selective_scan`'s result by a scan from zero (``kernel(la, b, C, meta)``, default this
    module's) plus :func:`initial_state_correction`: the route for a kernel that takes no initial state."""
    kernel = kernel or (lambda *a: chunk_selective_scan(*a, None, want_final=True))
    y, final = kernel(la, b, C, meta)
    if initial is None or meta.num_chunks == 0:
        return y, final if want_final else None
    lens = meta.cu_device.diff()
    piece = torch.repeat_interleave(torch.arange(lens.numel(), device=la.device), lens)
    dy, dfinal = initial_state_correction(la, C, piece, meta.cu_device, initial)
    return y + dy, (final + dfinal if want_final else None)
