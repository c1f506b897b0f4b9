"""blockdiag_dist's public face in one process: the batch function (padding, slicing, validation before
mutation), cp_blockdiag_sdpa with and without a context, the routing helper and configure_cp_varlen.
Multi-rank behaviour is in test_dist_multiproc.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import blockdiag_dist
from blockdiag_dist import (
    configure_cp_varlen,
    cp_blockdiag_sdpa,
    current_state,
    make_cp_blockdiag_batch_and_ctx,
    sdpa_routing,
)
from blockdiag_dist.sharding import shard_tensor, unshard
from blockdiag_dist.plan import plan_shards
from blockdiag_ref import DocLayout, reference_attention


def batch_of(B=2, S=7, H=3, ids=None):
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[1, 1, 1, 2, 2, 0, 0], [3, 3, 0, 3, 4, 4, 4]]) if ids is None else ids
    return {
        "inputs_embeds": torch.randn(B, S, H, generator=g),
        "labels": torch.randint(0, 5, (B, S), generator=g),
        "position_ids": torch.arange(S).expand(B, S).clone(),
        "_packed_seq_ids": ids,
        "attention_mask": torch.ones(B, S, dtype=torch.long),
        "extra_float": torch.randn(B, S, 2, generator=g),
        "not_sequence": torch.randn(5),
        "meta": "kept",
    }


def test_cp1_batch_is_padded_sliced_and_annotated():
    batch = batch_of()
    x = batch["inputs_embeds"].requires_grad_()
    ctx, out = make_cp_blockdiag_batch_and_ctx(None, None, batch, loss_mask=torch.ones(2, 7))
    assert out is batch
    assert "attention_mask" not in batch
    assert batch["padding_mask"].tolist() == [[False] * 5 + [True] * 2, [False, False, True] + [False] * 4]
    assert torch.equal(batch["loss_mask"], torch.ones(2, 7))
    assert batch["meta"] == "kept" and batch["not_sequence"].shape == (5,)
    batch["inputs_embeds"].sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # the slice is differentiable
    assert ctx.state.world == 1 and ctx.state.positions.tolist() == list(range(7))


@pytest.mark.parametrize("kwargs, planned", [
    ({}, [(-1, -1, False, False)]),  # the unwindowed one by default
    ({"window_sizes": [(4, 0), None]}, [(-1, -1, False, False), (4, -1, False, False)]),
    ({"window_sizes": []}, []),
    ({"expect_attention": False}, []),  # a model without attention plans none ahead
])
def test_the_batch_function_plans_the_windows_it_is_told(kwargs, planned):
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch_of(), **kwargs)
    assert sorted(ctx.state._windows) == planned
    wp = ctx.state.agreed_window_plan(2)  # any other window: on its first use
    assert (2, -1, False, False) in ctx.state._windows and wp.window_left == 2


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_shards_of_every_rank_put_together_give_the_padded_tensor(world):
    """Pure slicing, every rank in one process: each tensor kind with its pad value."""
    S = 7
    shards = plan_shards(S, world)
    t = torch.arange(2 * S * 3).view(2, S, 3).float()
    labels = torch.arange(2 * S).view(2, S)
    mrope = torch.arange(3 * 2 * S).view(3, 2, S)
    parts = [shard_tensor(t, 1, 0.0, shards, r) for r in range(world)]
    assert all(p.shape == (2, shards.local_len, 3) for p in parts)
    assert torch.equal(torch.cat(parts, 1), F.pad(t, (0, 0, 0, shards.padded_len - S)))
    lab = torch.cat([shard_tensor(labels, 1, -100, shards, r) for r in range(world)], 1)
    assert torch.equal(lab[:, :S], labels) and bool((lab[:, S:] == -100).all())
    pos = torch.cat([shard_tensor(mrope, 2, 0, shards, r) for r in range(world)], 2)
    assert torch.equal(pos[:, :, :S], mrope) and bool((pos[:, :, S:] == 0).all())


def test_input_ids_primary_pads_with_padding_token_id():
    ids = torch.tensor([[5, 6, 7]])
    batch = {"input_ids": ids, "position_ids": torch.tensor([[[0, 1, 2]]] * 3).view(3, 1, 3)}
    make_cp_blockdiag_batch_and_ctx(None, None, batch, padding_token_id=9)
    assert torch.equal(batch["input_ids"], ids) and batch["position_ids"].shape == (3, 1, 3)


def qkv(B=2, Hq=4, Hkv=2, L=7, D=5, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, L, D, generator=g, dtype=dtype, requires_grad=True) for h in (Hq, Hkv, Hkv)]


@pytest.mark.parametrize("kernel", ["varlen", "dense"])
@pytest.mark.parametrize("window", [None, (0, 0), (2, 0), (3, -1)])
def test_cp1_attention_equals_reference(kernel, window):
    batch = batch_of()
    ids = batch["_packed_seq_ids"].clone()
    ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, batch, kernel=kernel, window_sizes=[window])
    q, k, v = qkv()
    with ctx():
        out = cp_blockdiag_sdpa(q, k, v, is_causal=True, enable_gqa=True, window_size=window)
        grads = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    ref = reference_attention(q, k, v, ids, enable_gqa=True, window_size=window)
    ref_grads = torch.autograd.grad(ref.pow(2).sum(), (q, k, v))
    assert (out - ref).abs().max() <= 1e-12
    for a, b in zip(grads, ref_grads):
        assert (a - b).abs().max() <= 1e-12
    pad = ids == 0
    assert bool((out.transpose(1, 2)[pad] == 0).all())
    assert bool((grads[1].transpose(1, 2)[pad] == 0).all()) and bool((grads[2].transpose(1, 2)[pad] == 0).all())


def test_without_context_it_is_stock_sdpa():
    q, k, v = qkv(Hkv=4)
    mask = torch.rand(7, 7, generator=torch.Generator().manual_seed(1)) > 0.3
    assert torch.equal(cp_blockdiag_sdpa(q, k, v), F.scaled_dot_product_attention(q, k, v))
    assert torch.equal(cp_blockdiag_sdpa(q, k, v, is_causal=True), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert torch.equal(cp_blockdiag_sdpa(q, k, v, attn_mask=mask, scale=0.3), F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3))


def test_the_varlen_gathers_are_built_on_the_first_attention_call_only():
    """The batch function plans the pieces; the maskless blocks' gather indices (O(tokens)) wait for a call that
    runs them, and a padding-only rank never builds them."""
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch_of(), kernel="varlen")
    meta = ctx.state.window_plan(-1).kernel_meta
    assert "blocks" not in meta._cache and meta.piece_q.shape[0] > 0
    q, k, v = qkv()
    with ctx():
        cp_blockdiag_sdpa(q, k, v, is_causal=True, enable_gqa=True)
    assert meta.blocks is meta._cache["blocks"] and meta.blocks.buckets

    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch_of(ids=torch.zeros(2, 7, dtype=torch.long)), kernel="varlen")
    q, k, v = qkv()
    with ctx():
        out = cp_blockdiag_sdpa(q, k, v, is_causal=True, enable_gqa=True)
    meta = ctx.state.window_plan(-1).kernel_meta
    assert meta.piece_q.shape[0] == 0 and "blocks" not in meta._cache and bool((out == 0).all())


@pytest.mark.parametrize("mode", ["a2a", "halo"])
def test_the_send_index_is_built_on_the_first_exchange_only(mode):
    """A window plan keeps the rows a rank sends as runs (O(spans)); the token-level index waits for the first
    exchange, equals the exchange plan's send rows, and fills the send splits exactly."""
    from blockdiag_dist.plan import plan_step
    from blockdiag_dist.state import StepState

    ids = torch.tensor([[1] * 9 + [2] * 7 + [3] * 8, [4] * 5 + [5] * 15 + [0] * 4])
    plan = plan_step(ids, 3, "contiguous")
    for rank in range(3):
        wp = StepState(plan, rank=rank, group=None, device=torch.device("cpu"), kv_exchange=mode,
                       kernel="varlen").window_plan(3)
        assert wp.mode == mode and "send_rows" not in wp.__dict__
        assert torch.equal(wp.send_rows, plan.exchange(3).send_rows(rank)) and "send_rows" in wp.__dict__
        assert wp.send_rows.numel() == sum(wp.send_splits) == plan.exchange(3).sent_tokens()[rank]
    assert sum(plan.exchange(3).sent_tokens()) > 0  # the layout makes ranks send


