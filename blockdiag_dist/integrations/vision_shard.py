"""The vision tower's images sharded across the CP ranks (``make_cp_blockdiag_batch_and_ctx(...,
shard_vision=True)``): each rank runs the tower on its share of the images, balanced by cost, and a
differentiable gather gives every rank the whole output (merged tokens and deepstack features, in image order),
so the model splices and shards as before; the backward sums each image's gradient over the ranks on its owner.

Without it every rank runs the tower on every image (replicated): correct, but its time does not shrink with CP.
The plan is a pure function of ``grid_thw`` (replicated) and the CP size, so every rank derives the same.

Shape legend: n images, W ranks, P patches (rows of ``pixel_values``), T merged tokens, D output features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..exchange.gather_rows import gather_rows
from ..state import current_state

__all__ = ["VisionPlan", "plan_vision"]


@dataclass(frozen=True)
class VisionPlan:
    """Which rank runs which image, and where each merged token lands in the gathered output."""

    owners: list[int]  # rank of each image, in image order
    costs: list[float]  # modelled cost of each image
    patch_rows: Tensor  # int64 [P_r]: the rows of pixel_values this rank runs, in image order
    images: Tensor  # int64 [n_r]: the images this rank runs, in order
    token_counts: list[int]  # merged tokens each rank outputs
    token_pos: Tensor  # int64 [T]: for each merged token (image order), its row in the padded all-gather buffer

    def loads(self, world: int) -> list[float]:
        return [sum(c for c, o in zip(self.costs, self.owners) if o == r) for r in range(world)]


def plan_vision(grid_thw: Tensor, world: int, rank: int, *, spatial_merge_size: int, hidden_size: int) -> VisionPlan:
    """Images to ranks, largest modelled cost first to the least loaded rank (ties to the lowest rank). An
    image of ``t x h x w`` patches costs ``t*h*w * (1 + h*w / (6 * hidden_size))``: per patch, the linear layers
    (~``6 * hidden**2``) and attention over its frame (~``h*w * hidden``), in units of ``hidden**2``.

    >>> p = plan_vision(torch.tensor([[1, 4, 8], [1, 4, 4], [1, 4, 4]]), 2, 0, spatial_merge_size=2, hidden_size=16)
    >>> p.owners, p.token_counts, p.images.tolist()
    ([0, 1, 1], [8, 8], [0])
    """
    grids = [tuple(int(x) for x in g) for g in grid_thw.tolist()]
    costs = [t * h * w * (1 + h * w / (6 * hidden_size)) for t, h, w in grids]
    load = [0.0] * world
    owners = [0] * len(grids)
    for j in sorted(range(len(grids)), key=lambda j: (-costs[j], j)):
        r = min(range(world), key=lambda r: (load[r], r))
        owners[j] = r
        load[r] += costs[j]
    patches = [t * h * w for t, h, w in grids]
    tokens = [p // spatial_merge_size**2 for p in patches]
    starts = [sum(patches[:j]) for j in range(len(grids))]
    mine = [j for j in range(len(grids)) if owners[j] == rank]
    patch_rows = torch.cat([torch.arange(starts[j], starts[j] + patches[j]) for j in mine]) if mine else torch.zeros(0, dtype=torch.int64)
    counts = [sum(tokens[j] for j in range(len(grids)) if owners[j] == r) for r in range(world)]
    m = max(counts) if counts else 0
    offset = [0] * world
    pos = []
    for j in range(len(grids)):
        r = owners[j]
        pos.append(torch.arange(tokens[j]) + r * m + offset[r])
        offset[r] += tokens[j]
    token_pos = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.int64)
    return VisionPlan(owners, costs, patch_rows, torch.tensor(mine, dtype=torch.int64), counts, token_pos)


# id(tower) -> the plans of its calls in flight (the pre-hook pushes, the forward hook pops)
_in_flight: dict[int, list[VisionPlan | None]] = {}


def _active(module: nn.Module):
    state = current_state()
    if state is None or not getattr(state, "shard_vision", False) or state.world == 1:
        return None
    return state


def shard_images(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
    """Forward pre-hook of a vision tower: this rank's images only (``hidden_states`` = ``pixel_values`` rows,
    ``grid_thw``)."""
    state = _active(module)
    if state is None:
        return None
    stack = _in_flight.setdefault(id(module), [])
    args, kwargs = list(args), dict(kwargs)
    pixels = args[0] if args else kwargs.get("hidden_states")
    grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
    config = module.config
    if not isinstance(pixels, Tensor) or not isinstance(grid, Tensor) or grid.shape[0] < state.world:
        stack.append(None)
        state.note(f"{type(module).__name__}: fewer images than CP ranks ({0 if grid is None else grid.shape[0]} < "
                   f"{state.world}): the tower ran on every image on every rank")
        return None
    plan = plan_vision(grid, state.world, state.rank, spatial_merge_size=config.spatial_merge_size,
                       hidden_size=config.hidden_size)
    stack.append(plan)
    local_pixels = pixels.index_select(0, plan.patch_rows.to(pixels.device))
    local_grid = grid.index_select(0, plan.images.to(grid.device))
    if args:
        args[0] = local_pixels
    else:
        kwargs["hidden_states"] = local_pixels
    if len(args) > 1:
        args[1] = local_grid
    else:
        kwargs["grid_thw"] = local_grid
    loads = ", ".join(f"{x:.0f}" for x in plan.loads(state.world))
    state.note(f"{type(module).__name__}: {grid.shape[0]} images sharded over {state.world} CP ranks by cost "
               f"(modelled loads {loads}); outputs gathered")
    return tuple(args), kwargs


def gather_images(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
    """Forward hook of a vision tower: every rank's merged tokens and deepstack features, in image order
    (one collective). ``last_hidden_state`` (per patch, unused by the models' forward) keeps this rank's images
    only."""
    stack = _in_flight.get(id(module))
    if _active(module) is None or not stack:
        return None
    plan = stack.pop()
    if plan is None:
        return None
    state = current_state()
    pooled = output.pooler_output
    deepstack = list(getattr(output, "deepstack_features", None) or [])
    parts = [pooled, *deepstack]
    widths = [p.shape[-1] for p in parts]
    gathered = gather_rows(torch.cat(parts, dim=-1), plan.token_counts, plan.token_pos, state.group)
    pieces = gathered.split(widths, dim=-1)
    output.pooler_output = pieces[0]
    if deepstack:
        output.deepstack_features = list(pieces[1:])
    return output
