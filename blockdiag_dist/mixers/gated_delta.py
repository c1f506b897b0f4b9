"""The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5) per document, across CP ranks.

Per head a state ``S [K, V]``; per token ``S = exp(g) (I - beta k k^T) S + beta k v^T``, ``o = S^T q``, with q
and k l2-normalised and q scaled by ``K ** -0.5``, as transformers computes it
(``torch_chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True)``). A piece of a document maps its entering
state affinely: ``S_out = M S_in + C`` with ``M = prod_t exp(g_t) (I - beta_t k_t k_t^T)`` ``[K, K]`` and ``C``
the state it leaves from zero ``[K, V]``, per head: the summary :func:`blockdiag_dist.mixers.recurrence.run_recurrence`
exchanges, ``Hv * K * (K + V)`` numbers per continuing piece (``Hv * K * V`` for a document's first piece).

Computed in float32, or float64 for float64 inputs (transformers computes in float32 whatever the model's
dtype), with autocast off (under bf16 autocast transformers' chunked kernel runs its matmuls in bfloat16);
summaries are exchanged and folded in the same dtype unless ``state_dtype`` says otherwise (float32
or float64 only).

Shape legend: B rows, L rows of a rank, T = B * L, Hk query/key heads, Hv value heads, K key dim, V value dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.gated_delta import CHUNK, chunk_gated_delta, plan_chunks
from .recurrence import STATE_DTYPES, Recurrence, run_recurrence

__all__ = ["GatedDeltaRule", "gated_delta_rule", "prepare_gated_delta"]

L2NORM_EPS = 1e-6  # transformers' and flash-linear-attention's


class GatedDeltaRule(Recurrence):
    """The gated delta rule as a :class:`~blockdiag_dist.mixers.recurrence.Recurrence`: inputs ``(q, k, v, g,
    beta)`` token-major, q and k ``[T, Hv, K]`` prepared (normalised, q scaled, expanded to the value heads),
    v ``[T, Hv, V]``, g and beta ``[T, Hv]``; state ``[Hv, K, V]``; transition ``[Hv, K, K]`` acting by matmul."""

    transition = "matrix"
    name = "gated_delta_rule"
    kernel = staticmethod(chunk_gated_delta)  # the chunked scan over packed pieces (a subclass names its own)
    default_chunk = CHUNK

    def __init__(self, chunk: int | None = None) -> None:
        self.chunk = self.default_chunk if chunk is None else chunk

    def meta_key(self) -> tuple:
        return (self.name, self.chunk)

    def prepare(self, cu, device):
        return plan_chunks(cu, self.chunk, device)

    def shapes(self, inputs):
        q, _, v = inputs[:3]
        H, K, V = q.shape[1], q.shape[2], v.shape[2]
        return (H, K, V), (H, K, K)

    def scan(self, inputs, meta, initial, want_final):
        return self.kernel(*inputs, meta, initial, want_final=want_final)

    def summarize(self, inputs, meta):
        """One scan of the extended values ``[v | 0]`` from ``[0 | I]``: the leaving state is ``[C | M]``."""
        q, k, v, g, beta = inputs
        T, H, K = k.shape
        V, P = v.shape[-1], meta.num_pieces
        v_ext = torch.cat([v, v.new_zeros(T, H, K)], -1)
        eye = torch.eye(K, dtype=v.dtype, device=v.device).expand(P, H, K, K)
        initial = torch.cat([v.new_zeros(P, H, K, V), eye], -1)
        _, final = self.kernel(q, k, v_ext, g, beta, meta, initial)
        return final[..., V:], final[..., :V]


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def prepare_gated_delta(q, k, v, g, beta, *, scale: float | None, use_qk_l2norm: bool, dtype: torch.dtype):
    """Token-major, ``dtype`` inputs of :class:`GatedDeltaRule` from ``[B, L, ...]`` ones (as transformers
    prepares them: q/k heads repeated to the value heads, l2-normalised, q scaled); ``g`` keeps its key-channel
    axis where it has one (Kimi Delta Attention's ``[B, L, Hv, K]``)."""
    B, L, Hk, K = q.shape
    Hv = v.shape[2]
    q, k = (t.to(dtype).repeat_interleave(Hv // Hk, dim=2) for t in (q, k))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (K ** -0.5 if scale is None else scale)
    T = B * L
    return (q.reshape(T, Hv, K), k.reshape(T, Hv, K), v.to(dtype).reshape(T, Hv, -1),
            g.to(dtype).reshape(T, Hv, *g.shape[3:]), beta.to(dtype).reshape(T, Hv))


def _check(q, k, v, g, beta, state, state_dtype, what: str = "gated_delta_rule", per_key_channel: bool = False
           ) -> None:
    """The delta rules' input checks (``per_key_channel``: Kimi Delta Attention's decay ``g [B, L, Hv, K]``)."""
    from ._common import check_shard

    for name, t, nd in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 4 if per_key_channel else 3), ("beta", beta, 3)):
        check_shard(what, name, t, state, nd)
        if not t.is_floating_point():
            raise ValueError(f"{what}: {name} expected a floating dtype, got {t.dtype}")
    if k.shape != q.shape:
        raise ValueError(f"{what}: expected k shaped like q {tuple(q.shape)}, got {tuple(k.shape)}")
    Hk, K, Hv = q.shape[2], q.shape[3], v.shape[2]
    if Hv % Hk:
        raise ValueError(f"{what}: expected the value heads a multiple of the key heads, got Hv={Hv}, Hk={Hk}")
    if per_key_channel and tuple(g.shape[2:]) != (Hv, K):
        raise ValueError(f"{what}: g expected [B, L, Hv, K] (a log decay per key channel) with Hv={Hv}, K={K}, got "
                         f"{tuple(g.shape)}")
    for name, t in (() if per_key_channel else (("g", g),)) + (("beta", beta),):
        if t.shape[2] != Hv:
            raise ValueError(f"{what}: {name} expected [B, L, Hv] with Hv={Hv}, got {tuple(t.shape)}")
    if state_dtype is not None and state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"{what}: state_dtype expected one of {[str(d) for d in STATE_DTYPES]} (states are exchanged and merged in "
            f"float32 or better), got {state_dtype}"
        )


