"""Attention variants: sinks (gpt-oss), logit soft-capping (Gemma 2), chunked local attention (Llama 4).

- the float64 reference against an independent per-document computation (and the chunked layout against the
  chunk mask);
- every kernel path against the reference, one rank's queries at a time against an all-gathered key buffer
  (pieces cut by ranks, windows that bind, padding, a rank holding only padding), the sinks' gradient summed
  over ranks;
- the plans' needed sets of chunked attention against brute force from the reference mask;
- ``cp_blockdiag_sdpa`` with and without a step, its validation, the flash-attn path (emulated), and the
  common path (no variant) never reaching explicit scores. Multi-rank runs are the verifier's (``make verify``
  rotates the variants through its matrix; tests/test_verify.py).
"""

from __future__ import annotations

import math

import pytest
import torch

import blockdiag_dist.kernels.dense as dense
import blockdiag_dist.kernels.varlen as varlen
import blockdiag_dist.runtime as runtime
from blockdiag_dist import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx
from blockdiag_dist.kernels.dense import dense_attention, plan_dense
from blockdiag_dist.kernels.varlen import plan_varlen, varlen_attention
from blockdiag_dist.plan import plan_step
from blockdiag_ref import DocLayout, reference_attention

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64


def _ids(*runs: tuple[int, int]) -> torch.Tensor:
    return torch.tensor([[d for d, n in runs for _ in range(n)]])


def per_document(q, k, v, doc_ids, *, left=-1, sinks=None, softcap=None, chunk=-1):
    """Each document alone with plain float64 math, positions counted from its own start: a causal band, chunks of
    ``chunk`` from the document's first token, capped scores, a sink logit per head. Runs found by walking ids."""
    B, Hq, S, D = q.shape
    group = Hq // k.shape[1]
    out = torch.zeros(B, Hq, S, v.shape[-1], dtype=F64)
    for b in range(B):
        ids, start = doc_ids[b].tolist(), 0
        while start < S:
            end = start + 1
            while end < S and ids[end] == ids[start]:
                end += 1
            if ids[start] != 0:
                n = end - start
                i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
                allowed = j <= i
                if left >= 0:
                    allowed &= j >= i - left
                if chunk > 0:
                    allowed &= (i // chunk) == (j // chunk)
                s = q[b, :, start:end] @ k[b, :, start:end].repeat_interleave(group, 0).transpose(-1, -2) / math.sqrt(D)
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                e = torch.exp(s.masked_fill(~allowed, -math.inf))
                den = e.sum(-1, keepdim=True) + (0 if sinks is None else torch.exp(sinks)[:, None, None])
                out[b, :, start:end] = (e / den) @ v[b, :, start:end].repeat_interleave(group, 0)
            start = end
    return out


VARIANTS = [
    pytest.param(dict(sinks=True), id="sinks"),
    pytest.param(dict(softcap=1.5), id="softcap"),
    pytest.param(dict(chunk=5), id="chunk5"),
    pytest.param(dict(sinks=True, softcap=3.0, chunk=4), id="all"),
]


def _variant_kwargs(v: dict, hq: int, g: torch.Generator) -> dict:
    out = {}
    if v.get("sinks"):
        out["sinks"] = (torch.randn(hq, generator=g, dtype=F64) * 2).requires_grad_()
    if "softcap" in v:
        out["softcap"] = v["softcap"]
    if "chunk" in v:
        out["chunk_size"] = v["chunk"]
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("left", [-1, 2])
def test_reference_equals_per_document_with_variants(variant, left):
    g = torch.Generator().manual_seed(7)
    ids = torch.tensor([[1] * 9 + [2] * 3 + [0] * 2 + [3] * 12 + [1] * 4, [4] * 23 + [0] * 7])
    q, k, v = (torch.randn(2, h, 30, 4, generator=g, dtype=F64).requires_grad_() for h in (4, 2, 2))
    kw = _variant_kwargs(variant, 4, g)
    window = None if left < 0 else (left, 0)
    got = reference_attention(q, k, v, ids, enable_gqa=True, window_size=window, **kw)
    want = per_document(q, k, v, ids, left=left, sinks=kw.get("sinks"), softcap=kw.get("softcap"),
                        chunk=kw.get("chunk_size", -1))
    assert (got - want).abs().max() <= 1e-12
    assert bool((got.transpose(1, 2)[ids == 0] == 0).all())
    w = torch.randn(got.shape, generator=g, dtype=F64)
    leaves = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    for a, b in zip(torch.autograd.grad((got * w).sum(), leaves), torch.autograd.grad((want * w).sum(), leaves)):
        assert (a - b).abs().max() <= 1e-12


def test_a_chunk_counts_from_its_documents_start():
    """Documents of 5 and 4 tokens, chunks of 3: the second document's chunks start at its positions 0 and 3 (row
    positions 5 and 8), not at row positions 6 and 9."""
    m = DocLayout.from_seqlens([5, 4]).materialize_mask(chunk_size=3)[0, 0]
    assert m[7].nonzero().flatten().tolist() == [5, 6, 7] and m[8].nonzero().flatten().tolist() == [8]
    assert m[4].nonzero().flatten().tolist() == [3, 4]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_chunked_layout_is_the_chunk_mask(seed, chunk):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 4, (2, 37), generator=g).repeat_interleave(torch.randint(1, 6, (37,), generator=g), 1)[:, :41]
    layout = DocLayout.from_doc_ids(ids)
    assert torch.equal(layout.chunked(chunk).materialize_mask(), layout.materialize_mask(chunk_size=chunk))
    assert torch.equal(layout.chunked(chunk).padding_mask, layout.padding_mask)


