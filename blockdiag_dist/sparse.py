"""Indexer-selected sparse attention (DeepSeek Sparse Attention, DSA) per document across CP ranks.

DeepSeek-V3.2's layers (and GLM-5's) score every query against every earlier key with a lightning indexer (its
own small key head), keep the ``topk`` best keys and run their MLA attention over those keys only. Per document
under CP, one rank's query needs the indexer keys and the MLA latents of its document's earlier tokens, wherever
they live: exactly attention's needed set (keys ``[doc_start, query]``), so they travel in the step's attention
exchange for an unbounded window (:meth:`StepState.exchange`: needed-only halo or all-to-all, local at CP 1 or
when documents do not cross ranks), in one message per step and layer: latents and indexer keys side by side.
The exchange is differentiable: the latents' gradients go back to the ranks that own them.

Then per piece of a document this rank holds, and per chunk of its queries (memory bounded: no ``[S, S, heads]``
tensor; a chunk's scores are ``[c, Hi, n]`` for ``n`` keys of its document prefix):

- **selection** (no gradient, as the model's ``@torch.no_grad`` indexer): the scores in float32 as the model
  computes them (``relu(q . k * index_scale)`` weighted per head), on a row of the document's length with later
  keys at ``-inf``, ``torch.topk(min(topk, n_doc))``: the very call the model makes when the document runs alone,
  so its ties are broken as the model breaks them; a query with fewer than ``topk`` earlier keys keeps them all;
- **attention** over the selected keys of the prefix: the latents expanded by the layer's own ``expand`` (MLA's
  ``kv_b_proj``), stock SDPA with the selection as its mask; with ``sinks`` (HY-V4's per-head sink logits, one
  more term in each softmax denominator, with no value) the explicit-score kernel
  (:func:`blockdiag_dist.kernels.explicit.explicit_attention`), which differentiates the sinks too.

Selections are returned as positions inside the document (``[B, L, K]``, ``-1`` = none) so that a layer that
reuses an earlier layer's top-k (GLM-5's ``"shared"`` layers) passes them back as ``selection``.

Shape legend: B rows, L rows of this rank, H heads, D / Dv head dims, Hi / Di indexer heads / head dim, F latent
width, K selected keys, c queries of a chunk, n keys of a document prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .kernels.explicit import explicit_attention, graph_zero
from .mixers._common import active_state, bind
from .state import StepState

__all__ = ["DsaIndex", "SCORE_BUDGET", "dsa_attention"]

SCORE_BUDGET = 1 << 22  # elements of one chunk's score tensor ([c, max(H, Hi), n]); bounds the working memory


@dataclass(frozen=True)
class DsaIndex:
    """The indexer's inputs on this rank: ``query [B, L, Hi, Di]`` and ``key [B, L, Di]`` (after their rotary
    embedding, the model's dtype), ``weights [B, L, Hi]`` (float32, scaled as the model scales them) and
    ``scale`` (the indexer's softmax scale, applied to ``q . k`` before the ``relu``)."""

    query: Tensor
    key: Tensor
    weights: Tensor
    scale: float


@dataclass(frozen=True)
class _Piece:
    row: int
    local_start: int
    length: int
    offset: int  # tokens of its document before it
    doc_len: int
    key_rows: Tensor  # int64 [offset + length] (device): buffer rows of its document's keys doc_start .. end - 1


def _pieces(state: StepState, wp) -> tuple[_Piece, ...]:
    sp = state.plan.shards.padded_len
    out = []
    for p in state.docs.pieces:
        flat = p.row * sp + torch.arange(p.doc_start, p.end)
        rows = wp.key_index[flat]
        assert bool((rows >= 0).all()), f"DSA: keys of document {p.doc} missing from the key buffer"
        out.append(_Piece(p.row, p.local_start, p.length, p.offset, p.doc_end - p.doc_start, rows.to(state.device)))
    return tuple(out)


def _check(query: Tensor, latent: Tensor, index: DsaIndex | None, selection: Tensor | None, topk: int, L: int,
           sinks: Tensor | None = None) -> None:
    if query.dim() != 4 or query.shape[2] != L:
        raise ValueError(f"dsa_attention: query expected [B, H, L, D] with L = {L} (this rank's rows), got {tuple(query.shape)}")
    if sinks is not None and (not isinstance(sinks, Tensor) or sinks.dim() != 1 or sinks.shape[0] != query.shape[1]
                              or not sinks.is_floating_point()):
        got = f"{sinks.dtype} {tuple(sinks.shape)}" if isinstance(sinks, Tensor) else type(sinks).__name__
        raise ValueError(f"dsa_attention: sinks expected a floating-point tensor [H] = [{query.shape[1]}] (one logit "
                         f"per head), got {got}")
    B = query.shape[0]
    if latent.dim() != 3 or latent.shape[:2] != (B, L):
        raise ValueError(f"dsa_attention: latent expected [B, L, F] = [{B}, {L}, F], got {tuple(latent.shape)}")
    if (index is None) == (selection is None):
        raise ValueError("dsa_attention: expected exactly one of index (the indexer's inputs) and selection (an "
                         f"earlier layer's top-k), got {'both' if index is not None else 'neither'}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"dsa_attention: topk expected an int >= 1, got {topk!r}")
    if index is not None:
        q, k, w = index.query, index.key, index.weights
        if q.dim() != 4 or q.shape[:2] != (B, L) or tuple(k.shape) != (B, L, q.shape[-1]) or tuple(w.shape) != (B, L, q.shape[2]):
            raise ValueError(f"dsa_attention: index expected query [B, L, Hi, Di], key [B, L, Di], weights [B, L, Hi] "
                             f"with B={B}, L={L}, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(w.shape)}")
    elif selection.dim() != 3 or selection.shape[:2] != (B, L) or selection.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"dsa_attention: selection expected int [B, L, K] = [{B}, {L}, K] (positions in the document, "
                         f"-1 = none), got {selection.dtype} {tuple(selection.shape)}")


def _select(index: DsaIndex, keys_f32: Tensor, b: int, l0: int, l1: int, first: int, doc_len: int, topk: int) -> Tensor:
    """Top-k of queries ``l0 .. l1 - 1`` of row ``b`` (in-document positions ``first ..``) over the document's keys
    ``keys_f32 [n, Di]`` (float32): int64 ``[c, k]`` positions in the document, ``-1`` where a later key was taken."""
    c, n = l1 - l0, keys_f32.shape[0]
    q = index.query[b, l0:l1].float()  # [c, Hi, Di]
    scores = F.relu(torch.matmul(q, keys_f32.transpose(0, 1)) * index.scale)  # [c, Hi, n]
    scores = torch.matmul(index.weights[b, l0:l1].float().unsqueeze(-2), scores).squeeze(-2)  # [c, n]
    row = scores.new_full((c, doc_len), float("-inf"))
    i = first + torch.arange(c, device=scores.device).unsqueeze(1)
    j = torch.arange(n, device=scores.device)
    row[:, :n] = scores.masked_fill(j > i, float("-inf"))
    chosen = row.topk(min(topk, doc_len), dim=-1).indices
    return torch.where(chosen <= i, chosen, -1)


def dsa_attention(
    query: Tensor,
    latent: Tensor,
    expand: Callable[[Tensor], tuple[Tensor, Tensor]],
    *,
    topk: int,
    index: DsaIndex | None = None,
    selection: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    sinks: Tensor | None = None,
    state: StepState | None = None,
) -> tuple[Tensor, Tensor]:
    """DSA per document over this rank's rows: ``(out [B, H, L, Dv], selection int64 [B, L, K])``.

    Args:
        query: ``[B, H, L, D]`` the attention's queries (differentiable).
        latent: ``[B, L, F]`` what each token's key and value are expanded from (MLA: the normalised latent and
            the rotated shared key, ``F = kv_lora_rank + qk_rope_head_dim``); differentiable, exchanged.
        expand: ``latent rows [n, F] -> (key [n, H, D], value [n, H, Dv])`` (the layer's own projection).
        topk: keys kept per query (``index_topk``).
        index: the indexer's inputs (:class:`DsaIndex`) to select with, or
        selection: ``[B, L, K]`` an earlier layer's selection (GLM-5's shared layers), positions in the document.
        scale: the attention's softmax scale. dropout_p: attention dropout (SDPA's).
        sinks: ``[H]`` per-head sink logits joining each query's softmax denominator with no value
            (``p_j = exp(s_j) / (sum_k exp(s_k) + exp(sinks[h]))``, HY-V4's); differentiable.
        state: the step (default: the active one, :func:`blockdiag_dist.current_state`).

    Padding rows are exactly 0 and their selection ``-1``; latents at padding positions get no gradient.
    Raises ``ValueError`` (the same on every rank, before any collective) on inputs of the wrong shape.
    """
    state = active_state(state, query, "dsa_attention")
    _check(query, latent, index, selection, topk, state.local_len, sinks)
    return _dsa(query, latent, expand, topk, index, selection, scale, dropout_p, state, _pieces, sinks)


def _dsa(query: Tensor, latent: Tensor, expand, topk: int, index: DsaIndex | None, selection: Tensor | None,
         scale: float | None, dropout_p: float, state: StepState, plan_pieces,
         sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`dsa_attention` with the candidates of each piece's queries from ``plan_pieces(state, wp)``."""
    B, H, L, _ = query.shape
    F_lat = latent.shape[-1]
    wp = state.agreed_window_plan(-1)
    state.attention_calls += 1
    state.attention_kinds.add((-1, -1, sinks is not None, None))
    tok = latent.reshape(B * L, F_lat)
    if index is not None:  # one message: latents and (detached) indexer keys side by side
        tok = torch.cat([tok, index.key.detach().reshape(B * L, -1).to(tok.dtype)], dim=1)
    buf = state.exchange(tok, wp)  # [Tk, F (+ Di)]
    pieces = state.mixer_plan(("dsa", plan_pieces), lambda: plan_pieces(state, wp))
    keys_all, values_all = expand(buf[:, :F_lat])  # [Tk, H, D], [Tk, H, Dv]
    index_keys = None if index is None else buf[:, F_lat:].detach().float()
    longest = int(state.docs.doc_spans[:, 2].sub(state.docs.doc_spans[:, 1]).max()) if state.docs.doc_spans.numel() else 1
    longest = max([longest] + [p.doc_len for p in pieces])  # (the candidates' row: its document's, here)
    K = min(topk, longest) if selection is None else selection.shape[-1]
    sel_out = torch.full((B, L, K), -1, dtype=torch.int64, device=query.device)
    out = query.new_zeros(B, L, H, values_all.shape[-1])
    heads = max(H, 1 if index is None else index.query.shape[2])
    for p in pieces:
        n_prefix = p.offset + p.length
        # a chunk's scores [c, heads, n] and its top-k row [c, doc_len] stay within the budget
        chunk = max(1, SCORE_BUDGET // max(heads * n_prefix, p.doc_len))
        # the prefix's keys and values gathered once per piece: every chunk's are views of them (SDPA saves views
        # for backward, not a copy per chunk)
        k_piece = keys_all[p.key_rows].transpose(0, 1)  # [H, n_prefix, D]
        v_piece = values_all[p.key_rows].transpose(0, 1)
        keys_f32 = None if index is None else index_keys[p.key_rows]
        for c0 in range(0, p.length, chunk):
            c1 = min(p.length, c0 + chunk)
            l0, l1 = p.local_start + c0, p.local_start + c1
            n = p.offset + c1  # keys of the document up to the chunk's last query
            i = p.offset + c0 + torch.arange(c1 - c0, device=query.device).unsqueeze(1)
            if index is not None:
                with torch.no_grad():
                    chosen = _select(index, keys_f32[:n], p.row, l0, l1, p.offset + c0, p.doc_len, topk)
                sel_out[p.row, l0:l1, : chosen.shape[1]] = chosen
            else:
                chosen = selection[p.row, l0:l1].long()
                sel_out[p.row, l0:l1] = chosen
            ok = (chosen >= 0) & (chosen <= i)
            mask = _selected_mask(chosen, ok, n)
            q = query[p.row, :, l0:l1]  # [H, c, D]
            k, v = k_piece[:, :n], v_piece[:, :n]  # [H, n, D], [H, n, Dv]
            if sinks is None:
                o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                                   dropout_p=dropout_p, scale=scale)
            else:
                o = explicit_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask, scale=scale, sinks=sinks,
                                       dropout_p=dropout_p)
            out[p.row, l0:l1] = o[0].transpose(0, 1)
    # the exchange, the query, the expanded keys and values and the sinks stay in the graph on a rank whose rows use
    # none of them (padding only): the exchange's backward collective runs on every rank, and the query, the sinks
    # and the weights of ``expand`` get their (zero) gradients on every rank, as a data-parallel reduction over the
    # ranks needs
    out = out + graph_zero(buf, query, keys_all, values_all, sinks).to(out.dtype)
    bind(out, (query, latent) + (() if sinks is None else (sinks,)), state)
    return out.transpose(1, 2), sel_out


def _selected_mask(chosen: Tensor, ok: Tensor, n: int) -> Tensor:
    """bool ``[c, n]``: True at the chosen keys that are seen (``ok``), False elsewhere."""
    mask = torch.zeros(chosen.shape[0], n + 1, dtype=torch.bool, device=chosen.device)
    mask.scatter_(1, torch.where(ok, chosen, n), True)  # not seen -> a spare column
    return mask[:, :n]

