"""The shard plan: which global positions each rank holds (pure, identical on every rank), and the segment ids of the
padded stream. The lowest floor of the step's plans: :mod:`blockdiag_dist.docs` (documents for any mixer) and
:mod:`blockdiag_dist.plan` (the attention exchange) both build on it.

Shape legend:
    B     batch rows                 S     sequence length given       Sp    padded length = W * L
    W     CP world size              L     rows held by one rank
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from blockdiag_ref import DocLayout

from .balance import balanced_positions

__all__ = ["ShardPlan", "padded_doc_starts", "padded_segments", "plan_shards"]


@dataclass(frozen=True, eq=False)
class ShardPlan:
    """Which global positions each rank holds. Row ``l`` of rank ``r`` is position ``positions[r, l]``.

    Positions ``>= seq_len`` are CP padding (added so that every rank holds ``local_len`` rows).
    """

    world: int
    seq_len: int
    local_len: int
    positions: Tensor  # int64 [W, L], a permutation of range(W * L)
    layout: str = "contiguous"

    @property
    def padded_len(self) -> int:
        return self.world * self.local_len

    @cached_property
    def owner(self) -> Tensor:
        """int64 ``[Sp]``: the rank holding each position."""
        out = torch.empty(self.padded_len, dtype=torch.int64)
        out[self.positions.flatten()] = torch.arange(self.world).repeat_interleave(self.local_len)
        return out

    @cached_property
    def owner_row(self) -> Tensor:
        """int64 ``[Sp]``: the local row index of each position on its owner."""
        out = torch.empty(self.padded_len, dtype=torch.int64)
        out[self.positions.flatten()] = torch.arange(self.local_len).repeat(self.world)
        return out


def plan_shards(seq_len: int, world: int, layout: str = "contiguous", *, work: Tensor | None = None) -> ShardPlan:
    """Which positions each rank holds.

    ``contiguous`` (the seed's sequential sharding): pad to a multiple of ``world``; rank ``r`` holds
    ``[r * L, (r + 1) * L)`` with ``L = ceil(S / W)``. ``balanced``: equal row counts with equalised attention
    work, from ``work [S]`` (see :mod:`blockdiag_dist.balance`).

    >>> plan_shards(5, 2).positions
    tensor([[0, 1, 2],
            [3, 4, 5]])
    """
    if world < 1:
        raise ValueError(f"world: expected a CP size >= 1, got {world}")
    if seq_len < 1:
        raise ValueError(f"seq_len: expected S >= 1, got {seq_len}")
    if layout == "contiguous":
        local_len = -(-seq_len // world)
        positions = torch.arange(world * local_len).view(world, local_len)
    elif layout == "balanced":
        if work is None or work.shape != (seq_len,):
            got = None if work is None else tuple(work.shape)
            raise ValueError(f"layout 'balanced': expected the work per position [S] = [{seq_len}], got {got}")
        local_len, positions, _ = balanced_positions(work, world)
    else:
        raise ValueError(f"layout: expected 'contiguous' or 'balanced', got {layout!r}")
    return ShardPlan(world=world, seq_len=seq_len, local_len=local_len, positions=positions, layout=layout)



def padded_segments(layout: DocLayout, shards: ShardPlan) -> Tensor:
    """Segment ids ``[B, Sp]`` (unique across rows; 0 = padding), CP padding appended."""
    return torch.nn.functional.pad(layout.segment_ids, (0, shards.padded_len - layout.seq_len))


def padded_doc_starts(layout: DocLayout, shards: ShardPlan) -> Tensor:
    """Start position of each token's document ``[B, Sp]`` (``-1`` on padding)."""
    seg = padded_segments(layout, shards)
    starts = torch.cat([torch.tensor([-1]), layout.segments[:, 1]])
    return starts[seg]
