"""What the K/V exchange delivered, against the minimum computed from the reference mask alone.

Each rank reports the global (row, position) of its real rows and, per forward call, how many tokens arrived
from each other rank (the sizes of the tensors its collectives returned). Here, from ``blockdiag_ref``'s mask
and those positions only (no plan of the implementation), rank ``r`` must receive from rank ``s`` exactly the
keys held by ``s`` that some real query of ``r`` may see: a needed-only exchange (halo, all-to-all) moves
exactly that, no exchange (local) is allowed only when it is 0 everywhere, and an all-gather moves every
token of every other rank.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from blockdiag_ref import DocLayout

from .cases import Case, case_blocks

__all__ = ["exchange_metrics", "needed_from_reference"]


def needed_from_reference(doc_ids: Tensor, owner: Tensor, world: int, window: int = -1, chunk: int = -1,
                          bidirectional: bool = False, whole_blocks: bool = False) -> Tensor:
    """int64 ``[W (source), W (destination)]``: keys each rank needs from each other rank.

    ``doc_ids [B, S]``; ``owner [B, S]``: the rank holding each real position (-1 for padding positions);
    ``chunk``: chunked local attention's chunk length (-1 = none); ``bidirectional``: with the blocks of
    :func:`verify.cases.case_blocks` (later keys of a query's block; with ``whole_blocks`` every key of it, beyond the
    window too). A pure function of its arguments, computed
    once per distinct value (many cases of a matrix share their layout and sharding).
    """
    key = (_key(doc_ids), _key(owner), int(world), int(window), int(chunk), bool(bidirectional), bool(whole_blocks))
    return _needed(*key).clone()


def _key(t: Tensor) -> tuple:
    return (str(t.dtype), tuple(t.shape), tuple(t.flatten().tolist()))


@functools.lru_cache(maxsize=256)
def _needed(ids_key: tuple, owner_key: tuple, world: int, window: int, chunk: int, bidirectional: bool = False,
            whole_blocks: bool = False) -> Tensor:
    ids = torch.tensor(ids_key[2], dtype=getattr(torch, ids_key[0].removeprefix("torch."))).view(ids_key[1])
    owner = torch.tensor(owner_key[2], dtype=torch.int64).view(owner_key[1])
    blocks = torch.tensor(case_blocks(ids.tolist()), dtype=torch.int64) if bidirectional else None
    mask = DocLayout.from_doc_ids(ids).materialize_mask(
        window_size=(window, 0) if window >= 0 else None, chunk_size=chunk if chunk > 0 else None,
        bidirectional_blocks=blocks, whole_blocks=whole_blocks)[:, 0]
    held = (owner[None] == torch.arange(world)[:, None, None]).double()  # [W, B, S]: rank r holds (b, s)
    seen = torch.einsum("rbq,bqk->rbk", held, mask.double()) > 0  # [W, B, S] keys some real query of r may see
    counts = torch.einsum("rbk,sbk->sr", seen.double(), held).round().to(torch.int64)  # [source, destination]
    counts.fill_diagonal_(0)
    return counts


def exchange_metrics(case: Case, per_rank: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``recv_tokens_vs_needed``: what arrived per (source, destination), summed over forward calls' mismatches
    (empty when the implementation does not report its exchange)."""
    if not per_rank or any("arrived" not in info for info in per_rank):
        return {}
    world = len(per_rank)
    ids = torch.tensor(case.doc_ids(), dtype=torch.int64)
    owner = torch.full_like(ids, -1)
    for r, info in enumerate(per_rank):
        rows = torch.tensor(info["real_positions"], dtype=torch.int64).view(-1, 2)
        owner[rows[:, 0], rows[:, 1]] = r
    needed = needed_from_reference(ids, owner, world, per_rank[0].get("window", case.window), case.chunk,
                                   case.bidirectional and case.layer == "attention",  # a convolution's window: W - 1
                                   case.whole_blocks and case.layer == "attention")
    bad, worst = [], 0
    for r, info in enumerate(per_rank):
        mode = info.get("mode")
        want = [info["local_tokens"] if (mode == "allgather" and s != r) else int(needed[s, r]) for s in range(world)]
        calls = info["arrived"] or ([[0] * world] if mode == "local" else [])
        if not calls:
            bad.append(f"rank {r} ({mode}): no forward exchange recorded")
            worst = max(worst, sum(want) or 1)
        for got in calls:
            got = list(got) if got else [0] * world
            diff = sum(abs(g - w) for g, w in zip(got, want)) + abs(len(got) - world)
            if diff:
                bad.append(f"rank {r} ({mode}) received {got} tokens per source rank, expected {want}")
                worst = max(worst, diff)
    total = int(needed.sum())
    row = {"err": float(worst), "scale": float(total), "limit": 0.0, "ok": not bad, "expected": total}
    if bad:
        row["why"] = "; ".join(bad)
    return {"recv_tokens_vs_needed": row}
