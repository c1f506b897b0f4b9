"""Differentiable gather of row blocks of different sizes from every rank, placed in a global order (the vision
tower's outputs when its images are sharded across the CP ranks); backward reduce-scatters the gradients, so each
rank receives the sum over every rank of the gradient of its own rows.

Shape legend: W ranks, n_r rows held by rank r, m = max n_r, N = sum n_r rows in all, F features per row.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .allgather import all_gather_tensor, reduce_scatter_tensor

__all__ = ["gather_rows"]


def _gather_rows_forward(local: Tensor, pos: Tensor, m: int, group: dist.ProcessGroup, world: int) -> Tensor:
    """``[n_r, F]`` -> ``[N, F]``: every rank's rows padded to ``m``, all-gathered, taken at ``pos``."""
    padded = local.new_zeros((m, local.shape[1]))
    padded[: local.shape[0]] = local
    buffer = local.new_empty((world * m, local.shape[1]))
    all_gather_tensor(buffer, padded, group=group)
    return buffer.index_select(0, pos)


def _gather_rows_backward(grad: Tensor, pos: Tensor, n: int, m: int, group: dist.ProcessGroup, world: int) -> Tensor:
    """``[N, F]`` -> ``[n_r, F]``: the gradient of this rank's rows, summed over every rank."""
    buffer = grad.new_zeros((world * m, grad.shape[1]))
    buffer.index_copy_(0, pos, grad.contiguous())
    out = grad.new_empty((m, grad.shape[1]))
    reduce_scatter_tensor(out, buffer, op=dist.ReduceOp.SUM, group=group)
    return out[:n]


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: Tensor, pos: Tensor, m: int, group: dist.ProcessGroup, world: int) -> Tensor:
        ctx.save_for_backward(pos)
        ctx.n, ctx.m, ctx.group, ctx.world = local.shape[0], m, group, world
        return _gather_rows_forward(local, pos, m, group, world)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (pos,) = ctx.saved_tensors
        return _gather_rows_backward(grad, pos, ctx.n, ctx.m, ctx.group, ctx.world), None, None, None, None


def gather_rows(local: Tensor, counts: list[int], pos: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Differentiable: ``local [n_r, F]`` (this rank's rows; ``counts[r] = n_r`` on every rank) -> ``[N, F]``
    whose row ``i`` is row ``pos[i] % m`` of rank ``pos[i] // m`` (``m = max(counts)``; ``pos`` int64 ``[N]``,
    the same on every rank). Collective: every rank calls it, in the same order."""
    world = len(counts)
    m = max(counts)
    if local.dim() != 2 or local.shape[0] != counts[dist.get_rank(group)]:
        raise ValueError(
            f"gather_rows: expected this rank's rows [{counts[dist.get_rank(group)]}, F], got {tuple(local.shape)}"
        )
    return _GatherRows.apply(local, pos.to(local.device), m, group, world)
