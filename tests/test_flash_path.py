"""The CUDA flash-attn varlen path on the CPU, through the strict emulation of flash-attn 2.8.3's
``flash_attn_varlen_func`` (``verify.gpu.emulate``): what it refuses, what it computes, the fallback reasons that
keep blockdiag from calling it where flash-attn would raise, and the verifier's cases at CP 1, 2 and 4 (every
layout, a padding-only rank, windows, soft-cap, GQA) run through it. Only the CUDA kernel itself is not run."""

from __future__ import annotations

import math
import re
import types

import pytest
import torch

import blockdiag_dist.kernels.varlen as varlen
from blockdiag_dist import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx
from blockdiag_dist.options import LAYOUTS
from blockdiag_ref import reference_attention
from conftest import assert_pass
from verify.cases import NAMED_LAYOUTS, Case
from verify.gpu import emulate
from verify.gpu.emulate import emulated, flash_attn_varlen_func

BF16 = torch.bfloat16


def _cu(*lens: int, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=dtype)


def _qkv(tq: int, tk: int, hq: int = 4, hk: int = 2, d: int = 8, dv: int | None = None, dtype=BF16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(tq, hq, d, generator=g).to(dtype), torch.randn(tk, hk, d, generator=g).to(dtype),
            torch.randn(tk, hk, dv or d, generator=g).to(dtype))


# ---- the emulation refuses what flash-attn refuses ------------------------------------------------------------
@pytest.mark.parametrize("change, message", [
    pytest.param(dict(cu_q=_cu(3, 2, dtype=torch.int64)), "cu_seqlens_q must have dtype int32", id="int64-cu-q"),
    pytest.param(dict(cu_k=_cu(4, 3, dtype=torch.int64)), "cu_seqlens_k must have dtype int32", id="int64-cu-k"),
    pytest.param(dict(cu_q=_cu(), cu_k=_cu(), tq=0, tk=0), "batch size must be positive", id="no-sequence"),
    pytest.param(dict(dtype=torch.float32), "only support fp16 and bf16", id="float32"),
    pytest.param(dict(d=264), "head dimension at most 256", id="head-dim-264"),
    pytest.param(dict(dv=16), "flash-attn 2 needs Dv == D", id="dv-ne-d"),
    pytest.param(dict(hq=3), "must divide number of heads in query", id="heads"),
    pytest.param(dict(kw=dict(softcap=2.0, dropout_p=0.1)), "Softcapping does not support dropout", id="softcap-dropout"),
    pytest.param(dict(cu_k=_cu(4, 2)), "must run from 0 to 7 tokens", id="cu-k-short-of-the-keys"),
    pytest.param(dict(max_q=2), "a sequence of 3 tokens > max_seqlen 2", id="max-seqlen-too-small"),
    pytest.param(dict(cu_k=_cu(4, 3, 0)), "cu_seqlens_k must have shape (3,)", id="cu-lengths-differ"),
])
def test_the_flash_emulation_refuses_what_flash_attn_refuses(change, message):
    tq, tk = change.get("tq", 5), change.get("tk", 7)
    q, k, v = _qkv(tq, tk, hq=change.get("hq", 4), d=change.get("d", 8), dv=change.get("dv"), dtype=change.get("dtype", BF16))
    with pytest.raises((RuntimeError, TypeError), match=re.escape(message)):
        flash_attn_varlen_func(q, k, v, change.get("cu_q", _cu(3, 2)), change.get("cu_k", _cu(4, 3)), change.get("max_q", 3), 4,
                               causal=True, **change.get("kw", {}))


