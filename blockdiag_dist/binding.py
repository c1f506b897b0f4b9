"""Which step an attention call belongs to, including an activation-checkpoint recompute in backward.

A forward call uses the active step (``with train_ctx():``). A recompute must use the step *its forward* used,
whatever the caller did with ``train_ctx`` since (exited it, deleted it, entered another step's context, as
pipeline schedules do): the forward leaves the step in the autograd graph, and the recompute finds it there.

- Every call made with grad enabled tags the autograd nodes it created, and a few nodes upstream of the query
  (so that a recompute started from a sibling branch finds them too), with a strong reference to the step.
- Reentrant checkpointing runs its forward without grad inside an ``autograd.Function``; the call tags that
  Function's node, which is the node running when backward recomputes it.
- A recompute (a call while a backward graph task runs) searches the running node and its inputs, breadth
  first, for the nearest tag. Graphs of different steps share only parameters' ``AccumulateGrad`` nodes,
  which are never tagged.
"""

from __future__ import annotations

import sys
from collections import deque

import torch
from torch import Tensor

from .state import StepState

__all__ = ["bind_output", "bind_reentrant_forward", "in_backward", "recompute_state"]

_KEY = "blockdiag_step_state"
UPSTREAM_TAGS = 32  # nodes tagged upstream of the query per call
SEARCH_LIMIT = 100_000  # nodes visited by a recompute's search before it gives up
_FRAME_LIMIT = 256


def in_backward() -> bool:
    """True while a backward graph task runs on this thread (where checkpoint recomputes happen)."""
    return torch._C._current_graph_task_id() != -1


def _taggable(node) -> bool:
    return node is not None and type(node).__name__ != "AccumulateGrad"


def bind_output(out: Tensor, inputs: tuple[Tensor, ...], state: StepState) -> None:
    """Tag with ``state`` every node the call created (from ``out``'s node down to the nodes of ``inputs``, the
    call's query, key and value), and up to ``UPSTREAM_TAGS`` untagged nodes upstream of the query (``inputs[0]``).
    A non-reentrant checkpoint recomputes from whichever of the call's own nodes first unpacks a saved tensor."""
    stop = {t.grad_fn for t in inputs if t.grad_fn is not None}
    queue = deque([out.grad_fn])
    seen = set()
    while queue:
        node = queue.popleft()
        if not _taggable(node) or node in stop or node in seen:
            continue
        seen.add(node)
        node.metadata.setdefault(_KEY, state)
        queue.extend(n for n, _ in node.next_functions)
    queue = deque([inputs[0].grad_fn])
    tagged = 0
    while queue and tagged < UPSTREAM_TAGS:
        node = queue.popleft()
        if not _taggable(node) or _KEY in node.metadata:
            continue
        node.metadata[_KEY] = state
        tagged += 1
        queue.extend(n for n, _ in node.next_functions)


def bind_reentrant_forward(state: StepState) -> None:
    """Called without grad: tag the innermost ``autograd.Function`` whose forward is running (a reentrant
    checkpoint's), found on the Python stack by its ``ctx``; nothing when there is none (plain no-grad)."""
    frame = sys._getframe(1)
    for _ in range(_FRAME_LIMIT):
        if frame is None:
            return
        code = frame.f_code
        if code.co_argcount >= 1 and code.co_name == "forward":
            ctx = frame.f_locals.get(code.co_varnames[0])
            if isinstance(ctx, torch.autograd.function.BackwardCFunction):
                ctx.metadata.setdefault(_KEY, state)
                return
        frame = frame.f_back


def recompute_state() -> StepState | None:
    """In backward: the step whose forward built the running node (the nearest tag), or None if untagged."""
    start = torch._C._current_autograd_node()
    queue, seen = deque([start]), set()
    while queue and len(seen) < SEARCH_LIMIT:
        node = queue.popleft()
        if not _taggable(node) or node in seen:
            continue
        seen.add(node)
        state = node.metadata.get(_KEY)
        if state is not None:
            return state
        queue.extend(n for n, _ in node.next_functions)
    return None