# ---- kernels, rank by rank ----------------------------------------------------------------------------------
KERNEL_CASES = [  # ids, world, layout, window left
    pytest.param(_ids((1, 70), (2, 9), (3, 40), (0, 3)), 2, "contiguous", -1, id="cut-by-rank"),
    pytest.param(_ids((1, 120), (2, 30)), 2, "balanced", 20, id="window-bands-balanced"),
    pytest.param(_ids((1, 3), (2, 1), (3, 25), (0, 4), (4, 11)), 3, "contiguous", 0, id="window0-padding"),
    pytest.param(_ids((1, 30), (2, 9), (0, 13)), 4, "contiguous", 3, id="padding-only-rank"),
]
PATHS = ["fused", "masked", "dense"]  # fused: the maskless blocks (sinks merged / soft-cap on explicit blocks)


def _run_rank(ids, world, layout, left, variant, path, rank, g, dim_v=6):
    plan = plan_step(ids, world, layout)
    kw = variant["kw"]
    chunk = kw.get("chunk_size", -1)
    cplan = plan.chunked(chunk)
    B, sp, D, hq, hkv = ids.shape[0], plan.shards.padded_len, 6, 4, 2
    padded = torch.nn.functional.pad(ids, (0, sp - ids.shape[1]))
    q, k, v = (torch.randn(B, h, sp, d, generator=g, dtype=F64) * s for h, d, s in ((hq, D, 2), (hkv, D, 2), (hkv, dim_v, 1)))
    local, key_flat = plan.local_flat_ids(rank), plan.allgather_flat_ids()
    grad = torch.randn(local.numel(), hq, dim_v, generator=g, dtype=F64)
    sinks = kw.get("sinks")
    si = None if sinks is None else sinks.detach().clone().requires_grad_()
    qi, ki, vi = (t.detach().clone().requires_grad_() for t in (q, k, v))
    q_tok = qi.permute(0, 2, 1, 3).reshape(B * sp, hq, D)[local]
    kv_tok = torch.cat([ki.permute(0, 2, 1, 3).reshape(B * sp, -1), vi.permute(0, 2, 1, 3).reshape(B * sp, -1)], 1)[key_flat]
    opts = dict(heads_kv=hkv, dim_v=dim_v, dropout_p=0.0, scale=None, sinks=si, softcap=kw.get("softcap"))
    if path == "dense":
        meta = plan_dense(local, key_flat, cplan.segments, sp, left)
        out = dense_attention(q_tok, kv_tok, meta, **opts)
    else:
        meta = plan_varlen(local, key_flat, cplan.segments, cplan.doc_starts, sp, left)
        out = varlen_attention(q_tok, kv_tok, meta, **opts)
    out.backward(grad)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    sr = None if sinks is None else sinks.detach().clone().requires_grad_()
    ref = reference_attention(qr, kr, vr, DocLayout.from_doc_ids(padded), enable_gqa=True,
                              window_size=None if left < 0 else (left, 0), sinks=sr, softcap=kw.get("softcap"),
                              chunk_size=None if chunk < 0 else chunk)
    ref_tok = ref.permute(0, 2, 1, 3).reshape(B * sp, hq, dim_v)[local]
    ref_tok.backward(grad)
    pad = (plan.segments[local] == 0).nonzero().flatten()
    flat_pad = (padded == 0).flatten().nonzero().flatten()
    return dict(out=out, ref=ref_tok, grads=(qi.grad, ki.grad, vi.grad), ref_grads=(qr.grad, kr.grad, vr.grad),
                dsinks=None if si is None else si.grad, ref_dsinks=None if sr is None else sr.grad, pad=pad,
                flat_pad=flat_pad, sp=sp)


