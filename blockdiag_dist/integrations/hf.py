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

Vision-language models: the vision tower's bidirectional attention runs stock SDPA on this rank (its tensors are
not sharded; decided per module, :mod:`~blockdiag_dist.integrations.vlm`), and with the batch function's
``shard_primary=False`` the model's own forward embeds and splices on the full rows while its decoder entry is
sharded by the integration (docs/multimodal.md).
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .._stock import stock_sdpa
from ..runtime import cp_blockdiag_sdpa
from ..state import current_state
from .vlm import (BIDIRECTIONAL_MODELS, causal_with_prefix, in_bidirectional_region, in_sharded_region, unsharded_reason,
                  whole_blocks_of)

__all__ = ["ATTENTION_NAME", "UnsupportedAttentionError", "blockdiag_attention_forward", "register_transformers_attention"]

ATTENTION_NAME = "blockdiag_cp"

# Keywords transformers' layers pass to an attention function, by what blockdiag does with them. Every keyword
# is in exactly one of these; any other is refused (it may change what attention computes) unless it is None.
# - do not change what attention computes (bookkeeping of the model's forward):
NEUTRAL_KWARGS = frozenset({
    "position_ids", "cache_position", "use_cache", "output_attentions", "output_hidden_states",
    "output_router_logits", "num_items_in_batch", "shift_labels", "return_dict", "layer_idx", "past_key_values", "past_key_value",
    "cache",
})
# - describe the documents of the rows as given; under a step blockdiag takes them from the batch function
#   (the full doc ids), and outside one the mask or position ids of the call carry them to stock SDPA:
DOCUMENT_KWARGS = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"})
# - change the math and are carried (per document, across CP ranks): ``s_aux`` (gpt-oss' per-head sinks
#   ``[Hq]``) -> ``sinks``; ``softcap`` is a named parameter; chunked local attention comes from the layer's
#   config (``attention_chunk_size`` on layers whose ``config.layer_types[i]`` is ``"chunked_attention"``)
CARRIED_KWARGS = frozenset({"s_aux"})
# - change the math, not carried: refused on every rank, before any collective
REFUSED_KWARGS = {
    "sinks": "per-token attention sinks (a logit per query projected from its hidden state, [B, H, L, 1]); "
             "only per-head sinks [Hq] (gpt-oss' s_aux) are carried",
    "position_bias": "an additive position bias (ALiBi or relative-position buckets)",
    "indices": "sparse attention over selected key indices",
    "block_indices": "block-sparse attention over selected key blocks",
}


class UnsupportedAttentionError(ValueError):
    """An attention layer asked for something blockdiag_cp does not compute (a variant, an argument it does
    not know, a model that is wrong once packed); raised on every rank before any collective."""


def _refuse(module: nn.Module, expected: str, got: str) -> UnsupportedAttentionError:
    return UnsupportedAttentionError(
        f"{ATTENTION_NAME} attention in {type(module).__name__}: expected {expected}, got {got}. Refused rather "
        "than computed without it: the result would be silently wrong."
    )


def _check_layer(module: nn.Module, kwargs: dict[str, Any], softcap: float | None) -> int | None:
    """Refuse what this layer asks for that blockdiag does not compute (see the tables above); return the
    chunk length of a chunked-attention layer (None otherwise)."""
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
        raise _refuse(module, "softcap=None or a number > 0", f"softcap={softcap!r}")
    for key, value in kwargs.items():
        if key in REFUSED_KWARGS and value is not None:
            raise _refuse(module, f"no {key!r}", f"{key!r}: {REFUSED_KWARGS[key]}")
    # a keyword passed as None asks for nothing (BERT-style layers pass encoder_hidden_states=None to self-attention)
    known = NEUTRAL_KWARGS | DOCUMENT_KWARGS | CARRIED_KWARGS | REFUSED_KWARGS.keys()
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in known)
    if unknown:
        raise _refuse(
            module, f"only keywords blockdiag knows ({sorted(NEUTRAL_KWARGS | DOCUMENT_KWARGS | CARRIED_KWARGS)})",
            f"{unknown}, which may change what attention computes",
        )
    sinks = kwargs.get("s_aux")
    if sinks is not None and not (isinstance(sinks, Tensor) and sinks.dim() == 1):
        got = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
        raise _refuse(module, "s_aux: per-head attention sinks [Hq]", f"s_aux of shape {got}")
    config = getattr(module, "config", None)
    chunk = getattr(config, "attention_chunk_size", None)
    layer_type = _layer_type(module, config)
    if chunk is not None and layer_type is None:
        raise _refuse(
            module, "a layer whose config.layer_types says whether it is chunked",
            f"config.attention_chunk_size={chunk} without a layer type for layer_idx="
            f"{getattr(module, 'layer_idx', None)}: blockdiag cannot tell a chunked layer from a full one",
        )
    if layer_type == "chunked_attention":
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise _refuse(module, "config.attention_chunk_size an int >= 1 on a chunked layer", f"{chunk!r}")
        return chunk
    return None


