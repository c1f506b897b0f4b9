"""Attention variants on the CPU: which path a soft-capped call takes (``SOFTCAP_PLAN``), and what sinks and a
soft-cap cost next to the plain call. Forward + backward, CP 1, float32, long-tail documents, side by side.

- ``plain``: no variant (the fused maskless blocks; today's path);
- ``sinks``: sinks merged into the fused blocks;
- ``softcap blocks``: the maskless blocks with explicit scores (``SOFTCAP_PLAN = "blocks"``);
- ``softcap masked``: the masked plan with explicit scores (``SOFTCAP_PLAN = "masked"``);
- ``softcap dense``: the dense kernel with explicit scores.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from blockdiag_dist import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx
from blockdiag_dist.kernels import varlen

from verify.workloads import D, H, HKV, interleaved, layout_of, long_tail, make_qkv

__all__ = ["bench_softcap"]

SOFTCAP = 50.0  # Gemma 2's attention cap


def _step(lengths: list[int], kernel: str, window: int, *, softcap: float | None = None, sinks: bool = False,
          plan: str | None = None) -> Callable[[], None]:
    layout = layout_of(lengths)
    S = layout.seq_len
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(1, S, 1), "_packed_seq_ids": layout.doc_ids},
                                             kernel=kernel)
    q, k, v, grad_out = make_qkv(S, torch.float32, "cpu", 0, (H, HKV), D)
    s = torch.zeros(H, requires_grad=True) if sinks else None
    window_size = None if window < 0 else (window, 0)

    def step() -> None:
        saved = varlen.SOFTCAP_PLAN
        varlen.SOFTCAP_PLAN = plan or saved
        try:
            with ctx():
                out = cp_blockdiag_sdpa(q, k, v, is_causal=True, enable_gqa=True, window_size=window_size, softcap=softcap, sinks=s)
                torch.autograd.grad(out, (q, k, v), grad_out)
        finally:
            varlen.SOFTCAP_PLAN = saved

    return step


def bench_softcap(S: int = 4096, windows: tuple[int, ...] = (-1, 128), reps: int = 3, seed: int = 0, dense_up_to: int = 4096) -> dict:
    """Seconds of each path per window, and each one's ratio to the plain call (the dense kernel only up to
    ``dense_up_to`` tokens: its ``[S, S]`` scores)."""
    lengths = long_tail(S, seed)
    rows = []
    for window in windows:
        fns = {
            "plain": _step(lengths, "varlen", window),
            "sinks": _step(lengths, "varlen", window, sinks=True),
            "softcap blocks": _step(lengths, "varlen", window, softcap=SOFTCAP, plan="blocks"),
            "softcap masked": _step(lengths, "varlen", window, softcap=SOFTCAP, plan="masked"),
        }
        if S <= dense_up_to:
            fns["softcap dense"] = _step(lengths, "dense", window, softcap=SOFTCAP)
        t = interleaved(fns, reps)
        rows.append({"S": S, "window": window, "docs": len(lengths), "longest_doc": max(lengths), "seconds": t,
                     "over_plain": {k: v / t["plain"] for k, v in t.items()},
                     "masked_over_blocks": t["softcap masked"] / t["softcap blocks"]})
    return {"heads": [H, HKV], "head_dim": D, "dtype": "float32", "softcap": SOFTCAP, "chosen": varlen.SOFTCAP_PLAN, "rows": rows}
