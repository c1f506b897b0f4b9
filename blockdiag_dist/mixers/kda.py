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
from .gated_delta import GatedDeltaRule, _l2norm
from .recurrence import STATE_DTYPES, run_recurrence

__all__ = ["KimiDeltaAttention", "kimi_delta_attention", "prepare_kda"]


class KimiDeltaAttention(GatedDeltaRule):
    """KDA as a :class:`~blockdiag_dist.mixers.recurrence.Recurrence`: the gated delta rule with a per-channel decay,
    so everything but the kernel is :class:`GatedDeltaRule`'s. Inputs ``(q, k, v, g, beta)`` token-major, q and k
    ``[T, Hv, K]`` prepared (normalised, q scaled, expanded to the value heads), v ``[T, Hv, V]``, g ``[T, Hv, K]``,
    beta ``[T, Hv]``; state ``[Hv, K, V]``; transition ``[Hv, K, K]`` acting by matmul."""

    name = "kimi_delta_attention"
    kernel = staticmethod(chunk_kda)
    default_chunk = KDA_CHUNK


def prepare_kda(q, k, v, g, beta, *, scale: float | None, use_qk_l2norm: bool, dtype: torch.dtype):
    """Token-major, ``dtype`` inputs of :class:`KimiDeltaAttention` from ``[B, L, ...]`` ones (as transformers
    prepares them: l2-normalised q and k, q scaled; q/k heads repeated to the value heads)."""
    B, L, Hk, K = q.shape
    Hv = v.shape[2]
    q, k = (t.to(dtype).repeat_interleave(Hv // Hk, dim=2) for t in (q, k))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (K ** -0.5 if scale is None else scale)
    T = B * L
    return (q.reshape(T, Hv, K), k.reshape(T, Hv, K), v.to(dtype).reshape(T, Hv, -1), g.to(dtype).reshape(T, Hv, K),
            beta.to(dtype).reshape(T, Hv))


def _check(q, k, v, g, beta, state, state_dtype) -> None:
    from ._common import check_shard

    what = "kimi_delta_attention"
    for name, t, nd in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 4), ("beta", beta, 3)):
        check_shard(what, name, t, state, nd)
        if not t.is_floating_point():
            raise ValueError(f"{what}: {name} expected a floating dtype, got {t.dtype}")
    if k.shape != q.shape:
        raise ValueError(f"{what}: expected k shaped like q {tuple(q.shape)}, got {tuple(k.shape)}")
    Hk, K, Hv = q.shape[2], q.shape[3], v.shape[2]
    if Hv % Hk:
        raise ValueError(f"{what}: expected the value heads a multiple of the key heads, got Hv={Hv}, Hk={Hk}")
    if tuple(g.shape[2:]) != (Hv, K):
        raise ValueError(f"{what}: g expected [B, L, Hv, K] (a log decay per key channel) with Hv={Hv}, K={K}, got "
                         f"{tuple(g.shape)}")
    if beta.shape[2] != Hv:
        raise ValueError(f"{what}: beta expected [B, L, Hv] with Hv={Hv}, got {tuple(beta.shape)}")
    if state_dtype is not None and state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"{what}: state_dtype expected one of {[str(d) for d in STATE_DTYPES]} (states are exchanged and merged in "
            f"float32 or better), got {state_dtype}"
        )


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
    from ._common import active_state, bind

    state = active_state(state, q, "kimi_delta_attention")
    _check(q, k, v, g, beta, state, state_dtype)
    compute = torch.float32
    for t in (q, k, v, g, beta):
        compute = torch.promote_types(compute, t.dtype)
    sdt = compute if state_dtype is None else torch.promote_types(compute, state_dtype)
    state.agree_mixer(f"kimi_delta_attention q{tuple(q.shape[2:])} v{tuple(v.shape[2:])} {compute} state {sdt} "
                      f"chunk {chunk}")
    with torch.autocast(q.device.type, enabled=False):
        inputs = prepare_kda(q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, dtype=compute)
    out = run_recurrence(KimiDeltaAttention(chunk), inputs, state, state_dtype=sdt)
    B, L, Hv, V = v.shape
    out = out.view(B, L, Hv, V).to(q.dtype)
    bind(out, (q, k, v, g, beta), state)
    return out