def test_the_flash_emulation_computes_flash_attns_documented_semantics():
    """Bottom-right causal alignment, a window, a soft-cap, GQA, odd head dims, and a query row with no key (more
    queries than keys) giving 0, against explicit float64 math written from the docstring's example."""
    q, k, v = _qkv(2 + 5 + 4, 5 + 2 + 4, hq=4, hk=2, d=5)
    cu_q, cu_k = _cu(2, 5, 4), _cu(5, 2, 4)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True, window_size=(2, 0), softcap=3.0)
    assert out.dtype == BF16 and out.shape == q.shape
    # sequence 0 (2 queries, 5 keys): query a sees keys a+3-2 .. a+3 (the docstring's bottom-right example)
    # sequence 1 (5 queries, 2 keys): queries 0..2 see nothing (output 0), query 3 key 0, query 4 keys 0..1
    want = torch.zeros(out.shape, dtype=torch.float64)
    for qa, ka, n, m in ((0, 0, 2, 5), (2, 5, 5, 2), (7, 7, 4, 4)):
        for a in range(n):
            keys = [c for c in range(m) if a + m - n - 2 <= c <= a + m - n]
            for h in range(4):
                if not keys:
                    continue
                s = torch.stack([q[qa + a, h].double() @ k[ka + c, h // 2].double() / math.sqrt(5) for c in keys])
                p = torch.softmax(3.0 * torch.tanh(s / 3.0), 0)
                want[qa + a, h] = sum(p[i] * v[ka + c, h // 2].double() for i, c in enumerate(keys))
    assert (out.double() - want).abs().max() <= 2 ** -8 * want.abs().max()
    assert bool((out[2:5] == 0).all())


# ---- the fallback reasons cover every precondition ---------------------------------------------------------------
def _cuda_like(dtype=BF16):
    return types.SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype)


@pytest.mark.parametrize("kw, cap, expected", [
    pytest.param(dict(), (9, 0), None, id="usable"),
    pytest.param(dict(q=types.SimpleNamespace(device=torch.device("cpu"), dtype=BF16)), (9, 0), "device is cpu", id="cpu"),
    pytest.param(dict(q=_cuda_like(torch.float32)), (9, 0), "dtype is torch.float32", id="float32"),
    pytest.param(dict(dim_v=64), (9, 0), "D=128 != Dv=64", id="dv-ne-d"),
    pytest.param(dict(dim=260, dim_v=260), (9, 0), "head dim D=260 (padded to 264) > 256", id="head-dim"),
    pytest.param(dict(dim=256, dim_v=256), (9, 0), None, id="head-dim-256-ok"),
    pytest.param(dict(), (7, 5), "compute capability sm75 < sm80", id="turing"),
    pytest.param(dict(softcap=5.0, dropout_p=0.1), (9, 0), "softcap=5.0 with dropout_p=0.1", id="softcap-dropout"),
    pytest.param(dict(softcap=5.0), (9, 0), None, id="softcap-ok"),
    pytest.param(dict(sequences=0), (9, 0), "no sequence on this rank", id="padding-only"),
])
def test_flash_unusable_reason_covers_each_precondition(monkeypatch, kw, cap, expected):
    monkeypatch.setattr(varlen, "_device_capability", lambda device: cap)
    monkeypatch.setattr(varlen, "_flash_varlen_fn", lambda: flash_attn_varlen_func)
    q = kw.pop("q", _cuda_like())
    why = varlen.flash_unusable_reason(q, kw.pop("dim", 128), kw.pop("dim_v", 128), **kw)
    assert why is None if expected is None else expected in why


def test_flash_unusable_reason_names_a_missing_flash_attn(monkeypatch):
    monkeypatch.setattr(varlen, "_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(varlen, "_flash_varlen_fn", lambda: None)
    assert varlen.flash_unusable_reason(_cuda_like(), 64, 64) == "flash_attn is not importable"


def test_each_reason_is_a_fallback_the_step_takes_not_an_error(monkeypatch):
    """Under the emulation (which raises where flash-attn raises), a call that breaks a precondition runs the
    fallback and gives the per-document result: a soft-cap with dropout, D != Dv, a head dim above 256."""
    ids = torch.tensor([[1, 1, 1, 2, 2, 0, 3, 3, 3]])
    g = torch.Generator().manual_seed(0)
    with emulated() as calls:
        before = calls["flash_attn_varlen_func"]
        for d, dv in ((8, 4), (264, 264)):
            q, k = (torch.randn(1, 2, 9, d, generator=g).to(BF16) for _ in range(2))
            v = torch.randn(1, 2, 9, dv, generator=g).to(BF16)
            ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(1, 9, 1), "_packed_seq_ids": ids})
            with ctx():
                out = cp_blockdiag_sdpa(q, k, v, is_causal=True)
            ref = reference_attention(q.double(), k.double(), v.double(), ids)
            assert (out.double() - ref).abs().max() <= 2e-2 * ref.abs().max()
        q = torch.randn(1, 2, 9, 8, generator=g).to(BF16)
        ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(1, 9, 1), "_packed_seq_ids": ids})
        with ctx():
            out = cp_blockdiag_sdpa(q, q, q, is_causal=True, softcap=2.0, dropout_p=0.5)
        assert out.shape == q.shape and bool((out[0, :, 5] == 0).all())
        assert calls["flash_attn_varlen_func"] == before, "flash-attn was called where it raises"


# ---- the padding-only rank ---------------------------------------------------------------------------------------
def test_padding_only_rank_never_calls_flash_attn():
    """All-padding rows at CP 1 (the padding-only rank's situation): zeros with exactly 0 gradient that stay in
    the graph, and no flash-attn call (flash-attn raises "batch size must be positive" on zero sequences)."""
    ids = torch.zeros(2, 7, dtype=torch.long)
    q = torch.randn(2, 4, 7, 8).to(BF16).requires_grad_()
    kv = torch.randn(2, 2, 7, 8).to(BF16).requires_grad_()
    with emulated() as calls:
        before = calls["flash_attn_varlen_func"]
        ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(2, 7, 1), "_packed_seq_ids": ids})
        with ctx():
            out = cp_blockdiag_sdpa(q, kv, kv, is_causal=True, enable_gqa=True)
        assert calls["flash_attn_varlen_func"] == before
    assert bool((out == 0).all()) and out.grad_fn is not None
    out.float().sum().backward()
    assert bool((q.grad == 0).all()) and bool((kv.grad == 0).all())


