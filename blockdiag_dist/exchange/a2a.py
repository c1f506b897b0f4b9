"""Needed-only all-to-all: each rank sends each other rank exactly the tokens it needs (one
``all_to_all_single`` with split sizes); backward routes the grads back and accumulates them on the owner
(a token needed by several ranks receives the sum)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .traffic import TrafficLog

__all__ = ["a2a_kv"]


def _a2a_forward(
    kv_tok: Tensor, send_rows: Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup
) -> Tensor:
    """Send ``kv_tok[send_rows]`` split by destination; return the received ``[sum(recv_splits), F]``."""
    send = kv_tok.index_select(0, send_rows)
    recv = kv_tok.new_empty((sum(recv_splits), kv_tok.shape[1]))
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    return recv


def _a2a_backward(
    grad_recv: Tensor, send_rows: Tensor, send_splits: list[int], recv_splits: list[int], num_tokens: int,
    group: dist.ProcessGroup,
) -> Tensor:
    """Route the grads of received tokens back to their owners; sum them into ``[num_tokens, F]``."""
    grad_send = grad_recv.new_empty((sum(send_splits), grad_recv.shape[1]))
    dist.all_to_all_single(grad_send, grad_recv.contiguous(), send_splits, recv_splits, group=group)
    return grad_recv.new_zeros((num_tokens, grad_recv.shape[1])).index_add_(0, send_rows, grad_send)


class _AllToAllKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv_tok, send_rows, send_splits, recv_splits, group, log):
        ctx.save_for_backward(send_rows)
        ctx.meta = (send_splits, recv_splits, kv_tok.shape[0], group, log)
        recv = _a2a_forward(kv_tok, send_rows, send_splits, recv_splits, group)
        if log is not None:
            arrived = tuple(part.shape[0] for part in recv.split(recv_splits))
            log.record("a2a", "forward", sum(send_splits) * kv_tok.shape[1], recv.numel(), kv_tok.element_size(), arrived)
        return recv

    @staticmethod
    def backward(ctx, grad_recv):
        (send_rows,) = ctx.saved_tensors
        send_splits, recv_splits, num_tokens, group, log = ctx.meta
        grad = _a2a_backward(grad_recv, send_rows, send_splits, recv_splits, num_tokens, group)
        if log is not None:
            f = grad_recv.shape[1]
            log.record("a2a", "backward", sum(recv_splits) * f, sum(send_splits) * f, grad_recv.element_size())
        return grad, None, None, None, None, None


def a2a_kv(
    kv_tok: Tensor,
    send_rows: Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group: dist.ProcessGroup,
    log: TrafficLog | None = None,
) -> Tensor:
    """Differentiable needed-only exchange; returns the received tokens ``[sum(recv_splits), F]`` in source order.

    ``send_rows`` (int64 ``[sum(send_splits)]``) are local token indices grouped by destination rank.
    """
    return _AllToAllKV.apply(kv_tok, send_rows, send_splits, recv_splits, group, log)
