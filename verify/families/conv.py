"""``--layer conv``: ``inputs_embeds [B, S, E]`` -> ``u = x Wu [B, S, C]`` (``C = Hq * D``) -> causal depthwise
convolution of width ``case.width`` with bias and SiLU -> ``Wo`` -> summed cross-entropy. Planted bugs: the
history not masked by document, the history taken from the previous rank's last rows."""

from __future__ import annotations

import torch
from torch import Tensor

from ._spec import VOCAB, MixerSpec

__all__ = ["SPEC"]


def _weights(case, w, n):
    return {"wu": w(n["E"], n["C"]), "weight": w(n["C"], case.width, fan=case.width), "bias": 0.1 * w(n["C"], fan=1),
            "wo": w(n["C"], VOCAB)}


def _block(case, x, ws, mix, n):
    u = x @ ws["wu"]
    u.retain_grad()
    out = mix(u, ws["weight"], ws["bias"])
    return {"u": u}, out, out


def _reference_mix(reference, ids, dtype, **_):
    def mix(u, weight, bias):
        return reference(u, ids, weight, bias, "silu", dtype=dtype)

    return mix


def _impl_mix(fn, **_):
    def mix(u, weight, bias):
        return fn(u, weight, bias, "silu")

    return mix


def _received(case, state, rank, n):
    from blockdiag_dist.mixers import plan_conv

    plan = plan_conv(state.plan, rank, case.width)
    return None if plan.mode == "local" else plan.recv_tokens[rank] * n["C"]


def _conv_unmasked():
    from blockdiag_dist.mixers._common import active_state
    from blockdiag_dist.mixers.conv import conv_with_plan, plan_conv
    from blockdiag_dist.plan import StepPlan

    from ._wrong import merged

    def causal_conv(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None, *,
                    state=None) -> Tensor:
        state = active_state(state, x, "causal_conv")
        W = weight.shape[-1]
        plan = state.mixer_plan(("mutant conv_unmasked", W), lambda: plan_conv(
            StepPlan(layout=merged(state.plan.layout), shards=state.plan.shards), state.rank, W, state.device))
        return conv_with_plan(x, weight.reshape(weight.shape[0], W), bias, activation, plan, state)

    return causal_conv


def _history_wrong_rank():
    from blockdiag_dist.exchange import halo_kv
    from blockdiag_dist.mixers._common import active_state
    from blockdiag_dist.mixers.conv import ACTIVATIONS

    def causal_conv(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None, *,
                    state=None) -> Tensor:
        """History = the previous rank's last ``W - 1`` local rows of each batch row (right for contiguous shards of
        pieces at least ``W - 1`` long), masked by document; taps over this rank's rows as if they were
        consecutive."""
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

    return causal_conv


SPEC = MixerSpec(
    layer="conv", inputs=("u",), weight_names=("wu", "weight", "bias", "wo"), weights=_weights, block=_block,
    reference_mix=_reference_mix, impl_mix=_impl_mix, received=_received, exchange="history",
    label=lambda case: f"conv w{case.width} C{case.hq * case.dim}", args=lambda case: ["--width", str(case.width)],
    mutants={"conv_unmasked": _conv_unmasked, "history_wrong_rank": _history_wrong_rank},
)