def test_a_step_of_attention_alone_builds_no_per_row_tensor_of_its_documents():
    """The batch function plans the rank's pieces; the documents' per-row tensors (read by mixers and positions)
    and the kernel's padding rows wait for their first reader, and equal the per-token definitions then."""
    ids = torch.tensor([[1, 1, 1, 2, 2, 0, 0], [3, 3, 0, 3, 4, 4, 4]])
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch_of(ids=ids), kernel="varlen")
    docs, meta = ctx.state.docs, ctx.state.window_plan(-1).kernel_meta
    lazy = ("token_index", "doc_index", "doc_position", "doc_position_cpu", "_token_index_cpu", "_rows_cpu")
    assert not set(lazy) & set(vars(docs)) and "pad_rows" not in meta._cache
    q, k, v = qkv()
    with ctx():
        cp_blockdiag_sdpa(q, k, v, is_causal=True, enable_gqa=True)
    assert not set(lazy) & set(vars(docs)) and torch.equal(meta.pad_rows, (ids.flatten() == 0).nonzero().flatten())
    layout = DocLayout.from_doc_ids(ids)
    assert torch.equal(docs.doc_index, layout.segment_ids - 1)
    assert torch.equal(docs.doc_position, torch.where(ids != 0, torch.arange(7) - layout.doc_starts, -1))
    assert torch.equal(docs.token_index, (ids.flatten() != 0).nonzero().flatten())