def test_zero_pieces_with_use_flash_set_return_zeros_in_the_graph():
    meta = varlen.plan_varlen(torch.arange(6), torch.arange(6), torch.zeros(6, dtype=torch.long), torch.zeros(6, dtype=torch.long), 6, -1)
    q = torch.randn(6, 2, 8).to(BF16).requires_grad_()
    kv = torch.randn(6, 2 * 16).to(BF16).requires_grad_()
    with emulated():
        out = varlen.varlen_attention(q, kv, meta, heads_kv=2, dim_v=8, dropout_p=0.0, scale=None, use_flash=True)
    assert out.shape == (6, 2, 8) and bool((out == 0).all()) and out.requires_grad


# ---- the verifier's cases through the emulation -----------------------------------------------------------------
def flash_cases(cp: int) -> list[Case]:
    """bfloat16 varlen cases of every named layout, the sharding layouts rotating (the padding-only rank under
    every one), windows, a soft-cap and GQA rotating: what the flash path must get right at this CP size."""
    out, k = [], 0
    for i, (name, make) in enumerate(NAMED_LAYOUTS.items()):
        if name == "s-lt-cp" and cp == 1:
            continue
        for layout in LAYOUTS if name == "padding-rank" else [tuple(LAYOUTS)[i % len(LAYOUTS)]]:
            hq, hkv = ((4, 2), (2, 2), (3, 1))[k % 3]
            out.append(Case(rows=make(cp), cp=cp, name=name, hq=hq, hkv=hkv, dim=(8, 5, 16)[k % 3], window=(-1, 2, 0, -1)[k % 4],
                            softcap=(0.0, 5.0)[(k // 2) % 2], kernel="varlen", layout=layout, dtype="bfloat16", seed=k,
                            checkpoint=("none", "nonreentrant")[(k // 3) % 2]))
            k += 1
    return out


def test_verifier_cases_at_cp1_run_through_the_flash_emulation(one_thread):
    from verify.gpu.backends import BackendRecorder
    from verify.gpu.matrix import run_one

    cases = flash_cases(1)
    with emulated() as calls:
        before = calls["flash_attn_varlen_func"]
        results = [run_one(c, torch.device("cpu"), BackendRecorder()) for c in cases]
        assert calls["flash_attn_varlen_func"] - before >= len(cases) - 1  # every case with a real token
    assert_pass(results)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cp", [2, 4])
def test_verifier_cases_at_cp2_and_4_run_through_the_flash_emulation(emulated_session, cp):
    cases = flash_cases(cp)
    assert any(c.name == "padding-rank" for c in cases)
    results = emulated_session.run(cases)
    assert_pass(results)
    per_rank = emulated_session.pool(cp).run(emulate.calls, timeout=60, name="emulated calls")
    assert all(r["flash_attn_varlen_func"] > 0 for r in per_rank), per_rank
