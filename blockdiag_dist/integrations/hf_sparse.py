"""Hugging Face transformers' DeepSeek Sparse Attention layers per document under CP: DeepSeek-V3.2, GLM-5,
A.X-K2, HY-V4 (and its vision-language twin) and Mistral Large 4.

The installer of the ``dsa`` mixer family (:data:`blockdiag_dist.families.FAMILIES` names the classes it installs
on; nothing of transformers is imported here): the first time a step meets one of :data:`DSA_CLASSES`, the guard
installs a forward on the class that, **under a step**, computes the layer per document across CP ranks through
:func:`blockdiag_dist.sparse.dsa_attention`, and **outside a step** calls the class's own forward, unchanged.

The stock layers read the documents from the 4-D mask transformers builds for its own attention names
(``attention_mask[:, 0]`` for the indexer); under ``register_transformers_attention()`` that mask is ``None``, and
the documents come from the step instead. Everything else is the stock code's math, op for op. The layers share
one shape (DeepSeek-V3.2's): MLA queries, a latent ``kv_a_layernorm(kv) | rotated shared key`` expanded by
``kv_b_proj``, an indexer scoring ``sum_h w_h relu(q_h . k * scale)`` in float32 (``k_norm``'d keys, weights
``weights_proj(...).float() * Hi ** -0.5``), ``torch.topk`` of ``min(index_topk, n)`` per query over its
document's ``n`` keys, attention over the selected keys with the layer's ``scaling`` (yarn's mscale included).
Each class's differences from that shape are one row of :data:`DSA_CLASSES` (a :class:`DsaLayer`):

| class | model types | differences |
| --- | --- | --- |
| ``DeepseekV32Attention`` | ``deepseek_v32`` | none (interleaved MLA rotary, half-split indexer rotary) |
| ``GlmMoeDsaAttention`` | ``glm_moe_dsa`` | interleaved indexer rotary; ``"shared"`` layers reuse the previous full layer's top-k |
| ``AXK2Attention`` | ``axk2`` | queries and an output gate from one projection of ``q_resid | q_a_proj(x)``; ``sigmoid(gate)`` in float32 |
| ``HYV4Attention``, ``HYV4VLAttention`` | ``hy_v4``, ``hy_v4_vl`` | half-split MLA rotary; per-head sinks; an output gate ``sigmoid(gate_proj(x))``; the indexer's rotary channels last, its scale on the head weights after the ``relu``, its ``k_norm`` in float32; shared layers |
| ``MistralLarge4TextAttention`` | ``mistral_large4`` | queries ``q_proj(x)`` scaled per position (``scale * log(pos + 1) + bias``), as the indexer's (from ``q_input_norm(x)``); NoPE layers (no rotary in the layer nor its indexer); KV sharing (a layer reuses an earlier layer's latent); shared layers |

The indexer runs under ``no_grad`` as in the stock layers (transformers trains no indexer loss: its weights get no
gradient, here as there).

Under a step the layer takes no cache (``use_cache=False`` in training) and no ``attention_mask`` (build the model
with ``attn_implementation=register_transformers_attention()``); either raises ``ValueError`` on every rank
before any collective.

Shape legend: B rows, L rows of this rank, H heads, Dqk / Dv head dims, Hi indexer heads, Di indexer head dim,
R kv_lora_rank, Dr rotary head dim.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..sparse import DsaIndex, dsa_attention

__all__ = ["DSA_CLASSES", "DsaLayer", "install_dsa"]


# ---- queries: (layer, hidden [B, L, E], position_ids) -> (query [B, H, L, Dqk], q_resid or None, gate or None) --
def _lora_queries(self: nn.Module, hidden: Tensor, position_ids) -> tuple[Tensor, Tensor, None]:
    """DeepSeek-V3.2's: ``q_b_proj(q_a_layernorm(q_a_proj(x)))``."""
    B, L = hidden.shape[:-1]
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
    return self.q_b_proj(q_resid).view(B, L, -1, self.qk_head_dim).transpose(1, 2), q_resid, None


def _lora_queries_gate_proj(self: nn.Module, hidden: Tensor, position_ids) -> tuple[Tensor, Tensor, Tensor]:
    """HY-V4's: DeepSeek-V3.2's queries and a gate ``gate_proj(x)`` ``[B, L, H, Dv]``."""
    B, L = hidden.shape[:-1]
    gate = self.gate_proj(hidden).view(B, L, -1, self.gate_projection_size)
    query, q_resid, _ = _lora_queries(self, hidden, position_ids)
    return query, q_resid, gate