@pytest.mark.parametrize("layout", ["contiguous", "balanced", "auto"])
def test_a_collated_batch_is_read_once_and_its_full_rows_are_never_rebuilt(layout):
    """Documents from a flattening collator's positions: the plan's layout holds no doc-id tensor, and the
    batch's shards and padding mask equal those of the same batch given its doc ids."""
    lengths = [[5, 1, 6, 3], [2, 9, 4]]
    layout_of = DocLayout.from_seqlens(lengths, pad=[0, 0])
    ids = layout_of.doc_ids
    g = torch.Generator().manual_seed(1)
    base = {"input_ids": torch.randint(1, 50, ids.shape, generator=g), "labels": torch.randint(0, 50, ids.shape, generator=g),
            "position_ids": layout_of.doc_positions}
    ctx, got = make_cp_blockdiag_batch_and_ctx(None, None, dict(base), layout=layout)
    assert "doc_ids" not in vars(ctx.state.plan.layout) and "segment_ids" not in vars(ctx.state.plan.layout)
    assert ctx.state.plan.layout.seqlens == lengths
    _, want = make_cp_blockdiag_batch_and_ctx(None, None, dict(base, _packed_seq_ids=ids), layout=layout)
    for key in ("input_ids", "labels", "position_ids", "padding_mask"):
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("layout", ["contiguous", "balanced", "auto"])
def test_a_flattening_collators_boundaries_plan_the_step_its_positions_would(layout, world):
    """``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``: the documents come from ``cu_seq_lens_q``
    (no doc-id tensor), every rank's shards and padding mask equal those of the same batch without the boundaries,
    and the boundaries and longest lengths of the unsharded row are gone from the rank's batch."""
    from transformers import DataCollatorWithFlattening

    from blockdiag_dist import CPOptions
    from blockdiag_dist.batch import _step

    lengths = [5, 1, 6, 3, 9]
    g = torch.Generator().manual_seed(2)
    features = [{"input_ids": torch.randint(1, 50, (n,), generator=g).tolist()} for n in lengths]
    full = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features)
    assert sorted(full) == ["cu_seq_lens_k", "cu_seq_lens_q", "input_ids", "labels", "max_length_k", "max_length_q",
                            "position_ids"]
    bare = {k: full[k] for k in ("input_ids", "labels", "position_ids")}
    options = CPOptions(layout=layout, check_consensus=False)
    for rank in range(world):
        ctx, got = _step(dict(full), None, options, None, world, rank)
        _, want = _step(dict(bare), None, options, None, world, rank)
        assert ctx.state.plan.layout.seqlens == [lengths] and "doc_ids" not in vars(ctx.state.plan.layout)
        assert sorted(got) == sorted(want) == ["input_ids", "labels", "padding_mask", "position_ids"]
        for key in sorted(got):
            assert torch.equal(got[key], want[key]), key
        ctx, _ = _step({"input_ids": full["input_ids"], "cu_seq_lens_q": full["cu_seq_lens_q"]}, None, options, None,
                       world, rank)
        assert ctx.state.plan.layout.seqlens == [lengths]  # the boundaries alone name them