def _rel(a, b) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-3))


@pytest.mark.parametrize("ids, world, layout, left", KERNEL_CASES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("path", PATHS)
def test_kernels_carry_the_variants_rank_by_rank(ids, world, layout, left, variant, path, monkeypatch):
    if path == "masked":  # what runs when the fused op cannot (D != Dv, dropout, CUDA without flash-attn)
        monkeypatch.setattr(varlen, "fused_unusable_reason", lambda *a: "forced")
    g = torch.Generator().manual_seed(world * 10 + (left + 1))
    variant = {"kw": _variant_kwargs(variant, 4, g)}
    seen_sinks = []
    for rank in range(world):
        r = _run_rank(ids, world, layout, left, variant, path, rank, torch.Generator().manual_seed(100), dim_v=6)
        assert _rel(r["out"], r["ref"]) < 1e-10, f"rank {rank}: output"
        assert bool((r["out"][r["pad"]] == 0).all()), "padding rows must be exactly 0"
        for name, a, b in zip("qkv", r["grads"], r["ref_grads"]):
            assert _rel(a, b) < 1e-10, f"rank {rank}: d{name}"
            assert bool((a.permute(0, 2, 1, 3).reshape(r["sp"] * ids.shape[0], -1)[r["flat_pad"]] == 0).all())
        if r["dsinks"] is not None:  # a rank's part covers its own queries (the reference's: of the same rows)
            assert _rel(r["dsinks"], r["ref_dsinks"]) < 1e-10, f"rank {rank}: dsinks"
            seen_sinks.append(rank)
    assert seen_sinks == ([] if "sinks" not in variant["kw"] else list(range(world)))  # every rank, padding-only too


def test_value_head_dim_differs_on_the_masked_plan():
    """D != Dv: the fused op cannot run; the masked plan runs explicit scores with every variant."""
    g = torch.Generator().manual_seed(3)
    variant = {"kw": _variant_kwargs(dict(sinks=True, softcap=2.0, chunk=6), 4, g)}
    for rank in range(2):
        r = _run_rank(_ids((1, 50), (2, 21)), 2, "contiguous", -1, variant, "fused", rank, g, dim_v=3)
        assert _rel(r["out"], r["ref"]) < 1e-10
        assert all(_rel(a, b) < 1e-10 for a, b in zip(r["grads"], r["ref_grads"]))


def test_softcap_runs_explicit_blocks_and_sinks_the_fused_merge(monkeypatch):
    """Which path each variant takes on the fused op's inputs: sinks join the fused blocks' merge; a soft-cap runs
    the same blocks with explicit scores (SOFTCAP_PLAN); neither builds the masked plan."""
    calls, real = [], varlen._explicit_blocks

    def recorded(*args, **kwargs):
        calls.append("explicit blocks")
        return real(*args, **kwargs)

    monkeypatch.setattr(varlen, "_explicit_blocks", recorded)
    monkeypatch.setattr(varlen.VarlenMeta, "masked", lambda self, device: pytest.fail("masked plan built"))
    plan = plan_step(_ids((1, 40), (2, 30)), 2)
    meta = plan_varlen(plan.local_flat_ids(1), plan.allgather_flat_ids(), plan.segments, plan.doc_starts, 70, -1)
    q, kv = torch.randn(35, 2, 4, dtype=F64), torch.randn(70, 2 * 2 * 4, dtype=F64)
    varlen_attention(q, kv, meta, heads_kv=2, dim_v=4, dropout_p=0.0, scale=None, sinks=torch.zeros(2, dtype=F64))
    assert calls == []
    varlen_attention(q, kv, meta, heads_kv=2, dim_v=4, dropout_p=0.0, scale=None, softcap=2.0)
    assert calls == ["explicit blocks"]


@pytest.mark.parametrize("kernel", ["varlen", "dense"])
@pytest.mark.parametrize("window", [None, (3, 0)])
def test_no_variant_never_reaches_explicit_scores(kernel, window, monkeypatch):
    """The common path is today's: without a variant, no explicit-score code runs (fused blocks, masked plan, SDPA)."""
    def boom(*a, **k):
        raise AssertionError("explicit scores on the common path")

    for mod in (varlen, dense, runtime):
        monkeypatch.setattr(mod, "explicit_attention", boom, raising=False)
    monkeypatch.setattr(varlen, "_explicit_blocks", boom)
    ids = _ids((1, 20), (2, 7), (0, 2))
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(1, 29, 1), "_packed_seq_ids": ids}, kernel=kernel)
    for dv in (4, 3):  # 3: the masked plan
        q, k, v = (torch.randn(1, h, 29, d, dtype=F64, requires_grad=True) for h, d in ((2, 4), (2, 4), (2, dv)))
        with ctx():
            cp_blockdiag_sdpa(q, k, v, is_causal=True, window_size=window).sum().backward()
    cp_blockdiag_sdpa(q, k, v, is_causal=True)  # no step: stock SDPA


