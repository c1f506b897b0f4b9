"""Load-balanced sharding for packed documents (``layout="balanced"``): pure, identical on every rank.

Under causal document masks the attention work of a query is the number of keys it sees: ``p - doc_start + 1``
at position ``p``. Contiguous shards therefore get unequal work (the rank holding the end of a long document
does the most). Here the padded row is cut into ``c * W`` equal chunks and every rank gets exactly ``c`` of
them (so every rank still holds the same number of rows, and any S and CP work, with no divisibility rule),
chosen to equalise the summed work:

1. longest-processing-time first: chunks by decreasing work, each to the least-loaded rank that still has
   room (a rank takes exactly ``c`` chunks);
2. then pairwise swaps between the most and the least loaded rank while that lowers the maximum.

``c`` is the smallest of 2, 4, 8, 16, 32 that brings max/mean work within ``TARGET``; finer chunks balance
better but cut more documents across ranks (more K/V to exchange), so the coarsest good one wins. A rank's
chunks are kept in ascending order, so its rows stay in global order.

With ``B > 1`` the rows share one assignment (tensors are ``[B, L, ...]``): the work of a position is summed
over rows.

``snapped_positions`` is the same with chunk boundaries moved to the nearest document boundary (a position
where every row starts a document or is padding) wherever that keeps max/mean work and max/mean rows within
``SNAP_TARGET``: fewer documents are cut, so fewer keys move and fewer pieces need a prefix block. Chunks then
differ in length; a rank holding fewer rows gets CP padding (positions past the sequence) to reach ``L``.

``layout="auto"`` (:func:`choose_layout`) models the step cost of contiguous, balanced and snapped sharding
from the doc ids alone (so every rank picks the same) and takes the cheapest: the slowest rank's attention
work plus its received K/V tokens and its cut pieces, each priced in attention (query, key) pairs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from blockdiag_ref import DocLayout

__all__ = ["SNAP_TARGET", "TARGET", "balanced_positions", "doc_boundaries", "position_work", "snapped_positions"]

TARGET = 1.02  # max/mean attention work accepted before trying finer chunks
SNAP_TARGET = 1.05  # max/mean work (and rows) a snapped layout may reach
SNAP_TOLERANCES = (1 / 2, 1 / 4, 1 / 8, 1 / 16)  # how far a boundary may move, in chunk lengths, tried in turn
CHUNKS_PER_RANK = (2, 4, 8, 16, 32)
_MAX_SWAPS = 200


def position_work(layout: DocLayout) -> Tensor:
    """float64 ``[S]``: keys seen by the query at each position, summed over rows (0 on padding)."""
    pos = torch.arange(layout.seq_len)
    starts = torch.cat([torch.tensor([0]), layout.segments[:, 1]])[layout.segment_ids]  # [B, S]
    keys = torch.where(layout.segment_ids != 0, pos - starts + 1, 0)
    return keys.sum(0).to(torch.float64)


def _assign(chunk_work: list[float], world: int, per_rank: int) -> tuple[list[list[int]], list[float]]:
    """Chunks to ranks, exactly ``per_rank`` each, minimising the largest summed work (LPT, then swaps)."""
    order = sorted(range(len(chunk_work)), key=lambda k: (-chunk_work[k], k))
    load = [0.0] * world
    owned: list[list[int]] = [[] for _ in range(world)]
    for k in order:
        r = min((r for r in range(world) if len(owned[r]) < per_rank), key=lambda r: (load[r], r))
        owned[r].append(k)
        load[r] += chunk_work[k]
    for _ in range(_MAX_SWAPS):
        hi = max(range(world), key=lambda r: (load[r], -r))
        lo = min(range(world), key=lambda r: (load[r], r))
        gap = load[hi] - load[lo]
        best = None
        for a in owned[hi]:
            for b in owned[lo]:
                d = chunk_work[a] - chunk_work[b]
                if 0 < d < gap:
                    new_max = max(load[hi] - d, load[lo] + d)
                    if best is None or new_max < best[0]:
                        best = (new_max, a, b, d)
        if best is None or best[0] >= load[hi]:
            break
        _, a, b, d = best
        owned[hi][owned[hi].index(a)] = b
        owned[lo][owned[lo].index(b)] = a
        load[hi] -= d
        load[lo] += d
    return owned, load


def balanced_positions(work: Tensor, world: int) -> tuple[int, Tensor, float]:
    """``(local_len, positions [W, L], max/mean work)`` for per-position ``work [S]``.

    >>> L, pos, imbalance = balanced_positions(torch.arange(1.0, 9.0), 2)  # one document of 8 tokens
    >>> L, pos.tolist(), imbalance
    (4, [[0, 1, 6, 7], [2, 3, 4, 5]], 1.0)
    """
    S = work.numel()
    if world == 1:  # one rank holds everything: nothing to balance, no padding to add
        return S, torch.arange(S)[None], 1.0
    best = None
    for per_rank in CHUNKS_PER_RANK:
        chunks = per_rank * world
        if best is not None and chunks > S:
            break  # chunks of less than one real token only add padding
        local_len = per_rank * -(-S // chunks)
        chunk_len = local_len // per_rank
        padded = torch.nn.functional.pad(work, (0, world * local_len - S))
        chunk_work = padded.view(chunks, chunk_len).sum(1).tolist()
        owned, load = _assign(chunk_work, world, per_rank)
        mean = sum(load) / world
        imbalance = max(load) / mean if mean > 0 else 1.0
        if best is None or imbalance < best[0] - 1e-12:
            starts = torch.tensor([sorted(ks) for ks in owned]) * chunk_len  # [W, c]
            positions = (starts[:, :, None] + torch.arange(chunk_len)).flatten(1)
            best = (imbalance, local_len, positions)
        if best[0] <= TARGET:
            break
    imbalance, local_len, positions = best
    return local_len, positions, imbalance


def doc_boundaries(layout: DocLayout) -> Tensor:
    """bool ``[S + 1]``: whether a chunk may start at position ``p`` without cutting a document in any row
    (every row starts a document there, or is padding on either side; ``0`` and ``S`` always)."""
    ids = layout.segment_ids
    prev = torch.nn.functional.pad(ids[:, :-1], (1, 0))
    ok = (ids != prev) | (ids == 0)
    return torch.cat([ok.all(0), torch.tensor([True])])


def _snap(edges: list[int], bounds: Tensor, reach: int) -> list[int]:
    """Move each interior edge to the nearest allowed boundary within ``reach`` (kept strictly increasing)."""
    allowed = bounds.nonzero().flatten()
    out = [edges[0]]
    for x in edges[1:-1]:
        if x < bounds.numel() - 1:
            i = int(torch.searchsorted(allowed, x))
            near = [int(allowed[j]) for j in (i - 1, i) if 0 <= j < allowed.numel()]
            best = min(near, key=lambda b: (abs(b - x), b))
            if abs(best - x) <= reach and best > out[-1]:
                x = best
        out.append(max(x, out[-1] + 1))
    out.append(edges[-1])
    return out


def snapped_positions(work: Tensor, world: int, bounds: Tensor) -> tuple[int, Tensor, float] | None:
    """Like :func:`balanced_positions`, with chunk boundaries snapped to ``bounds`` (see
    :func:`doc_boundaries`); ``None`` when no snapped layout keeps work and rows within ``SNAP_TARGET``.

    >>> layout = DocLayout.from_seqlens([3, 5, 4, 4])
    >>> L, pos, imbalance = snapped_positions(position_work(layout), 2, doc_boundaries(layout))
    >>> pos.tolist(), round(imbalance, 3)  # cut at 8, a document boundary (balanced cuts the 5-token document)
    ([[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]], 1.024)
    """
    S = work.numel()
    if world == 1:
        return None
    for per_rank in CHUNKS_PER_RANK:
        chunks = per_rank * world
        if chunks > S:
            break
        local_len = per_rank * -(-S // chunks)
        chunk_len = local_len // per_rank
        padded_len = world * local_len
        padded = torch.nn.functional.pad(work, (0, padded_len - S))
        cum = torch.nn.functional.pad(torch.cumsum(padded, 0), (1, 0))
        for tolerance in SNAP_TOLERANCES:
            edges = _snap([k * chunk_len for k in range(chunks + 1)], bounds, int(tolerance * chunk_len))
            chunk_work = [float(cum[b] - cum[a]) for a, b in zip(edges[:-1], edges[1:])]
            owned, load = _assign(chunk_work, world, per_rank)
            rows = [sum(edges[k + 1] - edges[k] for k in ks) for ks in owned]
            mean = sum(load) / world
            imbalance = max(load) / mean if mean > 0 else 1.0
            if imbalance <= SNAP_TARGET and max(rows) <= SNAP_TARGET * local_len:
                L = max(rows)
                extra = iter(range(padded_len, world * L))
                positions = torch.tensor([
                    [p for k in sorted(ks) for p in range(edges[k], edges[k + 1])] + [next(extra) for _ in range(L - n)]
                    for ks, n in zip(owned, rows)
                ])
                return L, positions, imbalance
    return None
