"""``--layer lightning``: ``x`` -> ``q, k, v = silu(x Wq), silu(x Wk), silu(x Wv)`` (``[B, S, H, K]``, ``[B, S, H, K]``,
``[B, S, H, V]``; ``H = case.hq``, ``K = case.dim``, ``V = case.dim + 1``), ``slope [H]`` (MiniMax's rates: ``2 **
(-8 (h + 1) / H)``, a weight here so that its gradient, through every transition ``exp(-slope n)``, is compared
too) -> lightning attention -> ``Wo`` -> summed cross-entropy. Planted bugs: the recurrence bugs of the other
families (state leaking across documents, a reset one token late, summaries merged in bfloat16), and the decay of a
continuing document applied per rank (its entering state also decayed by the real tokens the rank holds before the
piece in its row, as a decay ``exp(-slope t)`` counted from the shard's start would)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._spec import VOCAB, MixerSpec

__all__ = ["SPEC"]


def _weights(case, w, n):
    H = n["H"]
    slope = 2.0 ** (-8.0 * torch.arange(1, H + 1, dtype=torch.float64) / H)  # 0.25 .. 2^-8 at H = 4
    return {"wq": w(n["E"], H * n["K"]), "wk": w(n["E"], H * n["K"]), "wv": w(n["E"], H * n["V"]), "slope": slope,
            "wo": w(H * n["V"], VOCAB)}


def _block(case, x, ws, mix, n):
    B, L, _ = x.shape
    H = n["H"]
    res = {"q": F.silu(x @ ws["wq"]).view(B, L, H, n["K"]), "k": F.silu(x @ ws["wk"]).view(B, L, H, n["K"]),
           "v": F.silu(x @ ws["wv"]).view(B, L, H, n["V"])}
    for t in res.values():
        t.retain_grad()
    out = mix(res["q"], res["k"], res["v"], ws["slope"])
    return res, out, out.reshape(B, L, -1).to(x.dtype)


def _reference_mix(reference, ids, dtype, **_):
    def mix(q, k, v, slope):
        return reference(q, k, v, slope, ids, dtype=dtype)

    return mix


def _impl_mix(fn, **_):
    def mix(q, k, v, slope):
        return fn(q, k, v, slope)

    return mix


def _received(case, state, rank, n):
    from blockdiag_dist.mixers import plan_recurrence

    plan = plan_recurrence(state.plan.documents, rank)
    if not plan.any_traffic or state.world == 1:
        return None
    return sum(plan.recv_splits(n["H"] * n["V"] * n["K"], n["H"]))  # state [H, V, K], transition [H]


def _mutant(bug: str):
    def make():
        from blockdiag_dist.mixers._common import active_state
        from blockdiag_dist.mixers.lightning import Lightning, prepare_lightning
        from blockdiag_dist.mixers.recurrence import plan_recurrence, run_recurrence

        from ._wrong import wrong_recurrence_plan

        class DecayPerRank(Lightning):
            """Entering states further decayed by ``extra [continuing pieces, H]`` before the continuing pass."""

            extra: Tensor | None = None

            def scan(self, inputs, meta, initial, want_final):
                if initial is not None and self.extra is not None:
                    initial = initial * self.extra[..., None, None].to(initial.dtype)
                return super().scan(inputs, meta, initial, want_final)

        def lightning_attention(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, *, state=None, **_) -> Tensor:
            state = active_state(state, q, "lightning_attention")
            compute = torch.float64 if q.dtype == torch.float64 else torch.float32
            B, L, H, V = v.shape
            s = slope.to(compute).reshape(H)
            inputs = prepare_lightning(q, k, v, s, compute)
            plan, state_dtype, rec = None, compute, Lightning(s)
            if bug == "summary_bf16":
                state_dtype = torch.bfloat16
            elif bug == "decay_per_rank":  # the rank's real tokens before the piece in its row decay it too
                rec = DecayPerRank(s)
                plan = state.mixer_plan(("mutant lightning", bug), lambda: plan_recurrence(state.plan.documents,
                                                                                              state.rank, state.device))
                real = (state.docs.doc_index >= 0).to(compute)  # [B, L]
                before = [real[p.row, :p.local_start].sum() for p in (plan.pieces[i] for i in plan.cont.pieces)]
                rec.extra = torch.exp(-torch.stack(before)[:, None] * s) if before else None
            else:
                plan = wrong_recurrence_plan(state, bug, "mutant lightning")
            return run_recurrence(rec, inputs, state, state_dtype=state_dtype, plan=plan).view(B, L, H, V)

        return lightning_attention

    return make


SPEC = MixerSpec(
    layer="lightning", inputs=("q", "k", "v"), weight_names=("wq", "wk", "wv", "slope", "wo"),
    weights=_weights, block=_block, reference_mix=_reference_mix, impl_mix=_impl_mix, received=_received,
    label=lambda case: f"lightning {case.hq}x{case.dim}",
    mutants={bug: _mutant(bug) for bug in ("state_leak", "reset_late", "summary_bf16", "decay_per_rank")},
    layouts_per_cp=4,  # SSD's scan and run_recurrence's plan and folds: judged on every layout x CP by mamba2
)
