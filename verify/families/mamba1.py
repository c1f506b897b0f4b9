"""``--layer mamba1``: ``x`` -> ``xs = x Wx [B, S, I]`` (``I = case.hq * case.dim``), ``dt = softplus(x Wdt + dt_bias)
[B, S, I]``, ``B, C = x Wb, x Wc [B, S, G, N]`` (``G = case.hkv``, ``N = case.dim + 1``), ``A = -exp(A_log) [I, N]``,
``D [I]`` -> Mamba1's selective scan -> ``Wo`` -> summed cross-entropy. Planted bugs: the recurrence bugs of the
other families (state leaking across documents, a reset one token late, summaries merged in bfloat16), and the
entering state decayed per rank instead of per document (by every token the rank holds before the piece in its
row, other documents' included)."""

from __future__ import annotations

import torch
from torch import Tensor

from ._spec import VOCAB, MixerSpec
from .mamba2 import scan_block, scan_impl_mix, scan_received, scan_reference_mix

__all__ = ["SPEC"]


def _weights(case, w, n):
    # A = -exp(A_log) ~ -(1..N) per channel (the models' init); dt ~ softplus(-1.5) ~ 0.2: decays from 0.8 to
    # 0.35 per token, so that a state crossing ranks still weighs on the outputs there (a bug in it shows)
    I, N = n["H"] * n["Dh"], n["N"]
    A_log = torch.log(torch.arange(1, N + 1, dtype=torch.float64)).expand(I, N) + 0.2 * w(I, N, fan=1)
    return {"wx": w(n["E"], I), "wdt": w(n["E"], I), "dt_bias": 0.3 * w(I, fan=1) - 1.5, "A_log": A_log,
            "wb": w(n["E"], n["G"] * N), "wc": w(n["E"], n["G"] * N), "D": w(I, fan=1), "wo": w(I, VOCAB)}


def _mutant(bug: str):
    def make():
        from blockdiag_dist.mixers._common import active_state
        from blockdiag_dist.mixers.recurrence import plan_recurrence, run_recurrence
        from blockdiag_dist.mixers.selective_scan import SelectiveScan, prepare_selective_scan

        from ._wrong import wrong_recurrence_plan

        class DecayPerRank(SelectiveScan):
            """Entering states decayed by ``extra`` (``[continuing pieces, I, N]``) before the continuing pass."""

            def __init__(self, extra: Tensor) -> None:
                super().__init__()
                self.extra = extra

            def scan(self, inputs, meta, initial, want_final):
                if initial is not None:
                    initial = initial * self.extra.to(initial.dtype)
                return super().scan(inputs, meta, initial, want_final)

        def selective_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *,
                           state=None, **_) -> Tensor:
            state = active_state(state, x, "selective_scan")
            compute = torch.float64 if x.dtype == torch.float64 else torch.float32
            inputs = prepare_selective_scan(x, dt, A, B, C, compute)
            plan, state_dtype, rec = None, compute, SelectiveScan()
            if bug == "summary_bf16":
                state_dtype = torch.bfloat16
            elif bug == "scan_decay_per_rank":  # the decay of the rank's row up to the piece, not the document's
                Bsz, L = x.shape[:2]
                mine = plan_recurrence(state.plan.documents, state.rank)
                la = inputs[0].view(Bsz, L, *inputs[0].shape[1:])
                before = [la[p.row, :p.local_start].sum(0) for p in (mine.pieces[k] for k in mine.cont.pieces)]
                rec = DecayPerRank(torch.stack(before).exp() if before else la.new_zeros(0))
            else:
                plan = wrong_recurrence_plan(state, bug, "mutant selective_scan")
            Bsz, L, I = x.shape
            y = run_recurrence(rec, inputs, state, state_dtype=state_dtype, plan=plan).view(Bsz, L, I)
            if D is not None:
                y = y + D.to(compute) * x.to(compute) * (state.docs.doc_index >= 0).to(compute)[..., None]
            return y

        return selective_scan

    return make


SPEC = MixerSpec(
    layer="mamba1", inputs=("xs", "dt", "Bm", "Cm"), weight_names=("wx", "wdt", "dt_bias", "A_log", "wb", "wc", "D", "wo"),
    weights=_weights, block=scan_block(lambda n: (n["H"] * n["Dh"],)), reference_mix=scan_reference_mix,
    impl_mix=scan_impl_mix, received=scan_received(lambda n: n["H"] * n["Dh"] * n["N"]),  # state, transition [I, N]
    label=lambda case: f"scan {case.hq * case.dim}:{case.hkv}x{case.dim + 1}",
    mutants={bug: _mutant(bug) for bug in ("state_leak", "reset_late", "summary_bf16", "scan_decay_per_rank")},
    layouts_per_cp=4,  # run_recurrence's plan and folds: judged on every layout x CP by gated_delta and mamba2
)
