"""Packed batches of a model-level case: the verifier's named layouts (``verify.cases.NAMED_LAYOUTS``, functions of
the CP size) with every run scaled for a small model, filled with random tokens from one seed.

Scaling every run by the same factor keeps what each layout is about at every CP size (a document over every
rank, documents ending exactly on rank boundaries, a rank holding only padding, many short documents): the
shard length scales with them. Documents are maximal runs of one id (ids 0 are padding), as everywhere.

Shape legend: B rows, S packed length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from blockdiag_ref import DocLayout

from ..cases import NAMED_LAYOUTS, Rows, format_rows
from .tiny import SPECIAL_TOKENS

__all__ = ["DEFAULT_LAYOUTS", "MODEL_LAYOUTS", "MODEL_SOURCES", "Packed", "batch_for_source", "covering", "make_packed", "model_coverage", "model_rows"]

# name -> scale of the named layout's runs
MODEL_LAYOUTS: dict[str, int] = {
    "spans-every-rank": 3,  # a document from rank 0 to the last rank, short ones around it
    "rank-edges": 4,  # each document is exactly one rank's shard
    "padding-rank": 3,  # the last rank holds only padding
    "many-short": 2,  # 2 * CP + 2 documents of 2 to 6 tokens
    "middle-padding": 3,  # padding between documents
    "two-rows": 3,  # B = 2, padding at both ends of the second row
    "reused-ids": 3,  # an id that comes back after another is a new document
    "s-not-divisible": 3,  # S not a multiple of the CP size
    "one-long": 3,  # one document over the whole row
    "single-tokens": 1,  # documents of one token (no target)
}
DEFAULT_LAYOUTS = ("spans-every-rank", "rank-edges", "padding-rank", "many-short", "reused-ids")

# How a trainer's collator hands the documents to the batch function (a case sends exactly one of them):
MODEL_SOURCES: dict[str, str] = {
    "packed": "_packed_seq_ids: the layout's own ids (an id may come back later in a row: reused-ids)",
    "positions": "position_ids restarting at 0 at every document, nothing else (a flattening collator)",
    "mask4d": "a 4-D boolean attention_mask [B, 1, S, S] of the documents, with the restarting position_ids",
}
TEXT_ONLY_SOURCES = ("positions", "mask4d")  # a vision-language batch gives its documents as _packed_seq_ids


def covering(layouts: Sequence[str], sources: Sequence[str], dtypes: Sequence[str]) -> list[tuple[str, str, str]]:
    """``(layout, source, dtype)`` triples in which every layout meets every source and every dtype at least once:
    ``max(len(sources), len(dtypes))`` per layout, the pairing of sources and dtypes shifted from layout to
    layout (so that each source also meets each dtype once there are enough layouts)."""
    if not layouts or not sources or not dtypes:
        raise ValueError(f"covering: expected layouts, sources and dtypes, got {list(layouts)}, {list(sources)}, {list(dtypes)}")
    n = max(len(sources), len(dtypes))
    return [(layout, sources[(i + j) % len(sources)], dtypes[(i + j // len(sources)) % len(dtypes)])
            for j, layout in enumerate(layouts) for i in range(n)]


def model_coverage(cases: Sequence, cps: Sequence[int], layouts: Sequence[str], sources: Sequence[str],
                   dtypes: Sequence[str]) -> dict[str, dict]:
    """The (layout, source) and (layout, dtype) pairs the model cases met at every CP size in ``cps``:
    ``{"layout x source": {"met": 15, "total": 15, "missing": ["reused-ids x mask4d (CP 2)", ...]}, ...}``."""
    seen = {(c.cp, c.layout, "source", c.source) for c in cases} | {(c.cp, c.layout, "dtype", c.dtype) for c in cases}
    out = {}
    for dim, values in (("source", sources), ("dtype", dtypes)):
        missing = []
        for layout in layouts:
            for value in values:
                gaps = [f"CP {cp}" for cp in cps if (cp, layout, dim, value) not in seen]
                if gaps:
                    missing.append(f"{layout} x {value} ({', '.join(gaps)})")
        total = len(layouts) * len(values)
        out[f"layout x {dim}"] = {"met": total - len(missing), "total": total, "missing": missing}
    return out


def batch_for_source(packed: Packed, source: str) -> dict[str, Tensor]:
    """The batch a collator of ``source`` (:data:`MODEL_SOURCES`) gives: ``input_ids``, pre-shifted ``labels``, the
    restarting ``position_ids``, and the documents as ``_packed_seq_ids`` (the layout's own ids, reused ones
    included), or nothing more (``positions``), or a 4-D boolean ``attention_mask``. ``packed.batch`` (whose
    ``_packed_seq_ids`` number the documents apart, for the parent's bookkeeping) is not changed."""
    if source not in MODEL_SOURCES:
        raise ValueError(f"source: expected one of {', '.join(MODEL_SOURCES)}, got {source!r}")
    ids = torch.tensor([[i for i, n in row for _ in range(n)] for row in packed.rows], dtype=torch.int64)
    batch = {k: v for k, v in packed.batch.items() if k != "_packed_seq_ids"}
    if source == "packed":
        batch["_packed_seq_ids"] = ids
    elif source == "mask4d":
        batch["attention_mask"] = DocLayout.from_doc_ids(ids).materialize_mask()
    return batch


def model_rows(name: str, cp: int) -> Rows:
    """The runs of model-level layout ``name`` at CP size ``cp``; ValueError naming the layouts otherwise."""
    if name not in MODEL_LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(MODEL_LAYOUTS)}, got {name!r}")
    scale = MODEL_LAYOUTS[name]
    return tuple(tuple((i, n * scale) for i, n in row) for row in NAMED_LAYOUTS[name](cp))