def test_window_without_context_is_a_causal_band():
    q, k, v = qkv(Hkv=4)
    band = DocLayout.from_seqlens([7]).materialize_mask(window_size=(2, 0))[0, 0]
    assert torch.equal(cp_blockdiag_sdpa(q, k, v, window_size=(2, 0)), F.scaled_dot_product_attention(q, k, v, attn_mask=band))


def test_context_replaces_a_mask_only_when_asked_and_records_it():
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch_of())
    q, k, v = qkv(Hkv=4)
    with ctx():
        a = cp_blockdiag_sdpa(q, k, v, is_causal=True)
        w = cp_blockdiag_sdpa(q, k, v, window_size=(-1, 0))  # a window is causal attention
        assert ctx.state.notes == []  # is_causal alone is the normal case of a causal model: nothing to record
        b = cp_blockdiag_sdpa(q, k, v, noncausal="causal")
        c = cp_blockdiag_sdpa(q, k, v, attn_mask=torch.ones(7, 7, dtype=torch.bool), noncausal="causal")
    assert torch.equal(a, w) and torch.equal(a, b) and torch.equal(a, c)
    assert sum("replaced by per-document causal attention" in n for n in ctx.state.notes) == 2


def test_state_is_active_only_inside_the_context_and_visible_from_other_threads():
    import threading

    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch_of(), expect_attention=False)
    seen = []
    with ctx():
        t = threading.Thread(target=lambda: seen.append(current_state()))
        t.start()
        t.join()
    assert seen == [ctx.state] and current_state() is None


def test_routing_helper_rebinds_and_restores():
    original = F.scaled_dot_product_attention
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch_of())
    q, k, v = qkv(Hkv=4)
    with ctx(), sdpa_routing():
        assert F.scaled_dot_product_attention is cp_blockdiag_sdpa
        routed = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        direct = cp_blockdiag_sdpa(q, k, v, is_causal=True)
    assert F.scaled_dot_product_attention is original
    assert torch.equal(routed, direct)
    with pytest.raises(RuntimeError), sdpa_routing():
        raise RuntimeError("restored on errors too")
    assert F.scaled_dot_product_attention is original


@pytest.mark.parametrize("reentrant", [True, False])
def test_recompute_after_the_context_exited_uses_its_forward_step(reentrant):
    """A checkpointed forward recomputed in a backward that runs after train_ctx() exited attends per document,
    as its forward did (the step travels in the autograd graph), instead of across documents."""
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch_of())
    q, k, v = qkv(Hkv=4)
    attend = lambda a, b, c: cp_blockdiag_sdpa(a, b, c, is_causal=True)  # noqa: E731
    with ctx():
        want = torch.autograd.grad(attend(q, k, v).pow(2).sum(), (q, k, v))
        out = torch.utils.checkpoint.checkpoint(attend, q, k, v, use_reentrant=reentrant)
    out.pow(2).sum().backward()  # reentrant checkpointing supports .backward() only
    assert all(torch.equal(t.grad, w) for t, w in zip((q, k, v), want))


