"""Attention over compressed blocks per document across CP ranks (DeepSeek-V4's CSA and HCA layers).

A DeepSeek-V4 layer with a compressor attends, in one softmax with a per-head sink, to

- the **sliding window**: the shared key/value (``K = V``, one head) of the ``window`` latest tokens of its
  document (``i - window < j <= i``);
- **compressed entries**: every ``rate`` tokens of its document form a window (windows start at the document's
  first token); an entry pools its window's projected tokens by a softmax over the slots of a gate (plus a
  per-slot bias), then a norm and a rotary embedding at the window's first in-document position (the layer's
  ``finish``). With ``overlap`` (CSA) the projections have two halves and entry ``w`` pools the first half of
  window ``w - 1`` with the second half of window ``w`` (``2 * rate`` slots; window 0 has only its own). A query
  ``i`` tokens into its document sees entry ``w`` once its window is complete: ``w < (i + 1) // rate``;
- with an **indexer** (CSA), only the ``topk`` entries it selects: the indexer pools its own keys the same way,
  scores ``sum_h w_h relu(q_h . k) * scale`` in float32, masks later entries and takes ``torch.topk`` of
  ``min(topk, T)`` on a row of the document's ``T = doc_len // rate`` entries: the very call the model makes
  when the document runs alone, so that ties are broken as the model breaks them.

Under CP a piece of a document needs the projections of its document's earlier tokens held by other ranks (the
sliding window's keys and the compressor's and indexer's inputs of every complete window of its prefix): they
travel in the step's exchange for an unbounded window (needed-only halo or all-to-all; nothing at CP 1 or when
documents do not cross ranks), one message per layer, and the rank pools the entries of its pieces' prefixes
itself. The exchange is differentiable: the projections' gradients return to the ranks that own them (the
indexer's inputs travel detached: the model's indexer yields integer indices, its weights get no gradient).

Shape legend: B rows, L rows of this rank, H heads, D head dim, C compressor width (D, or 2 D with overlap),
Hi / Di indexer heads / head dim, T entries, c queries of a chunk, n tokens of a document prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .kernels.explicit import graph_zero
from .mixers._common import active_state, bind
from .sparse import SCORE_BUDGET, _pieces

__all__ = ["CompressedIndex", "Compression", "compressed_attention", "pool_windows"]


@dataclass(frozen=True)
class Compression:
    """A compressor's inputs on this rank: ``kv`` and ``gate`` ``[B, L, C]`` (the token projections), ``rate``
    tokens per window, ``overlap`` (``C = 2 D``: entry ``w`` pools window ``w - 1``'s first half with window
    ``w``'s second half), ``position_bias [rate, C]`` (added to the gate per slot of a window), ``finish``:
    ``(pooled [1, T, D], positions int64 [1, T]) -> entries [1, T, D]`` (the layer's norm and rotary embedding;
    ``positions`` are the windows' first in-document positions; called on no entry, ``[1, 0, width]``, on a rank
    that makes none, so that its weights get a gradient on every rank), and ``pool_dtype`` (the gate softmax's
    dtype: float32 in DeepSeek-V4 whatever the model's)."""

    kv: Tensor
    gate: Tensor
    rate: int
    overlap: bool
    position_bias: Tensor
    finish: Callable[[Tensor, Tensor], Tensor]
    pool_dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class CompressedIndex:
    """The indexer over compressed entries (CSA): ``query [B, L, Hi, Di]`` (after its rotary embedding),
    ``weights [B, L, Hi]`` (float32, scaled as the model scales them), ``scale`` (applied after the ``relu``),
    ``topk`` (entries kept per query), ``keys``: its own :class:`Compression` (width ``Di`` or ``2 Di``), and
    ``score_dtype``: the scores' dtype (float32 in DeepSeek-V4 whatever the model's)."""

    query: Tensor
    weights: Tensor
    scale: float
    topk: int
    keys: Compression
    score_dtype: torch.dtype = torch.float32


def pool_windows(kv: Tensor, gate: Tensor, comp: Compression) -> Tensor:
    """The compressed entries of a document prefix: ``kv, gate [n, C]`` (its tokens from the document's first)
    -> ``[T, D]``, ``T = n // rate`` (an incomplete last window gives none), finished by ``comp.finish``."""
    m = comp.rate
    T = kv.shape[0] // m
    C = kv.shape[-1]
    if T == 0:
        return kv.new_zeros((0, C // 2 if comp.overlap else C))
    chunk_kv = kv[: T * m].reshape(1, T, m, C)
    chunk_gate = gate[: T * m].reshape(1, T, m, C) + comp.position_bias
    if comp.overlap:
        D = C // 2
        slots_kv = chunk_kv.new_zeros((1, T, 2 * m, D))
        slots_gate = chunk_gate.new_full((1, T, 2 * m, D), float("-inf"))
        slots_kv[:, :, m:] = chunk_kv[..., D:]
        slots_gate[:, :, m:] = chunk_gate[..., D:]
        if T > 1:
            slots_kv[:, 1:, :m] = chunk_kv[:, :-1, :, :D]
            slots_gate[:, 1:, :m] = chunk_gate[:, :-1, :, :D]
        chunk_kv, chunk_gate = slots_kv, slots_gate
    pooled = (chunk_kv * chunk_gate.softmax(dim=2, dtype=comp.pool_dtype).to(chunk_kv.dtype)).sum(dim=2)
    positions = (torch.arange(T, device=kv.device) * m).unsqueeze(0)
    return comp.finish(pooled, positions)[0]


def _check(query: Tensor, kv: Tensor, sinks: Tensor, window: int, compression: Compression,
           index: CompressedIndex | None, L: int) -> None:
    if query.dim() != 4 or query.shape[2] != L:
        raise ValueError(f"compressed_attention: query expected [B, H, L, D] with L = {L} (this rank's rows), "
                         f"got {tuple(query.shape)}")
    B, H, _, D = query.shape
    if tuple(kv.shape) != (B, L, D):
        raise ValueError(f"compressed_attention: kv expected [B, L, D] = {[B, L, D]}, got {tuple(kv.shape)}")
    if tuple(sinks.shape) != (H,):
        raise ValueError(f"compressed_attention: sinks expected [H] = [{H}], got {tuple(sinks.shape)}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"compressed_attention: window expected an int >= 1 (tokens a query sees, itself "
                         f"included), got {window!r}")
    comps = [("compression", compression, D)] + ([("index.keys", index.keys, index.query.shape[-1])] if index else [])
    for name, c, width in comps:
        C = 2 * width if c.overlap else width
        if c.kv.shape != (B, L, C) or c.gate.shape != (B, L, C) or tuple(c.position_bias.shape) != (c.rate, C):
            raise ValueError(f"compressed_attention: {name} expected kv, gate [B, L, C] = {[B, L, C]} and "
                             f"position_bias [rate, C] = {[c.rate, C]}, got {tuple(c.kv.shape)}, "
                             f"{tuple(c.gate.shape)}, {tuple(c.position_bias.shape)}")
        if isinstance(c.rate, bool) or not isinstance(c.rate, int) or c.rate < 1:
            raise ValueError(f"compressed_attention: {name}.rate expected an int >= 1, got {c.rate!r}")
    if index is not None:
        q, w = index.query, index.weights
        if q.dim() != 4 or q.shape[:2] != (B, L) or tuple(w.shape) != (B, L, q.shape[2]):
            raise ValueError(f"compressed_attention: index expected query [B, L, Hi, Di], weights [B, L, Hi] with "
                             f"B={B}, L={L}, got {tuple(q.shape)}, {tuple(w.shape)}")
        if index.keys.rate != compression.rate:
            raise ValueError(f"compressed_attention: the indexer's windows expected the compressor's rate "
                             f"{compression.rate}, got {index.keys.rate}")
        if isinstance(index.topk, bool) or not isinstance(index.topk, int) or index.topk < 1:
            raise ValueError(f"compressed_attention: index.topk expected an int >= 1, got {index.topk!r}")


def _select(index: CompressedIndex, keys: Tensor, b: int, l0: int, l1: int, seen: Tensor, total: int) -> Tensor:
    """bool ``[c, T]``: the entries the indexer keeps for queries ``l0 .. l1 - 1`` of row ``b`` (``seen [c, T]``:
    the complete ones), chosen on a row of the document's ``total`` entries as the model chooses them."""
    c, T = seen.shape
    dt = index.score_dtype
    q = index.query[b, l0:l1].to(dt).unsqueeze(0)  # [1, c, Hi, Di]
    scores = torch.matmul(q, keys.transpose(-1, -2).to(dt).unsqueeze(0).unsqueeze(1))  # [1, c, Hi, T]
    scores = F.relu(scores) * index.scale
    scores = (scores * index.weights[b, l0:l1].to(dt).unsqueeze(0).unsqueeze(-1)).sum(dim=2)[0]  # [c, T]
    row = scores.new_full((c, total), float("-inf"))
    row[:, :T] = scores.masked_fill(~seen, float("-inf"))
    chosen = row.topk(min(index.topk, total), dim=-1).indices  # [c, k]
    keep = torch.zeros(c, total + 1, dtype=torch.bool, device=seen.device)
    keep.scatter_(1, torch.where(chosen < T, chosen, total), True)
    return keep[:, :T] & seen


def compressed_attention(
    query: Tensor,
    kv: Tensor,
    sinks: Tensor,
    *,
    window: int,
    compression: Compression,
    index: CompressedIndex | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    state=None,
) -> Tensor:
    """A compressed-block attention layer per document over this rank's rows: ``out [B, H, L, D]``.

    Args:
        query: ``[B, H, L, D]`` (after its rotary embedding); kv: ``[B, L, D]`` the shared key and value of each
            token (one head); sinks: ``[H]`` per-head sink logits (in the softmax, no value).
        window: tokens of the sliding window (a query sees keys ``i - window < j <= i`` of its document).
        compression: the compressor's inputs (:class:`Compression`, width ``D``).
        index: the indexer (:class:`CompressedIndex`): only its top-k entries are seen (None: every complete one).
        scale: softmax scale (default ``D ** -0.5``). dropout_p: dropout on the attention probabilities.
        state: the step (default: the active one).

    Padding rows are exactly 0; projections at padding positions get no gradient. Raises ``ValueError`` (the same
    on every rank, before any collective) on inputs of the wrong shape.
    """
    state = active_state(state, query, "compressed_attention")
    L = state.local_len
    _check(query, kv, sinks, window, compression, index, L)
    B, H, _, D = query.shape
    scale = D ** -0.5 if scale is None else float(scale)
    wp = state.agreed_window_plan(-1)
    state.attention_calls += 1
    state.attention_kinds.add((window - 1, -1, True, None))
    c = compression
    parts = [kv.reshape(B * L, D), c.kv.reshape(B * L, -1), c.gate.reshape(B * L, -1)]
    if index is not None:  # the indexer's inputs travel in the same message, detached
        parts += [index.keys.kv.detach().reshape(B * L, -1).to(kv.dtype), index.keys.gate.detach().reshape(B * L, -1).to(kv.dtype)]
    widths = [p.shape[1] for p in parts]
    buf = state.exchange(torch.cat(parts, dim=1), wp)
    cols = buf.split(widths, dim=1)
    pieces = state.mixer_plan(("dsa", _pieces), lambda: _pieces(state, wp))
    out = query.new_zeros(B, L, H, D)
    m = c.rate
    pooled = False  # whether an entry was made here: the position bias and finish's weights are then in the graph
    for p in pieces:
        n = p.offset + p.length
        kv_p = cols[0][p.key_rows]  # [n, D]
        entries = pool_windows(cols[1][p.key_rows], cols[2][p.key_rows], c)  # [T, D]
        T = entries.shape[0]
        pooled = pooled or T > 0
        index_keys = None
        if index is not None and T > 0:
            with torch.no_grad():
                index_keys = pool_windows(cols[3][p.key_rows].to(index.keys.kv.dtype),
                                          cols[4][p.key_rows].to(index.keys.gate.dtype), index.keys)
        chunk = max(1, SCORE_BUDGET // max(H * (window + T + 1), 1))
        for c0 in range(0, p.length, chunk):
            c1 = min(p.length, c0 + chunk)
            l0, l1 = p.local_start + c0, p.local_start + c1
            i = p.offset + c0 + torch.arange(c1 - c0, device=query.device).unsqueeze(1)  # [c, 1]
            j0 = max(0, p.offset + c0 - window + 1)
            j = torch.arange(j0, p.offset + c1, device=query.device)
            near = (j <= i) & (j > i - window)  # [c, n_win]
            seen = torch.arange(T, device=query.device) < (i + 1) // m  # [c, T]
            if index is not None and T > 0:
                with torch.no_grad():
                    seen = _select(index, index_keys, p.row, l0, l1, seen, p.doc_len // m)
            keys = torch.cat([kv_p[j0 : p.offset + c1], entries])  # [n_win + T, D]
            mask = torch.cat([near, seen], dim=1)
            q = query[p.row, :, l0:l1]  # [H, c, D]
            logits = torch.matmul(q, keys.transpose(0, 1)) * scale  # [H, c, n_win + T]
            logits = logits.masked_fill(~mask, float("-inf"))
            sink = sinks.to(logits.dtype).reshape(H, 1, 1).expand(H, c1 - c0, 1)
            logits = torch.cat([logits, sink], dim=-1)
            logits = logits - logits.max(dim=-1, keepdim=True).values
            probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
            probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0).to(keys.dtype)
            out[p.row, l0:l1] = torch.matmul(probs, keys).transpose(0, 1)
    # the exchange, the inputs and the compressor stay in the graph on a rank whose rows use none of them (padding
    # only; documents without a complete window): the exchange's backward collective runs on every rank, and the
    # position bias and the weights of ``finish`` get their (zero) gradient there, as a data-parallel reduction over
    # the ranks needs
    unused = graph_zero(buf, query, sinks)
    if not pooled:
        width = c.kv.shape[-1] // 2 if c.overlap else c.kv.shape[-1]
        no_entry = c.finish(buf.new_zeros((1, 0, width)), torch.zeros(1, 0, dtype=torch.int64, device=buf.device))
        unused = unused + graph_zero(c.position_bias, no_entry)
    out = out + unused.to(out.dtype)
    bind(out, (query, kv), state)
    return out.transpose(1, 2)
