"""Vision-language batches for model-level cases: documents holding images, packed with what the model's own
forward needs, built by one entry per model family (:data:`FAMILIES`):

- **Qwen-VL** (Qwen2.5-VL, Qwen3-VL and their kin, found by their fields): each document of 3 tokens or more gets
  one image (the first grid of :data:`GRIDS` that fits, starting from a different one each document: 4, 2 or 1
  image tokens after the ``2 x 2`` merge) at its start, or after its first token when there is room:
  ``vision_start, image x k, vision_end``; mRoPE positions ``[3, n]`` from the model's own ``get_rope_index`` on
  the document alone; ``pixel_values [P, F]`` of every image in row order and ``image_grid_thw``;
- **Gemma 3** (``Gemma3Model``): an image is ``mm_tokens_per_image`` tokens between begin and end of image
  (bare when the document has room for the image tokens only), centred in the document, so that an image of a
  document spanning ranks crosses a rank edge; a second image after the first token when there is room before
  the centred one; ``token_type_ids`` 1 on image tokens (each image's tokens see the whole image), positions
  ``0 .. n - 1``;
- **PaliGemma** (``PaliGemmaModel``): the image (``(image_size / patch_size)^2`` tokens) opens each document with
  room for it and two more tokens; the prefix (image and the first half of the text) is bidirectional:
  ``token_type_ids`` 0 on it, 1 on the suffix (and on padding); positions ``1 .. n``, as its forward numbers a
  document alone. Gemma 3 and PaliGemma take ``pixel_values [k, C, H, W]``;
- **Gemma 4** (``Gemma4UnifiedModel``, no vision tower): an image is ``2 x 2`` patches of ``model_patch_size``
  pixels, one token each, placed as Gemma 3's (centred between begin and end of image, a second one after the
  first token when there is room); ``mm_token_type_ids`` 1 on image tokens (a block when the text config says
  ``use_bidirectional_attention="vision"``), positions ``0 .. n - 1``; ``pixel_values [k, 4, 3 * p * p]`` (the
  patches' pixels, p the model patch size) with ``image_position_ids [k, 4, 2]`` (each patch's (x, y) in the image).

The packed batch holds ``input_ids``, pre-shifted ``labels``, each document's own ``position_ids`` (``[3, B, S]``
for mRoPE, else ``[B, S]``), ``_packed_seq_ids`` and the image inputs (the token types under the family's
``types_key``, the grids under its ``grid_key``). The truth runs each document alone with
its images through the stock model; the CP step gives the whole packed batch to the batch function and calls the
model's own forward on what it returns (the tower, the token splicing and the blocks are the model's).

Shape legend: B rows, S packed length, P patches, F features per patch (channels x temporal x patch x patch),
k images, C channels, H x W pixels, n tokens of a document.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from blockdiag_dist.integrations import IGNORE_INDEX, causal_lm_loss

from .harness import StepResult, _recording, padded_batch_step, param_grads
from .layouts import Packed, make_packed

__all__ = ["FAMILIES", "GRIDS", "IMAGE_INPUTS", "MAX_IMAGE_TOKENS", "ImageFamily", "MultimodalPacked", "image_family",
           "image_inputs", "images_unsupported", "make_multimodal", "multimodal_batched", "multimodal_forward",
           "multimodal_reference", "redraw_zero_init"]

GRIDS = ((1, 4, 4), (1, 2, 4), (1, 2, 2))  # Qwen-VL image grids in patches (t, h, w): 4, 2, 1 tokens after the merge
MAX_IMAGE_TOKENS = 16  # an image of more tokens fits no document of the model layouts: such a model runs on text only
# the model inputs a multimodal batch may add
IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "image_position_ids", "token_type_ids", "mm_token_type_ids")


@dataclass
class MultimodalPacked(Packed):
    """A :class:`~verify.model.layouts.Packed` whose documents may hold images: per document its ``pixel_values``
    (or None), its grids (Qwen-VL's ``[k, 3]``, Gemma 4's patch positions ``[k, P, 2]``; or None), its positions
    (``[3, n]`` for mRoPE, else ``[n]``) and its token types ``[n]`` (or None); ``pad_type``: the token type of
    padding; ``types_key`` / ``grid_key``: the model's keywords of the token types and of the grids."""

    pixels: list[Tensor | None] = field(default_factory=list)
    grids: list[Tensor | None] = field(default_factory=list)
    positions: list[Tensor] = field(default_factory=list)
    types: list[Tensor | None] = field(default_factory=list)
    pad_type: int = 0
    types_key: str = "token_type_ids"
    grid_key: str = "image_grid_thw"

    def doc_batch(self, i: int) -> dict[str, Tensor]:
        """Document ``i`` alone, as the model's forward takes it (labels pre-shifted)."""
        d = self.docs[i]
        labels = torch.full((1, d.numel()), IGNORE_INDEX, dtype=torch.int64)
        labels[0, :-1] = d[1:]
        out = {"input_ids": d[None], "labels": labels, "position_ids": self.positions[i][..., None, :]}
        if self.pixels[i] is not None:
            out["pixel_values"] = self.pixels[i]
        if self.grids[i] is not None:
            out[self.grid_key] = self.grids[i]
        if self.types[i] is not None:
            out[self.types_key] = self.types[i][None]
        return out