def test_configure_cp_varlen_accepts_synonyms_and_per_call_options_win():
    try:
        assert configure_cp_varlen(attn_backend="Flash_Attention_2", kv_exchange="All_To_All")["kernel"] == "varlen"
        ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch_of())
        assert ctx.state.kernel == "varlen" and ctx.state.kv_exchange == "a2a"
        ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch_of(), kernel="sdpa", kv_exchange="needed_only")
        assert ctx.state.kernel == "dense" and ctx.state.kv_exchange == "halo"
        configure_cp_varlen(attn_backend="TE")
        ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch_of())
        assert ctx.state.kernel == "varlen" and any("TransformerEngine is not used" in n for n in ctx.state.notes)
        with pytest.raises(ValueError, match="attn_backend: expected one of 'auto', 'varlen', 'flash'.*got 'xformers'"):
            configure_cp_varlen(attn_backend="xformers")
        with pytest.raises(ValueError, match="kv_exchange: expected one of .*'a2a'.*got 'p2p'"):
            configure_cp_varlen(kv_exchange="p2p")
    finally:
        configure_cp_varlen(attn_backend="auto", kv_exchange="auto")


def test_public_api_is_exported():
    for name in ("make_cp_blockdiag_batch_and_ctx", "_cp_blockdiag_doc_ids", "cp_blockdiag_sdpa", "sdpa_routing", "configure_cp_varlen"):
        assert name in blockdiag_dist.__all__ and callable(getattr(blockdiag_dist, name))


# ---- CPOptions: the batch function's keyword options as one validated object ------------------------------
def test_options_object_gives_the_same_step_as_the_keywords():
    from blockdiag_dist import CPOptions

    ids = torch.tensor([[1, 1, 1, 2, 2, 0]])
    kw = dict(kernel="dense", layout="balanced", window_sizes=[(2, 0)], check_consensus=False)
    ctx_a, a = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": ids.clone(), "_packed_seq_ids": ids.clone()}, **kw)
    ctx_b, b = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": ids.clone(), "_packed_seq_ids": ids.clone()},
                                               options=CPOptions(**kw))
    assert ctx_a.state.kernel == ctx_b.state.kernel == "dense"
    assert ctx_a.state.plan.shards.layout == ctx_b.state.plan.shards.layout == "balanced"
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("values, match", [
    pytest.param({"layout": "zigzag"}, "layout: expected one of", id="bad-layout"),
    pytest.param({"kernel": "xformers"}, "kernel: expected one of", id="bad-kernel"),
    pytest.param({"window_sizes": [(2, 1)]}, "window_size", id="bad-window"),
    pytest.param({"conv_widths": [0]}, "conv_widths: expected", id="bad-conv-width"),
    pytest.param({"shard_vision": True}, "shard_vision=True: expected shard_primary=False", id="vision-needs-full-rows"),
    pytest.param({"layuot": "auto"}, r"CPOptions: expected keys among .* got unknown \['layuot'\]", id="unknown-key"),
])
def test_options_object_refuses_bad_values(values, match):
    from blockdiag_dist import CPOptions

    with pytest.raises(ValueError, match=match):
        CPOptions.from_mapping(values)


def test_options_object_and_keywords_together_are_refused_before_mutating():
    from blockdiag_dist import CPOptions

    batch = {"input_ids": torch.ones(1, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"left at their defaults when options= is given, got \['layout'\]"):
        make_cp_blockdiag_batch_and_ctx(None, None, batch, layout="balanced", options=CPOptions())
    assert sorted(batch) == ["input_ids"] and batch["input_ids"].shape == (1, 4)
