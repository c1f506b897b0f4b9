"""``--layer kda``: ``x`` -> ``q, k = x Wq, x Wk [B, S, Hk, K]``, ``v = x Wv [B, S, Hv, V]`` (``Hv = case.hq``, ``Hk =
case.hkv``, ``K = case.dim``, ``V = case.dim + 1``), ``g = -exp(A_log) softplus(x Wa + dt_bias) [B, S, Hv, K]`` (a
log decay per key channel, Kimi Linear's forget gate), ``beta = sigmoid(x Wb)`` -> Kimi Delta Attention -> ``Wo``
-> summed cross-entropy. Planted bugs: state leaking across documents, a reset one token late, summaries merged
in bfloat16, and the decay of a continuing document applied per rank (the entering state also decayed by the
rank's tokens before the piece in its row, as a cumulative decay counted from the shard's start would). The block,
the calls and the shared bugs are the gated delta rule's (:func:`~verify.families.gated_delta.delta_block`,
:func:`~verify.families.gated_delta.delta_mutant`): only the decay's projection and the per-rank decay differ."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._spec import VOCAB, MixerSpec
from .gated_delta import DELTA_BUGS, delta_block, delta_impl_mix, delta_mutant, delta_received, delta_reference_mix

__all__ = ["SPEC"]


def _weights(case, w, n):
    # decays as strong as the models' (A = exp(A_log) ~ 1..H, softplus(~1)): a float32 kernel that takes long
    # differences of cumulative decays loses digits here (caught in float32)
    A_log = torch.log(torch.arange(1, n["Hv"] + 1, dtype=torch.float64)) + 0.2 * w(n["Hv"], fan=1)
    return {"wq": w(n["E"], n["Hk"] * n["K"]), "wk": w(n["E"], n["Hk"] * n["K"]), "wv": w(n["E"], n["Hv"] * n["V"]),
            "wa": w(n["E"], n["Hv"] * n["K"]), "dt_bias": 0.3 * w(n["Hv"] * n["K"], fan=1) + 1.0, "A_log": A_log,
            "wb": w(n["E"], n["Hv"]), "wo": w(n["Hv"] * n["V"], VOCAB)}


def _decay(x, ws, n):
    B, L, _ = x.shape
    return -torch.exp(ws["A_log"])[:, None] * F.softplus((x @ ws["wa"] + ws["dt_bias"]).view(B, L, n["Hv"], n["K"]))


def _load():
    from blockdiag_dist.mixers.kda import KimiDeltaAttention, prepare_kda

    return KimiDeltaAttention, prepare_kda


def _decay_per_rank(inputs, state, L):
    """``decay_per_rank``: each continuing piece's entering state further decayed by the decays of the rank's real
    tokens before the piece in its row (a cumulative decay counted from the shard's start)."""
    from blockdiag_dist.mixers.kda import KimiDeltaAttention
    from blockdiag_dist.mixers.recurrence import plan_recurrence

    class DecayPerRank(KimiDeltaAttention):
        extra: Tensor | None = None  # [continuing pieces, H, K]

        def scan(self, inputs, meta, initial, want_final):
            if initial is not None and self.extra is not None:
                initial = initial * self.extra[..., None]
            return super().scan(inputs, meta, initial, want_final)

    rec = DecayPerRank()
    plan = state.mixer_plan(("mutant kda", "decay_per_rank"), lambda: plan_recurrence(state.plan.documents, state.rank,
                                                                                    state.device))
    real = (state.docs.doc_index >= 0).flatten()
    g_tok = inputs[3] * real[:, None, None].to(inputs[3].dtype)  # [T, H, K]
    cum = torch.cat([g_tok.new_zeros(1, *g_tok.shape[1:]), g_tok.cumsum(0)])
    extra = [cum[p.row * L + p.local_start] - cum[p.row * L] for p in (plan.pieces[i] for i in plan.cont.pieces)]
    rec.extra = torch.stack(extra).exp() if extra else None
    return rec, plan


SPEC = MixerSpec(
    layer="kda", inputs=("q", "k", "v", "g", "beta"),
    weight_names=("wq", "wk", "wv", "wa", "dt_bias", "A_log", "wb", "wo"),
    weights=_weights, block=delta_block(_decay), reference_mix=delta_reference_mix, impl_mix=delta_impl_mix,
    received=delta_received, label=lambda case: f"kda {case.hq}:{case.hkv}x{case.dim}",
    mutants={bug: delta_mutant(bug, "kimi_delta_attention", _load, _decay_per_rank)
             for bug in (*DELTA_BUGS, "decay_per_rank")},
)
