"""Hugging Face transformers: block-diagonal CP as an attention implementation.

    from blockdiag_dist.integrations import register_transformers_attention
    name = register_transformers_attention()                      # "blockdiag_cp"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)

How transformers (5.x) treats a registered attention function: it looks the name up in ``AttentionInterface``
and calls it from every attention layer. Masks are built by ``AttentionMaskInterface`` functions; for a name
registered there it has none, so ``create_causal_mask`` / ``create_sliding_window_causal_mask`` return
``None`` early, without reading the sharded ``position_ids`` (no packed-sequence detection on a shard). Older
releases (4.48+) may build a 4-D mask of the local shard instead: the layer being causal (checked), it is
replaced by the per-document causal mask (``noncausal="causal"``, recorded in the step's notes).

Under CP: pass ``position_ids`` (per-document positions, sharded by the batch function) and no ``labels``.
Models shift ``labels`` inside their loss, which is wrong on a shard; compute the loss from the logits with
pre-shifted labels (:func:`~blockdiag_dist.integrations.causal_lm_loss`). Pass ``use_cache=False`` in training.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..runtime import cp_blockdiag_sdpa

__all__ = ["ATTENTION_NAME", "blockdiag_attention_forward", "register_transformers_attention"]

ATTENTION_NAME = "blockdiag_cp"


def blockdiag_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """A transformers attention function over :func:`~blockdiag_dist.cp_blockdiag_sdpa`.

    ``query [B, Hq, L, D]``, ``key [B, Hkv, L, D]``, ``value [B, Hkv, L, Dv]`` -> ``([B, L, Hq, Dv], None)``.
    Inside a step context: causal attention per document across CP ranks (``attention_mask`` is replaced by the
    per-document mask). A layer's ``sliding_window = w`` (each query sees ``w`` keys, itself included) becomes
    ``window_size=(w - 1, 0)``. Outside a context: stock SDPA, causal over the row, with ``attention_mask``
    if one is given.
    """
    if softcap is not None:
        raise ValueError(f"{ATTENTION_NAME} attention: expected softcap=None (not supported), got {softcap}")
    if not getattr(module, "is_causal", True):
        raise ValueError(
            f"{ATTENTION_NAME} attention: expected a causal (decoder) attention layer, got {type(module).__name__} "
            "with is_causal=False"
        )
    out = cp_blockdiag_sdpa(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        is_causal=attention_mask is None,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
        window_size=None if sliding_window is None else (sliding_window - 1, 0),
        noncausal="causal",  # the layer is causal (checked above): a mask it was given is per-document under a step
    )
    return out.transpose(1, 2).contiguous(), None


def register_transformers_attention(name: str = ATTENTION_NAME) -> str:
    """Register :func:`blockdiag_attention_forward` in ``transformers.AttentionInterface`` under ``name``;
    returns ``name``, to pass as ``attn_implementation`` (or to set on ``model.set_attn_implementation``)."""
    try:
        from transformers import AttentionInterface
    except ImportError as e:
        raise ImportError(
            "register_transformers_attention: expected transformers >= 4.48 (with AttentionInterface); "
            "install the extra: pip install 'blockdiag[hf]'"
        ) from e
    AttentionInterface.register(name, blockdiag_attention_forward)
    return name
