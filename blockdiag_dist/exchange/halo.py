"""Halo exchange: each rank sends its right neighbour exactly the tokens it needs and receives from its left
neighbour (point-to-point, per-pair sizes from the plan). Valid when every rank's needed set lies on its
left neighbour. Every rank posts its send and receive, with zero elements when nothing is needed, so the
pattern of operations is the same on every step."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .traffic import TrafficLog

__all__ = ["halo_kv"]


def _shift(send: Tensor, recv: Tensor, to_rank: int | None, from_rank: int | None, group: dist.ProcessGroup) -> None:
    """Post ``send -> to_rank`` and ``recv <- from_rank`` (group ranks; None = no neighbour) and wait."""
    ops = []
    if to_rank is not None:
        ops.append(dist.P2POp(dist.isend, send, dist.get_global_rank(group, to_rank), group=group))
    if from_rank is not None:
        ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, from_rank), group=group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _halo_forward(kv_tok: Tensor, send_rows: Tensor, recv_count: int, rank: int, world: int, group) -> Tensor:
    send = kv_tok.index_select(0, send_rows)
    recv = kv_tok.new_empty((recv_count, kv_tok.shape[1]))
    _shift(send, recv, rank + 1 if rank + 1 < world else None, rank - 1 if rank > 0 else None, group)
    return recv


def _halo_backward(grad_recv: Tensor, send_rows: Tensor, num_tokens: int, rank: int, world: int, group) -> Tensor:
    grad_send = grad_recv.new_empty((send_rows.shape[0], grad_recv.shape[1]))
    _shift(grad_recv.contiguous(), grad_send, rank - 1 if rank > 0 else None, rank + 1 if rank + 1 < world else None, group)
    return grad_recv.new_zeros((num_tokens, grad_recv.shape[1])).index_add_(0, send_rows, grad_send)


class _HaloKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv_tok, send_rows, recv_count, rank, world, group, log):
        ctx.save_for_backward(send_rows)
        ctx.meta = (kv_tok.shape[0], rank, world, group, log)
        recv = _halo_forward(kv_tok, send_rows, recv_count, rank, world, group)
        if log is not None:
            arrived = tuple(recv.shape[0] if r == rank - 1 else 0 for r in range(world))
            log.record("halo", "forward", send_rows.shape[0] * kv_tok.shape[1], recv.numel(), kv_tok.element_size(), arrived)
        return recv

    @staticmethod
    def backward(ctx, grad_recv):
        (send_rows,) = ctx.saved_tensors
        num_tokens, rank, world, group, log = ctx.meta
        grad = _halo_backward(grad_recv, send_rows, num_tokens, rank, world, group)
        if log is not None:
            f = grad_recv.shape[1]
            log.record("halo", "backward", grad_recv.numel(), send_rows.shape[0] * f, grad_recv.element_size())
        return grad, None, None, None, None, None, None


def halo_kv(
    kv_tok: Tensor,
    send_rows: Tensor,
    recv_count: int,
    rank: int,
    world: int,
    group: dist.ProcessGroup,
    log: TrafficLog | None = None,
) -> Tensor:
    """Differentiable halo exchange; returns the ``recv_count`` tokens received from rank - 1.

    ``send_rows`` (int64) are the local token indices rank + 1 needs, in its order.
    """
    return _HaloKV.apply(kv_tok, send_rows, recv_count, rank, world, group, log)
