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
from verify.gpu.emulate import flash_attn_varlen_func as flash_attn_varlen_emulated
from verify.tolerances import judge

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
        assert judge("bfloat16", max_rel(g_, r_), 1.0, max_rel(s_, r_))[1], (max_rel(g_, r_), max_rel(s_, r_))


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
    monkeypatch.setattr(varlen, "_device_capability", lambda device: (9, 0))
    cuda_like = lambda dtype: types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"), dtype=dtype)  # noqa: E731
    assert varlen.flash_unusable_reason(cuda_like(torch.bfloat16), 6, 6) is None
    assert "float32" in varlen.flash_unusable_reason(cuda_like(torch.float32), 6, 6)
    seen = []

    def gate(q_tok, d, dv, **kw):
        seen.append(q_tok.dtype)
        return varlen.flash_unusable_reason(cuda_like(q_tok.dtype), d, dv, **kw)

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
    # [n, B, S] positions (mRoPE) mark documents as [B, S] ones do: where every component is 0 (issue 22)
    assert doc_ids_from_batch({"position_ids": pos.expand(3, 2, 8)}, 8, 2).tolist() == [[1, 1, 1, 2, 2, 3, 3, 3], [1, 1, 1, 1, 2, 2, 2, 2]]
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


# ---- 2. checkpoint recompute bound to its forward's step ---------------------------------------------------
def _grads(model):
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def _assert_grads_equal(got, want):
    for name in want:
        assert (got[name] - want[name]).abs().max() <= 1e-12 * want[name].abs().max().clamp_min(1), name


IDS_A = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [1] * 11])
DOCS_A = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2], [1] * 11])
DOCS_B = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 3], [1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2]])


def _reference_grads(ids, docs):
    """Grads of one step of the un-checkpointed model, backward inside its context."""
    model = tiny_model().double()
    ctx, batch = _packed(ids, docs)
    with ctx():
        model(batch["input_ids"], batch["position_ids"]).pow(2).mean().backward()
    return _grads(model)


def _packed(ids, docs):
    batch = {"input_ids": ids.clone(), "_packed_seq_ids": docs, "position_ids": torch.arange(ids.shape[1]).expand_as(ids).clone()}
    return make_cp_blockdiag_batch_and_ctx(None, None, batch)


@pytest.mark.parametrize("checkpointing", ["reentrant", "non_reentrant"])
def test_backward_after_the_context_was_exited_and_deleted(one_thread, checkpointing):
    want = _reference_grads(IDS_A, DOCS_A)
    model = tiny_model(checkpointing).double()
    train_ctx, batch = _packed(IDS_A, DOCS_A)
    with train_ctx():
        loss = model(batch["input_ids"], batch["position_ids"]).pow(2).mean()
    del train_ctx
    loss.backward()  # outside any context: the recompute finds the step in the autograd graph
    _assert_grads_equal(_grads(model), want)


@pytest.mark.parametrize("checkpointing", ["reentrant", "non_reentrant"])
def test_pipeline_order_a_forward_b_forward_a_backward(one_thread, checkpointing):
    """Micro-batch A's forward, then B's forward in B's context, then A's backward while B's context is active
    (as pipeline schedules do): A's recompute runs under A's documents."""
    ids_b = IDS_A.flip(1)
    want_a, want_b = _reference_grads(IDS_A, DOCS_A), _reference_grads(ids_b, DOCS_B)
    model = tiny_model(checkpointing).double()
    ctx_a, batch_a = _packed(IDS_A, DOCS_A)
    ctx_b, batch_b = _packed(ids_b, DOCS_B)
    with ctx_a():
        loss_a = model(batch_a["input_ids"], batch_a["position_ids"]).pow(2).mean()
    with ctx_b():
        loss_b = model(batch_b["input_ids"], batch_b["position_ids"]).pow(2).mean()
        loss_a.backward()
        _assert_grads_equal(_grads(model), want_a)
    loss_b.backward()
    _assert_grads_equal(_grads(model), want_b)


def test_recompute_that_left_no_step_in_the_graph_is_refused_after_the_context():
    """Non-reentrant checkpointing of attention over inputs that need no grad leaves no autograd node to carry
    the step: a recompute after the context exited raises (it would silently attend across documents)."""
    ctx, _ = _packed(IDS_A, DOCS_A)
    q, k, v = (torch.randn(2, 2, 11, 4, dtype=torch.float64) for _ in range(3))
    w = torch.ones((), dtype=torch.float64, requires_grad=True)
    with ctx():
        out = torch.utils.checkpoint.checkpoint(lambda a, b, c: cp_blockdiag_sdpa(a, b, c, is_causal=True) * w, q, k, v, use_reentrant=False)
    with pytest.raises(RuntimeError, match="expected backward to run inside `with train_ctx\\(\\):`"):
        out.sum().backward()