# ---- plans -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ids", [_ids((1, 13), (2, 4), (0, 2), (3, 9)), torch.tensor([[1] * 5 + [2] * 6, [0, 0] + [3] * 9])],
                         ids=["one-row", "two-rows"])
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("chunk, left", [(4, -1), (3, 1), (7, -1)])
def test_chunked_needed_sets_equal_brute_force(ids, world, chunk, left):
    plan = plan_step(ids, world)
    x = plan.chunked(chunk).exchange(left)
    sp = plan.shards.padded_len
    padded = torch.nn.functional.pad(ids, (0, sp - ids.shape[1]))
    mask = DocLayout.from_doc_ids(padded).materialize_mask(window_size=None if left < 0 else (left, 0), chunk_size=chunk)[:, 0]
    for rank in range(world):
        mine = set(plan.shards.positions[rank].tolist())
        want = {(b, p) for b in range(ids.shape[0]) for qp in mine for p in mask[b, qp].nonzero().flatten().tolist()
                if p not in mine}
        assert {(f // sp, f % sp) for f in x.needed[rank].tolist()} == want, f"rank {rank}"


def test_chunks_aligned_with_ranks_need_no_exchange():
    """Documents of 12 and 6 at CP 3 (6 rows a rank): causal attention needs rank 0's keys on rank 1; chunks of 6
    are each one rank's rows, and nothing moves."""
    plan = plan_step(_ids((1, 12), (2, 6)), 3)
    assert plan.exchange(-1).needed_tokens() == [0, 6, 0]
    assert plan.chunked(6).exchange(-1).needed_tokens() == [0, 0, 0]
    assert plan.chunked(4).exchange(-1).needed_tokens() == [0, 2, 0]  # the chunk of positions 4..7 straddles


# ---- the public function -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_at_cp1_and_without_a_step(variant):
    """Under a CP 1 step (packed rows) and without a step (one document per row) the same math as the reference."""
    g = torch.Generator().manual_seed(11)
    ids = torch.tensor([[1] * 8 + [2] * 11 + [0] * 2, [3] * 21])
    q, k, v = (torch.randn(2, h, 21, 4, generator=g, dtype=F64, requires_grad=True) for h in (4, 2, 2))
    kw = _variant_kwargs(variant, 4, g)
    ref = reference_attention(q, k, v, ids, enable_gqa=True, **kw)
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(2, 21, 1), "_packed_seq_ids": ids})
    with ctx():
        out = cp_blockdiag_sdpa(q, k, v, is_causal=True, enable_gqa=True, **kw)
    assert (out - ref).abs().max() <= 1e-12
    alone = cp_blockdiag_sdpa(q[1:], k[1:], v[1:], is_causal=True, enable_gqa=True, **kw)
    assert (alone - ref[1:]).abs().max() <= 1e-12
    leaves = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    w = torch.randn(ref.shape, generator=g, dtype=F64)
    for a, b in zip(torch.autograd.grad((out * w).sum(), leaves), torch.autograd.grad((ref * w).sum(), leaves)):
        assert (a - b).abs().max() <= 1e-12


