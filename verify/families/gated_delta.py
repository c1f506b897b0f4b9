"""``--layer gated_delta``: ``x`` -> ``q, k = x Wq, x Wk [B, S, Hk, K]``, ``v = x Wv [B, S, Hv, V]`` (``Hv = case.hq``,
``Hk = case.hkv``, ``K = case.dim``, ``V = case.dim + 1``), ``g = -softplus(x Wa)``, ``beta = sigmoid(x Wb)`` -> the
gated delta rule -> ``Wo`` -> summed cross-entropy. Planted bugs: state leaking across documents, a reset one token
late, summaries merged in bfloat16."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ._spec import VOCAB, MixerSpec

__all__ = ["DELTA_BUGS", "SPEC", "delta_block", "delta_impl_mix", "delta_mutant", "delta_received",
           "delta_reference_mix"]


def _weights(case, w, n):
    return {"wq": w(n["E"], n["Hk"] * n["K"]), "wk": w(n["E"], n["Hk"] * n["K"]), "wv": w(n["E"], n["Hv"] * n["V"]),
            "wa": w(n["E"], n["Hv"]), "wb": w(n["E"], n["Hv"]), "wo": w(n["Hv"] * n["V"], VOCAB)}


def delta_block(decay: Callable[[Tensor, dict, dict], Tensor]) -> Callable:
    """The block of a delta rule whose log decay ``g`` is ``decay(x, ws, n)`` (the only part the delta-rule families'
    blocks do not share): ``q, k, v, g, beta`` from ``x`` -> ``mix`` -> the features ``[B, L, Hv V]``."""

    def block(case, x, ws, mix, n):
        B, L, _ = x.shape
        res = {"q": (x @ ws["wq"]).view(B, L, n["Hk"], n["K"]), "k": (x @ ws["wk"]).view(B, L, n["Hk"], n["K"]),
               "v": (x @ ws["wv"]).view(B, L, n["Hv"], n["V"]), "g": decay(x, ws, n), "beta": torch.sigmoid(x @ ws["wb"])}
        for t in res.values():
            t.retain_grad()
        out = mix(*res.values())
        return res, out, out.reshape(B, L, -1)

    return block


def delta_reference_mix(reference, ids, dtype, **_):
    def mix(q, k, v, g, beta):
        return reference(q, k, v, g, beta, ids, dtype=dtype)

    return mix


def delta_impl_mix(fn, **_):
    def mix(q, k, v, g, beta):
        return fn(q, k, v, g, beta)

    return mix


def delta_received(case, state, rank, n):
    from blockdiag_dist.mixers import plan_recurrence

    plan = plan_recurrence(state.plan.documents, rank)
    if not plan.any_traffic or state.world == 1:
        return None
    return sum(plan.recv_splits(n["Hv"] * n["K"] * n["V"], n["Hv"] * n["K"] * n["K"]))


DELTA_BUGS = ("state_leak", "reset_late", "summary_bf16")  # the recurrence bugs every delta rule plants


def delta_mutant(bug: str, name: str, load: Callable[[], tuple[type, Callable]], own: Callable | None = None) -> Callable:
    """A factory of the delta-rule function ``name`` with ``bug`` planted. ``load() -> (recurrence class, prepare)``
    (blockdiag_dist's ``GatedDeltaRule, prepare_gated_delta``, ...); a bug of :data:`DELTA_BUGS` runs that
    recurrence over wrong documents or with bfloat16 summaries, any other is the family's own:
    ``own(inputs, state, L) -> (recurrence, plan)``."""

    def make():
        from blockdiag_dist.mixers._common import active_state
        from blockdiag_dist.mixers.recurrence import run_recurrence

        from ._wrong import wrong_recurrence_plan

        rule, prepare = load()

        def fn(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, state=None, **_) -> Tensor:
            state = active_state(state, q, name)
            compute = torch.float64 if q.dtype == torch.float64 else torch.float32
            inputs = prepare(q, k, v, g, beta, scale=None, use_qk_l2norm=True, dtype=compute)
            rec, plan, state_dtype = rule(), None, compute
            if bug == "summary_bf16":
                state_dtype = torch.bfloat16
            elif bug in DELTA_BUGS:
                plan = wrong_recurrence_plan(state, bug, f"mutant {name}")
            else:
                rec, plan = own(inputs, state, q.shape[1])
            out = run_recurrence(rec, inputs, state, state_dtype=state_dtype, plan=plan)
            B, L, Hv, V = v.shape
            return out.view(B, L, Hv, V).to(q.dtype)

        fn.__name__ = fn.__qualname__ = name
        return fn

    return make


def _load():
    from blockdiag_dist.mixers.gated_delta import GatedDeltaRule, prepare_gated_delta

    return GatedDeltaRule, prepare_gated_delta


SPEC = MixerSpec(
    layer="gated_delta", inputs=("q", "k", "v", "g", "beta"), weight_names=("wq", "wk", "wv", "wa", "wb", "wo"),
    weights=_weights, block=delta_block(lambda x, ws, n: -F.softplus(x @ ws["wa"])), reference_mix=delta_reference_mix,
    impl_mix=delta_impl_mix, received=delta_received, label=lambda case: f"gdr {case.hq}:{case.hkv}x{case.dim}",
    mutants={bug: delta_mutant(bug, "gated_delta_rule", _load) for bug in DELTA_BUGS},
)
