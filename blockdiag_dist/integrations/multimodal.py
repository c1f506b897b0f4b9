"""Pack (text, images) documents into rows for a vision-language model (Qwen2.5-VL / Qwen3-VL style mRoPE).

A document is a mapping: ``input_ids`` (its tokens, where each image is a run of ``image_token_id`` placeholders,
one per vision feature), and, when it holds images, ``pixel_values [n_patches, F]`` (its images' patches in
order) and ``image_grid_thw [n_images, 3]`` (each image's patch grid). A run of image tokens stands for
``t * h * w / merge**2`` features of the vision tower (``merge = spatial_merge_size``).

Per-document mRoPE positions ``[3, n]`` (temporal, height, width), the rule of Qwen2.5-VL's and Qwen3-VL's
``get_rope_index`` for images: text tokens count on from the previous position on every axis; an image starting at
position ``s`` with a merged grid ``(t, h', w')`` gives its token ``(i, j, k)`` the position ``(s + i, s + j,
s + k)``, and the text after it continues at ``s + max(h', w')``. A document's first token is ``(0, 0, 0)``,
text or image: a document starts where every axis is 0 (how :func:`blockdiag_ref.doc_ids_from_batch` reads
``[3, B, S]`` positions).

Shape legend: R packed rows, S tokens per row, n tokens of a document, F features per patch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .packing import IGNORE_INDEX, empty_rows, fill_rows

__all__ = ["NOT_MODEL_INPUTS", "MultimodalPackingCollator", "model_inputs", "mrope_position_ids",
           "pack_multimodal_documents"]

# what the batch function and the loss read beside a model's inputs (never passed to the model)
NOT_MODEL_INPUTS = ("labels", "loss_mask", "padding_mask", "_packed_seq_ids")

RopeIndex = Callable[..., Any]  # (input_ids [1, n], mm_token_type_ids=[1, n], image_grid_thw=[k, 3]) -> [3, 1, n]


def _runs(mask: Tensor) -> list[tuple[int, int]]:
    """(start, end) of every run of True in ``mask [n]``."""
    padded = torch.nn.functional.pad(mask.to(torch.int8), (1, 1))
    edges = (padded[1:] - padded[:-1]).nonzero().flatten().tolist()
    return list(zip(edges[0::2], edges[1::2]))


def mrope_position_ids(
    input_ids: Tensor, image_grid_thw: Tensor | None, *, image_token_id: int, spatial_merge_size: int
) -> Tensor:
    """int64 ``[3, n]``: the mRoPE positions of one document ``input_ids [n]`` whose images have the patch grids
    ``image_grid_thw [k, 3]`` (in order; each image is one run of ``image_token_id``), by the rule above.

    >>> mrope_position_ids(torch.tensor([5, 9, 9, 9, 9, 6]), torch.tensor([[1, 4, 4]]), image_token_id=9,
    ...                    spatial_merge_size=2).tolist()
    [[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]]
    """
    runs = _runs(input_ids == image_token_id)
    grids = [] if image_grid_thw is None else image_grid_thw.tolist()
    out = torch.empty(3, input_ids.numel(), dtype=torch.int64)
    pos, cursor = 0, 0
    for (start, end), (t, h, w) in zip(runs, grids):
        out[:, cursor:start] = torch.arange(pos, pos + start - cursor)
        pos += start - cursor
        hm, wm = h // spatial_merge_size, w // spatial_merge_size
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(hm), torch.arange(wm), indexing="ij"))
        out[:, start:end] = grid.reshape(3, -1) + pos
        pos += max(hm, wm)
        cursor = end
    out[:, cursor:] = torch.arange(pos, pos + input_ids.numel() - cursor)
    return out


@dataclass(frozen=True)
class _Doc:
    tokens: Tensor  # int64 [n]
    pixels: Tensor | None  # [n_patches, F]
    grids: Tensor  # int64 [k, 3]


def _check_document(doc: Any, index: int, image_token_id: int, merge: int, seq_len: int) -> _Doc:
    """One document, validated: its image-token runs match its grids and its patches match the grids."""
    where = f"docs[{index}]"
    if not isinstance(doc, Mapping) or "input_ids" not in doc:
        raise ValueError(f"{where}: expected a mapping with 'input_ids' (and 'pixel_values', 'image_grid_thw' "
                         f"when it holds images), got {type(doc).__name__}")
    tokens = torch.as_tensor(doc["input_ids"])
    if tokens.dim() != 1 or tokens.numel() == 0 or tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise ValueError(f"{where}: input_ids: expected a non-empty 1-D sequence of integer token ids, got "
                         f"{tokens.dtype} of shape {tuple(tokens.shape)}")
    tokens = tokens.to(torch.int64)
    if tokens.numel() > seq_len:
        raise ValueError(f"{where}: expected at most seq_len = {seq_len} tokens, got {tokens.numel()}")
    grids = doc.get("image_grid_thw")
    grids = torch.zeros(0, 3, dtype=torch.int64) if grids is None else torch.as_tensor(grids).to(torch.int64)
    if grids.dim() != 2 or grids.shape[1] != 3 or bool((grids < 1).any()):
        raise ValueError(f"{where}: image_grid_thw: expected [n_images, 3] positive (t, h, w) patch grids, got "
                         f"{grids.tolist()}")
    runs = _runs(tokens == image_token_id)
    if len(runs) != grids.shape[0]:
        raise ValueError(f"{where}: expected one run of image tokens ({image_token_id}) per image of "
                         f"image_grid_thw ({grids.shape[0]}), got {len(runs)} runs")
    for j, ((start, end), (t, h, w)) in enumerate(zip(runs, grids.tolist())):
        if h % merge or w % merge or end - start != t * h * w // merge**2:
            raise ValueError(
                f"{where}: image {j} (grid t={t}, h={h}, w={w}, spatial_merge_size={merge}): expected "
                f"{t * h * w // merge**2 if not (h % merge or w % merge) else 'h and w divisible by the merge'} "
                f"image tokens (one per vision feature), got {end - start} at positions {start}..{end - 1}"
            )
    pixels = doc.get("pixel_values")
    patches = int(grids.prod(-1).sum())
    if pixels is None and patches:
        raise ValueError(f"{where}: pixel_values: expected [{patches}, F] (the patches of its images), got none")
    if pixels is not None:
        pixels = torch.as_tensor(pixels)
        if pixels.dim() != 2 or pixels.shape[0] != patches:
            raise ValueError(f"{where}: pixel_values: expected [{patches}, F], one row per patch of image_grid_thw "
                             f"{grids.tolist()}, got shape {tuple(pixels.shape)}")
    return _Doc(tokens, pixels if patches else None, grids)


def pack_multimodal_documents(
    docs: Sequence[Mapping[str, Any]],
    seq_len: int,
    *,
    image_token_id: int,
    spatial_merge_size: int,
    rope_index: RopeIndex | None = None,
    rows: int | None = None,
    padding_token_id: int = 0,
) -> dict[str, Tensor]:
    """Pack (text, images) documents, in order, into rows of ``seq_len`` tokens (next-fit, never split).

    Returns ``input_ids``, ``mm_token_type_ids`` (1 on image tokens), ``labels``, ``_packed_seq_ids`` ``[R, S]``,
    ``position_ids [3, R, S]`` (per-document mRoPE positions; 0 on padding), and when any document holds images
    ``pixel_values [N, F]`` and ``image_grid_thw [n_images, 3]`` in row order. ``labels`` are pre-shifted:
    ``labels[t] = input_ids[t + 1]`` within a document, ``-100`` where the target is an image token and at each
    document's last token. Positions come from :func:`mrope_position_ids`, or from ``rope_index`` (the model's
    own ``get_rope_index``) called on each document alone.

    Raises ``ValueError`` naming the document when its image tokens, grids and patches disagree.
    """
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len: expected an int >= 1, got {seq_len!r}")
    if not isinstance(spatial_merge_size, int) or spatial_merge_size < 1:
        raise ValueError(f"spatial_merge_size: expected an int >= 1, got {spatial_merge_size!r}")
    if rows is not None and (not isinstance(rows, int) or rows < 1):
        raise ValueError(f"rows: expected None or an int >= 1, got {rows!r}")
    checked = [_check_document(d, i, image_token_id, spatial_merge_size, seq_len) for i, d in enumerate(docs)]
    widths = {d.pixels.shape[1] for d in checked if d.pixels is not None}
    if len(widths) > 1:
        raise ValueError(f"pixel_values: expected one feature width F in every document, got {sorted(widths)}")
    row_docs = [[checked[i] for i in row] for row in fill_rows([d.tokens.numel() for d in checked], seq_len, rows)]
    input_ids, labels, seq_ids = empty_rows(len(row_docs), seq_len, padding_token_id)
    position_ids = torch.zeros((3, len(row_docs), seq_len), dtype=torch.int64)
    pixels, grids = [], []
    for r, ds in enumerate(row_docs):
        start = 0
        for index, d in enumerate(ds, start=1):
            n = d.tokens.numel()
            input_ids[r, start:start + n] = d.tokens
            target = d.tokens[1:]
            labels[r, start:start + n - 1] = target.masked_fill(target == image_token_id, IGNORE_INDEX)
            seq_ids[r, start:start + n] = index
            position_ids[:, r, start:start + n] = _positions(d, image_token_id, spatial_merge_size, rope_index)
            if d.pixels is not None:
                pixels.append(d.pixels)
                grids.append(d.grids)
            start += n
    out = {
        "input_ids": input_ids,
        "mm_token_type_ids": (input_ids == image_token_id).to(torch.int64) * (seq_ids != 0),
        "position_ids": position_ids,
        "labels": labels,
        "_packed_seq_ids": seq_ids,
    }
    if pixels:
        out["pixel_values"] = torch.cat(pixels)
        out["image_grid_thw"] = torch.cat(grids)
    return out


def _positions(d: _Doc, image_token_id: int, merge: int, rope_index: RopeIndex | None) -> Tensor:
    if rope_index is None:
        return mrope_position_ids(d.tokens, d.grids, image_token_id=image_token_id, spatial_merge_size=merge)
    types = (d.tokens == image_token_id).to(torch.int64)[None]
    got = rope_index(d.tokens[None], mm_token_type_ids=types, image_grid_thw=d.grids if d.grids.numel() else None)
    got = got[0] if isinstance(got, tuple) else got
    if not isinstance(got, Tensor) or tuple(got.shape) != (3, 1, d.tokens.numel()):
        raise ValueError(f"rope_index: expected position ids [3, 1, {d.tokens.numel()}] for a document, got "
                         f"{tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__}")
    return got[:, 0].to(torch.int64)


@dataclass(frozen=True)
class MultimodalPackingCollator:
    """A ``collate_fn`` packing (text, images) documents with :func:`pack_multimodal_documents`.

    >>> collate = MultimodalPackingCollator(seq_len=8, image_token_id=9, spatial_merge_size=2)
    >>> b = collate([{"input_ids": [5, 9, 6], "pixel_values": torch.zeros(4, 12), "image_grid_thw": [[1, 2, 2]]},
    ...              {"input_ids": [7, 8]}])
    >>> b["position_ids"][:, 0].tolist(), b["labels"].tolist()
    ([[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 0, 1, 0, 0, 0]], [[-100, 6, -100, 8, -100, -100, -100, -100]])
    """

    seq_len: int
    image_token_id: int
    spatial_merge_size: int
    rope_index: RopeIndex | None = None
    rows: int | None = None
    padding_token_id: int = 0

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        return pack_multimodal_documents(
            features, self.seq_len, image_token_id=self.image_token_id, spatial_merge_size=self.spatial_merge_size,
            rope_index=self.rope_index, rows=self.rows, padding_token_id=self.padding_token_id,
        )


def model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of a (sharded) batch that the model's own forward takes: all but ``labels`` (the model would
    shift them again; the loss comes from the logits) and blockdiag's bookkeeping (``_packed_seq_ids``,
    ``padding_mask``, ``loss_mask``). ``model(**model_inputs(batch), use_cache=False)``."""
    return {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}
