"""The short causal depthwise convolution per document, across CP ranks.

Output ``t`` of a width-``W`` causal convolution reads the ``W - 1`` tokens before ``t``: those of ``t``'s
document only (zero before the document's start). Under CP a piece's first ``W - 1`` tokens read history that
lives on other ranks — on the previous rank for contiguous shards, on any rank (or on several, when pieces are
shorter than ``W - 1``) for balanced layouts. The history is the needed set of a causal window of ``W - 1``
(:func:`blockdiag_dist.plan.plan_exchange`): exactly those tokens are exchanged, by the halo exchange when
they all lie on the left neighbour, else by the needed-only all-to-all; their gradients go back the same way.

The computation: one ``conv1d`` over the rank's rows as stock code runs it, then the outputs whose window
reaches before their piece's start (the first ``W - 1`` tokens of every piece, few) recomputed from the rank's
tokens, the received history and zeros, masked by document; padding rows are 0.

Shape legend: B rows, L rows of a rank, T = B * L local tokens, C channels, W width, F recomputed tokens,
R received history tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..exchange import a2a_kv, halo_kv
from ..plan import StepPlan
from ..shard_plan import FlatIndex

__all__ = ["ConvPlan", "causal_conv", "plan_conv"]

ACTIVATIONS = {None: lambda t: t, "silu": F.silu, "swish": F.silu}


@dataclass(frozen=True, eq=False)
class ConvPlan:
    """One rank's history exchange and recomputed outputs for a convolution of width ``width``.

    The buffer the recomputed taps read is ``[local tokens (T), received history (R), one zero row]``.
    """

    width: int
    mode: str  # "local" | "halo" | "a2a"
    send_rows: Tensor | None  # int64 local tokens to send, grouped by destination (device)
    send_splits: list[int]
    recv_splits: list[int]
    fix_rows: Tensor  # int64 [F]: local tokens whose window reaches before their piece's start (device)
    fix_taps: Tensor  # int64 [W, F]: buffer row read by tap i (position t - (W - 1) + i) of each (device)
    real: Tensor  # bool [T]: real (non-padding) local tokens (device)
    recv_tokens: list[int]  # history tokens each rank receives (the needed set of window W - 1)
    sent_tokens: list[int]


def plan_conv(plan: StepPlan, rank: int, width: int, device: torch.device | str = "cpu") -> ConvPlan:
    """Rank ``rank``'s history exchange and recomputed taps for width ``width`` (pure)."""
    W, L, sp = plan.shards.world, plan.shards.local_len, plan.shards.padded_len
    xplan = plan.exchange(width - 1) if width > 1 else None
    local = plan.local_flat_ids(rank)  # [T]
    T = local.numel()
    needed = 0 if xplan is None else sum(xplan.needed_tokens())
    if W == 1 or needed == 0:
        mode, send_rows, send_splits, recv_splits, recv_ids = "local", None, [], [], torch.zeros(0, dtype=torch.int64)
    else:
        recv_ids = xplan.recv_flat_ids(rank)
        send_rows = xplan.send_rows(rank).to(device)
        if xplan.halo_ok:
            mode = "halo"
            send_splits = [send_rows.numel()]
            recv_splits = [xplan.recv_counts(rank)[rank - 1] if rank > 0 else 0]
        else:
            mode = "a2a"
            send_splits, recv_splits = xplan.send_counts(rank), xplan.recv_counts(rank)
    row_of = FlatIndex(torch.cat([local, recv_ids]), space=plan.layout.batch_size * sp)  # buffer row of a flat id, -1 where absent
    zero_row = T + recv_ids.numel()

    docs = plan.documents.for_rank(rank)  # this rank's rows: their document and position in it
    pos = local % sp
    real = docs.doc_index.flatten() >= 0
    starts = pos - docs.doc_position.flatten()  # [T], meaningful on real rows
    index_in_piece = torch.zeros(T, dtype=torch.int64)  # tokens before it in its piece on this rank
    for p in plan.documents.pieces_of(rank):
        t0 = p.row * L + p.local_start
        index_in_piece[t0:t0 + p.length] = torch.arange(p.length)
    fix = (real & (index_in_piece < width - 1)).nonzero().flatten()
    taps = []
    for i in range(width):
        src = pos[fix] - (width - 1) + i
        valid = src >= starts[fix]
        # a tap before its row's start has a negative flat id: clamped (it is before the document too, not valid)
        rows = row_of[(local[fix] - (width - 1) + i).clamp(min=0)].where(valid, zero_row) if fix.numel() else fix
        assert not bool((rows < 0).any()), "a history token of the same document is neither local nor received"
        taps.append(rows)
    fix_taps = torch.stack(taps) if taps else torch.zeros(0, 0, dtype=torch.int64)
    return ConvPlan(
        width=width, mode=mode, send_rows=send_rows, send_splits=send_splits, recv_splits=recv_splits,
        fix_rows=fix.to(device), fix_taps=fix_taps.to(device), real=real.to(device),
        recv_tokens=[0] * W if xplan is None else xplan.needed_tokens(),
        sent_tokens=[0] * W if xplan is None else xplan.sent_tokens(),
    )


