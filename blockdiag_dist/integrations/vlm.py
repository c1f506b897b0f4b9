"""Vision-language models of transformers under block-diagonal CP.

A vision-language model embeds its text, runs its vision tower on the images' patches and splices the vision
features into the embedded row; only then does its language model (the decoder) run along the sequence. CP shards
the decoder's rows; the vision tower's patches are never sharded. Two things follow:

- **encoder attention runs locally.** An attention layer of a vision or audio encoder (its module's ``config`` is
  a ``vision_config`` / ``audio_config`` sub-config) is bidirectional over tensors CP does not shard: under
  ``register_transformers_attention()`` it runs stock SDPA on this rank's tensors, per segment of
  ``cu_seq_lens_q`` when the layer passes them (one image each). Decided per module: a bidirectional layer of
  the language model, whose rows CP shards, is still refused;
- **the decoder's entry is where the row is sharded** (``make_cp_blockdiag_batch_and_ctx(...,
  shard_primary=False)``): the model's own forward embeds ``input_ids`` and splices the vision features on the
  full row, and a forward pre-hook on its language model (installed when a CP step first meets the model)
  slices ``inputs_embeds``, ``position_ids`` (``[B, S]`` or ``[3, B, S]``), ``visual_pos_masks`` and the
  deepstack embeddings with the step's plan, differentiably, so gradients reach the vision tower.

The same scan hooks the model (the module holding the tower and the language model): under a step its image
inputs are checked before anything computes (image tokens against ``image_grid_thw``'s features, each image
within one document; pixel values with ``shard_primary=True`` are refused), and its tower, with
``shard_vision=True``, runs on this rank's share of the images (:mod:`~blockdiag_dist.integrations.vision_shard`).
The hooks are installed once per module and are inert outside a step.

Shape legend: B batch rows, S the packed row's length, L rows held by this rank, H hidden size, Hq / Hkv heads,
D / Dv head dims, T tokens of an encoder call, n_vis visual tokens of the batch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..guard import register_scan_visitor
from ..sharding import check_visual_rows, shard_tensor, shard_visual_tokens
from ..state import current_state

__all__ = ["BIDIRECTIONAL_MODELS", "ENCODER_CONFIG_KEYS", "BlockRule", "bidirectional_blocks_of", "causal_with_prefix",
           "in_bidirectional_region", "in_sharded_region", "unsharded_reason", "whole_blocks_of"]

# ``base_config_key`` of the sub-configs whose modules run on tensors CP does not shard (images' patches, audio
# frames): their attention layers are bidirectional over those tensors and run locally.
ENCODER_CONFIG_KEYS = ("vision_config", "audio_config")

# Modules of language models whose entry the integration shards: their rows are this rank's L rows of the step.
_sharded_region: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _runs(marked: Tensor) -> Tensor:
    """Every run of marked tokens ``[B, S]`` is one block: ids 1, 2, ... along each row, 0 elsewhere."""
    start = marked & ~torch.nn.functional.pad(marked, (1, 0), value=False)[:, :-1]
    return torch.where(marked, torch.cumsum(start.to(torch.int64), 1), 0)


def _gemma3_blocks(token_type_ids: Tensor) -> Tensor:
    """Gemma 3: every run of image tokens (``token_type_ids == 1``) is one block."""
    return _runs(token_type_ids == 1)


def _gemma4_blocks(mm_token_type_ids: Tensor) -> Tensor:
    """Gemma 4: every run of vision tokens (``mm_token_type_ids`` 1, image, or 2, video; 3 is audio) is one block."""
    return _runs((mm_token_type_ids == 1) | (mm_token_type_ids == 2))


def _paligemma_blocks(token_type_ids: Tensor) -> Tensor:
    """PaliGemma: the prefix (image and prompt, ``token_type_ids == 0``) is one block."""
    return (token_type_ids == 0).to(torch.int64)


@dataclass(frozen=True)
class BlockRule:
    """How a vision-language model's forward reads bidirectional blocks of its text attention (transformers 5.24).

    - ``key``: its keyword of per-token types, ``[B, S]``;
    - ``blocks``: types -> block ids ``[B, S]`` (0 = none), the model's own rule;
    - ``whole``: its sliding layers let a query see its whole block beyond the window, ``(window AND causal) OR
      block`` (``cp_blockdiag_sdpa(whole_blocks=True)``), rather than ``window AND (causal OR block)``;
    - ``text``: the types of a row without blocks, in words;
    - ``gate``: ``(attribute, value)`` of the text config under which the forward builds blocks at all (None: always).
    """

    key: str
    blocks: Callable[[Tensor], Tensor]
    whole: bool
    text: str
    gate: tuple[str, Any] | None = None


# Vision-language models whose language model attends bidirectionally within blocks its forward reads from per-token
# types (transformers 5.24): class name -> its rule. Gemma 3 (``get_block_sequence_ids_for_mask`` and
# ``create_masks_for_vision_model``: its sliding layers AND the window with (causal OR block)); PaliGemma (its
# bidirectional prefix, given to the mask functions as ``block_sequence_ids``: their sliding masks OR the block with
# the causal window); Gemma 4 (``Gemma4UnifiedModel``: runs of image and video tokens of ``mm_token_type_ids``, as
# ``block_sequence_ids`` too, when its text config says ``use_bidirectional_attention="vision"``). Under a step the
# model's entry hands the blocks to the step (StepState.set_bidirectional_blocks) and every attention layer of its
# language model attends with them.
BIDIRECTIONAL_MODELS: dict[str, BlockRule] = {
    "Gemma3Model": BlockRule("token_type_ids", _gemma3_blocks, whole=False, text="all 0"),
    "PaliGemmaModel": BlockRule("token_type_ids", _paligemma_blocks, whole=True, text="all 1"),
    "Gemma4UnifiedModel": BlockRule("mm_token_type_ids", _gemma4_blocks, whole=True, text="none 1 or 2",
                                    gate=("use_bidirectional_attention", "vision")),
}
# module of such a language model -> its model's rule (PaliGemma's decoder layers say is_causal=False, from its
# config's use_bidirectional_attention set for backward compatibility, while the model's own mask is causal plus
# the prefix block: those layers attend causally with the blocks)
_bidirectional_region: weakref.WeakKeyDictionary[nn.Module, BlockRule] = weakref.WeakKeyDictionary()


def _bidirectional_rule(module: nn.Module) -> BlockRule | None:
    return next((BIDIRECTIONAL_MODELS[c.__name__] for c in type(module).__mro__ if c.__name__ in BIDIRECTIONAL_MODELS), None)


def bidirectional_blocks_of(module: nn.Module, types: Tensor) -> Tensor | None:
    """The block ids ``[B, S]`` a model of :data:`BIDIRECTIONAL_MODELS` reads from its per-token ``types`` (its
    rule's ``key``); None for any other model, and for one whose config says its forward builds no blocks."""
    rule = _bidirectional_rule(module)
    if rule is None:
        return None
    if rule.gate is not None:
        config = getattr(module, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(text, rule.gate[0], None) != rule.gate[1]:
            return None
    return rule.blocks(types.detach().cpu())


def in_bidirectional_region(module: nn.Module) -> bool:
    """True for a module of the language model of a model of :data:`BIDIRECTIONAL_MODELS`."""
    return module in _bidirectional_region


def whole_blocks_of(module: nn.Module) -> bool:
    """True for a module of the language model of a model whose sliding layers let a query see its whole block
    beyond the window (:attr:`BlockRule.whole`: Gemma 4, PaliGemma)."""
    rule = _bidirectional_region.get(module)
    return rule is not None and rule.whole


def causal_with_prefix(module: nn.Module) -> bool:
    """True for an attention layer of PaliGemma's language model: it says ``is_causal=False`` while the mask its
    model builds is causal plus the bidirectional prefix (``PaliGemmaModel.forward``)."""
    rule = _bidirectional_region.get(module)
    return rule is not None and rule.blocks is _paligemma_blocks


def _is_encoder(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return config is not None and getattr(type(config), "base_config_key", None) in ENCODER_CONFIG_KEYS


def unsharded_reason(module: nn.Module) -> str | None:
    """Why ``module`` runs on tensors CP does not shard (its config is an encoder's sub-config), or None.
    A module inside a language model whose rows CP shards never does."""
    if module in _sharded_region or not _is_encoder(module):
        return None
    return f"its config is a {type(module.config).base_config_key} ({type(module.config).__name__})"


def in_sharded_region(module: nn.Module) -> bool:
    """True for a module of a language model whose entry the integration shards (rows = this rank's L)."""
    return module in _sharded_region


# language model -> the handles of its decoder-entry hook and of its model's input check (installed once per
# module, inert outside a step)
_hooked: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def _visit(module: nn.Module) -> None:
    """A step's scan met ``module``: if it is a vision-language model (a ``language_model`` child next to an
    encoder child, or a model of :data:`BIDIRECTIONAL_MODELS`: Gemma 4 embeds its patches without an encoder), hook
    its language model's entry, its own inputs and its encoders, and mark the language model's modules as sharded."""
    lm = module._modules.get("language_model")
    if lm is None or lm in _hooked:
        return
    encoder = any(_is_encoder(child) for name, child in module.named_children() if name != "language_model")
    if not encoder and _bidirectional_rule(module) is None:
        return
    from .vision_shard import gather_images, shard_images

    encoders = [child for name, child in module.named_children() if name != "language_model" and _is_encoder(child)]
    _hooked[lm] = (
        lm.register_forward_pre_hook(_shard_decoder_entry, with_kwargs=True),
        module.register_forward_pre_hook(_check_model_inputs, with_kwargs=True),
        *[e.register_forward_pre_hook(shard_images, with_kwargs=True) for e in encoders],
        *[e.register_forward_hook(gather_images, with_kwargs=True) for e in encoders],
    )
    for m in lm.modules():
        _sharded_region.add(m)
        if _bidirectional_rule(module) is not None:
            _bidirectional_region[m] = _bidirectional_rule(module)


register_scan_visitor(_visit)

# pad value of the known sequence-aligned inputs of a decoder (any other [B, S, ...] tensor is padded with 0)
_PADS = {"inputs_embeds": 0.0, "visual_pos_masks": False}


def _shard_decoder_entry(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
    """Forward pre-hook of a vision-language model's language model: under a step built with
    ``shard_primary=False``, the full-row inputs the model prepared -> this rank's rows (differentiable)."""
    state = current_state()
    if state is None or state.shard_primary:
        return None
    name = type(module).__name__
    if args:
        raise ValueError(
            f"{name} (decoder entry under a CP step with shard_primary=False): expected keyword arguments, got "
            f"{len(args)} positional ones"
        )
    B, S = state.batch_size, state.seq_len
    new = dict(kwargs)
    primary_key = "inputs_embeds" if new.get("inputs_embeds") is not None else "input_ids"
    primary = new.get(primary_key)
    if not isinstance(primary, Tensor) or tuple(primary.shape[:2]) != (B, S):
        got = tuple(primary.shape) if isinstance(primary, Tensor) else None
        raise ValueError(
            f"{name} (decoder entry, shard_primary=False): expected {primary_key} of the full rows [B, S, ...] = "
            f"[{B}, {S}, ...] the batch function was given, got {got}"
        )
    pos = new.get("position_ids")
    if not isinstance(pos, Tensor) or not (
        (pos.dim() == 2 and tuple(pos.shape) == (B, S)) or (pos.dim() == 3 and tuple(pos.shape[1:]) == (B, S))
    ):
        got = tuple(pos.shape) if isinstance(pos, Tensor) else pos
        raise ValueError(
            f"{name} (decoder entry, shard_primary=False): position_ids: expected per-document positions [B, S] or "
            f"[n, B, S] (mRoPE) with [B, S] = [{B}, {S}], got {got}" + (
                " (without them the language model would number this rank's rows from 0)" if pos is None else "")
        )
    mask = new.get("attention_mask")
    if isinstance(mask, dict) and all(m is None for m in mask.values()):  # per layer type (Gemma 3), none built
        mask = None
    if mask is not None:
        got = {k: None if m is None else tuple(m.shape) for k, m in mask.items()} if isinstance(mask, dict) else tuple(mask.shape)
        raise ValueError(
            f"{name} (decoder entry, shard_primary=False): attention_mask: expected None under a CP step (the "
            f"documents come from the step; the batch function drops the mask), got shape {got}"
        )
    shards, rank = state.plan.shards, state.rank
    deepstack, vpm = new.get("deepstack_visual_embeds"), new.get("visual_pos_masks")
    if deepstack is not None:
        if not isinstance(vpm, Tensor) or vpm.dtype != torch.bool or tuple(vpm.shape) != (B, S):
            got = (vpm.dtype, tuple(vpm.shape)) if isinstance(vpm, Tensor) else vpm
            raise ValueError(
                f"{name} (decoder entry): visual_pos_masks: expected a bool [B, S] = [{B}, {S}] mask beside "
                f"deepstack_visual_embeds, got {got}"
            )
        check_visual_rows(deepstack, vpm, f"{name} (decoder entry): deepstack_visual_embeds",
                          lambda: " (the visual tokens of visual_pos_masks)")
        new["deepstack_visual_embeds"] = [shard_visual_tokens(t, vpm, shards, rank) for t in deepstack]
    sharded = []
    for key, value in kwargs.items():
        if not isinstance(value, Tensor):
            continue
        if key == "position_ids" and value.dim() == 3:
            new[key] = shard_tensor(value, 2, 0, shards, rank)
        elif value.dim() >= 2 and tuple(value.shape[:2]) == (B, S):
            pad = state.padding_token_id if key == "input_ids" else _PADS.get(key, 0)
            new[key] = shard_tensor(value, 1, pad, shards, rank)
        else:
            continue
        sharded.append(key)
    if deepstack is not None:
        sharded.append("deepstack_visual_embeds")
    state.decoder_entries += 1
    state.note(f"{name}: decoder entry sharded with the step's plan (shard_primary=False): {', '.join(sharded)}")
    return args, new


def _check_model_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Forward pre-hook of a vision-language model (the module holding the vision tower and the language model):
    under a step, before anything computes, the same on every rank (the rows are replicated): its image inputs
    must be spliced on the full rows (``shard_primary=False``), and its image tokens must match the features
    ``image_grid_thw`` gives, each image within one document."""
    state = current_state()
    pixels = kwargs.get("pixel_values")
    rule = _bidirectional_rule(module)
    # outside a step: PaliGemma's layers (is_causal=False) refuse themselves; Gemma 3's and 4's would run causally
    if state is None and rule is not None and rule.blocks is not _paligemma_blocks and kwargs.get(rule.key) is not None:
        _refuse_blocks_outside_a_step(module, rule, kwargs[rule.key])
    if state is not None and rule is not None:
        state.block_entries += 1
        if kwargs.get(rule.key) is not None:
            _step_blocks(module, rule, kwargs[rule.key], state)
        elif rule.blocks is _paligemma_blocks:
            from ..guard import UnsupportedLayerError

            raise UnsupportedLayerError(
                f"blockdiag_dist: layer {type(module).__name__} is not computed per document under CP without "
                "token_type_ids: expected token_type_ids [B, S] (0 on each document's prefix of image and prompt, 1 on "
                "its suffix), got none. Without them its stock text attention depends on the attention implementation "
                "(its layers say is_causal=False: sdpa attends bidirectionally over the whole text when no mask is "
                "needed, eager causally), so there is no one truth to compute. Refused on every rank, before the layer ran."
            )
    if state is None or (pixels is None and kwargs.get("pixel_values_videos") is None):
        return None
    name = type(module).__name__
    if state.shard_primary:
        raise ValueError(
            f"{name}: pixel values under a CP step built with shard_primary=True; expected shard_primary=False for "
            "the model's own forward (it embeds input_ids and splices the vision features on the full rows; the "
            "integration shards its decoder entry), got input_ids sharded to this rank's rows, into which the model "
            "would splice every image's features. (Or splice on the full rows yourself and pass inputs_embeds.)"
        )
    ids, grids = kwargs.get("input_ids"), kwargs.get("image_grid_thw")
    config = getattr(module, "config", None)
    token = getattr(config, "image_token_id", None)
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", None)
    if pixels is None or not isinstance(ids, Tensor) or not isinstance(grids, Tensor) or token is None or not merge:
        return None
    patches = int(grids.prod(-1).sum())
    if pixels.shape[0] != patches:
        raise ValueError(
            f"{name}: pixel_values: expected {patches} rows, one per patch of image_grid_thw {grids.tolist()}, got "
            f"shape {tuple(pixels.shape)}"
        )
    doc_ids = state.plan.layout.segment_ids  # [B, S] (0 = padding), replicated
    flat_docs = doc_ids.reshape(-1)[(ids == token).reshape(-1).cpu()]  # the document of each image token, in order
    per_image = (grids.prod(-1) // merge**2).tolist()
    if flat_docs.numel() != sum(per_image):
        raise ValueError(
            f"{name}: image tokens ({token}): expected {sum(per_image)}, one per vision feature of image_grid_thw "
            f"{grids.tolist()} (spatial_merge_size {merge}), got {flat_docs.numel()} ({_tokens_per_document(ids == token, doc_ids)})"
        )
    start = 0
    for j, n in enumerate(per_image):
        held = torch.unique(flat_docs[start:start + n]).tolist()
        if len(held) != 1 or held[0] == 0:
            raise ValueError(
                f"{name}: image {j} (grid {grids[j].tolist()}, {n} tokens): expected its tokens within one document, "
                f"got them in documents {held} (0 = padding); the image tokens of the rows do not match the images "
                "in order"
            )
        start += n
    return None


def _uses_blockdiag_attention(module: nn.Module) -> bool:
    """True when the language model of ``module`` dispatches its attention to blockdiag's registered function."""
    from transformers import AttentionInterface

    config = getattr(module, "config", None)
    impl = getattr(getattr(config, "text_config", config), "_attn_implementation", None)
    fn = AttentionInterface._global_mapping.get(impl) if isinstance(impl, str) else None
    # named, not imported: .hf imports this module
    return getattr(fn, "__module__", None) == f"{__package__}.hf" and fn.__name__ == "blockdiag_attention_forward"


def _refuse_blocks_outside_a_step(module: nn.Module, rule: BlockRule, types: Tensor) -> None:
    """Gemma 3 or 4 called outside a step with image tokens in its types while its attention is blockdiag's: the
    registered attention gets no blocks there (only a step carries them) and would attend causally."""
    blocks = bidirectional_blocks_of(module, types)
    if blocks is None or not bool((blocks != 0).any()) or not _uses_blockdiag_attention(module):
        return
    from ..guard import UnsupportedLayerError

    raise UnsupportedLayerError(
        f"blockdiag_dist: layer {type(module).__name__} is not computed outside a CP step with image tokens: expected "
        f"{rule.key} without image tokens ({rule.text}) outside a step, or the call under a step (a CP-1 step evaluates "
        f"one process), got {int((blocks != 0).sum())} image tokens, whose bidirectional blocks only a step "
        "gives blockdiag's attention (it would attend causally). Or set the model's stock attention "
        "(model.set_attn_implementation('sdpa')) for calls outside a step."
    )


def _step_blocks(module: nn.Module, rule: BlockRule, types: Tensor, state) -> None:
    """A model of :data:`BIDIRECTIONAL_MODELS` entered under a step: its blocks, from its per-token types of the full
    rows (``rule.key``), become the step's (the same on every rank: the rows are replicated). A model whose sliding
    layers let a block see itself beyond the window (``rule.whole``) has its layers attend with whole blocks."""
    name, (B, S) = type(module).__name__, (state.batch_size, state.seq_len)
    if tuple(types.shape) != (B, S) or state.shard_primary:
        raise ValueError(
            f"{name}: {rule.key}: expected the full rows [B, S] = [{B}, {S}] under a CP step built with "
            f"shard_primary=False (its text attention is bidirectional within blocks read from them: every rank needs "
            f"all of them), got shape {tuple(types.shape)} with shard_primary={state.shard_primary}"
        )
    blocks = bidirectional_blocks_of(module, types)
    if blocks is not None and bool((blocks != 0).any()):
        state.set_bidirectional_blocks(blocks)
        state.note(f"{name}: bidirectional blocks from {rule.key} given to the step's attention"
                   + (" (whole blocks: each sees its whole block beyond a sliding window)" if rule.whole else ""))


def _tokens_per_document(mask: Tensor, doc_ids: Tensor) -> str:
    parts = []
    for b in range(mask.shape[0]):
        ids, counts = torch.unique_consecutive(doc_ids[b], return_counts=True)
        start = 0
        for d, n in zip(ids.tolist(), counts.tolist()):
            k = int(mask[b, start:start + n].sum())
            if k:
                parts.append(f"row {b} {'padding' if d == 0 else f'document {d}'}: {k}")
            start += n
    return ", ".join(parts) or "none"
