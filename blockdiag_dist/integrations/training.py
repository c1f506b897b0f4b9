"""Loss and gradient reduction for a trainer on a data-parallel x context-parallel mesh.

Under CP every rank holds a slice of every sequence of its batch rows, so each rank's backward yields a
*partial* gradient of every parameter. With the loss of each rank normalised by the *global* number of target
tokens (over all DP x CP ranks), the true gradient is the plain sum of the partial gradients over the whole
mesh, and the true loss the sum of the per-rank losses:

    n = global_token_count(batch["labels"], mesh)           # same value on every rank
    loss = causal_lm_loss(logits, batch["labels"], n)       # this rank's share of the step's mean loss
    loss.backward()
    all_reduce_grads(model.parameters(), mesh)              # sum over dp and cp

DDP and FSDP2 *average* gradients over their group; that is right for data parallelism alone and wrong here:
CP ranks hold partial gradients that must be *summed*, and the global normalisation already divides by the
step's targets. The recipe is one group over the whole mesh (:func:`flat_mesh`) and a sum reduction:

    group = flat_mesh(mesh).get_group()
    ddp = DistributedDataParallel(model, process_group=group)
    ddp.register_comm_hook(group, allreduce_sum_hook)       # DDP: sum over dp x cp, no division

    fully_shard(block, mesh=flat_mesh(mesh)) ...; fully_shard(model, mesh=flat_mesh(mesh))
    fsdp_sum_gradients(model)                               # FSDP2: reduce-scatter with SUM, no division

Shape legend: B batch rows, L positions held by this rank, V vocabulary size.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from .packing import IGNORE_INDEX

__all__ = [
    "all_reduce_grads",
    "all_reduce_sum_",
    "allreduce_sum_hook",
    "causal_lm_loss",
    "flat_mesh",
    "fsdp_sum_gradients",
    "global_token_count",
    "mesh_groups",
]


def mesh_groups(mesh: Any) -> list[dist.ProcessGroup]:
    """The process groups to sum over to cover ``mesh``: one per dimension of a ``DeviceMesh``, the group
    itself for a ``ProcessGroup``, none for ``None`` (one process). Groups of one rank are left out."""
    if mesh is None:
        return []
    if isinstance(mesh, dist.ProcessGroup):
        groups = [mesh]
    elif hasattr(mesh, "get_group") and hasattr(mesh, "ndim"):
        groups = [mesh.get_group(d) for d in range(mesh.ndim)]
    else:
        raise ValueError(f"mesh: expected a DeviceMesh, a ProcessGroup or None, got {type(mesh).__name__}")
    return [g for g in groups if dist.get_world_size(g) > 1]


def all_reduce_sum_(tensor: Tensor, mesh: Any) -> Tensor:
    """Sum ``tensor`` in place over every rank of ``mesh`` (see :func:`mesh_groups`); returns it."""
    for group in mesh_groups(mesh):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def global_token_count(labels: Tensor, mesh: Any, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Number of target tokens (``labels != ignore_index``) over every rank of ``mesh``: an int64 scalar
    tensor on ``labels``' device, equal on every rank. ``labels`` is this rank's shard ``[B, L]``."""
    return all_reduce_sum_((labels != ignore_index).sum(), mesh)


def causal_lm_loss(
    logits: Tensor, labels: Tensor, num_tokens: Tensor | int, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """This rank's share of the mean next-token cross-entropy: ``sum(CE over targets) / num_tokens``.

    ``logits [B, L, V]`` and ``labels [B, L]`` are this rank's positions, labels pre-shifted (``labels[t]``
    is the target of position ``t``; no shift happens here). ``num_tokens`` is the global target count
    (:func:`global_token_count`), clamped to at least 1 so that a step with no target gives 0, not NaN.
    Half-precision logits are upcast to float32.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"causal_lm_loss: expected logits [B, L, V] and labels [B, L] with the same B, L; got logits "
            f"{tuple(logits.shape)} and labels {tuple(labels.shape)}"
        )
    dtype = torch.promote_types(logits.dtype, torch.float32)
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).to(dtype), labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )
    denominator = num_tokens.clamp_min(1) if isinstance(num_tokens, Tensor) else max(int(num_tokens), 1)
    return ce / denominator


def all_reduce_grads(parameters: Iterable[Tensor], mesh: Any) -> None:
    """Sum the gradients of ``parameters`` over every rank of ``mesh``, in place, one collective per dtype and
    device. A parameter without a gradient gets zeros first, so every rank issues the same collectives."""
    params = [p for p in parameters if p.requires_grad]
    groups = mesh_groups(mesh)
    if not groups:
        return
    buckets: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            raise ValueError(f"all_reduce_grads: expected dense gradients, got a sparse one of shape {tuple(p.shape)}")
        buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        for group in groups:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(reduced.view_as(g))


def flat_mesh(mesh: Any) -> Any:
    """A 1-D ``DeviceMesh`` over every rank of ``mesh`` (a ``("dp", "cp")`` mesh flattened to ``"dp_cp"``; a
    1-D mesh is returned as it is): the group over which DDP or FSDP2 reduce the gradients of a CP step."""
    if not (hasattr(mesh, "ndim") and hasattr(mesh, "mesh_dim_names")):
        raise ValueError(f"mesh: expected a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError(f"mesh: expected named dimensions (e.g. ('dp', 'cp')) to flatten, got {mesh}")
    return mesh._flatten("_".join(names))


def allreduce_sum_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: sum a gradient bucket over ``process_group`` (``None``: the default group),
    without DDP's division by the group size. Register it with the group DDP was built on:
    ``ddp.register_comm_hook(group, allreduce_sum_hook)``."""
    work = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# DDP compares the hook's annotations with the objects themselves; `from __future__ import annotations` made strings
allreduce_sum_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})


def fsdp_sum_gradients(module: torch.nn.Module) -> int:
    """Make every FSDP2 (``fully_shard``) module under ``module`` reduce gradients by a plain sum: divide factor
    1 with SUM collectives only (the divide factor alone makes FSDP2 use PREMUL_SUM, which gloo lacks). Returns
    how many modules were changed; raises ``ValueError`` when there is none (the model was not sharded yet)."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        raise ValueError("fsdp_sum_gradients: expected a module sharded with fully_shard, got no FSDP module")
    for m in sharded:
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
    return len(sharded)
