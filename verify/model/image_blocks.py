"""Vision-language models whose text attention is bidirectional within blocks (Gemma 3 and Gemma 4: each image's
tokens; PaliGemma: the prefix of image and prompt), stepped two ways: the truth (:func:`document_reference`: each
document alone through the stock model's own forward with its token types, ``token_type_ids`` or Gemma 4's
``mm_token_type_ids``) and one step under CP on this rank (:func:`run_case`: the model's own forward with
``shard_primary=False``; the integration reads the blocks from the token types at the model's entry). Compared with
:func:`verify.model.harness.compare`.

Tiny models from configs, random weights from a seed, no download: a SigLIP tower of one block over 8 x 8 images,
4 image tokens per image (Gemma 3 average-pools 4 x 4 patches to 2 x 2; PaliGemma's patches are 4 x 4 pixels),
a decoder of 2 layers (Gemma 3: one sliding layer of window 4, one full). Gemma 4 (``gemma4_unified``) has no tower:
each image is 4 patches of 2 x 2 pixels embedded one by one; its decoder has 4 layers (sliding, full, sliding,
full) with a window of 2, shorter than an image (its sliding layers let an image see its whole image beyond the
window), the last two layers reusing the first two's keys and values, the full layers' values equal to their keys
(``attention_k_eq_v``). Two rows of :data:`SEQ_LEN` = 24 (:func:`documents`): at CP 2 and 4 images / prefixes cross
rank edges (positions 6, 12 and 18), an image opens a document, one document has two images, one none.
``paligemma2`` (not in :data:`FAMILIES`) is PaliGemma with a Gemma 2 decoder: a sliding layer of window 2 (prefixes
longer than it, which they see beyond) and a full one, soft-capped logits.

Shape legend: B rows, S row length, n tokens of a document.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from blockdiag_dist.integrations import IGNORE_INDEX, causal_lm_loss, register_transformers_attention

from .harness import StepResult, cp_step, param_grads
from .multimodal import redraw_zero_init

__all__ = ["FAMILIES", "IMAGE_TOKEN", "PREFIX", "SEQ_LEN", "STOCK_ATTENTION", "TYPES", "build", "document_reference", "documents", "float64_norms", "forward", "judge",
           "packed_batch", "run_case", "tiny_config"]

FAMILIES = ("gemma3", "paligemma", "gemma4_unified")
IMAGE_TOKEN, BOI, EOI, BOS, SEP = 120, 121, 122, 1, 2
VOCAB = 128
SEQ_LEN = 24
IMAGE_TOKENS = 4  # tokens per image, every family
# the keyword of each family's per-token types (1 on an image token, except PaliGemma's 0 on the prefix)
TYPES = {"gemma3": "token_type_ids", "paligemma": "token_type_ids", "paligemma2": "token_type_ids",
         "gemma4_unified": "mm_token_type_ids"}
PREFIX = ("paligemma", "paligemma2")  # a bidirectional prefix (token types 0) rather than image blocks
# the stock attention of the truth: SDPA, or eager where transformers offers no SDPA path (Gemma 2), run in float64
STOCK_ATTENTION = {"paligemma2": "eager"}


def tiny_config(family: str):
    """A tiny config of ``family``: decoder hidden 32, 2 layers, 4 heads (2 key/value heads); tower hidden 16."""
    from transformers import Gemma3Config, Gemma4UnifiedConfig, PaliGemmaConfig

    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=256, bos_token_id=BOS, eos_token_id=SEP,
                pad_token_id=0)
    vision = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=8,
                  num_channels=3)
    if family == "gemma3":
        return Gemma3Config(text_config=dict(text, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
                            vision_config=dict(vision, patch_size=2), mm_tokens_per_image=IMAGE_TOKENS,
                            image_token_index=IMAGE_TOKEN, boi_token_index=BOI, eoi_token_index=EOI)
    if family == "gemma4_unified":
        g4_text = dict(text, num_hidden_layers=4, sliding_window=2, global_head_dim=8, num_kv_shared_layers=2,
                       attention_k_eq_v=True, use_bidirectional_attention="vision",
                       layer_types=["sliding_attention", "full_attention"] * 2)
        return Gemma4UnifiedConfig(text_config=g4_text, vision_config=dict(patch_size=2, pooling_kernel_size=1,
                                                                           mm_embed_dim=16, mm_posemb_size=8,
                                                                           output_proj_dims=16),
                                   audio_config=None, image_token_id=IMAGE_TOKEN, boi_token_id=BOI, eoi_token_id=EOI,
                                   video_token_id=123, audio_token_id=124, boa_token_id=125, eoa_token_index=126)
    if family in PREFIX:
        decoder = dict(model_type="gemma") if family == "paligemma" else dict(
            model_type="gemma2", sliding_window=2, layer_types=["sliding_attention", "full_attention"])
        return PaliGemmaConfig(text_config=dict(text, **decoder),
                               vision_config=dict(vision, patch_size=4, projection_dim=32), image_token_index=IMAGE_TOKEN,
                               projection_dim=32)
    raise ValueError(f"family: expected one of {FAMILIES} or 'paligemma2', got {family!r}")


def build(family: str, *, dtype: torch.dtype = torch.float64, attn_implementation: str | None = None,
          seed: int = 0) -> nn.Module:
    """``Gemma3ForConditionalGeneration`` / ``PaliGemmaForConditionalGeneration`` from :func:`tiny_config`, in
    ``dtype``, initialised from ``seed`` (Gemma 3's image projection, which its init leaves at zero, drawn too:
    :func:`~verify.model.multimodal.redraw_zero_init`); attention ``attn_implementation`` (default blockdiag's, registered here;
    ``"sdpa"`` for the stock model)."""
    from transformers import (Gemma3ForConditionalGeneration, Gemma4UnifiedForConditionalGeneration,
                              PaliGemmaForConditionalGeneration)

    cls = {"gemma3": Gemma3ForConditionalGeneration, "paligemma": PaliGemmaForConditionalGeneration,
           "paligemma2": PaliGemmaForConditionalGeneration, "gemma4_unified": Gemma4UnifiedForConditionalGeneration}[family]
    torch.manual_seed(seed)
    model = cls._from_config(tiny_config(family), attn_implementation=attn_implementation or register_transformers_attention())
    redraw_zero_init(model, seed)  # Gemma 3's image projection starts at zero: no image would reach the text
    return model.to(dtype).train()


def _doc(family: str, parts: list, g: torch.Generator, dtype: torch.dtype) -> dict:
    """A document from parts: token lists, ``"image"`` (its 4 image tokens, Gemma 3 and 4 between begin / end of
    image tokens when ``"image+"``), ``"|"`` (PaliGemma: the end of the prefix)."""
    tokens: list[int] = []
    prefix = None
    images = 0
    for p in parts:
        if p in ("image", "image+"):
            wrap = family not in PREFIX and p == "image+"
            tokens += ([BOI] if wrap else []) + [IMAGE_TOKEN] * IMAGE_TOKENS + ([EOI] if wrap else [])
            images += 1
        elif p == "|":
            prefix = len(tokens)
        else:
            tokens += list(p)
    ids = torch.tensor(tokens)
    if family not in PREFIX:  # 1 on image tokens (the processor's token_type_ids / mm_token_type_ids)
        types = (ids == IMAGE_TOKEN).to(torch.int64)
    else:  # 0 on the prefix (image and prompt), 1 on the suffix
        types = (torch.arange(len(tokens)) >= (len(tokens) if prefix is None else prefix)).to(torch.int64)
    doc = {"input_ids": ids, TYPES[family]: types}
    if images and family == "gemma4_unified":  # 2 x 2 patches of 2 x 2 pixels each, with their grid positions
        doc["pixel_values"] = torch.randn(images, IMAGE_TOKENS, 12, generator=g, dtype=torch.float64).to(dtype)
        grid = torch.tensor([[0, 0], [1, 0], [0, 1], [1, 1]])
        doc["image_position_ids"] = grid.expand(images, -1, -1).clone()
    elif images:
        doc["pixel_values"] = torch.randn(images, 3, 8, 8, generator=g, dtype=torch.float64).to(dtype)
    return doc


def documents(family: str, seed: int = 1, dtype: torch.dtype = torch.float64) -> list[list[dict]]:
    """Two rows of documents (random images from ``seed``), identical on every rank.

    Gemma 3: row 0 = [4 text, image 4..9 (begin/end tokens around 5..8), image 10..13, 2 text] (16) and
    [image 16..19, 4 text] (8); row 1 = 9 text, then [3 text, image 12..15, 3 text] (10), padding.
    PaliGemma: row 0 = [image, bos, 7 prompt, sep | 3 suffix] (prefix 0..12) and [image, bos, prompt | 2 suffix]
    (prefix 16..21); row 1 = [bos, 2 prompt, sep | 3 suffix] and [image, bos, 2 prompt, sep | 3 suffix], padding."""
    g = torch.Generator().manual_seed(seed)
    d = lambda *parts: _doc(family, list(parts), g, dtype)  # noqa: E731
    if family not in PREFIX:
        return [[d([5, 6, 7, 8], "image+", "image", [14, 15]), d("image", [30, 31, 32, 33])],
                [d(list(range(40, 49))), d([50, 51, 52], "image", [56, 57, 58])]]
    return [[d("image", [BOS, 5, 6, 7, 8, 9, 10, 11, SEP], "|", [14, 15, 16]), d("image", [BOS, 30], "|", [32, 33])],
            [d([BOS, 40, 41, SEP], "|", [42, 43, 44]), d("image", [BOS, 50, 51, SEP], "|", [52, 53, 54])]]


def _labels(ids: Tensor) -> Tensor:
    """Next-token targets, none on an image token (pre-shifted: position i's target is token i + 1)."""
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[..., :-1] = ids[..., 1:].masked_fill(ids[..., 1:] == IMAGE_TOKEN, IGNORE_INDEX)
    return labels


def packed_batch(family: str, rows: list[list[dict]]) -> dict[str, Tensor]:
    """The rows packed to :data:`SEQ_LEN`: ``input_ids``, the token types (``token_type_ids``, Gemma 4's
    ``mm_token_type_ids``), per-document ``position_ids`` (from 1 for PaliGemma, as its forward numbers a document
    alone), pre-shifted ``labels``, ``_packed_seq_ids`` and the images in row-major order (``pixel_values``, and
    Gemma 4's ``image_position_ids``)."""
    B, S = len(rows), SEQ_LEN
    key = TYPES[family]
    batch = {k: torch.zeros(B, S, dtype=torch.int64) for k in ("input_ids", key, "position_ids", "_packed_seq_ids")}
    batch["labels"] = torch.full((B, S), IGNORE_INDEX)
    first = 1 if family in PREFIX else 0
    images, grids = [], []
    for b, docs in enumerate(rows):
        at = 0
        for i, doc in enumerate(docs):
            n = doc["input_ids"].numel()
            if at + n > S:
                raise ValueError(f"documents of row {b}: expected at most {S} tokens, got more")
            batch["input_ids"][b, at:at + n] = doc["input_ids"]
            batch[key][b, at:at + n] = doc[key]
            batch["position_ids"][b, at:at + n] = torch.arange(n) + first
            batch["_packed_seq_ids"][b, at:at + n] = i + 1
            batch["labels"][b, at:at + n] = _labels(doc["input_ids"])
            if "pixel_values" in doc:
                images.append(doc["pixel_values"])
            if "image_position_ids" in doc:
                grids.append(doc["image_position_ids"])
            at += n
        batch[key][b, at:] = 1 if family in PREFIX else 0  # padding: in no block
    batch["pixel_values"] = torch.cat(images)
    if grids:
        batch["image_position_ids"] = torch.cat(grids)
    return batch


def document_reference(model: nn.Module, rows: list[list[dict]]) -> StepResult:
    """The truth: each document alone through the model's own forward (``input_ids [1, n]``, its images, its
    token types), the loss summed over every document's targets; the gradients of that sum. Eager attention
    functions, if the model uses them, run in float64 (:func:`verify.model.precision.float64_eager_attention`)."""
    from .precision import float64_eager_attention

    with float64_eager_attention(model):
        return _document_reference(model, rows)


def _document_reference(model: nn.Module, rows: list[list[dict]]) -> StepResult:
    model.zero_grad(set_to_none=True)
    total, targets = 0.0, 0
    for doc in (d for row in rows for d in row):
        ids = doc["input_ids"][None]
        key = next(k for k in ("token_type_ids", "mm_token_type_ids") if k in doc)
        inputs = {"input_ids": ids, key: doc[key][None]}
        for k in ("pixel_values", "image_position_ids"):
            if k in doc:
                inputs[k] = doc[k]
        labels = _labels(ids)
        loss = causal_lm_loss(model(**inputs, use_cache=False).logits, labels, 1)
        loss.backward()
        total += float(loss.detach())
        targets += int((labels != IGNORE_INDEX).sum())
    return StepResult(loss=total, grads=param_grads(model), targets=targets)


def _rms_norm_in_input_dtype(self, x: Tensor) -> Tensor:
    dtype = torch.promote_types(x.dtype, torch.float32)
    h = x.to(dtype)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
    return (h * (1.0 + self.weight.to(dtype))).to(x.dtype)


def _gemma4_rms_norm_in_input_dtype(self, x: Tensor) -> Tensor:
    dtype = torch.promote_types(x.dtype, torch.float32)
    h = x.to(dtype)
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
    return (h * self.weight.to(dtype) if self.with_scale else h).to(x.dtype)


@contextlib.contextmanager
def float64_norms():
    """Within the block, Gemma's RMS norms (which normalise in float32 whatever the input's dtype) compute in their
    input's dtype, float32 at least: a float64 model then stays in float64, so CP's own error is seen at float64's
    resolution."""
    from transformers.models.gemma import modeling_gemma
    from transformers.models.gemma2 import modeling_gemma2
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.gemma4_unified import modeling_gemma4_unified

    owners = (modeling_gemma.GemmaRMSNorm, modeling_gemma2.Gemma2RMSNorm, modeling_gemma3.Gemma3RMSNorm,
              modeling_gemma4_unified.Gemma4UnifiedRMSNorm)
    forwards = (_rms_norm_in_input_dtype,) * 3 + (_gemma4_rms_norm_in_input_dtype,)
    saved = [o.forward for o in owners]
    try:
        for o, f in zip(owners, forwards):
            o.forward = f
        yield
    finally:
        for o, f in zip(owners, saved):
            o.forward = f


def forward(model: nn.Module, local: dict[str, Any]) -> Tensor:
    """The model's own forward on a (sharded) batch of :func:`packed_batch`: logits ``[B, L, V]``."""
    inputs = {k: v for k, v in local.items() if k not in ("labels", "_packed_seq_ids", "padding_mask", "loss_mask")}
    return model(**inputs, use_cache=False).logits


def run_case(family: str, layout: str = "contiguous", *, seed: int = 0, kernel: str | None = None) -> StepResult:
    """One step of ``family`` on this rank (CP over the default group when one is initialised, else CP 1): the
    model's own forward on :func:`packed_batch` with ``shard_primary=False``, in float64 with :func:`float64_norms`;
    loss and gradients summed over the CP group."""
    model = build(family, seed=seed)
    batch = packed_batch(family, documents(family, seed + 1))
    mesh = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        from verify.pool import worker_info

        mesh = worker_info()["cp_mesh"]
    options = {"kernel": kernel} if kernel else {}
    with float64_norms():
        return cp_step(model, batch, mesh, forward, shard_primary=False, layout=layout, **options)


def judge(ref: StepResult, got: StepResult, model: nn.Module, limit: float = 1e-10) -> list[str]:
    """What differs beyond ``limit``: the loss and each parameter's gradient (:func:`~verify.model.harness.compare`:
    relative to its own norm, or, for a gradient zero in exact arithmetic such as SigLIP's key biases (a softmax is
    unchanged when every logit of a query moves alike), to the largest gradient's norm)."""
    from .harness import compare

    c = compare(ref, got, model, limit)
    out = [] if c.loss_rel <= limit else [f"loss: {c.loss_rel:.2e} > {limit:g}"]
    return out + [f"{n}: {c.per_param[n]:.2e} > {limit:g}" for n in c.failing]
