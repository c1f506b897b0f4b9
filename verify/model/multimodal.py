"""Vision-language batches for model-level cases (Qwen2.5-VL, Qwen3-VL and their kin): documents holding an
image, packed with what the model's own forward needs.

Each document of 3 tokens or more gets one image (the first grid of :data:`GRIDS` that fits, starting from a
different one each document: 4, 2 or 1 image tokens after the ``2 x 2`` merge) at its start, or after its first
token when there is room: ``vision_start, image x k, vision_end``. Its mRoPE
positions ``[3, n]`` come from the model's own ``get_rope_index`` on the document alone; the packed batch holds
``input_ids``, pre-shifted ``labels``, ``position_ids [3, B, S]`` (each document's own), ``_packed_seq_ids``,
``pixel_values`` of every image in row order and ``image_grid_thw``. The truth runs each document alone with
its image through the stock model; the CP step gives the whole packed batch to the batch function and calls
the model's own forward on what it returns (the tower and the token splicing are the model's).

Shape legend: B rows, S packed length, P patches, F features per patch (channels x temporal x patch x patch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from blockdiag_dist.integrations import IGNORE_INDEX, causal_lm_loss

from .harness import StepResult, _recording, padded_batch_step, param_grads
from .layouts import Packed, make_packed

__all__ = ["GRIDS", "MultimodalPacked", "images_unsupported", "make_multimodal", "multimodal_batched",
           "multimodal_forward", "multimodal_reference"]

GRIDS = ((1, 4, 4), (1, 2, 4), (1, 2, 2))  # image grids in patches (t, h, w): 4, 2, 1 tokens after the 2 x 2 merge


@dataclass
class MultimodalPacked(Packed):
    """A :class:`~verify.model.layouts.Packed` whose documents may hold an image: per document its
    ``pixel_values [P_i, F]`` (or None), grid ``[1, 3]`` and mRoPE positions ``[3, n_i]``."""

    pixels: list[Tensor | None] = field(default_factory=list)
    grids: list[Tensor | None] = field(default_factory=list)
    positions: list[Tensor] = field(default_factory=list)

    def doc_batch(self, i: int) -> dict[str, Tensor]:
        """Document ``i`` alone, as the model's forward takes it (labels pre-shifted)."""
        d = self.docs[i]
        labels = torch.full((1, d.numel()), IGNORE_INDEX, dtype=torch.int64)
        labels[0, :-1] = d[1:]
        out = {"input_ids": d[None], "labels": labels, "position_ids": self.positions[i][:, None, :]}
        if self.pixels[i] is not None:
            out["pixel_values"] = self.pixels[i]
            out["image_grid_thw"] = self.grids[i]
        return out


_TOKEN_FIELDS = ("vision_start_token_id", "image_token_id", "vision_end_token_id")
_VISION_FIELDS = ("spatial_merge_size", "temporal_patch_size", "patch_size", "in_channels")


def images_unsupported(config, model: nn.Module) -> str | None:
    """None when :func:`make_multimodal` builds images for this vision-language model (the Qwen-VL kind: vision
    start / image / end tokens, a vision config with a spatial merge and temporal patches, ``get_rope_index`` on
    the inner model); else why not, in a few words (such a model is judged on text only)."""
    missing = [f for f in _TOKEN_FIELDS if getattr(config, f, None) is None]
    vision = getattr(config, "vision_config", None)
    missing += [f"vision_config.{f}" for f in _VISION_FIELDS if getattr(vision, f, None) is None]
    if not hasattr(getattr(model, "model", None), "get_rope_index"):
        missing.append("model.get_rope_index")
    if missing:
        return ("images are built for Qwen-VL-style inputs only (pixel patches with image_grid_thw, mRoPE from "
                "get_rope_index); this model has no " + ", ".join(missing[:3]) + ("..." if len(missing) > 3 else ""))
    return None


def _tokens(config) -> tuple[int, int, int]:
    return config.vision_start_token_id, config.image_token_id, config.vision_end_token_id


def _feature_size(vision) -> int:
    return vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2


