"""``--layer kda``: ``x`` -> ``q, k = x Wq, x Wk [B, S, Hk, K]``, ``v = x Wv [B, S, Hv, V]`` (``Hv = case.hq``, ``Hk =
case.hkv``, ``K = case.dim``, ``V = case.dim + 1``), ``g = -exp(A_log) softplus(x Wa + dt_bias) [B, S, Hv, K]`` (a
log decay per key channel, Kimi Linear's forget gate), ``beta = sigmoid(x Wb)`` -> Kimi Delta Attention -> ``Wo``
-> summed cross-entropy. Planted bugs: state leaking across documents, a reset one token late, summaries merged
in bfloat16, and the decay of a continuing document applied per rank (the entering state also decayed by the
rank's tokens before the piece in its row, as a cumulative decay counted from the shard's start would)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._spec import VOCAB, MixerSpec

__all__ = ["SPEC"]


def _weights(case, w, n):
    # decays as strong as the models' (A = exp(A_log) ~ 1..H, softplus(~1)): a float32 kernel that takes long
    # differences of cumulative decays loses digits here (caught in float32)
    A_log = torch.log(torch.arange(1, n["Hv"] + 1, dtype=torch.float64)) + 0.2 * w(n["Hv"], fan=1)
    return {"wq": w(n["E"], n["Hk"] * n["K"]), "wk": w(n["E"], n["Hk"] * n["K"]), "wv": w(n["E"], n["Hv"] * n["V"]),
            "wa": w(n["E"], n["Hv"] * n["K"]), "dt_bias": 0.3 * w(n["Hv"] * n["K"], fan=1) + 1.0, "A_log": A_log,
            "wb": w(n["E"], n["Hv"]), "wo": w(n["Hv"] * n["V"], VOCAB)}


def _block(case, x, ws, mix, n):
    B, L, _ = x.shape
    Hv, K = n["Hv"], n["K"]
    g = -torch.exp(ws["A_log"])[:, None] * F.softplus((x @ ws["wa"] + ws["dt_bias"]).view(B, L, Hv, K))
    res = {"q": (x @ ws["wq"]).view(B, L, n["Hk"], K), "k": (x @ ws["wk"]).view(B, L, n["Hk"], K),
           "v": (x @ ws["wv"]).view(B, L, Hv, n["V"]), "g": g, "beta": torch.sigmoid(x @ ws["wb"])}
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
        from blockdiag_dist.mixers.kda import KimiDeltaAttention, prepare_kda
        from blockdiag_dist.mixers.recurrence import run_recurrence

        from ._wrong import wrong_recurrence_plan

        class DecayPerRank(KimiDeltaAttention):
            """A continuing piece's entering state further decayed by ``extra [P, H, K]``: the decays of the rank's
            real tokens before the piece in its row (a cumulative decay counted from the shard's start)."""

            extra: Tensor | None = None

            def scan(self, inputs, meta, initial, want_final):
                if initial is not None and self.extra is not None:
                    initial = initial * self.extra[..., None]
                return super().scan(inputs, meta, initial, want_final)

        def kimi_delta_attention(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, state=None, **_) -> Tensor:
            state = active_state(state, q, "kimi_delta_attention")
            compute = torch.float64 if q.dtype == torch.float64 else torch.float32
            inputs = prepare_kda(q, k, v, g, beta, scale=None, use_qk_l2norm=True, dtype=compute)
            plan, state_dtype, rec = None, compute, KimiDeltaAttention()
            if bug == "summary_bf16":
                state_dtype = torch.bfloat16
            elif bug == "decay_per_rank":
                from blockdiag_dist.mixers.recurrence import plan_recurrence

                rec, L = DecayPerRank(), q.shape[1]
                plan = state.mixer_plan(("mutant kda", bug), lambda: plan_recurrence(state.plan.documents, state.rank,
                                                                                        state.device))
                real = (state.docs.doc_index >= 0).flatten()
                g_tok = inputs[3] * real[:, None, None].to(compute)  # [T, H, K]
                cum = torch.cat([g_tok.new_zeros(1, *g_tok.shape[1:]), g_tok.cumsum(0)])
                extra = [cum[p.row * L + p.local_start] - cum[p.row * L] for p in (plan.pieces[i] for i in plan.cont.pieces)]
                rec.extra = torch.stack(extra).exp() if extra else None
            else:
                plan = wrong_recurrence_plan(state, bug, "mutant kda")
            out = run_recurrence(rec, inputs, state, state_dtype=state_dtype, plan=plan)
            B, L, Hv, V = v.shape
            return out.view(B, L, Hv, V).to(q.dtype)

        return kimi_delta_attention

    return make


SPEC = MixerSpec(
    layer="kda", inputs=("q", "k", "v", "g", "beta"),
    weight_names=("wq", "wk", "wv", "wa", "dt_bias", "A_log", "wb", "wo"),
    weights=_weights, block=_block, reference_mix=_reference_mix, impl_mix=_impl_mix, received=_received,
    label=lambda case: f"kda {case.hq}:{case.hkv}x{case.dim}",
    mutants={bug: _mutant(bug) for bug in ("state_leak", "reset_late", "summary_bf16", "decay_per_rank")},
)
