"""The reference of indexer-selected sparse attention (DeepSeek Sparse Attention, DSA), per document.

DeepSeek-V3.2's lightning indexer scores every query ``i`` against every earlier key ``j`` of its document with
its own small key head, ``score[i, j] = sum_h w[i, h] * relu(index_scale * q_idx[i, h] . k_idx[j])``, keeps the
``topk`` best keys, and the layer's attention runs over those keys only. Per document that is: the candidates
of query ``i`` are the keys ``doc_start .. i`` of its own document; a query with fewer than ``topk`` of them
attends to all of them (exactly dense causal attention).

Ties: the model takes ``torch.topk`` over a row of ``n`` scores, ``n`` its document's length run alone (later
keys ``-inf``), ``k = min(topk, n)``. torch does not specify which of equal scores ``topk`` keeps (scores are
``relu``'d: exact zeros tie often), so the reference makes that same call on that same row rather than follow a
rule of its own (on one device ``topk`` is a function of the row's values, its length and ``k``).

Shape legend:
    B    batch rows      S    positions per row          K    selected keys (<= topk)
    Hi   indexer heads   Di   indexer head dim           H    attention heads, D / Dv head dims
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .layout import DocLayout

__all__ = ["reference_dsa_attention", "reference_dsa_select", "reference_sparse_attention"]


def _layout(doc_ids: DocLayout | Tensor) -> DocLayout:
    return doc_ids if isinstance(doc_ids, DocLayout) else DocLayout.from_doc_ids(doc_ids)


def _check_topk(topk: object) -> int:
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk: expected an int >= 1, got {topk!r}")
    return topk


def reference_dsa_select(
    index_q: Tensor,
    index_w: Tensor,
    index_k: Tensor,
    doc_ids: DocLayout | Tensor,
    topk: int,
    *,
    index_scale: float,
    score_dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Each query's top-``topk`` keys of its own document prefix, chosen by the indexer's dense scores.

    Args:
        index_q: ``[B, S, Hi, Di]`` the indexer's queries (after their rotary embedding).
        index_w: ``[B, S, Hi]`` the per-head weights of each query.
        index_k: ``[B, S, Di]`` the indexer's keys (one head).
        doc_ids: ``[B, S]`` (0 = padding) or a :class:`DocLayout`.
        topk: keys kept per query (``index_topk``).
        index_scale: the indexer's softmax scale (``Di ** -0.5`` in DeepSeek-V3.2), applied before the ``relu``.
        score_dtype: the dtype the scores are computed in: float64 (the reference), or float32 to choose exactly
            as the model does (it scores in float32 whatever its dtype).

    Returns:
        int64 ``[B, S, K]``, ``K = min(topk, longest document)``: the selected keys of each query as positions
        inside its document (``0`` = the document's first token), unordered; ``-1`` fills the rest of a row
        (padding rows are all ``-1``). A query ``t`` tokens into its document with ``t + 1 <= topk`` selects all
        ``t + 1`` of its keys.

    >>> q = torch.ones(1, 4, 1, 2); w = torch.ones(1, 4, 1); k = torch.tensor([[[1., 0.], [3., 0.], [2., 0.], [0., 0.]]])
    >>> reference_dsa_select(q, w, k, torch.tensor([[1, 1, 1, 0]]), 2, index_scale=1.0)[0].sort(-1).values.tolist()
    [[-1, 0], [0, 1], [1, 2], [-1, -1]]
    """
    layout = _layout(doc_ids)
    topk = _check_topk(topk)
    B, S = layout.batch_size, layout.seq_len
    if index_q.dim() != 4 or index_q.shape[:2] != (B, S):
        raise ValueError(f"index_q: expected [B, S, Hi, Di] with B={B}, S={S}, got shape {tuple(index_q.shape)}")
    Hi, Di = index_q.shape[2:]
    if tuple(index_w.shape) != (B, S, Hi):
        raise ValueError(f"index_w: expected [B, S, Hi] = {[B, S, Hi]}, got shape {tuple(index_w.shape)}")
    if tuple(index_k.shape) != (B, S, Di):
        raise ValueError(f"index_k: expected [B, S, Di] = {[B, S, Di]}, got shape {tuple(index_k.shape)}")
    spans = layout.segments.tolist()
    K = min(topk, max((e - s for _, s, e in spans), default=1))
    sel = torch.full((B, S, K), -1, dtype=torch.int64)
    with torch.no_grad(), torch.autocast(device_type=index_q.device.type, enabled=False):
        for b, s, e in spans:
            n = e - s
            q, w, k = (t[b, s:e].to(score_dtype) for t in (index_q, index_w, index_k))
            scores = torch.relu(torch.einsum("ihd,jd->ihj", q, k) * index_scale)  # [n, Hi, n]
            scores = torch.einsum("ih,ihj->ij", w, scores)
            later = torch.ones(n, n, dtype=torch.bool).triu(1)
            scores = scores.masked_fill(later.to(scores.device), float("-inf"))
            chosen = scores.topk(min(topk, n), dim=-1).indices.cpu()  # [n, k]
            i = torch.arange(n).unsqueeze(1)
            sel[b, s:e, : chosen.shape[1]] = torch.where(chosen <= i, chosen, -1)  # later keys were -inf: not seen
    return sel.to(index_q.device)


