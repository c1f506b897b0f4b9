"""Several ranks on one GPU: every collective blockdiag issues goes through host memory, over gloo.

NCCL needs one GPU per rank, and gloo's support for CUDA tensors is partial (all-reduce and all-gather, not
known for all-to-all or point-to-point), so a hang or a refusal there would cost a whole device window. Once
:func:`install` has run in a rank's process, each collective the exchanges and the mixers call
(``all_gather_into_tensor`` / ``all_gather_single``, ``reduce_scatter_tensor`` / ``reduce_scatter_single``,
``all_to_all_single``, ``batch_isend_irecv``, ``all_reduce``, ``all_gather``, ``broadcast``) copies its inputs to
host tensors, runs the gloo collective on them, waits, and copies the results back into the caller's tensors.
Synchronous (an ``async_op`` gets a completed work); the kernels and autograd stay on the GPU. CPU tensors are
staged the same way (through a copy), so the CPU dry run runs this code too.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

__all__ = ["install", "installed", "uninstall"]

_ORIGINAL: dict[tuple[object, str], object] = {}


class _Done:
    """A finished collective's work."""

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - the signature of torch's Work.wait
        return True

    def is_completed(self) -> bool:
        return True


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _out_in(fn):
    """``fn(out, inp, ...)``: out is written."""
    @functools.wraps(fn)
    def staged(out, inp, *args, async_op=False, **kwargs):
        host_out = torch.empty(out.shape, dtype=out.dtype)
        fn(host_out, _host(inp), *args, **kwargs)
        out.copy_(host_out)
        return _Done() if async_op else None
    return staged


def _in_place(fn):
    """``fn(tensor, ...)``: the tensor is read and written (all_reduce, broadcast)."""
    @functools.wraps(fn)
    def staged(tensor, *args, async_op=False, **kwargs):
        host = _host(tensor)
        fn(host, *args, **kwargs)
        tensor.copy_(host)
        return _Done() if async_op else None
    return staged


def _list_out(fn):
    """``fn(tensor_list, tensor, ...)`` (all_gather)."""
    @functools.wraps(fn)
    def staged(tensor_list, tensor, *args, async_op=False, **kwargs):
        host = [torch.empty(t.shape, dtype=t.dtype) for t in tensor_list]
        fn(host, _host(tensor), *args, **kwargs)
        for t, h in zip(tensor_list, host):
            t.copy_(h)
        return _Done() if async_op else None
    return staged


def _p2p(fn):
    """``batch_isend_irecv(ops)``: host copies sent and received, all waited for, received ones copied back."""
    @functools.wraps(fn)
    def staged(ops):
        host_ops, back = [], []
        for op in ops:
            if op.op in (dist.irecv, dist.recv):
                host = torch.empty(op.tensor.shape, dtype=op.tensor.dtype)
                back.append((op.tensor, host))
            else:
                host = _host(op.tensor)
            host_ops.append(dist.P2POp(op.op, host, op.peer, group=op.group, tag=op.tag))
        for work in fn(host_ops):
            work.wait()
        for t, host in back:
            t.copy_(host)
        return [_Done() for _ in ops]
    return staged


def _patch(owner: object, name: str, wrap) -> None:
    original = getattr(owner, name, None)
    if original is None or (owner, name) in _ORIGINAL:
        return
    _ORIGINAL[(owner, name)] = original
    setattr(owner, name, wrap(original))


def install() -> None:
    """Stage every collective of this process through host memory (idempotent)."""
    from blockdiag_dist.exchange import allgather, gather_rows

    for owner in (allgather, gather_rows):  # bound at import: patched where they are looked up
        _patch(owner, "all_gather_tensor", _out_in)
        _patch(owner, "reduce_scatter_tensor", _out_in)
    for name in ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
                 "all_to_all_single"):
        _patch(dist, name, _out_in)
    _patch(dist, "all_reduce", _in_place)
    _patch(dist, "broadcast", _in_place)
    _patch(dist, "all_gather", _list_out)
    _patch(dist, "batch_isend_irecv", _p2p)


def uninstall() -> None:
    """Put every staged function back."""
    for (owner, name), original in _ORIGINAL.items():
        setattr(owner, name, original)
    _ORIGINAL.clear()


def installed() -> bool:
    return bool(_ORIGINAL)
