"""Explicit-score attention: the scores are materialized, so every variant the fused kernels lack fits in
between — logit soft-capping (``softcap * tanh(scores / softcap)``, before the mask), attention sinks (one
logit per head in each softmax denominator, with no value) — and autograd differentiates all of it.

It runs what torch's SDPA cannot: the pieces of the varlen kernel and the dense kernel when a call carries a
soft-cap or sinks on a path without a fused variant, and ``cp_blockdiag_sdpa`` outside a step with variants.

Half-precision inputs are computed in float32 (scores, softmax and the weighted sum; as SDPA's math backend
and transformers' eager attention upcast the softmax) and returned in their dtype. A row whose bool mask
allows no key outputs exactly 0 with exactly 0 gradient (no NaN), sinks or not.

Shape legend: n blocks (or batch rows), Hq / Hkv heads (g = Hq / Hkv queries per key head), Lq / Lk query /
key slots of a block, D / Dv head dims.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["TwoTailedSigmoid", "explicit_attention", "graph_zero", "own_key_attention"]


def graph_zero(*tensors: Tensor) -> Tensor:
    """An exact 0 (0-dim, the first tensor's dtype and device) that reaches each of ``tensors`` (None: skipped) in
    the graph with exactly 0 gradient: added to an output computed without them (a rank of padding only, a softmax of
    one key), it keeps them in the backward as any other path would, so every rank runs the same collectives there."""
    zero = tensors[0][:0].sum()  # an empty slice's sum (a view, no copy): exactly 0, whatever the tensors hold
    for t in tensors[1:]:
        if t is not None:
            zero = zero + t[:0].sum().to(zero.dtype)
    return zero


class TwoTailedSigmoid(torch.autograd.Function):
    """``sigmoid(x)`` whose derivative is ``sigmoid(x) * sigmoid(-x)``: precise in both tails. Autograd's
    ``s * (1 - s)`` loses the sink's share ``1 - s`` to cancellation when ``s`` is near 1 (a sink far below the
    row's log-sum-exp), and with it the sinks' gradient (8x the baseline's float32 error, measured)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return grad * torch.sigmoid(x) * torch.sigmoid(-x)


def own_key_attention(q: Tensor, k: Tensor, v: Tensor, sink: Tensor, scale: float | None,
                      softcap: float | None) -> Tensor:
    """``sigmoid(s - sink) * v`` in ``q``'s dtype: the output of a query whose only key is ``k`` (value ``v``) beside
    its sink (``q``, ``k`` ``[..., D]``, ``v`` ``[..., Dv]``, ``sink`` broadcastable to ``q.shape[:-1]``). The weight
    is computed in float32 at least, and its score's gradient ``(dO . v) sigmoid(x) sigmoid(-x)`` is precise in both
    tails (:class:`TwoTailedSigmoid`)."""
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    score = (q.to(work) * k.to(work)).sum(-1) * scale
    if softcap is not None:
        score = torch.tanh(score / softcap) * softcap
    weight = TwoTailedSigmoid.apply(score - sink.to(work))
    return (v * weight[..., None]).to(q.dtype)


def explicit_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    lse_needed: bool = True,
) -> Tensor | tuple[Tensor, Tensor | None]:
    """``q [n, Hq, Lq, D]``, ``k [n, Hkv, Lk, D]``, ``v [n, Hkv, Lk, Dv]`` -> ``[n, Hq, Lq, Dv]``.

    ``mask``: bool (True = attend) or additive float, broadcastable to ``[n, Hq, Lq, Lk]``; ``causal``: top-left
    causal as SDPA's ``is_causal`` (combined with ``mask`` if both are given). ``sinks [Hq]``: per-head sink
    logits. ``return_lse``: ``(out, lse)`` in the compute dtype (float32 for half inputs), ``lse [n, Hq, Lq]``
    the log-sum-exp of each row's (capped, masked) scores, sinks excluded (``-inf`` for a row with no key),
    for a log-sum-exp merge of blocks (``lse_needed=False``: the output in the compute dtype and None).
    """
    n, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dtype = q.dtype
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    # the g query heads of one key head as one [g * Lq] block of rows: keys and values are never repeated
    q5 = q.to(work).reshape(n, Hkv, g * Lq, D)
    scores = (torch.matmul(q5, k.to(work).transpose(-2, -1)) * scale).view(n, Hkv, g, Lq, Lk)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    allowed = None
    if mask is not None:
        m = _five_d(mask, Hkv, g)
        if m.dtype == torch.bool:
            allowed = m
        else:
            scores = scores + m.to(work)
    if causal:
        tri = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril()
        allowed = tri if allowed is None else allowed & tri
    empty = None
    if allowed is not None:
        empty = ~allowed.any(dim=-1, keepdim=True)
        # rows with no key get finite scores (no NaN), and their weights are zeroed below
        scores = scores.masked_fill(~allowed, -math.inf).masked_fill(empty, 0.0)
    if sinks is None:  # torch's softmax (its fused backward), and the logsumexp beside it for a merge
        probs = torch.softmax(scores, dim=-1)
        lse = torch.logsumexp(scores, dim=-1) if return_lse and lse_needed else None
    else:
        # softmax by hand, the sink joining the denominator: exp relative to the row's largest logit (sink
        # included), so that a probability near 1 keeps full precision
        sink = sinks.to(work).view(1, Hkv, g, 1, 1)
        top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
        top = top.detach()  # any finite shift gives the same result
        e = torch.exp(scores - top)
        total = e.sum(dim=-1, keepdim=True)
        lse = (top + torch.log(total))[..., 0] if return_lse and lse_needed else None
        probs = e / (total + torch.exp(sink - top))  # p_j = exp(s_j) / (sum_k exp(s_k) + exp(sink))
    if empty is not None:
        probs = probs.masked_fill(empty, 0.0)
        if lse is not None:
            lse = lse.masked_fill(empty[..., 0], -math.inf)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    out = torch.matmul(probs.view(n, Hkv, g * Lq, Lk), v.to(work)).view(n, Hq, Lq, v.shape[-1])
    if return_lse:
        return out, None if lse is None else lse.view(n, Hq, Lq)
    return out.to(dtype)


def _five_d(mask: Tensor, Hkv: int, g: int) -> Tensor:
    """A mask broadcastable to ``[n, Hq, Lq, Lk]`` as ``[n | 1, Hkv | 1, g | 1, Lq | 1, Lk]``."""
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.shape[1] == 1:
        return mask.unsqueeze(2)
    return mask.unflatten(1, (Hkv, g))