def _fused_query_gate(self: nn.Module, hidden: Tensor, position_ids) -> tuple[Tensor, Tensor, Tensor]:
    """A.X-K2's: queries and gate from one projection of ``q_resid | q_a_proj(x)``; gate ``[B, L, H * Dv]``."""
    B, L = hidden.shape[:-1]
    q_compressed = self.q_a_proj(hidden)
    q_resid = self.q_a_layernorm(q_compressed)
    both = self.q_gate_proj(torch.cat([q_resid, q_compressed], dim=-1)).view(B, L, -1, self.qk_head_dim + self.v_head_dim)
    query, gate = torch.split(both, [self.qk_head_dim, self.v_head_dim], dim=-1)
    return query.transpose(1, 2), q_resid, gate.reshape(B, L, -1)


def _direct_queries(self: nn.Module, hidden: Tensor, position_ids) -> tuple[Tensor, None, None]:
    """Mistral Large 4's: ``q_proj(x)`` (no LoRA); scaled per position after the rotary (``query_scaling``)."""
    B, L = hidden.shape[:-1]
    return self.q_proj(hidden).view(B, L, -1, self.qk_head_dim).transpose(1, 2), None, None


# ---- output gates: (attention output [B, L, H, Dv], gate) -> [B, L, H * Dv] ------------------------------------
def _gate_float32(out: Tensor, gate: Tensor) -> Tensor:
    """A.X-K2's: ``sigmoid`` of the gate in float32, the product back in the output's dtype."""
    out = out.reshape(*out.shape[:2], -1)
    return (out * torch.sigmoid(gate.float())).to(out.dtype)


def _gate_per_head(out: Tensor, gate: Tensor) -> Tensor:
    """HY-V4's: ``out * sigmoid(gate)`` per head, in the model's dtype."""
    return (out * torch.sigmoid(gate)).reshape(*out.shape[:2], -1)


# ---- indexer queries: (indexer, hidden, q_resid, position_ids) -> [B, L, Hi, Di] before the rotary ----------------
def _index_query_lora(indexer: nn.Module, hidden: Tensor, q_resid: Tensor, position_ids) -> Tensor:
    """DeepSeek-V3.2's: ``wq_b(q_resid)``."""
    return indexer.wq_b(q_resid).view(*hidden.shape[:2], indexer.n_heads, indexer.head_dim)


def _index_query_scaled(indexer: nn.Module, hidden: Tensor, q_resid, position_ids) -> Tensor:
    """Mistral Large 4's: ``wq_b(q_input_norm(x))`` scaled per position (its own ``softmax_scaling``)."""
    q = indexer.wq_b(indexer.q_input_norm(hidden)).view(*hidden.shape[:2], indexer.n_heads, indexer.head_dim)
    return indexer.softmax_scaling(q, position_ids, head_dim_first=False)


@dataclass(frozen=True)
class DsaLayer:
    """How one attention class differs from DeepSeek-V3.2's (the defaults).

    - ``rotary`` / ``index_rotary``: the rotary function of the MLA attention / of the indexer, by name in the
      class's modeling module (``apply_rotary_pos_emb_interleave``: interleaved pairs; ``apply_rotary_pos_emb``:
      half-split);
    - ``index_rope_last``: the indexer's rotated channels are the last ``qk_rope_head_dim`` of its head (HY-V4),
      not the first;
    - ``index_scale_on_weights``: the indexer's softmax scale multiplies the head weights after the ``relu``
      (HY-V4: ``relu(q . k) * (w * Hi ** -0.5 * scale)``), not the scores before it;
    - ``queries`` / ``index_query``: the attention's queries (and ``q_resid``, and an output gate) / the indexer's;
    - ``query_scaling``: the queries are scaled per position by the layer's ``softmax_scaling`` after the rotary
      (Mistral Large 4);
    - ``gate``: how the output gate applies (None: no gate); ``sinks``: the layer's ``sinks`` ``[H]`` join each
      softmax denominator;
    - ``returns_topk``: the forward returns ``(out, weights, top-k)`` (layers with shared indexers).

    Attributes a layer holds decide the rest: a layer without an ``indexer`` reuses the previous full layer's
    top-k; ``use_rope`` False (Mistral Large 4's NoPE layers) drops the rotary of the layer and of its indexer;
    ``is_kv_shared_layer`` / ``store_full_length_kv`` read / write the latent of KV sharing (Mistral Large 4).
    """

    rotary: str = "apply_rotary_pos_emb_interleave"
    index_rotary: str = "apply_rotary_pos_emb"
    index_rope_last: bool = False
    index_scale_on_weights: bool = False
    queries: Callable = _lora_queries
    index_query: Callable = _index_query_lora
    query_scaling: bool = False
    gate: Callable | None = None
    sinks: bool = False
    returns_topk: bool = False