def _nope_temperature(module: nn.Module) -> tuple[float, float] | None:
    """``(floor_scale, attn_scale)`` of a NoPE layer with Llama 4's temperature tuning (``attn_temperature_tuning``
    on a layer without RoPE), None for any other layer."""
    if not (getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True)):
        return None
    floor_scale, attn_scale = getattr(module, "floor_scale", None), getattr(module, "attn_scale", None)
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (floor_scale, attn_scale))
    if not numbers or not floor_scale > 0:
        raise _refuse(module, "NoPE temperature tuning with a number floor_scale > 0 and a number attn_scale",
                      f"floor_scale={floor_scale!r}, attn_scale={attn_scale!r}")
    return floor_scale, attn_scale


def _without_row_temperature(query: Tensor, key: Tensor, temperature: tuple[float, float]) -> Tensor:
    """Undo the temperature a NoPE layer applied to ``query [B, Hq, Lq, D]`` before calling attention: it scaled
    query ``i`` by its row position ``past + i`` (``torch.arange`` plus the cached length ``past = Lk - Lq``), in
    float32 on the query's device; divided by the same numbers here. ``cp_blockdiag_sdpa(temperature=...)`` then
    scales by each query's position inside its document (under a step; in its row outside one)."""
    floor_scale, attn_scale = temperature
    Lq, Lk = query.shape[-2], key.shape[-2]
    positions = torch.arange(Lq, device=query.device) + (Lk - Lq)
    applied = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    return (query / applied[:, None]).to(query.dtype)


def _layer_type(module: nn.Module, config: Any) -> str | None:
    types, idx = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if types is None or idx is None or not 0 <= idx < len(types):
        return None
    return types[idx]


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
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """A transformers attention function over :func:`~blockdiag_dist.cp_blockdiag_sdpa`.

    ``query [B, Hq, L, D]``, ``key [B, Hkv, L, D]``, ``value [B, Hkv, L, Dv]`` -> ``([B, L, Hq, Dv], None)``.
    Inside a step context: causal attention per document across CP ranks (a bool ``attention_mask`` is replaced
    by the per-document mask, recorded in the step's notes). A layer's ``sliding_window = w`` (each query sees
    ``w`` keys, itself included) becomes ``window_size=(w - 1, 0)``. Outside a context: stock SDPA, causal over
    the row, with ``attention_mask`` if one is given.

    Carried, per document across CP ranks: ``s_aux`` (gpt-oss' per-head attention sinks ``[Hq]``),
    ``softcap`` (Gemma 2's logit soft-capping) and chunked local attention (Llama 4: a layer whose
    ``config.layer_types[layer_idx]`` is ``"chunked_attention"`` attends within chunks of
    ``config.attention_chunk_size`` positions of each document, counted from the document's start) and NoPE
    temperature tuning (Llama 4's ``attn_temperature_tuning``: the layer scaled its queries by their positions in
    the rows, ``torch.arange``; that scale is divided out and each query is scaled by its position inside its
    document instead, the positions each document has when run alone).

    A bidirectional layer (``is_causal=False``) of an encoder whose tensors CP does not shard (a vision tower's
    patches: the module's ``config`` is a ``vision_config`` / ``audio_config`` sub-config, and it is not a layer
    of a language model whose rows CP shards) runs stock SDPA on this rank's tensors, with its mask, per segment
    of ``cu_seq_lens_q`` when given: exactly what transformers' ``sdpa`` attention computes. Any other
    bidirectional layer is refused.

    Every other keyword is honoured or refused (``UnsupportedAttentionError``, the same on every rank, before
    any collective): per-token ``sinks``, position biases, sparse indices and keywords it does not know are
    refused; so are a bidirectional layer on the sequence CP shards and, under a step, an
    additive float ``attention_mask`` (a bias).
    """
    chunk = _check_layer(module, kwargs, softcap)
    temperature = _nope_temperature(module)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if not causal and causal_with_prefix(module) and current_state() is not None:
        causal = True  # PaliGemma under a step: causal plus its prefix block (the step's blocks), as its model's mask
    if not causal:
        if temperature is not None:
            raise _refuse(module, "NoPE temperature tuning on a causal layer", "a bidirectional layer with it")
        return _encoder_attention(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
                                  kwargs), None
    if temperature is not None:  # positions from the rows -> positions inside each document (cp_blockdiag_sdpa)
        query = _without_row_temperature(query, key, temperature)
    state = current_state()
    # Gemma 3 / PaliGemma / Gemma 4: the blocks the model's entry gave the step (blockdiag_dist.integrations.vlm)
    bidirectional = None
    if state is not None and in_bidirectional_region(module):
        if state.block_entries == 0:
            raise _refuse(
                module, "the bidirectional blocks its model reads from token_type_ids / mm_token_type_ids at its entry (a "
                "forward pre-hook the step's first scan installs)", f"a layer of the language model of a {' / '.join(BIDIRECTIONAL_MODELS)} called "
                "in a step whose model entry was not seen (the model itself was the step's first call: call its "
                "...ForConditionalGeneration, or the same model again from the next step on); its image blocks are unknown")
        bidirectional = True if state.blocks is not None else None
    whole = bidirectional is not None and whole_blocks_of(module)  # Gemma 4, PaliGemma: the window OR the block
    if attention_mask is not None and attention_mask.is_floating_point() and state is not None:
        raise _refuse(
            module, "no attention_mask, or a bool one (replaced by the per-document causal mask)",
            f"an additive float attention_mask of shape {tuple(attention_mask.shape)} (a bias, e.g. ALiBi, "
            "is not carried)",
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
        sinks=kwargs.get("s_aux"),
        softcap=softcap,
        chunk_size=chunk,
        temperature=temperature,
        bidirectional_blocks=bidirectional,
        whole_blocks=whole,
    )
    return out.transpose(1, 2).contiguous(), None


