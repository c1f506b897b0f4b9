"""Tiny vision-language models of transformers (Qwen2.5-VL, Qwen3-VL with deepstack), random weights from a seed,
no download, and synthetic (text, image) documents for them. Needs the ``hf`` extra (transformers).

Each tower has 2 blocks; Qwen2.5-VL's first block attends within windows of 2 x 2 merged tokens, its second over
the whole image; Qwen3-VL feeds features of both blocks to the first two decoder layers (deepstack). Patches are
2 x 2 pixels x 2 frames x 3 channels (F = 24 features), merged 2 x 2 into one token, so an image of h x w patches
is h * w / 4 image tokens.

Shape legend: n tokens of a document, F features per patch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from blockdiag_dist.integrations import model_inputs, register_transformers_attention

__all__ = ["FAMILIES", "IMAGE_TOKEN", "VISION_END", "VISION_START", "build_tiny_vlm", "image_document",
           "tiny_vlm_config", "vlm_forward"]

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 120, 121, 122, 123
VOCAB = 128
MERGE = 2
PATCH_FEATURES = 3 * 2 * 2 * 2  # channels x frames x patch height x patch width


def tiny_vlm_config(family: str):
    """A tiny config of ``family`` (2-block tower, hidden 32 in the decoder, 16 in the tower)."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    text = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
    )
    vision = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=2, temporal_patch_size=2,
                  spatial_merge_size=MERGE, out_hidden_size=32, in_channels=3)
    ids = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
               vision_end_token_id=VISION_END, tie_word_embeddings=False)
    if family == "qwen2_5_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
        vision.update(window_size=8, fullatt_block_indexes=[1])  # block 0: windows of 2 x 2 merged tokens
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    if family == "qwen3_vl":
        text.update(head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
        return Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")


def build_tiny_vlm(
    family: str, *, dtype: torch.dtype = torch.float64, attn_implementation: str | None = None, seed: int = 0,
    checkpointing: str | None = None,
) -> nn.Module:
    """A ``...ForConditionalGeneration`` of ``family`` from :func:`tiny_vlm_config`, in ``dtype``, initialised
    from ``seed``; attention ``attn_implementation`` (default blockdiag's, registered here; ``"sdpa"`` for the
    stock model); ``checkpointing`` ``"reentrant"`` / ``"non_reentrant"`` turns on transformers' activation
    checkpointing (vision blocks and decoder layers)."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    cls = {"qwen2_5_vl": Qwen2_5_VLForConditionalGeneration, "qwen3_vl": Qwen3VLForConditionalGeneration}[family]
    torch.manual_seed(seed)
    model = cls._from_config(
        tiny_vlm_config(family), attn_implementation=attn_implementation or register_transformers_attention()
    ).to(dtype)
    if checkpointing is not None:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": checkpointing == "reentrant"})
    return model.train()


def image_document(text_before: Sequence[int], grid: tuple[int, int, int] | None, text_after: Sequence[int],
                   generator: torch.Generator, dtype: torch.dtype = torch.float64) -> dict:
    """A document: ``text_before``, then an image of patch ``grid`` (t, h, w) between vision start / end tokens
    (none when ``grid`` is None; with an empty ``text_before`` the image is the document's first token), then
    ``text_after``; random patches (drawn in float64 whatever ``dtype``, so every dtype sees the same image)."""
    tokens = list(text_before)
    doc: dict = {}
    if grid is not None:
        t, h, w = grid
        tokens += ([VISION_START] if text_before else []) + [IMAGE_TOKEN] * (t * h * w // MERGE**2) + [VISION_END]
        doc["pixel_values"] = torch.randn(t * h * w, PATCH_FEATURES, generator=generator, dtype=torch.float64).to(dtype)
        doc["image_grid_thw"] = torch.tensor([grid])
    doc["input_ids"] = torch.tensor(tokens + list(text_after))
    return doc


def vlm_forward(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """The model's own forward on the batch (no labels, no cache): logits ``[B, L, V]``."""
    return model(**model_inputs(batch), use_cache=False).logits