@dataclass
class Packed:
    """A packed batch (``input_ids``, ``labels`` pre-shifted, ``position_ids`` and ``_packed_seq_ids``, ``[B, S]``),
    its documents (token ids, in row order) and where each starts (``places[i] = (row, start)``)."""

    batch: dict[str, Tensor]
    docs: list[Tensor]
    places: list[tuple[int, int]]
    rows: Rows

    @property
    def lengths(self) -> list[int]:
        return [int(d.numel()) for d in self.docs]

    @property
    def real(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, positions) of every real token, row-major."""
        b, s = torch.nonzero(self.batch["_packed_seq_ids"] != 0, as_tuple=True)
        return b.numpy(), s.numpy()

    def describe(self) -> str:
        return format_rows(self.rows)


def make_packed(rows: Rows, vocab: int, seed: int = 0) -> Packed:
    """Random tokens in ``[1, vocab - SPECIAL_TOKENS)`` (never a special token of the tiny vocabulary) for the
    documents of ``rows``; padding id 0, label -100 on padding and on each document's last token."""
    if vocab <= SPECIAL_TOKENS + 1:
        raise ValueError(f"vocab: expected more than {SPECIAL_TOKENS + 1} tokens, got {vocab}")
    g = torch.Generator().manual_seed(1000 + seed)
    ids = torch.tensor([[i for i, n in row for _ in range(n)] for row in rows], dtype=torch.int64)
    layout = DocLayout.from_doc_ids(ids)
    seg = layout.segment_ids  # [B, S]: one id per document, 0 on padding
    B, S = ids.shape
    input_ids = torch.zeros(B, S, dtype=torch.int64)
    labels = torch.full((B, S), -100, dtype=torch.int64)
    position_ids = torch.zeros(B, S, dtype=torch.int64)
    seq_ids = torch.zeros(B, S, dtype=torch.int64)
    docs, places = [], []
    for b in range(B):
        s, index = 0, 0
        while s < S:
            if seg[b, s] == 0:
                s += 1
                continue
            e = s
            while e < S and seg[b, e] == seg[b, s]:
                e += 1
            index += 1
            tokens = torch.randint(1, vocab - SPECIAL_TOKENS, (e - s,), generator=g)
            input_ids[b, s:e] = tokens
            labels[b, s : e - 1] = tokens[1:]
            position_ids[b, s:e] = torch.arange(e - s)
            seq_ids[b, s:e] = index
            docs.append(tokens)
            places.append((b, s))
            s = e
    batch = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "_packed_seq_ids": seq_ids}
    return Packed(batch=batch, docs=docs, places=places, rows=rows)
