"""Exchanges under non-reentrant activation checkpointing: start the region's recompute before the backward
collective, on every rank.

Non-reentrant checkpointing recomputes a region (its forward collectives included) when backward first reads a
tensor saved in it. An exchange whose backward reads nothing saved would run its backward collective on a rank
that has not recomputed yet (one whose use of what it received saved nothing, e.g. a rank of padding only),
while the other ranks run the recompute's forward collective: a hang, or two different collectives paired.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

__all__ = ["save_recompute_marker", "read_recompute_marker"]


def save_recompute_marker(ctx: Any, like: Tensor) -> None:
    """Save an empty tensor (no bytes) for :func:`read_recompute_marker`."""
    ctx.save_for_backward(like.new_empty(0))


def read_recompute_marker(ctx: Any) -> None:
    """Read the saved marker back: under non-reentrant checkpointing, this starts the recompute here, before the
    backward's collective, if nothing earlier in this rank's backward did."""
    ctx.saved_tensors  # noqa: B018