def delta_rule_step(rec: GatedDeltaRule, what: str, q, k, v, g, beta, *, scale, use_qk_l2norm, state_dtype, state,
                    per_key_channel: bool = False) -> Tensor:
    """:func:`gated_delta_rule` and :func:`~blockdiag_dist.mixers.kda.kimi_delta_attention` (``rec`` their
    recurrence, ``what`` their name): checks, consensus, the float32-or-better inputs, the exchange."""
    from ._common import active_state, bind

    state = active_state(state, q, what)
    _check(q, k, v, g, beta, state, state_dtype, what, per_key_channel)
    compute = torch.float32
    for t in (q, k, v, g, beta):
        compute = torch.promote_types(compute, t.dtype)
    sdt = compute if state_dtype is None else torch.promote_types(compute, state_dtype)
    state.agree_mixer(f"{what} q{tuple(q.shape[2:])} v{tuple(v.shape[2:])} {compute} state {sdt} chunk {rec.chunk}")
    with torch.autocast(q.device.type, enabled=False):
        inputs = prepare_gated_delta(q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, dtype=compute)
    out = run_recurrence(rec, inputs, state, state_dtype=sdt)
    B, L, Hv, V = v.shape
    out = out.view(B, L, Hv, V).to(q.dtype)
    bind(out, (q, k, v, g, beta), state)
    return out


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    state_dtype: torch.dtype | None = None,
    chunk: int = CHUNK,
    state=None,
) -> Tensor:
    """The gated delta rule per document over this rank's rows: ``q, k [B, L, Hk, K]``, ``v [B, L, Hv, V]``,
    ``g`` (log decay) and ``beta [B, L, Hv]`` -> ``[B, L, Hv, V]`` in q's dtype; padding rows 0. A document
    continuing from other ranks enters with the state their pieces left. ``state`` defaults to the active step's.

    Raises ``ValueError`` naming expected vs got (before any collective) for tensors that are not this rank's
    shard, non-floating inputs, heads that do not divide, a ``state_dtype`` below float32, and (with the
    consensus check) ranks that call it with different sizes (``PlanMismatchError``).
    """
    return delta_rule_step(GatedDeltaRule(chunk), "gated_delta_rule", q, k, v, g, beta, scale=scale,
                           use_qk_l2norm=use_qk_l2norm, state_dtype=state_dtype, state=state)