# ---- 3. attention that never reaches cp_blockdiag_sdpa ------------------------------------------------------
def test_a_step_whose_attention_bypassed_the_routing_fails_at_exit():
    """A module that bound SDPA by name before sdpa_routing() attends within the shard only: the context's exit
    raises (after backward ran, before an optimizer step can use the gradients)."""
    from blockdiag_dist import AttentionNotRoutedError, sdpa_routing

    bound = torch.nn.functional.scaled_dot_product_attention  # bound before the routing: never rerouted
    q = torch.randn(2, 2, 7, 4, requires_grad=True)
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(2, 7, 1)})
    with pytest.raises(AttentionNotRoutedError, match="without any attention call reaching cp_blockdiag_sdpa") as e:
        with ctx(), sdpa_routing():
            bound(q, q, q, is_causal=True).sum().backward()
    # the refusal names only what gives correct gradients: not the opt-out, which would leave the shard's attention
    # (or a recurrent model's layers) silently wrong
    assert "expect_attention" not in str(e.value), str(e.value)
    # a model that does not mix the sequence opts out; a step that routed its attention exits normally
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(2, 7, 1)}, expect_attention=False)
    with ctx():
        q.sum().backward()
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(2, 7, 1)})
    with ctx(), sdpa_routing():
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    assert ctx.state.attention_calls == 1


def test_a_transformers_model_on_eager_attention_fails_at_exit():
    transformers = pytest.importorskip("transformers")
    from blockdiag_dist import AttentionNotRoutedError

    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": torch.ones(1, 9, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])})
    with pytest.raises(AttentionNotRoutedError):
        with ctx():
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits.sum().backward()


# ---- 4. bidirectional calls and masks ---------------------------------------------------------------------
def test_a_bidirectional_layer_under_routing_is_refused_or_runs_locally_when_asked():
    """Under sdpa_routing() an encoder-style layer (is_causal=False, or its own mask) no longer becomes causal
    silently: it raises naming the opt-in; with noncausal='local' it is stock SDPA on its own tensors, while a
    causal layer in the same step attends per document."""
    from blockdiag_dist import sdpa_routing

    ids = torch.tensor([[1, 1, 1, 2, 2, 2, 2]])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(7, 7, generator=g) > 0.5
    F = torch.nn.functional
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(1, 7, 1), "_packed_seq_ids": ids})
    with ctx(), sdpa_routing():
        with pytest.raises(ValueError, match="got is_causal=False; block-diagonal CP computes causal attention per document.*noncausal='local'"):
            F.scaled_dot_product_attention(q, k, v)
        with pytest.raises(ValueError, match="with an attn_mask of shape"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with ctx(), sdpa_routing(noncausal="local"):
        bidir = F.scaled_dot_product_attention(q, k, v)
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    sdpa = torch._C._nn.scaled_dot_product_attention
    assert torch.equal(bidir, sdpa(q, k, v)) and torch.equal(masked, sdpa(q, k, v, attn_mask=mask))
    assert (causal - reference_attention(q, k, v, ids)).abs().max() <= 1e-12
    assert any("noncausal='local'" in n for n in ctx.state.notes)


# ---- 6. ranks given different batches ---------------------------------------------------------------------
def test_disagreeing_ranks_raise_by_default_and_can_opt_out(session):
    import mp_checks

    for m in session.pool(3).run(mp_checks.consensus_by_default, args=(None,), timeout=60, name="consensus default"):
        assert "CP plan consensus failed" in m and "ranks [0, 2] have" in m and "ranks [1] have" in m
    assert session.pool(3).run(mp_checks.consensus_by_default, args=(False,), timeout=60, name="consensus off") == ["no error"] * 3


# ---- 7. one rank alone: reports, in-place ops on a padding-only rank ---------------------------------------
def test_a_report_from_one_rank_and_inplace_ops_on_a_padding_only_rank(session):
    import mp_checks

    results = session.pool(4).run(mp_checks.lone_report_and_inplace_output, timeout=30, name="lone report")
    assert results[0]["report_mode"] is not None
    for r in results:
        assert r["out_err"] <= 1e-12 and r["dq_err"] <= 1e-12, r
        assert 0 not in r["out_stride"], r


def test_padding_only_output_is_an_ordinary_tensor():
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(1, 6, 1), "_packed_seq_ids": torch.zeros(1, 6, dtype=torch.long)})
    q = torch.randn(1, 2, 6, 4, requires_grad=True)
    with ctx():
        out = cp_blockdiag_sdpa(q, q, q, is_causal=True)
        assert 0 not in out.stride() and bool((out == 0).all())
        out.add_(1).sum().backward()
    assert bool((q.grad == 0).all())
