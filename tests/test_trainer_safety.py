"""Ordinary trainer situations end in correct gradients or a clear error, never a silent result: bf16
autocast, packing signalled by position_ids, checkpoint recompute bound to its forward's step, attention that
never reaches the routing, bidirectional calls, disagreeing ranks, one rank failing alone. Multi-rank parts run
on the verifier's pools (tests/mp_checks.py)."""

from __future__ import annotations

import types

import pytest
import torch

import blockdiag_dist.kernels.varlen as varlen
import blockdiag_dist.runtime as runtime
from blockdiag_dist import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx
from blockdiag_ref import reference_attention
from examples.model import TinyConfig, TinyDecoder
from test_flash_path import flash_attn_varlen_emulated

CFG = TinyConfig(vocab_size=32, hidden=32, layers=2, heads=4, kv_heads=2, mlp_hidden=48)


def tiny_model(checkpointing=None, seed=0):
    torch.manual_seed(seed)
    return TinyDecoder(CFG, checkpointing=checkpointing)


def max_rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


# ---- 1. autocast ----------------------------------------------------------------------------------------
def test_bf16_autocast_trains_like_stock_sdpa(one_thread):
    """TinyDecoder (RoPE keeps q, k in float32, v is bf16) under CPU bf16 autocast inside the step: it runs, and
    its output and weight grads are as close to float64 as the same model on stock SDPA under the same autocast."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, CFG.vocab_size, (2, 19), generator=g)
    pos = torch.arange(19).expand(2, 19)

    def run(model, dtype=None, ctx=None):
        model.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype is None), (ctx() if ctx else torch.enable_grad()):
            logits = model(ids, pos)
            logits.float().pow(2).mean().backward()
        return logits.detach(), model.lm_head.weight.grad.clone(), model.blocks[0].attn.q_proj.weight.grad.clone()

    model = tiny_model()
    ref = run(model.double(), dtype=torch.float64)  # one document per row: stock causal SDPA is the truth
    stock = run(model.float())  # no context: stock SDPA under autocast
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": ids.clone()})
    got = run(model, ctx=ctx)
    assert got[0].dtype == stock[0].dtype == torch.bfloat16
    for g_, s_, r_ in zip(got, stock, ref):
        assert max_rel(g_, r_) <= 2 * max_rel(s_, r_) + 1e-2


def test_mixed_dtypes_without_autocast_are_refused_as_sdpa_refuses_them():
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": torch.ones(1, 5, dtype=torch.long)})
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    v = torch.randn(1, 2, 5, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    with ctx(), pytest.raises(ValueError, match="expected one dtype for query/key/value, got torch.float32, torch.float32, torch.bfloat16"):
        cp_blockdiag_sdpa(q, k, v, is_causal=True)
    with ctx(), torch.autocast("cpu", torch.bfloat16):  # float64 is never cast by autocast: still refused
        with pytest.raises(ValueError, match="expected one dtype"):
            cp_blockdiag_sdpa(q.double(), k, v, is_causal=True)


def test_flash_path_engages_under_autocast(monkeypatch):
    """Under autocast the kernel receives the autocast dtype, which the flash-attn gate accepts on CUDA; the
    flash path (its documented semantics, emulated) then gives the per-document result."""
    monkeypatch.setattr(varlen, "_flash_varlen_fn", lambda: flash_attn_varlen_emulated)
    cuda_like = lambda dtype: types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"), dtype=dtype)  # noqa: E731
    assert varlen.flash_unusable_reason(cuda_like(torch.bfloat16), 6, 6) is None
    assert "float32" in varlen.flash_unusable_reason(cuda_like(torch.float32), 6, 6)
    seen = []

    def gate(q_tok, d, dv):
        seen.append(q_tok.dtype)
        return varlen.flash_unusable_reason(cuda_like(q_tok.dtype), d, dv)

    monkeypatch.setattr(runtime, "flash_unusable_reason", gate)
    ids = torch.tensor([[1, 1, 1, 2, 2, 0, 3, 3, 3, 3, 3]])
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(1, 11, 1), "_packed_seq_ids": ids})
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 11, 6, generator=g), torch.randn(1, 2, 11, 6, generator=g)
    v = torch.randn(1, 2, 11, 6, generator=g).bfloat16()
    with ctx(), torch.autocast("cpu", torch.bfloat16):
        out = cp_blockdiag_sdpa(q, k, v, is_causal=True, enable_gqa=True)
    assert seen == [torch.bfloat16] and out.dtype == torch.bfloat16
    ref = reference_attention(q.bfloat16(), k.bfloat16(), v, ids, enable_gqa=True)
    assert (out.double() - ref).abs().max() <= 2e-2


# ---- 5. documents from position_ids ----------------------------------------------------------------------
def test_position_id_resets_give_the_documents():
    from blockdiag_ref import doc_ids_from_batch

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [5, 6, 7, 8, 0, 1, 2, 3]])
    assert doc_ids_from_batch({"position_ids": pos}, 8, 2).tolist() == [[1, 1, 1, 2, 2, 3, 3, 3], [1, 1, 1, 1, 2, 2, 2, 2]]
    # the seed's order stays above: _packed_seq_ids, then a 4-D mask, then a 2-D indexed mask
    packed = torch.tensor([[1] * 8, [1] * 8])
    assert torch.equal(doc_ids_from_batch({"position_ids": pos, "_packed_seq_ids": packed}, 8, 2), packed)
    indexed = torch.tensor([[1, 1, 2, 2, 2, 2, 2, 0], [3] * 8])
    assert torch.equal(doc_ids_from_batch({"position_ids": pos, "attention_mask": indexed}, 8, 2), indexed)
    # a 0/1 validity mask says which tokens are real, not where documents start: the resets split it
    valid = torch.tensor([[1] * 7 + [0], [1] * 8])
    got = doc_ids_from_batch({"position_ids": pos, "attention_mask": valid}, 8, 2)
    assert got.tolist() == [[1, 1, 1, 2, 2, 3, 3, 0], [1, 1, 1, 1, 2, 2, 2, 2]]
    # [n, B, S] positions (mRoPE) do not mark documents
    assert doc_ids_from_batch({"position_ids": pos.expand(3, 2, 8)}, 8, 2).tolist() == [[1] * 8] * 2
    with pytest.raises(ValueError, match="position_ids: expected integer positions, got dtype torch.float32"):
        doc_ids_from_batch({"position_ids": pos.float()}, 8, 2)


def test_flattening_collator_batch_attends_per_document(one_thread):
    """transformers' DataCollatorWithFlattening signals packing by position_ids alone; each document attends
    only to itself (it attended across all of them before)."""
    transformers = pytest.importorskip("transformers")
    docs = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    batch = transformers.DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d} for d in docs])
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, batch)
    assert ctx.state.plan.layout.doc_ids.tolist() == [[1] * 4 + [2] * 3 + [3] * 5]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 4, generator=g, dtype=torch.float64) for _ in range(3))
    with ctx():
        out = cp_blockdiag_sdpa(q, k, v, is_causal=True)
    ref = reference_attention(q, k, v, ctx.state.plan.layout.doc_ids)
    assert (out - ref).abs().max() <= 1e-12
