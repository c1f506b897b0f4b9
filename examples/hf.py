"""Tiny Hugging Face causal LMs (random weights, no download) trained with block-diagonal CP through
transformers' attention registry. Needs the ``hf`` extra (transformers).

The model gets ``position_ids`` and no ``labels``: transformers models shift labels inside their loss, which is
wrong on a CP shard; the loop computes the loss from the logits with the collator's pre-shifted labels.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from blockdiag_dist.integrations import register_transformers_attention

from .training import DTYPES, TrainConfig

__all__ = ["FAMILIES", "build_tiny_hf", "hf_forward"]

FAMILIES = ("llama", "qwen2-sliding")  # qwen2-sliding: layer 0 full attention, layer 1 a sliding window of 8


def _config(cfg: TrainConfig, family: str):
    from transformers import LlamaConfig, Qwen2Config

    m = cfg.model
    shape = dict(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden,
        intermediate_size=m.mlp_hidden,
        num_hidden_layers=m.layers,
        num_attention_heads=m.heads,
        num_key_value_heads=m.kv_heads,
        rms_norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        max_position_embeddings=4 * cfg.seq_len,
        tie_word_embeddings=False,
    )
    if family == "llama":
        return LlamaConfig(**shape)
    if family == "qwen2-sliding":
        layer_types = ["full_attention" if i % 2 == 0 else "sliding_attention" for i in range(m.layers)]
        return Qwen2Config(**shape, use_sliding_window=True, sliding_window=8, layer_types=layer_types)
    raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")


def build_tiny_hf(cfg: TrainConfig, family: str = "llama", attn_implementation: str | None = None) -> nn.Module:
    """An ``AutoModelForCausalLM`` of ``family`` shaped by ``cfg.model``, in ``cfg.dtype``, initialised from
    ``cfg.seed``, with ``cfg.checkpointing`` as transformers' gradient checkpointing. ``attn_implementation``
    defaults to blockdiag's (registered here); ``"sdpa"`` gives transformers' own, which finds the packed
    documents from ``position_ids`` when given the whole, unsharded batch."""
    from transformers import AutoModelForCausalLM

    config = _config(cfg, family)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation or register_transformers_attention()
    ).to(DTYPES[cfg.dtype])
    if cfg.checkpointing is not None:  # activation_checkpointing_enable since transformers 5.x
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": cfg.checkpointing == "reentrant"})
    return model.train()


def hf_forward(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Logits ``[B, L, V]`` of this rank's shard: per-document positions in, no labels, no cache."""
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