_HY_V4 = DsaLayer(rotary="apply_rotary_pos_emb", index_rope_last=True, index_scale_on_weights=True,
                  queries=_lora_queries_gate_proj, gate=_gate_per_head, sinks=True, returns_topk=True)

DSA_CLASSES: dict[str, DsaLayer] = {
    "DeepseekV32Attention": DsaLayer(),
    "GlmMoeDsaAttention": DsaLayer(index_rotary="apply_rotary_pos_emb_interleave", returns_topk=True),
    "AXK2Attention": DsaLayer(queries=_fused_query_gate, gate=_gate_float32),
    "HYV4Attention": _HY_V4,
    "HYV4VLAttention": _HY_V4,
    "MistralLarge4TextAttention": DsaLayer(index_rotary="apply_rotary_pos_emb_interleave", queries=_direct_queries,
                                           index_query=_index_query_scaled, query_scaling=True, returns_topk=True),
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


def _rope_split(x: Tensor, rope: int, last: bool) -> tuple[Tensor, Tensor]:
    """``(rotated part, passed part)`` of the last axis: the first ``rope`` channels, or the last (``last``)."""
    if last:
        passed, rot = torch.split(x, [x.shape[-1] - rope, rope], dim=-1)
        return rot, passed
    return tuple(torch.split(x, [rope, x.shape[-1] - rope], dim=-1))


def _indexer_inputs(indexer: nn.Module, row: DsaLayer, modeling, hidden: Tensor, q_resid: Tensor | None,
                    cos: Tensor, sin: Tensor, position_ids) -> DsaIndex:
    """The stock indexer's forward up to its scores: queries, keys and weights of this rank's rows."""
    with torch.no_grad():
        q = row.index_query(indexer, hidden, q_resid, position_ids)  # [B, L, Hi, Di]
        k = indexer.k_norm(indexer.wk(hidden).to(indexer.k_norm.weight.dtype)).to(hidden.dtype).unsqueeze(2)
        if getattr(indexer, "use_rope", True):
            rope, last = indexer.qk_rope_head_dim, row.index_rope_last
            q_rot, q_pass = _rope_split(q, rope, last)
            k_rot, k_pass = _rope_split(k, rope, last)
            q_rot, k_rot = getattr(modeling, row.index_rotary)(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
            q = torch.cat([q_pass, q_rot] if last else [q_rot, q_pass], dim=-1)
            k = torch.cat([k_pass, k_rot] if last else [k_rot, k_pass], dim=-1)
        w = indexer.weights_proj(hidden.to(indexer.weights_proj.weight.dtype)).float() * (indexer.n_heads ** -0.5)
        if row.index_scale_on_weights:  # relu(q . k * 1.0) is relu(q . k) exactly
            w, scale = w * indexer.softmax_scale, 1.0
        else:
            scale = indexer.softmax_scale
    return DsaIndex(query=q, key=k.squeeze(2), weights=w, scale=scale)


def _latent(self: nn.Module, hidden: Tensor, shared_kv_states) -> tuple[Tensor, Tensor, bool]:
    """``(k_pass [B, 1, L, R], k_rot [B, 1, L, Dr], already rotated)``: the layer's own, or (KV sharing) the
    source layer's, rotated there."""
    B, L = hidden.shape[:-1]
    if getattr(self, "is_kv_shared_layer", False):
        k_pass, k_rot = shared_kv_states["rope" if self.use_rope else "nope"]
        return k_pass, k_rot, True
    kv_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    k_pass = self.kv_a_layernorm(kv_pass).view(B, 1, L, self.kv_lora_rank)
    return k_pass, k_rot.view(B, 1, L, self.qk_rope_head_dim), False


def _per_document_forward(self: nn.Module, row: DsaLayer, state, hidden_states: Tensor, position_embeddings,
                          position_ids, prev_topk_indices, shared_kv_states) -> tuple[Tensor, Tensor]:
    """The layer under ``state``: ``(attn_output [B, L, E], selection [B, L, K])``."""
    modeling = sys.modules[type(self).__module__]
    B, L = hidden_states.shape[:-1]
    R, Dr = self.kv_lora_rank, self.qk_rope_head_dim
    q_states, q_resid, gate = row.queries(self, hidden_states, position_ids)
    q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, Dr], dim=-1)
    k_pass, k_rot, rotated = _latent(self, hidden_states, shared_kv_states)
    cos, sin = position_embeddings
    if getattr(self, "use_rope", True):
        rotary = getattr(modeling, row.rotary)
        if rotated:  # the keys were rotated by the layer that stored them: only the queries turn here
            q_rot = rotary(q_rot, k_rot, cos, sin)[0]
        else:
            q_rot, k_rot = rotary(q_rot, k_rot, cos, sin)
    if getattr(self, "store_full_length_kv", False):
        shared_kv_states["rope" if self.use_rope else "nope"] = (k_pass, k_rot)
    query = torch.cat((q_pass, q_rot), dim=-1)
    if row.query_scaling:
        query = self.softmax_scaling(query, position_ids, head_dim_first=True)
    latent = torch.cat((k_pass.view(B, L, R), k_rot.reshape(B, L, Dr)), dim=-1)  # [B, L, R + Dr]

    def expand(rows: Tensor) -> tuple[Tensor, Tensor]:
        n = rows.shape[0]
        key, value = self.expand_kv(rows[:, :R].reshape(1, 1, n, R), rows[:, R:].reshape(1, 1, n, Dr))
        return key[0].transpose(0, 1), value[0].transpose(0, 1)  # [n, H, Dqk], [n, H, Dv]

    indexer = getattr(self, "indexer", None)
    if indexer is not None:
        index = _indexer_inputs(indexer, row, modeling, hidden_states, q_resid, cos, sin, position_ids)
        topk, selection = indexer.index_topk, None
    else:
        if prev_topk_indices is None:
            raise ValueError(f"{type(self).__name__} (layer {self.layer_idx}): a shared DSA layer expected the top-k of "
                             "a previous full indexer layer, got none")
        index, topk, selection = None, self.config.index_topk, prev_topk_indices
    out, sel = dsa_attention(query, latent, expand, topk=topk, index=index, selection=selection, scale=self.scaling,
                             dropout_p=self.attention_dropout if self.training else 0.0,
                             sinks=self.sinks if row.sinks else None, state=state)
    out = out.transpose(1, 2)  # [B, L, H, Dv]
    out = out.reshape(B, L, -1) if row.gate is None else row.gate(out, gate)
    return self.o_proj(out), sel


