"""The reference of attention over compressed blocks (DeepSeek-V4's CSA and HCA layers), per document.

Each document runs alone: its tokens ``0 .. n - 1`` form windows of ``rate`` tokens from its first token; window
``w`` (tokens ``w * rate .. (w + 1) * rate - 1``) gives one entry, the softmax-over-slots pooling of its tokens'
projections ``kv`` weighted by ``gate + position_bias[slot]`` (per channel), then ``finish`` (the layer's norm and
rotary embedding at position ``w * rate``). With ``overlap`` the projections have two halves ``[a | b]`` and
entry ``w`` pools the ``a`` halves of window ``w - 1`` (slots ``0 .. rate - 1``) with the ``b`` halves of window
``w`` (slots ``rate .. 2 rate - 1``); window 0 has only its own. An incomplete last window gives no entry.

Query ``i`` (in-document position) attends, in one softmax with its head's sink logit (a column with no value),
to the keys ``j`` of its document with ``i - window < j <= i`` and to the entries ``w < (i + 1) // rate`` (its
complete windows); with an indexer, only to those of them among its ``topk`` best by
``sum_h weights[i, h] * relu(q[i, h] . key[w]) * index_scale`` (the indexer's own pooled keys), chosen with
``torch.topk`` of ``min(topk, T)`` on a row of the document's ``T`` entries with the incomplete ones at ``-inf``
(ties as the model breaks them, see :mod:`blockdiag_ref.sparse`).

Shape legend:
    B rows, S positions per row, H heads, D head dim, C projection width (D, or 2 D with overlap),
    Hi / Di indexer heads / head dim, T entries of a document.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from .layout import DocLayout

__all__ = ["reference_compressed_attention", "reference_pool_windows"]

Finish = Callable[[Tensor, Tensor], Tensor]  # (pooled [1, T, D], positions int64 [1, T]) -> entries [1, T, D]


def reference_pool_windows(kv: Tensor, gate: Tensor, rate: int, position_bias: Tensor, *, overlap: bool,
                           finish: Finish | None = None) -> Tensor:
    """The entries of one document: ``kv, gate [n, C]`` -> ``[n // rate, D]``, slot by slot in float64.

    >>> kv = torch.arange(8.).view(4, 2); gate = torch.zeros(4, 2)
    >>> reference_pool_windows(kv, gate, 2, torch.zeros(2, 2), overlap=False).tolist()    # window means
    [[1.0, 2.0], [5.0, 6.0]]
    """
    n, C = kv.shape
    D = C // 2 if overlap else C
    entries = []
    for w in range(n // rate):
        slots = []  # (value [D], logit [D]) per slot
        if overlap and w > 0:
            for s in range(rate):
                t = (w - 1) * rate + s
                slots.append((kv[t, :D], gate[t, :D] + position_bias[s, :D]))
        for s in range(rate):
            t = w * rate + s
            lo = D if overlap else 0
            slots.append((kv[t, lo:], gate[t, lo:] + position_bias[s, lo:]))
        values = torch.stack([v for v, _ in slots]).to(torch.float64)
        weights = torch.softmax(torch.stack([g for _, g in slots]).to(torch.float64), dim=0)
        entries.append((weights * values).sum(0))
    pooled = torch.stack(entries).unsqueeze(0) if entries else kv.new_zeros((1, 0, D), dtype=torch.float64)
    if finish is not None and entries:
        pooled = finish(pooled, (torch.arange(len(entries)) * rate).unsqueeze(0).to(kv.device))
    return pooled[0].to(torch.float64)


def reference_compressed_attention(
    query: Tensor,
    kv: Tensor,
    sinks: Tensor,
    doc_ids: DocLayout | Tensor,
    *,
    window: int,
    rate: int,
    comp_kv: Tensor,
    comp_gate: Tensor,
    position_bias: Tensor,
    overlap: bool,
    finish: Finish | None = None,
    index: dict | None = None,
    scale: float | None = None,
    score_dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Compressed-block attention per document, float64, returned in ``query``'s dtype.

    Args:
        query: ``[B, H, S, D]``; kv: ``[B, S, D]`` each token's shared key and value; sinks: ``[H]`` logits.
        doc_ids: ``[B, S]`` (0 = padding) or a :class:`DocLayout`.
        window: tokens of the sliding window (keys ``i - window < j <= i``).
        rate, comp_kv, comp_gate ``[B, S, C]``, position_bias ``[rate, C]``, overlap, finish: the compressor.
        index: the indexer, or None (every complete entry is seen): a dict with ``query [B, S, Hi, Di]``,
            ``weights [B, S, Hi]``, ``scale``, ``topk`` and its own ``kv``, ``gate`` ``[B, S, Ci]``,
            ``position_bias`` ``[rate, Ci]``, ``finish`` (same ``rate`` and ``overlap``).
        scale: softmax scale, default ``1 / sqrt(D)``. score_dtype: the indexer's score dtype (float32 chooses as
            DeepSeek-V4 does).

    Returns:
        ``[B, H, S, D]``; padding rows exactly 0. Differentiable in query, kv, sinks and the compressor's inputs.

    >>> B, H, S, D = 1, 1, 5, 2
    >>> q = torch.zeros(B, H, S, D); kv = torch.ones(B, S, D); g = torch.zeros(B, S, D)
    >>> out = reference_compressed_attention(q, kv, torch.zeros(H), torch.tensor([[1, 1, 1, 2, 0]]), window=2, rate=2,
    ...                                      comp_kv=kv, comp_gate=g, position_bias=torch.zeros(2, D), overlap=False)
    >>> [round(x, 4) for x in out[0, 0, :, 0].tolist()]   # the sink takes a share; query 1 sees entry 0; padding 0
    [0.5, 0.75, 0.75, 0.5, 0.0]
    """
    layout = doc_ids if isinstance(doc_ids, DocLayout) else DocLayout.from_doc_ids(doc_ids)
    B, H, S, D = query.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = torch.zeros(B, H, S, D, dtype=torch.float64, device=query.device)
    with torch.autocast(device_type=query.device.type, enabled=False):
        for b, s, e in layout.segments.tolist():
            n = e - s
            entries = reference_pool_windows(comp_kv[b, s:e], comp_gate[b, s:e], rate, position_bias, overlap=overlap,
                                             finish=finish)  # [T, D]
            T = entries.shape[0]
            i = torch.arange(n).unsqueeze(1)
            j = torch.arange(n).unsqueeze(0)
            near = (j <= i) & (j > i - window)  # [n, n]
            seen = torch.arange(T).unsqueeze(0) < (i + 1) // rate  # [n, T]
            if index is not None and T > 0:
                seen = seen & _index_choice(index, b, s, e, rate, overlap, seen, score_dtype)
            keys = torch.cat([kv[b, s:e].to(torch.float64), entries])  # [n + T, D]
            mask = torch.cat([near, seen], dim=1).to(query.device)
            logits = torch.matmul(query[b, :, s:e].to(torch.float64), keys.transpose(0, 1)) * scale  # [H, n, n + T]
            logits = logits.masked_fill(~mask, float("-inf"))
            sink = sinks.to(torch.float64).reshape(H, 1, 1).expand(H, n, 1)
            probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
            out[b, :, s:e] = torch.matmul(probs, keys)
    return out.to(query.dtype)


def _index_choice(index: dict, b: int, s: int, e: int, rate: int, overlap: bool, seen: Tensor,
                  score_dtype: torch.dtype) -> Tensor:
    """bool ``[n, T]``: the entries the indexer keeps for each query of the document ``b, s:e``."""
    with torch.no_grad():
        keys = reference_pool_windows(index["kv"][b, s:e].detach(), index["gate"][b, s:e].detach(), rate,
                                      index["position_bias"].detach(), overlap=overlap, finish=index.get("finish"))
        q = index["query"][b, s:e].to(score_dtype)  # [n, Hi, Di]
        scores = torch.relu(torch.einsum("ihd,wd->ihw", q, keys.to(score_dtype))) * index["scale"]
        scores = torch.einsum("ih,ihw->iw", index["weights"][b, s:e].to(score_dtype), scores)
        scores = scores.masked_fill(~seen, float("-inf"))
        T = keys.shape[0]
        chosen = scores.topk(min(index["topk"], T), dim=-1).indices
        keep = torch.zeros_like(seen)
        keep.scatter_(1, chosen, True)
    return keep
