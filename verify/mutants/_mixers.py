"""Planted bugs in the per-document mixers: blockdiag_dist's own convolution, gated delta rule and Mamba2 SSD, each
with one mistake that CP systems for hybrid models are known to make. Attention (and everything else) is
blockdiag_dist's.

``mixer_module(bug)`` returns ``(causal_conv, gated_delta_rule, ssd)``; those the bug is not about are the correct
ones (the recurrence bugs apply to both recurrences).
"""

from __future__ import annotations

import torch
from torch import Tensor

from blockdiag_dist.docs import plan_documents
from blockdiag_dist.exchange import halo_kv
from blockdiag_dist.mixers import causal_conv as good_conv
from blockdiag_dist.mixers import gated_delta_rule as good_gdr
from blockdiag_dist.mixers import ssd as good_ssd
from blockdiag_dist.mixers._common import active_state
from blockdiag_dist.mixers.conv import ACTIVATIONS, conv_with_plan, plan_conv
from blockdiag_dist.mixers.gated_delta import GatedDeltaRule, prepare_gated_delta
from blockdiag_dist.mixers.recurrence import plan_recurrence, run_recurrence
from blockdiag_dist.mixers.ssd import SSD, prepare_ssd
from blockdiag_dist.plan import StepPlan
from blockdiag_ref import DocLayout

MIXER_BUGS = {
    "state_leak": "the recurrence runs over each row's real tokens as one sequence: state leaks across documents",
    "reset_late": "a document's state is reset one token late: its first token still sees the previous document's",
    "summary_bf16": "continuing documents' summaries are merged (exchanged and folded) in bfloat16",
    "conv_unmasked": "the convolution's history is not masked by document: a document reads the previous one's tail",
    "history_wrong_rank": "the convolution's history is the previous rank's last rows, whatever the layout holds there",
    "ssd_no_decay": "the SSD's fold drops the transitions: a state crossing a piece held elsewhere is not decayed by it",
    "topk_over_row": "the DSA indexer's candidates are the row's earlier tokens (a global causal mask, as NeMo Automodel's "
                     "packed path), not the query's document: top-k slots and attention go to other documents",
}


def _merged(layout: DocLayout) -> DocLayout:
    """Every run of real tokens one document (a boundary only where padding intervenes)."""
    return DocLayout.from_doc_ids((layout.doc_ids != 0).to(torch.int64))


def _reset_late(layout: DocLayout) -> DocLayout:
    """A document that starts right after another starts one token later (its first token joins the other)."""
    seg = layout.segment_ids
    prev = torch.nn.functional.pad(seg[:, :-1], (1, 0))
    start = (seg != prev) & (seg != 0) & (prev != 0)
    return DocLayout.from_doc_ids(torch.where(start, prev, seg))


def _gated_delta(bug: str):
    wrong = {"state_leak": _merged, "reset_late": _reset_late}.get(bug)

    def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, state=None, **_) -> Tensor:
        state = active_state(state, q, "gated_delta_rule")
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        inputs = prepare_gated_delta(q, k, v, g, beta, scale=None, use_qk_l2norm=True, dtype=compute)
        plan, state_dtype = None, compute
        if bug == "summary_bf16":
            state_dtype = torch.bfloat16
        else:
            plan = state.mixer_plan(("mutant", bug), lambda: plan_recurrence(
                plan_documents(wrong(state.plan.layout), state.plan.shards), state.rank, state.device))
        out = run_recurrence(GatedDeltaRule(), inputs, state, state_dtype=state_dtype, plan=plan)
        B, L, Hv, V = v.shape
        return out.view(B, L, Hv, V).to(q.dtype)

    return gated_delta_rule


class _NoDecaySSD(SSD):
    def apply_transition(self, M: Tensor, S: Tensor) -> Tensor:
        return S


def _ssd(bug: str):
    wrong = {"state_leak": _merged, "reset_late": _reset_late}.get(bug)

    def ssd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *, state=None, **_) -> Tensor:
        state = active_state(state, x, "ssd")
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        inputs = prepare_ssd(x, dt, A, B, C, compute)
        plan, state_dtype, rec = None, compute, (_NoDecaySSD() if bug == "ssd_no_decay" else SSD())
        if bug == "summary_bf16":
            state_dtype = torch.bfloat16
        elif wrong is not None:
            plan = state.mixer_plan(("mutant ssd", bug), lambda: plan_recurrence(
                plan_documents(wrong(state.plan.layout), state.plan.shards), state.rank, state.device))
        Bsz, L, H, Dh = x.shape
        y = run_recurrence(rec, inputs, state, state_dtype=state_dtype, plan=plan).view(Bsz, L, H, Dh)
        if D is not None:
            y = y + D.to(compute)[:, None] * x.to(compute) * (state.docs.doc_index >= 0).to(compute)[..., None, None]
        return y

    return ssd


