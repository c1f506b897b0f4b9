"""Summary exchange of the recurrent mixers: each rank sends each other rank exactly the piece summaries
(transition and contribution of a document's fragment, see :mod:`blockdiag_dist.mixers.recurrence`) it needs,
in one ``all_to_all_single`` over a flat buffer with per-pair element counts from the replicated plan;
backward sends the summaries' gradients back along the reverse route.

Every rank takes part whenever any rank sends anything (the caller decides from the plan, identically on every
rank), with zero elements where it has nothing to send or receive.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .recompute import read_recompute_marker, save_recompute_marker
from .traffic import TrafficLog

__all__ = ["exchange_summaries"]


def _summary_forward(send: Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """``send [sum(send_splits)]`` grouped by destination -> ``[sum(recv_splits)]`` grouped by source."""
    recv = send.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv, send.contiguous(), recv_splits, send_splits, group=group)
    return recv


def _summary_backward(grad_recv: Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    grad_send = grad_recv.new_empty(sum(send_splits))
    dist.all_to_all_single(grad_send, grad_recv.contiguous(), send_splits, recv_splits, group=group)
    return grad_send


class _SummaryExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send, send_splits, recv_splits, group, log):
        ctx.meta = (send_splits, recv_splits, group, log)
        save_recompute_marker(ctx, send)
        recv = _summary_forward(send, send_splits, recv_splits, group)
        if log is not None:
            log.record("summary", "forward", send.numel(), recv.numel(), send.element_size(), tuple(recv_splits))
        return recv

    @staticmethod
    def backward(ctx, grad_recv):
        read_recompute_marker(ctx)
        send_splits, recv_splits, group, log = ctx.meta
        grad = _summary_backward(grad_recv, send_splits, recv_splits, group)
        if log is not None:
            log.record("summary", "backward", grad_recv.numel(), grad.numel(), grad_recv.element_size())
        return grad, None, None, None, None


def exchange_summaries(
    send: Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup, log: TrafficLog | None = None
) -> Tensor:
    """Differentiable needed-only exchange of flat summaries: ``send`` (1-D, ``send_splits[d]`` elements for
    rank ``d``, in rank order) -> the received ``[sum(recv_splits)]``, ``recv_splits[s]`` elements from rank
    ``s``, in rank order. ``recv_by_source`` of the traffic entry counts elements."""
    return _SummaryExchange.apply(send, send_splits, recv_splits, group, log)