def test_chunks_without_a_step_are_bottom_right_aligned():
    """Two queries against eight keys, chunks of 3: the queries are keys 6 and 7, both in the chunk of keys 6..8."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 4, generator=g, dtype=F64) for n in (2, 8, 8))
    out = cp_blockdiag_sdpa(q, k, v, chunk_size=3, softcap=50.0)
    want = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, 6:], v[:, :, 6:], is_causal=False,
                                                             attn_mask=torch.tensor([[True, False], [True, True]]))
    assert (out - want).abs().max() <= 1e-3  # the cap of 50 barely bends these scores
    exact = cp_blockdiag_sdpa(q, k, v, chunk_size=3, sinks=torch.full((1,), -1e4, dtype=F64))  # a sink of weight 0
    assert (exact - want).abs().max() <= 1e-12


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param({"sinks": torch.zeros(3)}, r"sinks expected a tensor \[Hq\] = \[2\]", id="sinks-heads"),
        pytest.param({"sinks": torch.zeros(1, 2)}, r"sinks expected a tensor \[Hq\]", id="sinks-2d"),
        pytest.param({"sinks": torch.zeros(2, dtype=torch.long)}, "floating-point", id="sinks-int"),
        pytest.param({"softcap": 0.0}, "softcap expected None or a number > 0, got 0.0", id="softcap-0"),
        pytest.param({"softcap": True}, "softcap expected None or a number > 0", id="softcap-bool"),
        pytest.param({"chunk_size": 0}, r"chunk_size: expected None or an int >= 1", id="chunk-0"),
        pytest.param({"chunk_size": 2.5}, r"chunk_size: expected None or an int >= 1", id="chunk-float"),
    ],
)
@pytest.mark.parametrize("in_step", [False, True])
def test_variant_validation(kwargs, match, in_step):
    q = torch.zeros(1, 2, 5, 4)
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(1, 5, 1)})
    with pytest.raises(ValueError, match=match):
        if in_step:
            with ctx():
                cp_blockdiag_sdpa(q, q, q, is_causal=True, **kwargs)
        else:
            cp_blockdiag_sdpa(q, q, q, is_causal=True, **kwargs)
    if in_step:
        assert ctx.state.plan._chunked == {} and not ctx.state._windows.keys() - {(-1, -1, False, False)}, "validated before planning"


# ---- flash-attn (emulated on the CPU, as in test_flash_path.py) ---------------------------------------------------
def _flash_emulated(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0):
    """flash-attn's varlen semantics (bottom-right causal, window, GQA) with its ``softcap`` (0 = none)."""
    assert causal and dropout_p == 0.0
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=F64)
    group = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qa, qb, ka, kb = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        a, c = torch.arange(qb - qa)[:, None] + (kb - ka) - (qb - qa), torch.arange(kb - ka)[None, :]
        allowed = (c <= a) & ((c >= a - window_size[0]) if window_size[0] >= 0 else True)
        s = q[qa:qb].transpose(0, 1) @ k[ka:kb].repeat_interleave(group, 1).permute(1, 2, 0) / math.sqrt(q.shape[-1])
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        p = torch.softmax(s.masked_fill(~allowed, -math.inf), -1)
        out[qa:qb] = (p @ v[ka:kb].repeat_interleave(group, 1).transpose(0, 1)).transpose(0, 1)
    return out


