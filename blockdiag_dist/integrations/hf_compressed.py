"""Hugging Face transformers' DeepSeek-V4 attention (``DeepseekV4Attention``) per document under CP.

The installer of the ``compressed`` mixer family (:data:`blockdiag_dist.families.FAMILIES`; nothing of
transformers is imported here): the first time a step meets the class, the guard installs a forward that,
**under a step**, computes a layer with a compressor (``compressed_sparse_attention``: CSA, overlapping windows
of 4 and an indexer; ``heavily_compressed_attention``: HCA, windows of 128) per document across CP ranks through
:func:`blockdiag_dist.compressed.compressed_attention`, and calls the class's own forward otherwise: outside a
step, and for the ``sliding_attention`` layers (no compressor: the stock code calls the registered attention with
the layer's ``sliding_window`` and its sinks, both carried per document).

Everything else is the stock code's math: the low-rank queries and their unweighted norm, the shared key/value
and its norm, the interleaved rotary embedding (and its inverse on the output), the compressors' projections,
norms and rotary embeddings at the windows' first positions, the indexer's queries, weights and float32 scores,
the sinks, and the grouped output projection. What changes is where the windows start (each document's first
token, as when the document runs alone) and which entries a query sees (its own document's). The stock layer takes
its gate softmax and its indexer's scores in float32 whatever the model's dtype; here in float32 too, or in the
model's dtype where it is wider (float64: exact, the truth a float64 check compares with).

Under a step the layer takes no cache (``use_cache=False`` in training) and no ``attention_mask`` (build the
model with ``attn_implementation=register_transformers_attention()``); either raises ``ValueError`` on every rank
before any collective.

Shape legend: B rows, L rows of this rank, H heads, D head dim, Hi / Di indexer heads / head dim, T entries.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..compressed import CompressedIndex, Compression, compressed_attention
from .hf_sparse import _refuse

__all__ = ["COMPRESSED_CLASSES", "install_compressed"]

COMPRESSED_CLASSES = ("DeepseekV4Attention",)


def _finish(compressor: nn.Module, rotary) -> Callable[[Tensor, Tensor], Tensor]:
    """The compressor's norm and rotary embedding of pooled entries ``[1, T, D]`` at ``positions [1, T]``."""

    def finish(pooled: Tensor, positions: Tensor) -> Tensor:
        entries = compressor.kv_norm(pooled)
        cos, sin = compressor.rotary_emb(entries, position_ids=positions, layer_type=compressor.rope_layer_type)
        return rotary(entries.unsqueeze(1), cos, sin).squeeze(1)

    return finish


def _wide(dtype: torch.dtype) -> torch.dtype:
    """float32, or the model's dtype where wider: the stock layer's float32 softmax and scores, exact in float64."""
    return torch.promote_types(torch.float32, dtype)


def _compression(compressor: nn.Module, rotary, hidden: Tensor, width: int) -> Compression:
    return Compression(kv=compressor.kv_proj(hidden), gate=compressor.gate_proj(hidden), rate=compressor.compress_rate,
                       overlap=compressor.kv_proj.out_features == 2 * width, position_bias=compressor.position_bias,
                       finish=_finish(compressor, rotary), pool_dtype=_wide(hidden.dtype))


def _index(indexer: nn.Module, rotary, hidden: Tensor, q_resid: Tensor, position_ids: Tensor) -> CompressedIndex:
    """The stock indexer's inputs: its rotated queries, float32 weights and its own compressor's projections."""
    B, L, _ = hidden.shape
    with torch.no_grad():
        cos, sin = indexer.rotary_emb(hidden, position_ids=position_ids, layer_type=indexer.rope_layer_type)
        q = indexer.q_b_proj(q_resid).view(B, L, -1, indexer.head_dim).transpose(1, 2)
        q = rotary(q, cos, sin).transpose(1, 2)  # [B, L, Hi, Di]
        weights = indexer.scorer.weights_proj(hidden).float() * indexer.scorer.weights_scaling
        keys = _compression(indexer, rotary, hidden, indexer.head_dim)
    return CompressedIndex(query=q, weights=weights, scale=indexer.scorer.softmax_scale, topk=indexer.index_topk,
                           keys=keys, score_dtype=_wide(hidden.dtype))


def _per_document_forward(self: nn.Module, state, hidden_states: Tensor, position_embeddings, position_ids: Tensor) -> Tensor:
    """A compressed layer under ``state``: its output ``[B, L, E]``."""
    rotary = sys.modules[type(self).__module__].apply_rotary_pos_emb
    B, L = hidden_states.shape[:-1]
    cos, sin = position_embeddings[self.rope_layer_type]
    q_resid = self.q_a_norm(self.q_a_proj(hidden_states))
    q = self.q_b_norm(self.q_b_proj(q_resid).view(B, L, -1, self.head_dim).transpose(1, 2))
    q = rotary(q, cos, sin)  # [B, H, L, D]
    kv = self.kv_norm(self.kv_proj(hidden_states)).view(B, L, -1, self.head_dim).transpose(1, 2)
    kv = rotary(kv, cos, sin)[:, 0]  # [B, L, D]
    comp = self.compressor
    indexer = getattr(comp, "indexer", None)
    index = None if indexer is None else _index(indexer, rotary, hidden_states, q_resid, position_ids)
    out = compressed_attention(q, kv, self.sinks, window=self.sliding_window,
                               compression=_compression(comp, rotary, hidden_states, self.head_dim), index=index,
                               scale=self.scaling, dropout_p=self.attention_dropout if self.training else 0.0,
                               state=state)  # [B, H, L, D]
    out = rotary(out, cos, -sin).transpose(1, 2)  # the inverse rotation of the values' rotary slice: [B, L, H, D]
    grouped = self.o_a_proj(out.reshape(B, L, self.config.o_groups, -1)).flatten(2)
    return self.o_b_proj(grouped)


def install_compressed(cls: type) -> str:
    """Give ``cls`` (``DeepseekV4Attention``) a forward that is per document under a CP step for its layers with a
    compressor, and the class's own otherwise; returns how (for the guard's notes)."""
    if cls.__name__ not in COMPRESSED_CLASSES:
        raise ValueError(f"install_compressed: expected one of {list(COMPRESSED_CLASSES)}, got {cls.__name__}")
    stock = cls.forward
    if getattr(stock, "_blockdiag_stock", None) is not None:
        return stock._blockdiag_how
    how = ("compression windows aligned to each document's first token, each query's sliding window, compressed "
           "entries and indexer top-k over its own document, projections of earlier ranks exchanged needed-only "
           "(blockdiag_dist.compressed.compressed_attention)")

    @functools.wraps(stock)
    def forward(self, hidden_states, position_embeddings=None, position_ids=None, attention_mask=None, cache=None,
                **kwargs):
        from ..runtime import _step_of_call

        state = _step_of_call(hidden_states) if torch.is_tensor(hidden_states) else None
        if state is None or self.compressor is None:  # sliding layers: the registered attention, per document
            return stock(self, hidden_states, position_embeddings, position_ids, attention_mask, cache=cache, **kwargs)
        _refuse(self, kwargs.get("past_key_values", cache), attention_mask)
        return _per_document_forward(self, state, hidden_states, position_embeddings, position_ids), None

    forward._blockdiag_stock = stock
    forward._blockdiag_how = how
    cls.forward = forward
    return how
