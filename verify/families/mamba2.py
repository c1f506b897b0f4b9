"""``--layer mamba2``: ``x`` -> ``xs = x Wx [B, S, H, Dh]`` (``H = case.hq``, ``Dh = case.dim``), ``dt = softplus(x Wdt
+ dt_bias) [B, S, H]``, ``B, C = x Wb, x Wc [B, S, G, N]`` (``G = case.hkv``, ``N = case.dim + 1``), ``A =
-exp(A_log)``, ``D`` -> Mamba2's SSD -> ``Wo`` -> summed cross-entropy. Planted bugs: the recurrence bugs of the
gated delta rule, and the fold dropping the transitions (a state crossing a piece held elsewhere not decayed)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ._spec import VOCAB, MixerSpec

__all__ = ["SPEC", "scan_block", "scan_impl_mix", "scan_received", "scan_reference_mix"]


def _weights(case, w, n):
    # decays as strong as the models': A = -exp(A_log) ~ -(1..H) (their init), dt ~ softplus(1): a float32 kernel
    # that subtracts long cumulative sums of dt A loses digits here (caught in float32)
    A_log = torch.log(torch.arange(1, n["H"] + 1, dtype=torch.float64)) + 0.2 * w(n["H"], fan=1)
    return {"wx": w(n["E"], n["H"] * n["Dh"]), "wdt": w(n["E"], n["H"]), "dt_bias": 0.3 * w(n["H"], fan=1) + 1.0,
            "A_log": A_log, "wb": w(n["E"], n["G"] * n["N"]), "wc": w(n["E"], n["G"] * n["N"]), "D": w(n["H"], fan=1),
            "wo": w(n["H"] * n["Dh"], VOCAB)}


def scan_block(channels: Callable[[dict], tuple[int, ...]]) -> Callable:
    """The block of the diagonal-transition scans (Mamba2's SSD, Mamba1's selective scan): ``xs = x Wx`` shaped
    ``[B, L, *channels(n)]`` (Mamba2: heads x head dim; Mamba1: channels), ``dt``, ``B``, ``C``, ``A = -exp(A_log)``
    and ``D`` into ``mix``; its output flattened back to ``[B, L, -1]``."""

    def block(case, x, ws, mix, n):
        B, L, _ = x.shape
        res = {"xs": (x @ ws["wx"]).view(B, L, *channels(n)), "dt": F.softplus(x @ ws["wdt"] + ws["dt_bias"]),
               "Bm": (x @ ws["wb"]).view(B, L, n["G"], n["N"]), "Cm": (x @ ws["wc"]).view(B, L, n["G"], n["N"])}
        for t in res.values():
            t.retain_grad()
        out = mix(res["xs"], res["dt"], -torch.exp(ws["A_log"]), res["Bm"], res["Cm"], ws["D"])
        return res, out, out.reshape(B, L, -1).to(x.dtype)

    return block


def scan_reference_mix(reference, ids, dtype, **_):
    def mix(xs, dt, A, Bm, Cm, D):
        return reference(xs, dt, A, Bm, Cm, ids, D=D, dtype=dtype)

    return mix


def scan_impl_mix(fn, **_):
    def mix(xs, dt, A, Bm, Cm, D):
        return fn(xs, dt, A, Bm, Cm, D)

    return mix


def scan_received(transition: Callable[[dict], int]) -> Callable:
    """The summary bytes a rank receives: a state ``[H * Dh, N]`` per continuing piece and a transition of
    ``transition(n)`` elements (Mamba2: one per head; Mamba1: one per channel and state)."""

    def received(case, state, rank, n):
        from blockdiag_dist.mixers import plan_recurrence

        plan = plan_recurrence(state.plan.documents, rank)
        if not plan.any_traffic or state.world == 1:
            return None
        return sum(plan.recv_splits(n["H"] * n["Dh"] * n["N"], transition(n)))

    return received


def _mutant(bug: str):
    def make():
        from blockdiag_dist.mixers._common import active_state
        from blockdiag_dist.mixers.recurrence import run_recurrence
        from blockdiag_dist.mixers.ssd import SSD, prepare_ssd

        from ._wrong import wrong_recurrence_plan

        class NoDecaySSD(SSD):
            def apply_transition(self, M: Tensor, S: Tensor) -> Tensor:
                return S

        def ssd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *, state=None,
                **_) -> Tensor:
            state = active_state(state, x, "ssd")
            compute = torch.float64 if x.dtype == torch.float64 else torch.float32
            inputs = prepare_ssd(x, dt, A, B, C, compute)
            plan, state_dtype, rec = None, compute, (NoDecaySSD() if bug == "ssd_no_decay" else SSD())
            if bug == "summary_bf16":
                state_dtype = torch.bfloat16
            elif bug != "ssd_no_decay":
                plan = wrong_recurrence_plan(state, bug, "mutant ssd")
            Bsz, L, H, Dh = x.shape
            y = run_recurrence(rec, inputs, state, state_dtype=state_dtype, plan=plan).view(Bsz, L, H, Dh)
            if D is not None:
                real = (state.docs.doc_index >= 0).to(compute)[..., None, None]
                y = y + D.to(compute)[:, None] * x.to(compute) * real
            return y

        return ssd

    return make


SPEC = MixerSpec(
    layer="mamba2", inputs=("xs", "dt", "Bm", "Cm"), weight_names=("wx", "wdt", "dt_bias", "A_log", "wb", "wc", "D", "wo"),
    weights=_weights, block=scan_block(lambda n: (n["H"], n["Dh"])), reference_mix=scan_reference_mix,
    impl_mix=scan_impl_mix, received=scan_received(lambda n: n["H"]),  # state [H, Dh, N], transition [H]
    label=lambda case: f"ssd {case.hq}:{case.hkv}x{case.dim}",
    mutants={bug: _mutant(bug) for bug in ("state_leak", "reset_late", "summary_bf16", "ssd_no_decay")},
)