def _encoder_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    kwargs: dict[str, Any],
) -> Tensor:
    """A bidirectional layer: stock SDPA on this rank's tensors when they are an encoder's (CP does not shard
    them), refused otherwise. ``query [B, Hq, T, D]`` -> ``[B, T, Hq, Dv]``; with ``cu_seq_lens_q``
    (``= cu_seq_lens_k``, ``[n + 1]``, one packed row ``B = 1``) each segment attends within itself."""
    reason = unsharded_reason(module)
    if reason is None:
        where = (
            "a layer of the language model, whose rows CP shards" if in_sharded_region(module)
            else "not an encoder's layer over tensors CP does not shard (its config is no vision_config / audio_config)"
        )
        raise _refuse(
            module,
            "a causal (decoder) attention layer, or a bidirectional one of a vision / audio encoder (tensors CP does "
            "not shard)",
            f"is_causal=False in {where}: bidirectional attention over the sharded sequence is not computed per "
            "document",
        )
    variants = {"sliding_window": sliding_window, "softcap": softcap, "s_aux": kwargs.get("s_aux"),
                "seq_idx": kwargs.get("seq_idx")}
    asked = sorted(k for k, v in variants.items() if v is not None)
    if asked:
        raise _refuse(module, "plain bidirectional attention in an encoder layer", f"{asked}, not carried there")
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    gqa = query.shape[1] != key.shape[1]
    if cu_q is None and cu_k is None:
        out = stock_sdpa(query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=False,
                         scale=scaling, enable_gqa=gqa)
    else:
        T = query.shape[2]
        bounds = [] if cu_q is None else [int(b) for b in cu_q.tolist()]
        same = cu_q is not None and cu_k is not None and bounds == [int(b) for b in cu_k.tolist()]
        rising = bool(bounds) and bounds[0] == 0 and bounds[-1] == T and all(a <= b for a, b in zip(bounds, bounds[1:]))
        if not (same and rising and query.shape[0] == 1 and attention_mask is None and key.shape[2] == T):
            raise _refuse(
                module, f"segments cu_seq_lens_q = cu_seq_lens_k rising from 0 to T = {T} over one packed row "
                "[1, H, T, D], without an attention_mask",
                f"cu_seq_lens_q={bounds}, cu_seq_lens_k={None if cu_k is None else cu_k.tolist()}, query "
                f"{tuple(query.shape)}, key {tuple(key.shape)}, attention_mask {attention_mask is not None}",
            )
        out = torch.cat([
            stock_sdpa(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout, is_causal=False,
                       scale=scaling, enable_gqa=gqa)
            for a, b in zip(bounds, bounds[1:]) if b > a
        ], dim=2)
    state = current_state()
    if state is not None:
        state.note(f"{type(module).__name__}: bidirectional attention over tensors CP does not shard ({reason}) ran "
                   "stock SDPA on this rank")
    return out.transpose(1, 2).contiguous()


