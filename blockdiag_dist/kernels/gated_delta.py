"""The gated delta rule over pieces, chunked, each piece entering with its own state (plain torch, autograd).

Per head a state ``S [K, V]``; per token ``S = exp(g) (I - beta k k^T) S + beta k v^T`` and ``o = S^T q``
(q, k already normalised and q scaled: the caller prepares them as transformers does). The math of a chunk is
the one of transformers' ``torch_chunk_gated_delta_rule`` (the WY/UT form: a unit lower-triangular solve
condenses a chunk's delta updates into matmuls); what differs is the layout: the tokens of many pieces,
packed one piece after another with boundaries ``cu``, each piece padded to whole chunks on its own (padded
tokens have ``k = v = q = 0``, ``beta = 0``, ``g = 0``: they leave the state unchanged), so that

- the intra-chunk work of every chunk of every piece is one batched computation, and
- the scan over chunks runs ``max(chunks per piece)`` steps, each over every piece still running: the pieces are
  sorted by chunk count and their chunks stored step-major (step ``i`` holds chunk ``i`` of every piece that has
  one), so each step works on contiguous slices.

On CUDA, with flash-linear-attention installed, :func:`chunk_gated_delta` calls its varlen kernel instead
(``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` with ``cu_seqlens`` and per-piece initial states): same
inputs, same outputs. The CPU tests run that branch through a strict emulation of fla's function
(``verify.gpu.emulate``); only fla's Triton kernel itself is not exercised there.

Shape legend: T packed tokens, P pieces, H heads, K key dim, V value dim, NC chunks of all pieces, C chunk length.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .chunks import ChunkMeta, carry_chunks, plan_chunks, to_chunks

__all__ = ["CHUNK", "ChunkMeta", "chunk_gated_delta", "fla_kernel", "plan_chunks"]

CHUNK = 64  # transformers' and flash-linear-attention's chunk length
FLA_DEVICE_TYPES = ("cuda",)  # where flash-linear-attention's kernels run (an emulation may add "cpu": verify.gpu.emulate)
FLA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # its Triton kernels' (not float64)


def no_chunks(q: Tensor, v: Tensor, meta: ChunkMeta, initial: Tensor | None,
              want_final: bool) -> tuple[Tensor, Tensor | None] | None:
    """The result of a delta rule over no tokens (``initial`` passes through), or None when there are chunks."""
    if meta.num_chunks:
        return None
    P, H, K, V = meta.num_pieces, q.shape[1], q.shape[2], v.shape[2]
    return v.new_zeros(0, H, V), (None if not want_final else (q.new_zeros(P, H, K, V) if initial is None else initial))


def carry_delta(meta: ChunkMeta, ut: Tensor, intra: Tensor, v_beta: Tensor, k_beta_decayed: Tensor, q_dec: Tensor,
                k_dec: Tensor, chunk_decay: Tensor, initial: Tensor | None,
                want_final: bool) -> tuple[Tensor, Tensor | None]:
    """A chunked delta rule's solve and carry, from its chunk products (``[NC, H, C, C]`` ``ut`` and ``intra``, the
    rest ``[NC, H, C, D]``; ``chunk_decay`` broadcasts against the state ``[H, K, V]``): the unit lower-triangular
    solves condense each chunk's updates, then the state runs across the chunks of each piece. Shared by the gated
    delta rule (a scalar decay per token) and KDA (:mod:`.kda`, a decay per key channel)."""
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta_decayed, upper=False, unitriangular=True)

    def step(sl: slice, S_run: Tensor) -> tuple[Tensor, Tensor]:
        v_new = new_values[sl] - k_cumdecay[sl] @ S_run
        return q_dec[sl] @ S_run + intra[sl] @ v_new, S_run * chunk_decay[sl] + k_dec[sl].transpose(-1, -2) @ v_new

    P, H, K, V = meta.num_pieces, q_dec.shape[1], q_dec.shape[-1], v_beta.shape[-1]
    S0 = q_dec.new_zeros(P, H, K, V) if initial is None else initial.index_select(0, meta.order)
    outs, S = carry_chunks(meta, S0, step)
    out = outs.transpose(1, 2).reshape(meta.num_chunks * meta.chunk, H, V).index_select(0, meta.dest)
    return out, (S.index_select(0, meta.inverse) if want_final else None)


def _torch_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, meta: ChunkMeta,
                   initial: Tensor | None, want_final: bool) -> tuple[Tensor, Tensor | None]:
    if (empty := no_chunks(q, v, meta, initial, want_final)) is not None:
        return empty
    qc, kc, vc = (to_chunks(t, meta) for t in (q, k, v))  # [NC, H, C, D]
    gc, bc = (to_chunks(t, meta) for t in (g, beta))  # [NC, H, C]
    v_beta, k_beta = vc * bc[..., None], kc * bc[..., None]
    cum = gc.cumsum(-1)
    C = meta.chunk
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ kc.transpose(-1, -2)) * pairwise
    intra = (qc @ kc.transpose(-1, -2)) * pairwise
    return carry_delta(meta, ut, intra, v_beta, k_beta * cum.exp()[..., None], qc * cum.exp()[..., None],
                       kc * (cum[..., -1:] - cum).exp()[..., None], cum[..., -1].exp()[..., None, None],  # [NC, H, 1, 1]
                       initial, want_final)


@functools.lru_cache(maxsize=1)
def fla_kernel():
    """flash-linear-attention's varlen chunked gated delta rule, or None when it is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # noqa: BLE001 - any import failure means: not usable here
        return None
    return chunk_gated_delta_rule


def chunk_gated_delta(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    meta: ChunkMeta,
    initial: Tensor | None = None,
    *,
    want_final: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """The gated delta rule over packed pieces: ``q, k [T, H, K]`` (normalised, q scaled), ``v [T, H, V]``,
    ``g, beta [T, H]``, ``initial [P, H, K, V]`` (None: zero) -> ``(out [T, H, V], final [P, H, K, V] | None)``.
    Every tensor in one dtype, the one computed in (float32 or float64; the caller casts). Differentiable in
    every input, ``initial`` included."""
    fla = fla_kernel() if q.device.type in FLA_DEVICE_TYPES and q.dtype in FLA_DTYPES else None
    if fla is not None and meta.num_pieces:
        out, final = fla(q[None], k[None], v[None], g[None], beta[None], scale=1.0, initial_state=initial,
                         output_final_state=want_final, cu_seqlens=meta.cu_device, use_qk_l2norm_in_kernel=False)
        return out[0], final
    return _torch_chunked(q, k, v, g, beta, meta, initial, want_final)