def _history(x_tok: Tensor, plan: ConvPlan, state) -> Tensor:
    """The received history tokens ``[R, C]`` (differentiable; every rank takes part unless mode is local)."""
    if plan.mode == "local":
        return x_tok[:0]
    if plan.mode == "halo":
        return halo_kv(x_tok, plan.send_rows, plan.recv_splits[0], state.rank, state.world, state.group,
                       state.mixer_traffic)
    return a2a_kv(x_tok, plan.send_rows, plan.send_splits, plan.recv_splits, state.group, state.mixer_traffic)


def conv_with_plan(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None, plan: ConvPlan, state) -> Tensor:
    """The convolution of ``x [B, L, C]`` with ``weight [C, W]`` under ``plan`` (no validation: see
    :func:`causal_conv`)."""
    B, L, C = x.shape
    W = plan.width
    x_tok = x.reshape(B * L, C)
    y = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight[:, None, :], bias, padding=W - 1, groups=C)[..., :L]
    y_tok = y.transpose(1, 2).reshape(B * L, C)
    recv = _history(x_tok, plan, state)
    buf = torch.cat([x_tok, recv, x_tok.new_zeros(1, C)])
    taps = buf.index_select(0, plan.fix_taps.reshape(-1)).view(W, -1, C)  # [W, F, C]
    fixed = (taps * weight.t()[:, None, :]).sum(0)
    if bias is not None:
        fixed = fixed + bias
    y_tok = y_tok.index_copy(0, plan.fix_rows, fixed.to(y_tok.dtype))
    y_tok = ACTIVATIONS[activation](y_tok) * plan.real[:, None]
    return y_tok.view(B, L, C).to(x.dtype)


def causal_conv(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None, *, state=None
) -> Tensor:
    """Causal depthwise convolution per document over this rank's rows, with the history of documents that
    continue from other ranks: ``x [B, L, C]``, ``weight [C, W]`` (or ``[C, 1, W]`` as ``nn.Conv1d`` holds a
    depthwise kernel), ``bias [C]`` -> ``[B, L, C]`` in ``x``'s dtype (computed in the weight's, as
    transformers' ``causal_conv1d_fn``), then ``activation`` (None or ``"silu"``); padding rows 0.
    ``state`` defaults to the active step's.

    Raises ``ValueError`` naming expected vs got (before any collective) for tensors that are not this rank's
    shard, a weight that is not depthwise, an unknown activation, a width wider than the history the step
    planned (when the batch function was given ``conv_widths``), and (with the consensus check) ranks that call it with different sizes (``PlanMismatchError``).
    """
    from ._common import active_state, bind, check_shard

    state = active_state(state, x, "causal_conv")
    check_shard("causal_conv", "x", x, state, 3)
    C = x.shape[-1]
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(
            f"causal_conv: expected a depthwise weight [C, W] or [C, 1, W] with C = {C} channels of x, got "
            f"{tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"causal_conv: expected bias [C] = [{C}], got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv: activation expected one of {sorted(map(str, ACTIVATIONS))}, got {activation!r}")
    if not x.is_floating_point() or not weight.is_floating_point():
        raise ValueError(f"causal_conv: expected floating tensors, got x {x.dtype} and weight {weight.dtype}")
    width = weight.shape[1]
    planned = state.mixer_widths
    if planned is not None and width > max(planned):
        raise ValueError(
            f"causal_conv: expected a width of at most {max(planned)}, the history the step planned (W - 1 = "
            f"{max(planned) - 1} tokens: conv_widths={sorted(planned)} in make_cp_blockdiag_batch_and_ctx), got "
            f"width {width}"
        )
    state.agree_mixer(f"causal_conv C={C} W={width} {x.dtype}/{weight.dtype} bias={bias is not None} act={activation}")
    plan = state.mixer_plan(("conv", width), lambda: plan_conv(state.plan, state.rank, width, state.device))
    out = conv_with_plan(x, weight, bias, activation, plan, state)
    bind(out, (x, weight) if bias is None else (x, weight, bias), state)
    return out