@pytest.mark.parametrize("kw", [dict(softcap=2.0), dict(softcap=2.0, chunk_size=4), dict(chunk_size=5)], ids=["softcap", "softcap-chunk", "chunk"])
def test_flash_path_takes_softcap_and_chunks(kw, monkeypatch):
    calls = []
    monkeypatch.setattr(varlen, "_flash_varlen_fn", lambda: lambda *a, **k: calls.append(k.get("softcap")) or _flash_emulated(*a, **k))
    monkeypatch.setattr(runtime, "flash_unusable_reason", lambda q_tok, d, dv, **kw: None)
    ids = torch.tensor([[1, 1, 1, 2, 2, 0, 3, 3, 3, 3, 3, 3, 3, 1, 1]])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 15, 6, generator=g, dtype=F64) for h in (4, 2, 2))
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(1, 15, 1), "_packed_seq_ids": ids})
    with ctx():
        out = cp_blockdiag_sdpa(q, k, v, is_causal=True, enable_gqa=True, window_size=(3, 0), **kw)
    assert calls == [kw.get("softcap")]
    assert (out - reference_attention(q, k, v, ids, enable_gqa=True, window_size=(3, 0), **kw)).abs().max() <= 1e-12


def test_sinks_never_go_to_flash_attn(monkeypatch):
    monkeypatch.setattr(varlen, "_flash_varlen_fn", lambda: pytest.fail("flash-attn called with sinks"))
    monkeypatch.setattr(runtime, "flash_unusable_reason", lambda q_tok, d, dv, **kw: None)
    ids = _ids((1, 6), (2, 5))
    q = torch.randn(1, 2, 11, 4, dtype=F64)
    sinks = torch.randn(2, dtype=F64)
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(1, 11, 1), "_packed_seq_ids": ids})
    with ctx():
        out = cp_blockdiag_sdpa(q, q, q, is_causal=True, sinks=sinks)
    assert (out - reference_attention(q, q, q, ids, sinks=sinks)).abs().max() <= 1e-12


def test_sinks_keep_a_lone_keys_gradient_in_bfloat16():
    """Documents of one token with sinks well below their scores: a key's gradient is the small sink share
    ``p (1 - p)`` of its queries' gradients. The fused blocks' backward must take its row term ``dout . out``
    from the float32 merged output; taken from the output rounded to bfloat16 after the sink's scaling it
    cancelled against ``dout . v`` and left dk off by ~10% (verifier case ``single-tokens``, seed 188). Judged
    like the verifier: against the float64 reference, within 2x the error of the same attention by explicit
    scores in bfloat16 (transformers' eager attention) plus a floor of 1e-2 of the largest reference dk."""
    g = torch.Generator().manual_seed(5)
    T, hq, hkv, D = 24, 3, 1, 5
    ids = torch.arange(1, T + 1)[None]  # every token its own document
    plan = plan_step(ids, 1)
    meta = plan_varlen(plan.local_flat_ids(0), plan.allgather_flat_ids(), plan.segments, plan.doc_starts, T, -1)
    q, k, v = (torch.randn(T, h, D, generator=g, dtype=F64) for h in (hq, hkv, hkv))
    scores = (q * k.repeat_interleave(hq, 1)).sum(-1) / math.sqrt(D)  # [T, Hq]: a row's only score
    sinks = scores.mean(0) - 4.0 + 0.1 * torch.randn(hq, generator=g, dtype=F64)  # p = sigmoid(score - sink) ~ 0.98
    grad = torch.randn(T, hq, D, generator=g, dtype=F64)

    def dk(dtype: torch.dtype, run) -> torch.Tensor:
        kk = k.detach().to(dtype, copy=True).requires_grad_()
        run(q.to(dtype), kk, v.to(dtype)).backward(grad.to(dtype))
        return kk.grad.double()

    def ours(qq, kk, vv):
        return varlen_attention(qq, torch.cat([kk, vv], 1).flatten(1), meta, heads_kv=hkv, dim_v=D, dropout_p=0.0,
                                scale=None, sinks=sinks.to(qq.dtype))

    def explicit(qq, kk, vv):  # per token: softmax over [own score, sink] in float32, the weighted value in dtype
        s = ((qq * kk.repeat_interleave(hq, 1)).sum(-1) / math.sqrt(D)).to(torch.promote_types(qq.dtype, torch.float32))
        p = torch.softmax(torch.stack([s, sinks.to(s.dtype)[None].expand_as(s)], -1), -1)[..., 0]
        return p.to(qq.dtype)[..., None] * vv.repeat_interleave(hq, 1)

    truth = dk(F64, ours)
    assert (truth - dk(F64, explicit)).abs().max() <= 1e-12  # the two are the same attention
    err = (dk(torch.bfloat16, ours) - truth).abs().max().item()
    base = (dk(torch.bfloat16, explicit) - truth).abs().max().item()
    limit = 2 * base + 1e-2 * truth.abs().max().item()
    assert err <= limit, f"dk error {err:.3e} > {limit:.3e} (explicit bf16 scores: {base:.3e})"


