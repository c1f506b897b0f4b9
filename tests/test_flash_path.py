"""The CUDA flash-attn varlen path, with flash-attn's function replaced by a float64 emulation of its documented
semantics (cu_seqlens packing, bottom-right causal alignment, window, GQA): everything blockdiag feeds it
and does with its output is checked here on the CPU; only the CUDA kernel itself is not."""

from __future__ import annotations

import math

import pytest
import torch

import blockdiag_dist.kernels.varlen as varlen
import blockdiag_dist.runtime as runtime
from blockdiag_dist import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx
from blockdiag_ref import reference_attention


def flash_attn_varlen_emulated(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1)):
    """q [Tq, Hq, D], k/v [Tk, Hkv, D]; sequence i is q[cu_q[i]:cu_q[i+1]] against k[cu_k[i]:cu_k[i+1]];
    causal is bottom-right aligned (query a of n sees key c of m iff c <= a + m - n), window (left, right)."""
    assert causal and dropout_p == 0.0
    scale = softmax_scale or 1 / math.sqrt(q.shape[-1])
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qa, qb, ka, kb = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        n, m = qb - qa, kb - ka
        a = torch.arange(n)[:, None] + (m - n)
        c = torch.arange(m)[None, :]
        allowed = (c <= a) & ((c >= a - window_size[0]) if window_size[0] >= 0 else True)
        qi = q[qa:qb].double().transpose(0, 1)
        ki = k[ka:kb].double().repeat_interleave(group, 1).transpose(0, 1)
        vi = v[ka:kb].double().repeat_interleave(group, 1).transpose(0, 1)
        s = (qi @ ki.transpose(-1, -2)) * scale
        out[qa:qb] = (torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ vi).transpose(0, 1)
    return out.to(q.dtype)


@pytest.fixture
def emulated_flash(monkeypatch):
    monkeypatch.setattr(varlen, "_flash_varlen_fn", lambda: flash_attn_varlen_emulated)
    monkeypatch.setattr(runtime, "flash_unusable_reason", lambda q_tok, d, dv: None)


@pytest.mark.parametrize("window", [None, (0, 0), (3, 0)])
@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_flash_path_matches_the_reference(emulated_flash, window, layout):
    ids = torch.tensor([[1, 1, 1, 2, 2, 0, 3, 3, 3, 3, 3, 1, 1, 0, 0], [4] * 9 + [0] * 2 + [5] * 4])
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(2, 15, 1), "_packed_seq_ids": ids}, layout=layout)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 15, 6, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    with ctx():
        out = cp_blockdiag_sdpa(q, k, v, is_causal=True, enable_gqa=True, window_size=window)
    ref = reference_attention(q, k, v, ids, enable_gqa=True, window_size=window)
    assert (out - ref).abs().max() <= 1e-12
    assert bool((out.transpose(1, 2)[ids == 0] == 0).all())