class Placed(NamedTuple):
    """One document with its images spliced in: tokens ``[n]``, pixel values (None: no image), grids (Qwen-VL's
    ``[k, 3]``, Gemma 4's ``[k, P, 2]``; or None) and token types ``[n]`` (None where the family has none)."""

    doc: Tensor
    pixels: Tensor | None = None
    grid: Tensor | None = None
    types: Tensor | None = None


@dataclass(frozen=True)
class ImageFamily:
    """How verify builds one family's image documents: ``models``, the inner model classes (by name, over the MRO)
    that select it (none: selected by its fields when no class selects another); ``problems(config, model)``, what
    the model lacks for these images (empty: images are built); ``place(config, doc, images_so_far, generator)``, the
    document with its images (:class:`Placed`); ``positions(model, placed)``, the document's own positions;
    ``pad_type``, the token type of padding (in no bidirectional block); ``redraw``, parameters (by name suffix) the
    model's init leaves all zero that carry the images into the text (:func:`redraw_zero_init`); ``types_key`` /
    ``grid_key``, the model's keywords of the token types and of the grids."""

    name: str
    inputs: str  # what the images are, in words (for the refusal of another family)
    models: tuple[str, ...]
    problems: Callable[[Any, nn.Module], list[str]]
    place: Callable[[Any, Tensor, int, torch.Generator], Placed]
    positions: Callable[[nn.Module, Placed], Tensor]
    pad_type: int = 0
    redraw: tuple[str, ...] = ()
    types_key: str = "token_type_ids"
    grid_key: str = "image_grid_thw"


REDRAW_STD = 0.02  # transformers' usual initializer_range


def redraw_zero_init(model: nn.Module, seed: int) -> list[str]:
    """Parameters of the model's image family (``ImageFamily.redraw``) that its init left all zero, drawn from
    ``seed`` (normal, std :data:`REDRAW_STD`); returns their names. Gemma 3 initialises its image projection to
    zero: every image feature would be 0, the vision tower's gradients 0, and RMS norms of zero rows in the decoder
    would scale gradients by ``1 / sqrt(eps)`` per norm (a float64 baseline error of order 1): images verify nothing
    then. Call on the model in one dtype before casting, so that every dtype holds the same weights."""
    family, _ = image_family(model.config, model)
    names = []
    if family is None:
        return names
    g = torch.Generator().manual_seed(3000 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(family.redraw) and not bool(p.any()):
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * REDRAW_STD)
                names.append(name)
    return names


