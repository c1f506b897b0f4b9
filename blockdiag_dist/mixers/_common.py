"""What every mixer does first and last: find the step it computes under, check it was given this rank's
shard, and tag its autograd nodes with the step (for activation-checkpoint recomputes)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["active_state", "bind", "check_shard"]


def active_state(state, tensor: Tensor, what: str):
    """``state``, or the step this call computes under (the active one; in a checkpoint recompute, the one its
    forward used). ``ValueError`` when there is none: a mixer per document needs the step's documents."""
    if state is not None:
        return state
    from ..runtime import _step_of_call

    found = _step_of_call(tensor)
    if found is None:
        raise ValueError(
            f"{what}: expected an active CP step (call it inside `with train_ctx():`, or pass state=train_ctx.state), "
            "got none: the documents of the rows come from the step"
        )
    return found


def check_shard(what: str, name: str, t: Tensor, state, ndim: int) -> None:
    """``t`` must be ``[B, L, ...]`` with ``ndim`` dims, on the batch's device."""
    if not isinstance(t, Tensor) or t.dim() != ndim:
        got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{what}: {name} expected {ndim} dims [B, L, ...], got {got}")
    B, L = state.batch_size, state.local_len
    if t.shape[0] != B or t.shape[1] != L:
        raise ValueError(
            f"{what}: {name} expected this rank's shard [B={B}, L={L}, ...] of the active step, got {tuple(t.shape)}"
        )
    if t.device != state.device:
        raise ValueError(f"{what}: {name} expected on the batch's device {state.device}, got {t.device}")


def bind(out: Tensor, inputs: tuple[Tensor, ...], state) -> None:
    """Tag the autograd nodes this call created with ``state`` (see :mod:`blockdiag_dist.binding`)."""
    if torch.is_grad_enabled() and out.grad_fn is not None:
        from ..binding import bind_output

        bind_output(out, inputs, state)