def register_transformers_attention(name: str = ATTENTION_NAME) -> str:
    """Register :func:`blockdiag_attention_forward` in ``transformers.AttentionInterface`` under ``name``;
    returns ``name``, to pass as ``attn_implementation`` (or to set on ``model.set_attn_implementation``).
    Models whose attention layers do not call the interface are refused by name when built with it (Falcon,
    GPT-Neo, GIT: :data:`SELF_DISPATCHING`) or when a step meets them (:mod:`blockdiag_dist.guard`)."""
    try:
        from transformers import AttentionInterface
    except ImportError as e:
        raise ImportError(
            "register_transformers_attention: expected transformers >= 4.48 (with AttentionInterface); "
            "install the extra: pip install 'blockdiag[hf]'"
        ) from e
    AttentionInterface.register(name, blockdiag_attention_forward)
    for module_name, table, model in SELF_DISPATCHING:
        _after_import(module_name, functools.partial(_refuse_in_table, name=name, table=table, model=model))
    for module_name, table in UNSHARDED_TABLES:
        _after_import(module_name, functools.partial(_stock_in_table, name=name, table=table))
    return name


# Models that pick their attention class from a table keyed by the implementation's name (a KeyError at build for
# any other name); their classes compute attention themselves: (module, table, what the refusal says).
SELF_DISPATCHING = (
    ("transformers.models.falcon.modeling_falcon", "FALCON_ATTENTION_CLASSES", "Falcon"),
    ("transformers.models.gpt_neo.modeling_gpt_neo", "GPT_NEO_ATTENTION_CLASSES", "GPT-Neo"),
    ("transformers.models.git.modeling_git", "GIT_SELF_ATTENTION_CLASSES", "GIT"),
)


# Vision encoders that pick their attention class from a table keyed by the implementation's name (a KeyError at
# build for any other name): their attention is bidirectional over image patches, tensors CP does not shard, so
# under ``name`` they get the table's own SDPA class, what transformers' ``sdpa`` builds. (module, table)
UNSHARDED_TABLES = (
    ("transformers.models.sam.modeling_sam", "SAM_VISION_ATTENTION_CLASSES"),
    ("transformers.models.sam_hq.modeling_sam_hq", "SAM_HQ_VISION_ATTENTION_CLASSES"),
    ("transformers.models.deepseek_ocr2.modeling_deepseek_ocr2", "DEEPSEEK_OCR2_SAM_VISION_ATTENTION_CLASSES"),
    ("transformers.models.unlimited_ocr.modeling_unlimited_ocr", "UNLIMITED_OCR_SAM_VISION_ATTENTION_CLASSES"),
)


def _stock_in_table(module: Any, *, name: str, table: str) -> None:
    classes = getattr(module, table)
    classes.setdefault(name, classes.get("sdpa", classes.get("eager")))


def _refuse_in_table(module: Any, *, name: str, table: str, model: str) -> None:
    """Give ``name`` a class in ``module.<table>`` that refuses when the model is built, saying why."""

    class RefusedAttention(nn.Module):
        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            alibi = " with an ALiBi bias (config.alibi=True)" if getattr(config, "alibi", False) else ""
            raise UnsupportedAttentionError(
                f"{name} attention: expected a model whose attention layers call transformers' attention interface, "
                f"got {model}: its attention layers compute attention themselves{alibi}, so {name!r} cannot route "
                "them per document. Refused rather than computed within each rank's shard."
            )

    getattr(module, table).setdefault(name, RefusedAttention)


class _PostImport(importlib.abc.MetaPathFinder):
    """Runs callbacks on a module right after it is first imported (no import happens here)."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable[[Any], None]]] = {}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                exec_module, callbacks = spec.loader.exec_module, self.callbacks.pop(fullname)

                def exec_and_call(module: Any) -> None:
                    exec_module(module)
                    for callback in callbacks:
                        callback(module)

                spec.loader.exec_module = exec_and_call
                return spec
        return None


_post_import = _PostImport()


def _after_import(module_name: str, callback: Callable[[Any], None]) -> None:
    """``callback(module)`` now if ``module_name`` is imported, else right after its first import."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    _post_import.callbacks.setdefault(module_name, []).append(callback)
    if _post_import not in sys.meta_path:
        sys.meta_path.insert(0, _post_import)
