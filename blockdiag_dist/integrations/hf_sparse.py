"""Hugging Face transformers' DeepSeek Sparse Attention layers (DeepSeek-V3.2, GLM-5) per document under CP.

The installer of the ``dsa`` mixer family (:data:`blockdiag_dist.families.FAMILIES` names the classes it installs
on; nothing of transformers is imported here): the first time a step meets one of :data:`DSA_CLASSES`, the guard
installs a forward on the class that, **under a step**, computes the layer per document across CP ranks through
:func:`blockdiag_dist.sparse.dsa_attention`, and **outside a step** calls the class's own forward, unchanged.

The stock layer reads the documents from the 4-D mask transformers builds for its own attention names
(``attention_mask[:, 0]`` for the indexer); under ``register_transformers_attention()`` that mask is ``None``, and
the documents come from the step instead. Everything else is the stock code's math, op for op: the MLA
projections and norms, the interleaved rotary embedding of the attention, the indexer's projections, its
``k_norm``, its rotary embedding (half-split for DeepSeek-V3.2, interleaved for GLM-5) and its float32 scores
(``q.float() @ k.float()``, ``relu``, ``weights_proj(...).float() * Hi ** -0.5``), ``torch.topk`` of
``min(index_topk, n)`` per query over its document's ``n`` keys, and SDPA over the selected keys with the layer's
``scaling`` (yarn's mscale included). The indexer runs under ``no_grad`` as in the stock layer (transformers
trains no indexer loss: its weights get no gradient, here as there).

| class | model types | top-k |
| --- | --- | --- |
| ``DeepseekV32Attention`` | ``deepseek_v32`` | every layer's own indexer |
| ``GlmMoeDsaAttention`` | ``glm_moe_dsa`` (GLM-5) | ``"full"`` layers their own; ``"shared"`` layers reuse the previous full layer's |

Under a step the layer takes no cache (``use_cache=False`` in training) and no ``attention_mask`` (build the model
with ``attn_implementation=register_transformers_attention()``); either raises ``ValueError`` on every rank
before any collective.

Shape legend: B rows, L rows of this rank, H heads, Hi indexer heads, R kv_lora_rank, Dr rotary head dim.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch import Tensor, nn

from ..sparse import DsaIndex, dsa_attention

__all__ = ["DSA_CLASSES", "install_dsa"]

# attention class -> (its indexer's rotary function in the class's modeling module, whether it returns its top-k)
DSA_CLASSES: dict[str, tuple[str, bool]] = {
    "DeepseekV32Attention": ("apply_rotary_pos_emb", False),
    "GlmMoeDsaAttention": ("apply_rotary_pos_emb_interleave", True),
}


def _refuse(self: nn.Module, cache: Any, attention_mask: Any) -> None:
    what = f"{type(self).__name__} (layer {getattr(self, 'layer_idx', '?')})"
    if cache is not None:
        raise ValueError(f"{what}: expected no cache under a CP step (use_cache=False in training), got {type(cache).__name__}")
    if attention_mask is not None:
        got = f"a tensor of shape {tuple(attention_mask.shape)}" if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise ValueError(
            f"{what}: expected no attention_mask under a CP step (the documents come from the step; build the model "
            f"with attn_implementation=register_transformers_attention()), got {got}"
        )


def _indexer_inputs(indexer: nn.Module, rotary, hidden: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor) -> DsaIndex:
    """The stock indexer's forward up to its scores: queries, keys and weights of this rank's rows."""
    B, L, _ = hidden.shape
    with torch.no_grad():
        q = indexer.wq_b(q_resid).view(B, L, indexer.n_heads, indexer.head_dim)
        q_rot, q_pass = torch.split(q, [indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim], dim=-1)
        k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim], dim=-1)
        q_rot, k_rot = rotary(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1)
        k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
        w = indexer.weights_proj(hidden.to(indexer.weights_proj.weight.dtype)).float() * (indexer.n_heads ** -0.5)
    return DsaIndex(query=q, key=k, weights=w, scale=indexer.softmax_scale)


def _per_document_forward(self: nn.Module, state, hidden_states: Tensor, position_embeddings, prev_topk_indices,
                          *, rotary_name: str) -> tuple[Tensor, Tensor]:
    """The layer under ``state``: ``(attn_output [B, L, E], selection [B, L, K])``."""
    modeling = sys.modules[type(self).__module__]
    B, L = hidden_states.shape[:-1]
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
    q_states = self.q_b_proj(q_resid).view(B, L, -1, self.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    kv_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    k_pass = self.kv_a_layernorm(kv_pass)
    cos, sin = position_embeddings
    q_rot, k_rot = modeling.apply_rotary_pos_emb_interleave(q_rot, k_rot.view(B, 1, L, self.qk_rope_head_dim), cos, sin)
    query = torch.cat((q_pass, q_rot), dim=-1)
    latent = torch.cat((k_pass, k_rot.view(B, L, self.qk_rope_head_dim)), dim=-1)  # [B, L, R + Dr]
    R = self.kv_lora_rank

    def expand(rows: Tensor) -> tuple[Tensor, Tensor]:
        n = rows.shape[0]
        key, value = self.expand_kv(rows[:, :R].reshape(1, 1, n, R), rows[:, R:].reshape(1, 1, n, -1))
        return key[0].transpose(0, 1), value[0].transpose(0, 1)  # [n, H, D], [n, H, Dv]

    indexer = getattr(self, "indexer", None)
    if indexer is not None:
        index = _indexer_inputs(indexer, getattr(modeling, rotary_name), hidden_states, q_resid, cos, sin)
        topk, selection = indexer.index_topk, None
    else:
        if prev_topk_indices is None:
            raise ValueError(f"{type(self).__name__} (layer {self.layer_idx}): a shared DSA layer expected the top-k of "
                             "a previous full indexer layer, got none")
        index, topk, selection = None, self.config.index_topk, prev_topk_indices
    out, sel = dsa_attention(query, latent, expand, topk=topk, index=index, selection=selection, scale=self.scaling,
                             dropout_p=self.attention_dropout if self.training else 0.0, state=state)
    return self.o_proj(out.transpose(1, 2).reshape(B, L, -1)), sel


def install_dsa(cls: type) -> str:
    """Give ``cls`` (a class of :data:`DSA_CLASSES`) a forward that is per document under a CP step and the class's
    own outside one; returns how (for the guard's notes)."""
    if cls.__name__ not in DSA_CLASSES:
        raise ValueError(f"install_dsa: expected one of {sorted(DSA_CLASSES)}, got {cls.__name__}")
    stock = cls.forward
    if getattr(stock, "_blockdiag_stock", None) is not None:
        return stock._blockdiag_how
    rotary_name, returns_topk = DSA_CLASSES[cls.__name__]
    per_document = functools.partial(_per_document_forward, rotary_name=rotary_name)
    how = ("the indexer's top-k over each query's own document prefix and MLA over the selected keys, indexer keys "
           "and latents of earlier ranks exchanged needed-only (blockdiag_dist.sparse.dsa_attention)")

    @functools.wraps(stock)
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, position_ids=None,
                prev_topk_indices=None, **kwargs):
        from ..runtime import _step_of_call

        state = _step_of_call(hidden_states) if torch.is_tensor(hidden_states) else None
        if state is None:
            extra = {"prev_topk_indices": prev_topk_indices} if returns_topk else {}
            return stock(self, hidden_states, position_embeddings, attention_mask, cache=cache,
                         position_ids=position_ids, **extra, **kwargs)
        _refuse(self, kwargs.get("past_key_values", cache), attention_mask)
        out, sel = per_document(self, state, hidden_states, position_embeddings, prev_topk_indices)
        return (out, None, sel) if returns_topk else (out, None)

    forward._blockdiag_stock = stock
    forward._blockdiag_how = how
    cls.forward = forward
    return how

