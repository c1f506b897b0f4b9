"""All-gather exchange: every rank receives every rank's packed K/V; backward reduce-scatters the grads."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .recompute import read_recompute_marker, save_recompute_marker
from .traffic import TrafficLog

__all__ = ["all_gather_tensor", "allgather_kv", "reduce_scatter_tensor"]

# torch 2.13 renamed the tensor forms of all-gather / reduce-scatter; older releases have only the old names.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _allgather_forward(kv_tok: Tensor, group: dist.ProcessGroup, world: int) -> Tensor:
    """``[Tq, F]`` -> ``[W * Tq, F]``, ordered by rank."""
    out = kv_tok.new_empty((world * kv_tok.shape[0], kv_tok.shape[1]))
    all_gather_tensor(out, kv_tok.contiguous(), group=group)
    return out


def _allgather_backward(grad: Tensor, group: dist.ProcessGroup, world: int) -> Tensor:
    """``[W * Tq, F]`` -> ``[Tq, F]``: each rank's slice summed over every rank that used it."""
    out = grad.new_empty((grad.shape[0] // world, grad.shape[1]))
    reduce_scatter_tensor(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=group)
    return out


class _AllGatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv_tok: Tensor, group: dist.ProcessGroup, world: int, log: TrafficLog | None) -> Tensor:
        ctx.group, ctx.world, ctx.log = group, world, log
        save_recompute_marker(ctx, kv_tok)
        out = _allgather_forward(kv_tok, group, world)
        if log is not None:
            n = kv_tok.numel() * (world - 1)
            rank = dist.get_rank(group)
            arrived = tuple(0 if r == rank else part.shape[0] for r, part in enumerate(out.chunk(world)))
            log.record("allgather", "forward", n, n, kv_tok.element_size(), arrived)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        read_recompute_marker(ctx)
        out = _allgather_backward(grad, ctx.group, ctx.world)
        if ctx.log is not None:
            n = out.numel() * (ctx.world - 1)
            ctx.log.record("allgather", "backward", n, n, out.element_size())
        return out, None, None, None


def allgather_kv(kv_tok: Tensor, group: dist.ProcessGroup, world: int, log: TrafficLog | None = None) -> Tensor:
    """Differentiable all-gather of packed K/V tokens ``[Tq, F]`` -> ``[W * Tq, F]``."""
    return _AllGatherKV.apply(kv_tok, group, world, log)
