"""Mamba2's SSD (state-space duality) over pieces, chunked, each piece entering with its own state (plain torch,
autograd).

Per head a state ``S [P, N]``; per token ``S = exp(a) S + x B^T`` and ``y = S C`` (``a = dt * A`` the log decay,
``x`` already multiplied by ``dt``: the caller discretises as transformers does). The math of a chunk is the one
of transformers' ``mamba2_chunk_scan`` (a chunk's outputs are a causal, decay-weighted ``C B^T`` "attention"
over its ``x`` plus the entering state read through ``C``); what differs is the layout, as in
:mod:`blockdiag_dist.kernels.gated_delta` (the chunk layout of :mod:`blockdiag_dist.kernels.chunks`): the tokens of many pieces packed one piece after another, each piece padded to whole chunks on its
own (padded tokens have ``a = 0``, ``x = B = C = 0``: they leave the state unchanged), the intra-chunk work of
every chunk batched, and the scan over chunks ``max(chunks per piece)`` steps over the pieces still running.

Shape legend: T packed tokens, P pieces (``NP`` in code, P is the head dim), H heads, Dh head dim, N state size,
NC chunks of all pieces, C chunk length.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .chunks import ChunkMeta, carry_chunks, to_chunks

__all__ = ["SSD_CHUNK", "chunk_ssd"]

SSD_CHUNK = 64  # the torch path's chunk (any length gives the same result; transformers' configs use 128-256)


def chunk_ssd(x: Tensor, a: Tensor, B: Tensor, C: Tensor, meta: ChunkMeta, initial: Tensor | None = None, *,
              want_final: bool = True) -> tuple[Tensor, Tensor | None]:
    """SSD over packed pieces: ``x [T, H, Dh]`` (times dt), ``a [T, H]`` (log decay), ``B, C [T, H, N]`` (expanded to
    the heads), ``initial [NP, H, Dh, N]`` (None: zero) -> ``(y [T, H, Dh], final [NP, H, Dh, N] | None)``, without
    the ``D`` skip. Every tensor in one dtype, the one computed in. Differentiable in every input."""
    NP, Cl = meta.num_pieces, meta.chunk
    H, Dh, N = x.shape[1], x.shape[2], B.shape[2]
    if meta.num_chunks == 0:
        final = None if not want_final else (x.new_zeros(NP, H, Dh, N) if initial is None else initial)
        return x.new_zeros(0, H, Dh), final
    xc, Bc, Cc = (to_chunks(t, meta) for t in (x, B, C))  # [NC, H, C, D]
    ac = to_chunks(a, meta)  # [NC, H, C]
    cum = ac.cumsum(-1)
    # decay[l, s] = exp(a_{s+1} + ... + a_l), the sum taken directly (as transformers' segment_sum): the difference
    # cum[l] - cum[s] of two large negative sums loses float32 digits when the decays are strong
    strict = torch.ones(Cl, Cl, dtype=torch.bool, device=x.device).tril(-1)
    seg = ac[..., :, None].expand(*ac.shape, Cl).masked_fill(~strict, 0.0).cumsum(-2)
    decay = seg.masked_fill(~strict.logical_or(torch.eye(Cl, dtype=torch.bool, device=x.device)), float("-inf")).exp()
    y_diag = ((Cc @ Bc.transpose(-1, -2)) * decay) @ xc  # [NC, H, C, Dh]
    to_end = (cum[..., -1:] - cum).exp()[..., None]  # [NC, H, C, 1]
    chunk_state = (xc * to_end).transpose(-1, -2) @ Bc  # [NC, H, Dh, N]: a chunk's contribution from zero
    c_dec = Cc * cum.exp()[..., None]  # reads the entering state
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [NC, H, 1, 1]

    def step(sl: slice, S_run: Tensor) -> tuple[Tensor, Tensor]:
        return y_diag[sl] + c_dec[sl] @ S_run.transpose(-1, -2), S_run * chunk_decay[sl] + chunk_state[sl]

    S0 = x.new_zeros(NP, H, Dh, N) if initial is None else initial.index_select(0, meta.order)
    outs, S = carry_chunks(meta, S0, step)
    y = outs.transpose(1, 2).reshape(meta.num_chunks * Cl, H, Dh).index_select(0, meta.dest)
    return y, (S.index_select(0, meta.inverse) if want_final else None)
