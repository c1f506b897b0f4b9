"""Moving sequence-aligned tensors between the full row and a rank's shard.

``shard_tensor`` pads a tensor to ``W * L`` along its sequence dim and takes one rank's rows (differentiable);
``shard_visual_tokens`` takes the rows of a tensor indexed by visual token (deepstack embeddings ``[n_vis, H]``)
whose positions one rank holds, in its local order; ``unshard`` puts every rank's shard back in global order;
``gather_sequence`` does that across the CP group, for evaluation and logging (for example to restore per-token
outputs of a ``balanced`` layout).

Shape legend: B rows, S sequence length, Sp = W * L padded length, L rows of one rank, n_vis visual tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .shard_plan import ShardPlan

__all__ = [
    "check_visual_rows", "gather_sequence", "local_visual_index", "shard_tensor", "shard_visual_tokens", "unshard",
]


MAX_SLICES = 64  # runs of a rank copied slice by slice; beyond, one gather (index_select) of its positions


def shard_tensor(t: Tensor, dim: int, pad_value: object, shards: ShardPlan, rank: int) -> Tensor:
    """This rank's rows of ``t`` along ``dim``, in its local order, the rows past the end of ``t`` (CP padding up to
    ``W * L``) filled with ``pad_value`` (differentiable). Only the rank's rows are copied, never a padded copy of
    the whole row: its runs as slices (a view where one run of real rows is all it holds), or one gather where it
    holds more than ``MAX_SLICES`` runs."""
    S = shards.seq_len
    runs = shards.rank_runs(rank)
    if runs.shape[0] > MAX_SLICES:
        positions = shards.rank_positions(rank)
        beyond = positions >= S
        if not bool(beyond.any()):
            return t.index_select(dim, positions.to(t.device))
        rows = t.index_select(dim, positions.clamp(max=S - 1).to(t.device))
        shape = [1] * t.dim()
        shape[dim] = positions.numel()
        fill = torch.full((), pad_value, dtype=t.dtype, device=t.device)
        return torch.where(beyond.view(shape).to(t.device), fill, rows)
    parts, padding = [], False
    for start, length in runs[:, 1:3].tolist():
        real = max(0, min(S, start + length) - start)
        if real:
            parts.append(t.narrow(dim, start, real))
        if real < length:
            pad_shape = list(t.shape)
            pad_shape[dim] = length - real
            parts.append(torch.full(pad_shape, pad_value, dtype=t.dtype, device=t.device))
            padding = True
    if len(parts) == 1 and not padding:
        return parts[0]  # one run of real rows: a view, as a contiguous shard is
    # (a rank of padding alone still returns a function of t, with zero gradient, as any other shard)
    return torch.cat([t.narrow(dim, 0, 0), *parts], dim=dim)


def local_visual_index(mask: Tensor, shards: ShardPlan, rank: int) -> Tensor:
    """int64 ``[n_local]``: for the visual tokens (``mask [B, S]`` True) at positions ``rank`` holds, their index
    in the batch's visual-token order (row-major over ``[B, S]``, as ``hidden[mask]`` enumerates them), listed in
    the rank's local order (row-major over ``[B, L]``, as ``hidden_local[mask_local]`` enumerates them)."""
    B, S = mask.shape
    index = torch.cumsum(mask.reshape(-1).to(torch.int64), 0).view(B, S) - 1
    padded = torch.zeros(B, shards.padded_len, dtype=torch.bool, device=mask.device)
    padded[:, :S] = mask
    index = torch.nn.functional.pad(index, (0, shards.padded_len - S))
    rows = shards.rank_positions(rank).to(mask.device)
    return index[:, rows][padded[:, rows]]


def shard_visual_tokens(t: Tensor, mask: Tensor, shards: ShardPlan, rank: int) -> Tensor:
    """The rows of ``t [n_vis, ...]`` (one per visual token of ``mask [B, S]``, in the batch's order) whose
    positions ``rank`` holds, in its local order: what ``hidden_local[mask_local]`` pairs with (differentiable)."""
    return t.index_select(0, local_visual_index(mask, shards, rank).to(t.device))


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


def check_visual_rows(levels: Sequence[Tensor], visual_pos_masks: Tensor, name: str, why: Callable[[], str]) -> None:
    """Each tensor of ``levels`` (deepstack features) holds one row per visual token of ``visual_pos_masks``,
    ``[n_vis, H]``; else ``ValueError`` naming ``name[level]``, with ``why()`` after the expected count."""
    n_vis = int(visual_pos_masks.sum())
    for level, t in enumerate(levels):
        if t.dim() != 2 or t.shape[0] != n_vis:
            raise ValueError(f"{name}[{level}]: expected [n_vis, H] with n_vis = {n_vis}{why()}, got shape {tuple(t.shape)}")