@pytest.mark.parametrize("variant", ["softcap", "sinks"])
def test_dense_explicit_scores_round_bfloat16_once(variant):
    """The dense kernel's explicit-score path on bfloat16 inputs keeps every intermediate (scores, the soft-cap's
    tanh and its derivative, probabilities, dS) in float32 and rounds each gradient once: its dq, dk, dv are the
    float32 computation's on the same values, rounded to bfloat16, bit for bit. So its own error is below that
    of eager attention, which rounds the scores to bfloat16 before capping (verifier case ``spans-every-rank``,
    seed 160: a dk there exceeds the bfloat16 limit only because the baseline's own rounding happens to cancel
    the error that the keys' bfloat16 rounding carries into dk)."""
    g = torch.Generator().manual_seed(160)
    ids = _ids((1, 2), (2, 13), (3, 1))
    T, hq, hkv, D = ids.shape[1], 4, 2, 5
    plan = plan_step(ids, 1)
    meta = plan_dense(plan.local_flat_ids(0), plan.allgather_flat_ids(), plan.segments, T, -1)
    q, k, v = ((torch.randn(T, h, D, generator=g, dtype=F64) * 2.5).bfloat16().double() for h in (hq, hkv, hkv))
    grad = torch.randn(T, hq, D, generator=g, dtype=F64).bfloat16().double()
    kw = {"softcap": 5.0} if variant == "softcap" else {"sinks": torch.randn(hq, generator=g, dtype=F64).bfloat16().double()}

    def grads(dtype: torch.dtype, run) -> list[torch.Tensor]:
        leaves = [t.to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
        run(*leaves).backward(grad.to(dtype))
        return [t.grad for t in leaves]

    def ours(qq, kk, vv):
        opts = {n: t.to(qq.dtype) if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
        return dense_attention(qq, torch.cat([kk, vv], 1).flatten(1), meta, heads_kv=hkv, dim_v=D, dropout_p=0.0,
                               scale=None, **opts)

    def eager(qq, kk, vv):  # transformers' eager attention: scores in the inputs' dtype, softmax in float32
        s = (qq.transpose(0, 1) @ kk.repeat_interleave(hq // hkv, 1).permute(1, 2, 0)) / math.sqrt(D)
        s = s.float() if qq.dtype == torch.bfloat16 else s
        if "softcap" in kw:
            s = torch.tanh(s / kw["softcap"]) * kw["softcap"]
        s = s.masked_fill(~meta.mask[0], -math.inf)
        if "sinks" in kw:
            sink = kw["sinks"].to(s.dtype).view(-1, 1, 1).expand(hq, T, 1)
            p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
        else:
            p = torch.softmax(s, -1)
        return (p.to(qq.dtype) @ vv.repeat_interleave(hq // hkv, 1).transpose(0, 1)).transpose(0, 1)

    bf16, f32 = grads(torch.bfloat16, ours), grads(torch.float32, ours)
    for name, a, b in zip("qkv", bf16, f32):
        assert torch.equal(a, b.bfloat16()), f"d{name}: not the float32 gradient rounded once"
    truth, base = grads(F64, ours), grads(torch.bfloat16, eager)
    assert all((t - e).abs().max() <= 1e-12 for t, e in zip(truth, grads(F64, eager)))  # the same attention
    for name, a, e, t in zip("qkv", bf16, base, truth):
        err, base_err = (a.double() - t).abs().max().item(), (e.double() - t).abs().max().item()
        assert err <= base_err, f"d{name}: error {err:.3e} above eager bfloat16 attention's {base_err:.3e}"
