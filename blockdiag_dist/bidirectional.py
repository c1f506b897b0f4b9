"""Bidirectional blocks per document (Gemma 3's image tokens, PaliGemma's prefix): the step's plan.

A *block* is the set of tokens of one document that share a block id (:meth:`blockdiag_ref.DocLayout.block_labels`).
A query in a block also sees every later key of its block; everywhere else attention stays causal per document,
and a window bounds only the keys before a query. A block that crosses a rank edge therefore makes a rank need
keys *after* its pieces, held by later ranks: the needed set of a piece grows by ``[piece end, block end)`` for the
block its last query lies in (the later keys of every other block of the piece are inside the piece). The
exchanges carry those keys like any other needed key, and their gradients flow back to their owners through the
exchange's backward; the kernels mask by block label (the masked plan of the varlen kernel, the dense kernel).

Planning reads the block ids once per step, token by token (they are a per-token input): labels and block ends
``[B * Sp]`` on the host, a maximum per piece. Every rank derives the same plan from the replicated ids.

Shape legend: B batch rows, S positions given, Sp padded positions (W * L), P pieces (all ranks), K ranges.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from blockdiag_ref import DocLayout

from .docs import DocPlan
from .shard_plan import ShardPlan, interval_ranges

__all__ = ["BlockPlan", "bidirectional_ranges", "plan_blocks"]


@dataclass(frozen=True, eq=False)
class BlockPlan:
    """The step's bidirectional blocks, per flat id of the padded batch (host tensors).

    - ``labels`` int64 ``[B * Sp]``: the block of each token (1, 2, ...; 0 outside any block, on padding and on
      CP padding), unique across documents and rows;
    - ``ends`` int64 ``[B * Sp]``: one past the last position of each token's block (0 outside any block);
    - ``piece_key_end`` int64 ``[P]``: one past the last key each piece's queries may see (the piece's end, or
      the end of the block its queries reach furthest into).
    """

    labels: Tensor
    ends: Tensor
    piece_key_end: Tensor
    digest: bytes

    @property
    def any(self) -> bool:
        return bool(self.piece_key_end.numel()) and bool((self.labels != 0).any())


def plan_blocks(layout: DocLayout, shards: ShardPlan, docs: DocPlan, bidirectional_blocks: Tensor) -> BlockPlan:
    """The blocks of ``bidirectional_blocks`` (int ``[B, S]``, 0 = no block) over the step's pieces (pure).

    >>> from blockdiag_dist.plan import plan_step
    >>> plan = plan_step(torch.tensor([[1, 1, 1, 1, 1, 2, 2, 2]]), 2)   # rank 0: 0..3, rank 1: 4..7
    >>> bp = plan_blocks(plan.layout, plan.shards, plan.documents, torch.tensor([[0, 0, 7, 7, 7, 0, 0, 0]]))
    >>> bp.labels.tolist(), bp.piece_key_end.tolist()   # the image 2..4 crosses the rank edge
    ([0, 0, 1, 1, 1, 0, 0, 0], [5, 5, 8])
    """
    labels = layout.block_labels(bidirectional_blocks)  # [B, S], validated
    sp, B = shards.padded_len, layout.batch_size
    flat = torch.nn.functional.pad(labels, (0, sp - layout.seq_len)).flatten()
    n = int(flat.max()) + 1 if flat.numel() else 1
    pos = torch.arange(sp).repeat(B)
    last = torch.full((n,), -1, dtype=torch.int64).scatter_reduce_(0, flat, pos, "amax")
    ends = torch.where(flat != 0, last[flat] + 1, 0)
    t = docs.table
    q_flat = interval_ranges(t["row"] * sp + t["start"], t["length"])
    piece = torch.repeat_interleave(torch.arange(t["length"].numel()), t["length"])
    reach = torch.zeros(t["length"].numel(), dtype=torch.int64).scatter_reduce_(0, piece, ends[q_flat], "amax")
    key_end = torch.maximum(t["start"] + t["length"], reach)
    digest = hashlib.sha256(flat.numpy().tobytes()).digest()
    return BlockPlan(labels=flat, ends=ends, piece_key_end=key_end, digest=digest)


def bidirectional_ranges(docs: DocPlan, causal_ranges: Tensor, blocks: BlockPlan) -> Tensor:
    """The needed ranges ``[K, 4]`` (``(dest, row, lo, hi)``, see :class:`~blockdiag_dist.plan.ExchangePlan`) of
    causal attention (``causal_ranges``) joined with the later keys of the blocks: ``[piece end, key end)`` of
    every piece whose block goes on after it. Merged per destination and row, ordered by destination then flat id,
    disjoint."""
    t = docs.table
    end = t["start"] + t["length"]
    later = blocks.piece_key_end > end
    extra = torch.stack([t["rank"][later], t["row"][later], end[later], blocks.piece_key_end[later]], 1)
    ranges = torch.cat([causal_ranges, extra])
    if ranges.shape[0] == 0:
        return ranges
    sp = docs.shards.padded_len
    key = (ranges[:, 0] * docs.batch_size + ranges[:, 1]) * (sp + 1)
    order = torch.argsort(key + ranges[:, 2])
    ranges, key = ranges[order], key[order]
    hi_so_far = torch.cummax(key + ranges[:, 3], 0).values
    new = torch.ones(ranges.shape[0], dtype=torch.bool)
    new[1:] = key[1:] + ranges[1:, 2] > hi_so_far[:-1]  # starts after everything before it (same dest and row)
    group = torch.cumsum(new, 0) - 1
    first = new.nonzero().flatten()
    hi = torch.zeros(first.numel(), dtype=torch.int64).scatter_reduce_(0, group, ranges[:, 3], "amax", include_self=False)
    return torch.stack([ranges[first, 0], ranges[first, 1], ranges[first, 2], hi], 1)