def make_multimodal(model: nn.Module, rows, vocab: int, seed: int = 0) -> MultimodalPacked:
    """The text layout of :func:`~verify.model.layouts.make_packed` with images spliced into documents that have
    room (see the module docstring); every tensor from one seed, float32 pixels."""
    base = make_packed(rows, vocab, seed)
    config = model.config
    vision = config.vision_config
    merge = vision.spatial_merge_size
    start, image, end = _tokens(config)
    g = torch.Generator().manual_seed(2000 + seed)
    ids = base.batch["input_ids"].clone()
    pixels, grids, positions, docs = [], [], [], []
    k_img = 0
    for i, (doc, (b, s)) in enumerate(zip(base.docs, base.places)):
        doc = doc.clone()
        order = GRIDS[k_img % len(GRIDS):] + GRIDS[: k_img % len(GRIDS)]
        fits = [gr for gr in order if doc.numel() >= gr[0] * gr[1] * gr[2] // (merge * merge) + 2]
        if fits:
            grid = fits[0]
            n_tokens = grid[0] * grid[1] * grid[2] // (merge * merge)
            at = 1 if doc.numel() >= n_tokens + 3 else 0
            doc[at] = start
            doc[at + 1 : at + 1 + n_tokens] = image
            doc[at + 1 + n_tokens] = end
            pixels.append(torch.randn(grid[0] * grid[1] * grid[2], _feature_size(vision), generator=g))
            grids.append(torch.tensor([grid], dtype=torch.int64))
            k_img += 1
        else:
            pixels.append(None)
            grids.append(None)
        ids[b, s : s + doc.numel()] = doc
        docs.append(doc)
        positions.append(_rope_index(model, doc, grids[-1]))
    labels = torch.full_like(ids, IGNORE_INDEX)
    position_ids = torch.zeros(3, *ids.shape, dtype=torch.int64)
    for doc, (b, s), pos in zip(docs, base.places, positions):
        n = doc.numel()
        labels[b, s : s + n - 1] = doc[1:]
        position_ids[:, b, s : s + n] = pos
    batch = {"input_ids": ids, "labels": labels, "position_ids": position_ids,
             "_packed_seq_ids": base.batch["_packed_seq_ids"]}
    with_images = [i for i, p in enumerate(pixels) if p is not None]
    if with_images:
        batch["pixel_values"] = torch.cat([pixels[i] for i in with_images])
        batch["image_grid_thw"] = torch.cat([grids[i] for i in with_images])
    return MultimodalPacked(batch=batch, docs=docs, places=base.places, rows=base.rows, pixels=pixels, grids=grids,
                            positions=positions)


def _rope_index(model: nn.Module, doc: Tensor, grid: Tensor | None) -> Tensor:
    """mRoPE positions ``[3, n]`` of one document alone, from the model's own ``get_rope_index``."""
    if grid is None:
        return torch.arange(doc.numel()).expand(3, -1).clone()
    inner = model.model
    types = (doc == model.config.image_token_id).to(torch.int32)[None]
    pos, _ = inner.get_rope_index(doc[None], mm_token_type_ids=types, image_grid_thw=grid)
    return pos[:, 0].to(torch.int64)


def multimodal_forward(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """The model's own forward on a (sharded or whole) multimodal batch: logits ``[B, L, V]``."""
    kwargs = {k: batch[k] for k in ("pixel_values", "image_grid_thw") if batch.get(k) is not None}
    if "pixel_values" in kwargs:
        kwargs["pixel_values"] = kwargs["pixel_values"].to(next(model.parameters()).dtype)
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False, **kwargs).logits


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
    """The documents (in ``order``) right-padded into one batch ``[k, length]`` with their images: the float64
    baseline. Records per document, in ``order``."""
    order = list(range(len(packed.docs))) if order is None else list(order)
    pixels = [packed.pixels[i] for i in order if packed.pixels[i] is not None]
    images = {}
    if pixels:
        images["pixel_values"] = torch.cat(pixels).to(next(model.parameters()).dtype)
        images["image_grid_thw"] = torch.cat([packed.grids[i] for i in order if packed.grids[i] is not None])
    return padded_batch_step(model, recorder, [packed.docs[i] for i in order], length,
                             [packed.positions[i] for i in order], **images)