def _splice(doc: Tensor, at: int, tokens: Sequence[int]) -> None:
    doc[at : at + len(tokens)] = torch.tensor(tokens, dtype=doc.dtype)


# ---- Qwen-VL: patches with image_grid_thw, mRoPE from get_rope_index ----------------------------------------
_QWEN_TOKENS = ("vision_start_token_id", "image_token_id", "vision_end_token_id")
_QWEN_VISION = ("spatial_merge_size", "temporal_patch_size", "patch_size", "in_channels")


def _qwen_problems(config, model: nn.Module) -> list[str]:
    missing = [f for f in _QWEN_TOKENS if getattr(config, f, None) is None]
    vision = getattr(config, "vision_config", None)
    missing += [f"vision_config.{f}" for f in _QWEN_VISION if getattr(vision, f, None) is None]
    if not hasattr(getattr(model, "model", None), "get_rope_index"):
        missing.append("model.get_rope_index")
    return [f"no {m}" for m in missing]


def _qwen_place(config, doc: Tensor, so_far: int, g: torch.Generator) -> Placed:
    vision = config.vision_config
    merge = vision.spatial_merge_size
    order = GRIDS[so_far % len(GRIDS):] + GRIDS[: so_far % len(GRIDS)]
    fits = [gr for gr in order if doc.numel() >= gr[0] * gr[1] * gr[2] // (merge * merge) + 2]
    if not fits:
        return Placed(doc)
    grid = fits[0]
    n_tokens = grid[0] * grid[1] * grid[2] // (merge * merge)
    _splice(doc, 1 if doc.numel() >= n_tokens + 3 else 0,
            [config.vision_start_token_id] + [config.image_token_id] * n_tokens + [config.vision_end_token_id])
    features = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    pixels = torch.randn(grid[0] * grid[1] * grid[2], features, generator=g)
    return Placed(doc, pixels, torch.tensor([grid], dtype=torch.int64))


def _qwen_positions(model: nn.Module, placed: Placed) -> Tensor:
    """mRoPE positions ``[3, n]`` of one document alone, from the model's own ``get_rope_index``."""
    doc = placed.doc
    if placed.grid is None:
        return torch.arange(doc.numel()).expand(3, -1).clone()
    types = (doc == model.config.image_token_id).to(torch.int32)[None]
    pos, _ = model.model.get_rope_index(doc[None], mm_token_type_ids=types, image_grid_thw=placed.grid)
    return pos[:, 0].to(torch.int64)


# ---- Gemma 3 and PaliGemma: whole images, token_type_ids ---------------------------------------------------
def _pixels(config, k: int, g: torch.Generator) -> Tensor:
    v = config.vision_config
    return torch.randn(k, v.num_channels, v.image_size, v.image_size, generator=g)


def _token(config, name: str) -> int | None:
    """``<name>_token_id`` or ``<name>_token_index`` (Gemma 3's configs carry both spellings)."""
    value = getattr(config, f"{name}_token_id", None)
    return getattr(config, f"{name}_token_index", None) if value is None else value


def _gemma3_problems(config, model: nn.Module) -> list[str]:
    out = [f"no {n}_token_id" for n in ("image", "boi", "eoi") if _token(config, n) is None]
    v = getattr(config, "vision_config", None)
    tokens = getattr(config, "mm_tokens_per_image", None)
    if v is None or not all(isinstance(getattr(v, f, None), int) for f in ("image_size", "patch_size", "num_channels")):
        return out + ["no vision_config.image_size / patch_size / num_channels"]
    if not isinstance(tokens, int):
        return out + ["no mm_tokens_per_image"]
    side, patches = round(tokens ** 0.5), v.image_size // v.patch_size
    if side * side != tokens or side == 0 or patches % side:
        out.append(f"pooling of {patches} x {patches} patches to mm_tokens_per_image {tokens}: expected a square "
                   "number of tokens whose side divides the patches per side")
    if tokens > MAX_IMAGE_TOKENS:
        out.append(f"{tokens} tokens per image (verify builds images of at most {MAX_IMAGE_TOKENS})")
    return out


def _centred_images(config, doc: Tensor, n_img: int) -> int:
    """Gemma 3's and Gemma 4's placement: ``n_img`` image tokens between begin and end of image (bare when the
    document has room for the image tokens only), centred, and a second image after the first token when there is
    room before the centred one; returns how many images (0: no room)."""
    image, n = _token(config, "image"), doc.numel()
    wrapped = [_token(config, "boi")] + [image] * n_img + [_token(config, "eoi")]
    span = wrapped if n >= len(wrapped) else [image] * n_img if n >= n_img else None
    if span is not None:
        centre = (n - len(span)) // 2
        starts = ([1] if centre >= len(span) + 1 else []) + [centre]
        for at in starts:
            _splice(doc, at, span)
    return 0 if span is None else len(starts)


def _gemma3_place(config, doc: Tensor, so_far: int, g: torch.Generator) -> Placed:
    k = _centred_images(config, doc, config.mm_tokens_per_image)
    types = (doc == _token(config, "image")).to(torch.int64)
    return Placed(doc, _pixels(config, k, g) if k else None, types=types)


def _paligemma_problems(config, model: nn.Module) -> list[str]:
    out = [] if _token(config, "image") is not None else ["no image_token_id"]
    v = getattr(config, "vision_config", None)
    if v is None or not all(isinstance(getattr(v, f, None), int) for f in ("image_size", "patch_size", "num_channels")):
        return out + ["no vision_config.image_size / patch_size / num_channels"]
    tokens = (v.image_size // v.patch_size) ** 2
    if tokens > MAX_IMAGE_TOKENS:
        out.append(f"{tokens} tokens per image (verify builds images of at most {MAX_IMAGE_TOKENS})")
    return out


def _paligemma_place(config, doc: Tensor, so_far: int, g: torch.Generator) -> Placed:
    v = config.vision_config
    n_img, n = (v.image_size // v.patch_size) ** 2, doc.numel()
    has_image = n >= n_img + 2
    if has_image:
        _splice(doc, 0, [_token(config, "image")] * n_img)
    text = n_img if has_image else 0
    prefix = text + (n - text + 1) // 2  # the image and the first half of the text (the prompt)
    types = (torch.arange(n) >= prefix).to(torch.int64)
    return Placed(doc, _pixels(config, 1, g) if has_image else None, types=types)


# ---- Gemma 4: patches embedded one by one (no tower), image_position_ids, mm_token_type_ids ---------------------
GEMMA4_GRID = (2, 2)  # patches per image (x, y): one token each


def _gemma4_problems(config, model: nn.Module) -> list[str]:
    out = [f"no {n}_token_id" for n in ("image", "boi", "eoi") if _token(config, n) is None]
    v = getattr(config, "vision_config", None)
    if v is None or not all(isinstance(getattr(v, f, None), int) for f in ("patch_size", "pooling_kernel_size",
                                                                            "mm_posemb_size")):
        return out + ["no vision_config.patch_size / pooling_kernel_size / mm_posemb_size"]
    if v.mm_posemb_size < max(GEMMA4_GRID):
        out.append(f"vision_config.mm_posemb_size {v.mm_posemb_size}: expected at least {max(GEMMA4_GRID)} (the "
                   f"{GEMMA4_GRID[0]} x {GEMMA4_GRID[1]} patches of an image)")
    return out


def _gemma4_place(config, doc: Tensor, so_far: int, g: torch.Generator) -> Placed:
    w, h = GEMMA4_GRID
    k = _centred_images(config, doc, w * h)
    types = (doc == _token(config, "image")).to(torch.int64)
    if not k:
        return Placed(doc, types=types)
    p = config.vision_config.model_patch_size
    grid = torch.tensor([[x, y] for y in range(h) for x in range(w)], dtype=torch.int64)
    return Placed(doc, torch.randn(k, w * h, 3 * p * p, generator=g), grid.expand(k, -1, -1).clone(), types)


FAMILIES: dict[str, ImageFamily] = {
    "qwen_vl": ImageFamily("Qwen-VL", "pixel patches with image_grid_thw, mRoPE from get_rope_index", (),
                           _qwen_problems, _qwen_place, _qwen_positions),
    "gemma3": ImageFamily("Gemma 3", "whole images between begin / end of image tokens, token_type_ids",
                          ("Gemma3Model",), _gemma3_problems, _gemma3_place,
                          lambda model, placed: torch.arange(placed.doc.numel()),
                          redraw=("multi_modal_projector.mm_input_projection_weight",)),
    "paligemma": ImageFamily("PaliGemma", "an image opening a bidirectional prefix, token_type_ids",
                             ("PaliGemmaModel",), _paligemma_problems, _paligemma_place,
                             lambda model, placed: torch.arange(placed.doc.numel()) + 1, pad_type=1),
    "gemma4": ImageFamily("Gemma 4", "patches with image_position_ids between begin / end of image tokens, "
                          "mm_token_type_ids", ("Gemma4UnifiedModel",), _gemma4_problems, _gemma4_place,
                          lambda model, placed: torch.arange(placed.doc.numel()),
                          types_key="mm_token_type_ids", grid_key="image_position_ids"),
}


def image_family(config, model: nn.Module) -> tuple[ImageFamily | None, str | None]:
    """``(family, None)`` when :func:`make_multimodal` builds images for this vision-language model, else
    ``(None, why not)`` in a few words (such a model is judged on text only). A family whose model class the model's
    inner model is (by name, over the MRO) is the only candidate; else the Qwen-VL family, by its fields."""
    names = {c.__name__ for c in type(getattr(model, "model", model)).__mro__}
    chosen = next((f for f in FAMILIES.values() if names & set(f.models)), None)
    if chosen is None:
        chosen = FAMILIES["qwen_vl"]
        problems = chosen.problems(config, model)
        if problems:
            known = ", ".join(f"{f.name} ({' / '.join(f.models)})" for f in FAMILIES.values() if f.models)
            return None, (f"images are built for {chosen.name}-style inputs ({chosen.inputs}) and for {known} only; "
                          "this model has " + ", ".join(problems[:3]) + ("..." if len(problems) > 3 else ""))
        return chosen, None
    problems = chosen.problems(config, model)
    if problems:
        return None, f"{chosen.name} images ({chosen.inputs}) not built: " + "; ".join(problems)
    return chosen, None


def images_unsupported(config, model: nn.Module) -> str | None:
    """None when :func:`make_multimodal` builds images for this vision-language model (:func:`image_family`); else
    why not, in a few words (such a model is judged on text only)."""
    return image_family(config, model)[1]


def make_multimodal(model: nn.Module, rows, vocab: int, seed: int = 0) -> MultimodalPacked:
    """The text layout of :func:`~verify.model.layouts.make_packed` with images spliced into documents that have
    room, by the model's family (see the module docstring); every tensor from one seed, float32 pixels."""
    family, why = image_family(model.config, model)
    if family is None:
        raise ValueError(f"make_multimodal: expected a model verify builds images for, got {type(model).__name__}: {why}")
    base = make_packed(rows, vocab, seed)
    g = torch.Generator().manual_seed(2000 + seed)
    ids = base.batch["input_ids"].clone()
    placed: list[Placed] = []
    for doc, (b, s) in zip(base.docs, base.places):
        p = family.place(model.config, doc.clone(), sum(x.pixels is not None for x in placed), g)
        ids[b, s : s + p.doc.numel()] = p.doc
        placed.append(p)
    positions = [family.positions(model, p) for p in placed]
    labels = torch.full_like(ids, IGNORE_INDEX)
    position_ids = torch.zeros(*positions[0].shape[:-1], *ids.shape, dtype=torch.int64) if positions else \
        torch.zeros_like(ids)
    types = torch.full_like(ids, family.pad_type) if any(p.types is not None for p in placed) else None
    for p, (b, s), pos in zip(placed, base.places, positions):
        n = p.doc.numel()
        labels[b, s : s + n - 1] = p.doc[1:]
        position_ids[..., b, s : s + n] = pos
        if types is not None and p.types is not None:
            types[b, s : s + n] = p.types
    batch = {"input_ids": ids, "labels": labels, "position_ids": position_ids,
             "_packed_seq_ids": base.batch["_packed_seq_ids"]}
    if types is not None:
        batch[family.types_key] = types
    if any(p.pixels is not None for p in placed):
        batch["pixel_values"] = torch.cat([p.pixels for p in placed if p.pixels is not None])
    if any(p.grid is not None for p in placed):
        batch[family.grid_key] = torch.cat([p.grid for p in placed if p.grid is not None])
    return MultimodalPacked(batch=batch, docs=[p.doc for p in placed], places=base.places, rows=base.rows,
                            pixels=[p.pixels for p in placed], grids=[p.grid for p in placed], positions=positions,
                            types=[p.types for p in placed], pad_type=family.pad_type, types_key=family.types_key,
                            grid_key=family.grid_key)


def image_inputs(model: nn.Module, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The image inputs (:data:`IMAGE_INPUTS`) the batch holds, pixels in the model's dtype."""
    kwargs = {k: batch[k] for k in IMAGE_INPUTS if batch.get(k) is not None}
    if "pixel_values" in kwargs:
        kwargs["pixel_values"] = kwargs["pixel_values"].to(next(model.parameters()).dtype)
    return kwargs


def multimodal_forward(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """The model's own forward on a (sharded or whole) multimodal batch: logits ``[B, L, V]``."""
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
                 **image_inputs(model, batch)).logits


def multimodal_reference(model: nn.Module, packed: MultimodalPacked, *, recorder=None) -> StepResult:
    """The truth: each document alone with its image, summed next-token cross-entropy and its gradients."""
    model.zero_grad(set_to_none=True)
    total, targets, records = 0.0, 0, []
    for i in range(len(packed.docs)):
        batch = packed.doc_batch(i)
        with _recording(recorder, 1, packed.docs[i].numel(), records):
            logits = multimodal_forward(model, batch)
        loss = causal_lm_loss(logits, batch["labels"], 1)
        loss.backward()
        total += float(loss.detach())
        targets += int((batch["labels"] != IGNORE_INDEX).sum())
    return StepResult(loss=total, grads=param_grads(model), targets=targets, records=records)


def multimodal_batched(model: nn.Module, recorder, packed: MultimodalPacked, length: int,
                       order: Sequence[int] | None = None) -> tuple[StepResult, list]:
    """The documents (in ``order``) right-padded into one batch ``[k, length]`` with their images (and their
    token types, padding of the family's padding type): the float64 baseline. Records per document, in
    ``order``."""
    order = list(range(len(packed.docs))) if order is None else list(order)
    images: dict[str, Tensor] = {}
    pixels = [packed.pixels[i] for i in order if packed.pixels[i] is not None]
    if pixels:
        images["pixel_values"] = torch.cat(pixels).to(next(model.parameters()).dtype)
    grids = [packed.grids[i] for i in order if packed.grids[i] is not None]
    if grids:
        images[packed.grid_key] = torch.cat(grids)
    if any(packed.types[i] is not None for i in order):
        n = max(length, max(packed.docs[i].numel() for i in order))
        types = torch.full((len(order), n), packed.pad_type, dtype=torch.int64)
        for row, i in enumerate(order):
            if packed.types[i] is not None:
                types[row, : packed.types[i].numel()] = packed.types[i]
        images[packed.types_key] = types
    return padded_batch_step(model, recorder, [packed.docs[i] for i in order], length,
                             [packed.positions[i] for i in order], **images)
