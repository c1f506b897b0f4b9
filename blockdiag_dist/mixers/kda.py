"""Kimi Delta Attention (KDA: Kimi Linear, Ling / Bailing hybrid) per document, across CP ranks.

Per head a state ``S [K, V]``; per token ``S = diag(exp(g)) S``, then the delta update ``S = S + k (beta (v - k^T
S))^T`` and ``o = S^T q``, with ``g [K]`` a log decay per key channel, q and k l2-normalised and q scaled by
``K ** -0.5``, as transformers computes it (``chunk_kimi_delta_attention(..., use_qk_l2norm_in_kernel=True)``): the
gated delta rule (:mod:`.gated_delta`) with a diagonal decay. A piece of a document maps its entering state
affinely, ``S_out = M S_in + C``, with ``M = prod_t (I - beta_t k_t k_t^T) diag(exp(g_t))`` ``[K, K]`` and ``C`` the
state it leaves from zero ``[K, V]``, per head: the summary :func:`blockdiag_dist.mixers.recurrence.run_recurrence`
exchanges, ``Hv * K * (K + V)`` numbers per continuing piece (``Hv * K * V`` for a document's first piece),
whatever the piece's length.

Computed in float32, or float64 for float64 inputs (transformers computes in float32 whatever the model's dtype),
with autocast off; summaries exchanged and folded in the same dtype unless ``state_dtype`` says otherwise
(float32 or float64 only).

Shape legend: B rows, L rows of a rank, T = B * L, Hk query/key heads, Hv value heads, K key dim, V value dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.kda import KDA_CHUNK, chunk_kda
from .gated_delta import GatedDeltaRule, delta_rule_step, prepare_gated_delta

__all__ = ["KimiDeltaAttention", "kimi_delta_attention", "prepare_kda"]


class KimiDeltaAttention(GatedDeltaRule):
    """KDA as a :class:`~blockdiag_dist.mixers.recurrence.Recurrence`: the gated delta rule with a per-channel decay,
    so everything but the kernel is :class:`GatedDeltaRule`'s. Inputs ``(q, k, v, g, beta)`` token-major, q and k
    ``[T, Hv, K]`` prepared (normalised, q scaled, expanded to the value heads), v ``[T, Hv, V]``, g ``[T, Hv, K]``,
    beta ``[T, Hv]``; state ``[Hv, K, V]``; transition ``[Hv, K, K]`` acting by matmul."""

    name = "kimi_delta_attention"
    kernel = staticmethod(chunk_kda)
    default_chunk = KDA_CHUNK


prepare_kda = prepare_gated_delta  # the gated delta rule's preparation: g keeps its key-channel axis


def kimi_delta_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    state_dtype: torch.dtype | None = None,
    chunk: int = KDA_CHUNK,
    state=None,
) -> Tensor:
    """Kimi Delta Attention per document over this rank's rows: ``q, k [B, L, Hk, K]``, ``v [B, L, Hv, V]``, ``g
    [B, L, Hv, K]`` (log decay per key channel), ``beta [B, L, Hv]`` -> ``[B, L, Hv, V]`` in q's dtype; padding rows
    0. A document continuing from other ranks enters with the state their pieces left. ``state`` defaults to the
    active step's.

    Raises ``ValueError`` naming expected vs got (before any collective) for tensors that are not this rank's
    shard, non-floating inputs, heads that do not divide, a decay that is not per key channel, a ``state_dtype``
    below float32, and (with the consensus check) ranks that call it with different sizes (``PlanMismatchError``).
    """
    return delta_rule_step(KimiDeltaAttention(chunk), "kimi_delta_attention", q, k, v, g, beta, scale=scale,
                           use_qk_l2norm=use_qk_l2norm, state_dtype=state_dtype, state=state, per_key_channel=True)