def _conv_unmasked(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None, *, state=None) -> Tensor:
    state = active_state(state, x, "causal_conv")
    W = weight.shape[-1]
    plan = state.mixer_plan(("mutant conv_unmasked", W), lambda: plan_conv(
        StepPlan(layout=_merged(state.plan.layout), shards=state.plan.shards), state.rank, W, state.device))
    return conv_with_plan(x, weight.reshape(weight.shape[0], W), bias, activation, plan, state)


def _conv_prev_rank(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None, *, state=None) -> Tensor:
    """History = the previous rank's last ``W - 1`` local rows of each batch row (right for contiguous shards of
    pieces at least ``W - 1`` long), masked by document; taps over this rank's rows as if they were consecutive."""
    state = active_state(state, x, "causal_conv")
    B, L, C = x.shape
    weight = weight.reshape(C, -1)
    W = weight.shape[1]
    h = min(W - 1, L)
    docs = state.docs
    x_tok = x.reshape(B * L, C)
    if state.world > 1 and h > 0:
        rows = (torch.arange(B)[:, None] * L + torch.arange(L - h, L)[None]).flatten().to(x.device)
        recv = halo_kv(x_tok, rows, B * h if state.rank > 0 else 0, state.rank, state.world, state.group)
        # rank 0 receives nothing; its (empty) receive stays in the graph so that it takes part in the backward
        prev = recv.view(B, h, C) if state.rank > 0 else torch.cat([x.new_zeros(B, h, C), recv.view(B, 0, C)], 1)
        prev_doc = (docs.plan.for_rank(state.rank - 1, x.device).doc_index[:, L - h:] if state.rank > 0
                    else torch.full((B, h), -1, dtype=torch.int64, device=x.device))
    else:
        prev, prev_doc = x.new_zeros(B, h, C), torch.full((B, h), -1, dtype=torch.int64, device=x.device)
    ext = torch.cat([prev, x], 1)  # [B, h + L, C]
    ext_doc = torch.cat([prev_doc, docs.doc_index], 1)
    out = x.new_zeros(B, L, C) if bias is None else bias.expand(B, L, C).to(x.dtype)
    for i in range(W):
        j = torch.arange(L, device=x.device) + h - (W - 1) + i  # index into ext of tap i
        ok = j >= 0
        jj = j.clamp(min=0)
        same = (ext_doc[:, jj] == docs.doc_index) & ok[None]
        out = out + weight[:, i] * ext[:, jj] * same[..., None]
    return ACTIVATIONS[activation](out) * (docs.doc_index >= 0)[..., None]


def _row_pieces(state, wp):
    """Each piece's candidates: every earlier token of its row in the key buffer, whatever its document."""
    from blockdiag_dist.sparse import _Piece

    sp, out = state.plan.shards.padded_len, []
    for p in state.docs.pieces:
        flat = p.row * sp + torch.arange(0, p.end)
        rows = wp.key_index[flat]
        keep = rows >= 0
        rows, before = rows[keep], int(keep[: p.start].sum())
        out.append(_Piece(p.row, p.local_start, p.length, before, before + p.length, rows.to(state.device)))
    return tuple(out)


def dsa_topk_over_row(query: Tensor, latent: Tensor, expand, *, topk: int, index=None, selection=None, scale=None,
                      dropout_p: float = 0.0, state=None):
    from blockdiag_dist.sparse import _dsa

    state = active_state(state, query, "dsa_attention")
    return _dsa(query, latent, expand, topk, index, selection, scale, dropout_p, state, _row_pieces)


def mixer_module(bug: str):
    assert bug in MIXER_BUGS, bug
    if bug == "conv_unmasked":
        return _conv_unmasked, good_gdr, good_ssd
    if bug == "history_wrong_rank":
        return _conv_prev_rank, good_gdr, good_ssd
    if bug == "topk_over_row":
        return good_conv, good_gdr, good_ssd
    if bug == "ssd_no_decay":
        return good_conv, good_gdr, _ssd(bug)
    return good_conv, _gated_delta(bug), _ssd(bug)
