"""Bidirectional blocks per document (Gemma 3's and Gemma 4's image tokens, PaliGemma's prefix): the step's plan.

A *block* is the set of tokens of one document that share a block id (:meth:`blockdiag_ref.DocLayout.block_labels`).
A query in a block also sees every later key of its block; everywhere else attention stays causal per document.
How a window meets a block is the model's: a window bounds the keys before a query, those of its block included
(Gemma 3: the window AND (causal OR block)), or, with *whole blocks*, a query sees its whole block beyond the window
(Gemma 4, PaliGemma: (the window AND causal) OR the block). A block that crosses a rank edge therefore makes a rank
need keys *after* its pieces, held by later ranks, and with whole blocks the block's keys before the window, held by
earlier ranks: the needed set of a piece grows by the runs of every block one of its queries lies in, after the
piece's end (and, with whole blocks, before it; a block whose id recurs later in its document is several runs:
only its own runs are fetched, not the text between them). The
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
from .plan import ExchangePlan, StepPlan
from .shard_plan import ShardPlan, interval_ranges

__all__ = ["BlockPlan", "bidirectional_ranges", "exchange_plan", "plan_blocks"]


@dataclass(frozen=True, eq=False)
class BlockPlan:
    """The step's bidirectional blocks, per flat id of the padded batch (host tensors).

    - ``labels`` int64 ``[B * Sp]``: the block of each token (1, 2, ...; 0 outside any block, on padding and on
      CP padding), unique across documents and rows;
    - ``piece_key_end`` int64 ``[P]``: one past the last key each piece's queries may see (the piece's end, or
      the end of the block its queries reach furthest into);
    - ``piece_block_start`` int64 ``[P]``: the first token of the block each piece's queries reach furthest back
      into (the piece's start when none does): with whole blocks, the first key they may see is the earlier of it
      and the window's start.
    """

    labels: Tensor
    piece_key_end: Tensor
    piece_block_start: Tensor
    digest: bytes


def plan_blocks(layout: DocLayout, shards: ShardPlan, docs: DocPlan, bidirectional_blocks: Tensor) -> BlockPlan:
    """The blocks of ``bidirectional_blocks`` (int ``[B, S]``, 0 = no block) over the step's pieces (pure).

    >>> from blockdiag_dist.plan import plan_step
    >>> plan = plan_step(torch.tensor([[1, 1, 1, 1, 1, 2, 2, 2]]), 2)   # rank 0: 0..3, rank 1: 4..7
    >>> bp = plan_blocks(plan.layout, plan.shards, plan.documents, torch.tensor([[0, 0, 7, 7, 7, 0, 0, 0]]))
    >>> bp.labels.tolist(), bp.piece_key_end.tolist(), bp.piece_block_start.tolist()  # the image 2..4 crosses the edge
    ([0, 0, 1, 1, 1, 0, 0, 0], [5, 5, 8], [0, 2, 5])
    """
    labels = layout.block_labels(bidirectional_blocks)  # [B, S], validated
    sp, B = shards.padded_len, layout.batch_size
    flat = torch.nn.functional.pad(labels, (0, sp - layout.seq_len)).flatten()
    n = int(flat.max()) + 1 if flat.numel() else 1
    pos = torch.arange(sp).repeat(B)
    last = torch.full((n,), -1, dtype=torch.int64).scatter_reduce_(0, flat, pos, "amax")
    first = torch.full((n,), sp, dtype=torch.int64).scatter_reduce_(0, flat, pos, "amin")
    ends = torch.where(flat != 0, last[flat] + 1, 0)
    starts = torch.where(flat != 0, first[flat], sp)
    t = docs.table
    q_flat = interval_ranges(t["row"] * sp + t["start"], t["length"])
    piece = torch.repeat_interleave(torch.arange(t["length"].numel()), t["length"])
    reach = torch.zeros(t["length"].numel(), dtype=torch.int64).scatter_reduce_(0, piece, ends[q_flat], "amax")
    key_end = torch.maximum(t["start"] + t["length"], reach)
    back = torch.full((t["length"].numel(),), sp, dtype=torch.int64).scatter_reduce_(0, piece, starts[q_flat], "amin")
    block_start = torch.minimum(t["start"], back)
    digest = hashlib.sha256(flat.numpy().tobytes()).digest()
    return BlockPlan(labels=flat, piece_key_end=key_end, piece_block_start=block_start, digest=digest)


def _block_ranges(docs: DocPlan, labels: Tensor, whole: bool = False) -> Tensor:
    """``[K, 4]`` ``(dest, row, lo, hi)``: for every piece, the runs of each block one of its queries lies in,
    clipped to after the piece's end, or whole with ``whole`` (a block's tokens are contiguous runs; a recurring id
    makes several; a destination's own positions in them are dropped by the exchange plan)."""
    t, sp = docs.table, docs.shards.padded_len
    n = labels.numel()
    change = torch.ones(n, dtype=torch.bool)
    change[1:] = (labels[1:] != labels[:-1]) | (torch.arange(1, n) % sp == 0)
    run_lo = change.nonzero().flatten()
    run_hi = torch.cat([run_lo[1:], torch.tensor([n])])
    run_label = labels[run_lo]
    keep = run_label != 0
    run_lo, run_hi, run_label = run_lo[keep], run_hi[keep], run_label[keep]
    order = torch.argsort(run_label, stable=True)  # the runs of each block, grouped
    run_lo, run_hi, run_label = run_lo[order], run_hi[order], run_label[order]
    count = torch.bincount(run_label, minlength=int(labels.max()) + 1 if n else 1)
    first_run = torch.cumsum(count, 0) - count
    q_flat = interval_ranges(t["row"] * sp + t["start"], t["length"])
    piece = torch.repeat_interleave(torch.arange(t["length"].numel()), t["length"])
    pairs = torch.unique(torch.stack([piece, labels[q_flat]], 1)[labels[q_flat] != 0], dim=0)  # (piece, block)
    if pairs.shape[0] == 0:
        return torch.zeros(0, 4, dtype=torch.int64)
    p, lab = pairs[:, 0], pairs[:, 1]
    per = count[lab]
    which = interval_ranges(first_run[lab], per)  # every run of each pair's block
    p = torch.repeat_interleave(p, per)
    end_flat = t["row"][p] * sp + t["start"][p] + t["length"][p]
    lo, hi = (run_lo[which] if whole else torch.maximum(run_lo[which], end_flat)), run_hi[which]
    later = hi > lo
    p, lo, hi = p[later], lo[later], hi[later]
    row = t["row"][p]
    return torch.stack([t["rank"][p], row, lo - row * sp, hi - row * sp], 1)


def bidirectional_ranges(docs: DocPlan, causal_ranges: Tensor, blocks: BlockPlan, whole: bool = False) -> Tensor:
    """The needed ranges ``[K, 4]`` (``(dest, row, lo, hi)``, see :class:`~blockdiag_dist.plan.ExchangePlan`) of
    causal attention (``causal_ranges``) joined with the keys of the blocks: every run, after the piece's end (all
    of it with ``whole``: whole blocks), of each block a query of the piece lies in. Merged per destination and
    row, ordered by destination then flat id, disjoint."""
    extra = _block_ranges(docs, blocks.labels, whole)
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


def exchange_plan(plan: StepPlan, window_left: int, blocks: BlockPlan, whole: bool = False) -> ExchangePlan:
    """The step's :class:`~blockdiag_dist.plan.ExchangePlan` for attention with ``blocks``: the causal (and
    windowed) needed ranges of ``plan`` joined with the later keys of the blocks, or with ``whole`` (whole blocks)
    every key of them (:func:`bidirectional_ranges`).

    >>> from blockdiag_dist.plan import plan_step
    >>> plan = plan_step(torch.tensor([[1] * 8]), 2)   # rank 0: 0..3, rank 1: 4..7
    >>> bp = plan_blocks(plan.layout, plan.shards, plan.documents, torch.tensor([[0, 0, 7, 7, 7, 0, 0, 0]]))
    >>> [sorted(n.tolist()) for n in exchange_plan(plan, -1, bp).needed]   # rank 0 fetches the image's key 4
    [[4], [0, 1, 2, 3]]
    >>> [sorted(n.tolist()) for n in exchange_plan(plan, 0, bp, whole=True).needed]  # window 0: the image only
    [[4], [2, 3]]
    """
    causal = plan.exchange(window_left)
    return ExchangePlan(shards=causal.shards, batch_size=causal.batch_size, window_left=window_left,
                        ranges=bidirectional_ranges(plan.documents, causal.ranges, blocks, whole))
