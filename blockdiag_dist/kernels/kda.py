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

from .chunks import ChunkMeta, to_chunks
from .gated_delta import carry_delta, no_chunks

__all__ = ["KDA_CHUNK", "chunk_kda"]

KDA_CHUNK = 16


def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, meta: ChunkMeta, initial: Tensor | None = None,
              *, want_final: bool = True) -> tuple[Tensor, Tensor | None]:
    """KDA over packed pieces: ``q, k [T, H, K]`` (normalised, q scaled), ``v [T, H, V]``, ``g [T, H, K]`` (log
    decays), ``beta [T, H]``, ``initial [P, H, K, V]`` (None: zero) -> ``(out [T, H, V], final [P, H, K, V] |
    None)``. Every tensor in one dtype, the one computed in (float32 or float64; the caller casts).
    Differentiable in every input, ``initial`` included."""
    if (empty := no_chunks(q, v, meta, initial, want_final)) is not None:
        return empty
    qc, kc, vc, gc = (to_chunks(t, meta) for t in (q, k, v, g))  # [NC, H, C, D]
    bc = to_chunks(beta, meta)  # [NC, H, C]
    cum = gc.cumsum(-2)  # [NC, H, C, K]
    C = meta.chunk
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    # pairwise[i, j] = exp(G_i - G_j) per channel for j <= i, 0 above the diagonal: [NC, H, C, C, K]
    pairwise = (cum[..., :, None, :] - cum[..., None, :, :]).masked_fill(upper[..., None], float("-inf")).exp()
    k_beta, v_beta = kc * bc[..., None], vc * bc[..., None]
    ut = torch.einsum("nhik,nhjk,nhijk->nhij", k_beta, kc, pairwise)
    intra = torch.einsum("nhik,nhjk,nhijk->nhij", qc, kc, pairwise)
    return carry_delta(meta, ut, intra, v_beta, k_beta * cum.exp(), qc * cum.exp(), kc * (cum[..., -1:, :] - cum).exp(),
                       cum[..., -1, :].exp()[..., None],  # [NC, H, K, 1]
                       initial, want_final)