def reference_sparse_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    doc_ids: DocLayout | Tensor,
    selection: Tensor,
    *,
    scale: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Attention of each query over its selected keys only, in float64, returned in ``query``'s dtype.

    Args:
        query: ``[B, H, S, D]``; key: ``[B, H, S, D]``; value: ``[B, H, S, Dv]``.
        doc_ids: ``[B, S]`` (0 = padding) or a :class:`DocLayout`.
        selection: int64 ``[B, S, K]``: keys as positions inside the query's document (``-1`` = none), e.g.
            from :func:`reference_dsa_select`. Entries after the query or outside its document are not seen.
        scale: softmax scale, default ``1 / sqrt(D)``.
        sinks: ``[H]`` per-head sink logits (HY-V4's): one more term ``exp(sinks[h])`` in every softmax
            denominator, with no value: ``p_j = exp(s_j) / (sum_k exp(s_k) + exp(sinks[h]))``.

    Returns:
        ``[B, H, S, Dv]``; padding rows exactly 0, no gradient to keys or values at padding positions.
        Differentiable in query, key, value and sinks.

    >>> q = k = v = torch.ones(1, 1, 2, 1, dtype=torch.float64); sel = torch.tensor([[[0, -1], [0, 1]]])
    >>> reference_sparse_attention(q, k, v, torch.tensor([[1, 1]]), sel, scale=1.0, sinks=torch.ones(1))[0, 0, :, 0].tolist()
    [0.5, 0.6666666666666666]
    """
    layout = _layout(doc_ids)
    B, S = layout.batch_size, layout.seq_len
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4 or t.shape[0] != B or t.shape[2] != S:
            raise ValueError(f"{name}: expected [B, H, S, *] with B={B}, S={S}, got shape {tuple(t.shape)}")
    if selection.dim() != 3 or selection.shape[:2] != (B, S):
        raise ValueError(f"selection: expected [B, S, K] with B={B}, S={S}, got shape {tuple(selection.shape)}")
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != query.shape[1]):
        raise ValueError(f"sinks: expected [H] = [{query.shape[1]}], got shape {tuple(sinks.shape)}")
    allowed = torch.zeros(B, S, S, dtype=torch.bool)
    sel = selection.cpu()
    for b, s, e in layout.segments.tolist():
        rows = sel[b, s:e]  # [n, K], positions in the document
        i = torch.arange(e - s).unsqueeze(1)
        ok = (rows >= 0) & (rows <= i)
        q_at = (i + s).expand_as(rows)[ok]
        allowed[b, q_at, rows[ok] + s] = True
    allowed = allowed.unsqueeze(1).to(query.device)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    with torch.autocast(device_type=query.device.type, enabled=False):
        q, k, v = (t.to(torch.float64) for t in (query, key, value))
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale
        has_key = allowed.any(-1, keepdim=True)
        scores = scores.masked_fill(~allowed & has_key, float("-inf")).masked_fill(~has_key, 0.0)
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:  # the sink as one more logit of each row, dropped after the softmax
            sink = sinks.to(torch.float64).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        probs = torch.where(has_key, probs, 0.0)
        out = torch.matmul(probs, v)
    return out.to(query.dtype)


def reference_dsa_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    index_q: Tensor,
    index_w: Tensor,
    index_k: Tensor,
    doc_ids: DocLayout | Tensor,
    topk: int,
    *,
    index_scale: float,
    scale: float | None = None,
    sinks: Tensor | None = None,
    score_dtype: torch.dtype = torch.float64,
) -> tuple[Tensor, Tensor]:
    """DSA per document: :func:`reference_dsa_select` then :func:`reference_sparse_attention`; returns
    ``(out [B, H, S, Dv], selection [B, S, K])``. The selection carries no gradient (the model's indexer runs
    under ``no_grad``); the output is differentiable in query, key, value (and ``sinks``, HY-V4's per-head sink
    logits, when given).

    >>> q = k = v = torch.ones(1, 1, 3, 2); iq = torch.ones(1, 3, 1, 2); iw = torch.ones(1, 3, 1); ik = torch.ones(1, 3, 2)
    >>> out, sel = reference_dsa_attention(q, k, v, iq, iw, ik, torch.tensor([[1, 1, 2]]), 1, index_scale=1.0)
    >>> out[0, 0, :, 0].tolist(), sel[:, :, 0].tolist()
    ([1.0, 1.0, 1.0], [[0, 0, 0]])
    """
    layout = _layout(doc_ids)
    sel = reference_dsa_select(index_q, index_w, index_k, layout, topk, index_scale=index_scale, score_dtype=score_dtype)
    return reference_sparse_attention(query, key, value, layout, sel, scale=scale, sinks=sinks), sel
