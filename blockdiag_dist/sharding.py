"""Moving sequence-aligned tensors between the full row and a rank's shard.

``shard_tensor`` pads a tensor to ``W * L`` along its sequence dim and takes one rank's rows (differentiable);
``unshard`` puts every rank's shard back in global order; ``gather_sequence`` does that across the CP group,
for evaluation and logging (for example to restore per-token outputs of a ``balanced`` layout).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .plan import ShardPlan

__all__ = ["gather_sequence", "shard_tensor", "unshard"]


def shard_tensor(t: Tensor, dim: int, pad_value: object, shards: ShardPlan, rank: int) -> Tensor:
    """Pad ``t`` along ``dim`` to ``W * L`` with ``pad_value`` and take this rank's rows (differentiable)."""
    S, L = shards.seq_len, shards.local_len
    if shards.layout in ("contiguous", "auto:contiguous"):
        start = rank * L
        real = max(0, min(S, start + L) - start)
        piece = t.narrow(dim, min(start, S), real)
        if real == L:
            return piece
        pad_shape = list(t.shape)
        pad_shape[dim] = L - real
        return torch.cat([piece, torch.full(pad_shape, pad_value, dtype=t.dtype, device=t.device)], dim=dim)
    pad_shape = list(t.shape)
    pad_shape[dim] = shards.padded_len - S
    padded = torch.cat([t, torch.full(pad_shape, pad_value, dtype=t.dtype, device=t.device)], dim=dim)
    return padded.index_select(dim, shards.positions[rank].to(t.device))


def unshard(parts: list[Tensor], shards: ShardPlan, dim: int = 1) -> Tensor:
    """Every rank's shard (rank order) -> the tensor in global order along ``dim``, CP padding dropped."""
    if len(parts) != shards.world:
        raise ValueError(f"unshard: expected {shards.world} shards (one per rank), got {len(parts)}")
    full = torch.cat(parts, dim=dim)
    order = torch.argsort(shards.positions.flatten()).to(full.device)
    return full.index_select(dim, order[: shards.seq_len])


@torch.no_grad()
def gather_sequence(local: Tensor, state=None, *, dim: int = 1) -> Tensor:
    """All-gather this rank's shard of a sequence-aligned tensor from every CP rank and return the full tensor
    in the original token order (CP padding dropped), on every rank. Collective: every rank must call it.
    No gradient flows through it. ``state`` defaults to the active step state.

    For example ``logits_BSV = gather_sequence(logits_BLV)`` after a forward under ``train_ctx()``.
    """
    from .state import current_state

    state = state or current_state()
    if state is None:
        raise ValueError("gather_sequence: expected a step state (pass train_ctx.state, or call inside train_ctx()), got none")
    if local.shape[dim] != state.local_len:
        raise ValueError(f"gather_sequence: expected {state.local_len} rows along dim {dim}, got shape {tuple(local.shape)}")
    if state.world == 1:
        parts = [local]
    else:
        parts = [torch.empty_like(local) for _ in range(state.world)]
        dist.all_gather(parts, local.contiguous(), group=state.group)
    return unshard(parts, state.plan.shards, dim)
