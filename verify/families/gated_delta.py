"""``--layer gated_delta``: ``x`` -> ``q, k = x Wq, x Wk [B, S, Hk, K]``, ``v = x Wv [B, S, Hv, V]`` (``Hv = case.hq``,
``Hk = case.hkv``, ``K = case.dim``, ``V = case.dim + 1``), ``g = -softplus(x Wa)``, ``beta = sigmoid(x Wb)`` -> the
gated delta rule -> ``Wo`` -> summed cross-entropy. Planted bugs: state leaking across documents, a reset one token
late, summaries merged in bfloat16."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._spec import VOCAB, MixerSpec

__all__ = ["SPEC"]


def _weights(case, w, n):
    return {"wq": w(n["E"], n["Hk"] * n["K"]), "wk": w(n["E"], n["Hk"] * n["K"]), "wv": w(n["E"], n["Hv"] * n["V"]),
            "wa": w(n["E"], n["Hv"]), "wb": w(n["E"], n["Hv"]), "wo": w(n["Hv"] * n["V"], VOCAB)}


def _block(case, x, ws, mix, n):
    B, L, _ = x.shape
    res = {"q": (x @ ws["wq"]).view(B, L, n["Hk"], n["K"]), "k": (x @ ws["wk"]).view(B, L, n["Hk"], n["K"]),
           "v": (x @ ws["wv"]).view(B, L, n["Hv"], n["V"]), "g": -F.softplus(x @ ws["wa"]),
           "beta": torch.sigmoid(x @ ws["wb"])}
    for t in res.values():
        t.retain_grad()
    out = mix(*res.values())
    return res, out, out.reshape(B, L, -1)


def _reference_mix(reference, ids, dtype, **_):
    def mix(q, k, v, g, beta):
        return reference(q, k, v, g, beta, ids, dtype=dtype)

    return mix


def _impl_mix(fn, **_):
    def mix(q, k, v, g, beta):
        return fn(q, k, v, g, beta)

    return mix


def _received(case, state, rank, n):
    from blockdiag_dist.mixers import plan_recurrence

    plan = plan_recurrence(state.plan.documents, rank)
    if not plan.any_traffic or state.world == 1:
        return None
    return sum(plan.recv_splits(n["Hv"] * n["K"] * n["V"], n["Hv"] * n["K"] * n["K"]))


def _mutant(bug: str):
    def make():
        from blockdiag_dist.mixers._common import active_state
        from blockdiag_dist.mixers.gated_delta import GatedDeltaRule, prepare_gated_delta
        from blockdiag_dist.mixers.recurrence import run_recurrence

        from ._wrong import wrong_recurrence_plan

        def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, state=None, **_) -> Tensor:
            state = active_state(state, q, "gated_delta_rule")
            compute = torch.float64 if q.dtype == torch.float64 else torch.float32
            inputs = prepare_gated_delta(q, k, v, g, beta, scale=None, use_qk_l2norm=True, dtype=compute)
            plan, state_dtype = None, compute
            if bug == "summary_bf16":
                state_dtype = torch.bfloat16
            else:
                plan = wrong_recurrence_plan(state, bug, "mutant")
            out = run_recurrence(GatedDeltaRule(), inputs, state, state_dtype=state_dtype, plan=plan)
            B, L, Hv, V = v.shape
            return out.view(B, L, Hv, V).to(q.dtype)

        return gated_delta_rule

    return make


SPEC = MixerSpec(
    layer="gated_delta", inputs=("q", "k", "v", "g", "beta"), weight_names=("wq", "wk", "wv", "wa", "wb", "wo"),
    weights=_weights, block=_block, reference_mix=_reference_mix, impl_mix=_impl_mix, received=_received,
    label=lambda case: f"gdr {case.hq}:{case.hkv}x{case.dim}",
    mutants={bug: _mutant(bug) for bug in ("state_leak", "reset_late", "summary_bf16")},
)
