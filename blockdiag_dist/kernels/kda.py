"""Kimi Delta Attention (KDA) over pieces, chunked, each piece entering with its own state (plain torch, autograd).

Per head a state ``S [K, V]``; per token ``S = diag(exp(g)) S``, ``S = S + k (beta (v - k^T S))^T`` and ``o = S^T q``
with ``g [K]`` one log decay per key channel (q, k already normalised and q scaled: the caller prepares them as
transformers does). The gated delta rule of :mod:`.gated_delta` with the scalar decay made diagonal; the math of a
chunk is the one of transformers' ``chunk_kimi_delta_attention`` (the WY/UT form: a unit lower-triangular solve
condenses a chunk's delta updates into matmuls), with decays per channel: the pairwise decay between two tokens
of a chunk is a vector ``exp(G_i - G_j) [K]`` (``G`` the chunk's cumulative log decay), folded into the
key-key and query-key products. The layout is :mod:`.chunks`' (pieces packed, each padded to whole chunks on its
own: padded tokens have ``k = v = q = 0``, ``beta = 0``, ``g = 0`` and leave the state unchanged).

The pairwise decays cost ``C * K`` numbers per token and head, hence a shorter chunk than Gated DeltaNet's
(:data:`KDA_CHUNK`; any length gives the same result): short chunks also keep the differences of cumulative
sums short, where float32 loses digits on strong decays.

Shape legend: T packed tokens, P pieces, H heads, K key dim, V value dim, NC chunks of all pieces, C chunk length.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .chunks import ChunkMeta, carry_chunks, to_chunks

__all__ = ["KDA_CHUNK", "chunk_kda"]

KDA_CHUNK = 16


def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, meta: ChunkMeta, initial: Tensor | None = None,
              *, want_final: bool = True) -> tuple[Tensor, Tensor | None]:
    """KDA over packed pieces: ``q, k [T, H, K]`` (normalised, q scaled), ``v [T, H, V]``, ``g [T, H, K]`` (log
    decays), ``beta [T, H]``, ``initial [P, H, K, V]`` (None: zero) -> ``(out [T, H, V], final [P, H, K, V] |
    None)``. Every tensor in one dtype, the one computed in (float32 or float64; the caller casts).
    Differentiable in every input, ``initial`` included."""
    P, C = meta.num_pieces, meta.chunk
    H, K, V = q.shape[1], q.shape[2], v.shape[2]
    if meta.num_chunks == 0:
        final = None if not want_final else (q.new_zeros(P, H, K, V) if initial is None else initial)
        return v.new_zeros(0, H, V), final
    qc, kc, vc, gc = (to_chunks(t, meta) for t in (q, k, v, g))  # [NC, H, C, D]
    bc = to_chunks(beta, meta)  # [NC, H, C]
    cum = gc.cumsum(-2)  # [NC, H, C, K]
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    # pairwise[i, j] = exp(G_i - G_j) per channel for j <= i, 0 above the diagonal: [NC, H, C, C, K]
    pairwise = (cum[..., :, None, :] - cum[..., None, :, :]).masked_fill(upper[..., None], float("-inf")).exp()
    k_beta, v_beta = kc * bc[..., None], vc * bc[..., None]
    ut = torch.einsum("nhik,nhjk,nhijk->nhij", k_beta, kc, pairwise)
    intra = torch.einsum("nhik,nhjk,nhijk->nhij", qc, kc, pairwise)
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * cum.exp(), upper=False, unitriangular=True)
    q_dec = qc * cum.exp()
    k_dec = kc * (cum[..., -1:, :] - cum).exp()
    chunk_decay = cum[..., -1, :].exp()[..., None]  # [NC, H, K, 1]

    def step(sl: slice, S_run: Tensor) -> tuple[Tensor, Tensor]:
        v_new = new_values[sl] - k_cumdecay[sl] @ S_run
        return q_dec[sl] @ S_run + intra[sl] @ v_new, S_run * chunk_decay[sl] + k_dec[sl].transpose(-1, -2) @ v_new

    S0 = q.new_zeros(P, H, K, V) if initial is None else initial.index_select(0, meta.order)
    outs, S = carry_chunks(meta, S0, step)
    out = outs.transpose(1, 2).reshape(meta.num_chunks * C, H, V).index_select(0, meta.dest)
    return out, (S.index_select(0, meta.inverse) if want_final else None)