def install_dsa(cls: type) -> str:
    """Give ``cls`` (a class of :data:`DSA_CLASSES`) a forward that is per document under a CP step and the class's
    own outside one; returns how (for the guard's notes)."""
    if cls.__name__ not in DSA_CLASSES:
        raise ValueError(f"install_dsa: expected one of {sorted(DSA_CLASSES)}, got {cls.__name__}")
    stock = cls.forward
    if getattr(stock, "_blockdiag_stock", None) is not None:
        return stock._blockdiag_how
    row = DSA_CLASSES[cls.__name__]
    signature = inspect.signature(stock)
    how = ("the indexer's top-k over each query's own document prefix and MLA over the selected keys, indexer keys "
           "and latents of earlier ranks exchanged needed-only (blockdiag_dist.sparse.dsa_attention)")

    @functools.wraps(stock)
    def forward(self, *args, **kwargs):
        from ..runtime import _step_of_call

        hidden_states = args[0] if args else kwargs.get("hidden_states")
        state = _step_of_call(hidden_states) if torch.is_tensor(hidden_states) else None
        if state is None:
            return stock(self, *args, **kwargs)
        given = signature.bind(self, *args, **kwargs).arguments
        extra = next((given.pop(p.name, {}) for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), {})
        given.update(extra)
        _refuse(self, given.get("cache", given.get("past_key_values")), given.get("attention_mask"))
        out, sel = _per_document_forward(self, row, state, given["hidden_states"], given.get("position_embeddings"),
                                         given.get("position_ids"), given.get("prev_topk_indices"),
                                         given.get("shared_kv_states"))
        return (out, None, sel) if row.returns_topk else (out, None)

    forward._blockdiag_stock = stock
    forward._blockdiag_how = how
    cls.forward = forward
    return how
