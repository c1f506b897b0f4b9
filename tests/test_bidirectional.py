"""Bidirectional blocks per document (Gemma 3's image tokens, PaliGemma's prefix): a query in a block also sees the
later keys of its block, documents stay isolated, causal (and windowed) elsewhere; with whole blocks (Gemma 4,
PaliGemma's sliding layers) a query sees its whole block beyond the window too: (the window AND causal) OR the block.

- the float64 reference's mask against its definition, token by token, and block labels per document;
- the plans' needed sets (later keys on later ranks included) against brute force from the reference mask;
- every kernel path rank by rank against the reference (an all-gathered key buffer), outputs and q/k/v gradients,
  with windows, sinks and a soft-cap;
- ``cp_blockdiag_sdpa`` with a step at CP 1 and without one, and its validation. Multi-rank runs with the real
  exchanges are the verifier's (the ``bidirectional`` variant of the case matrix; tests/test_verify.py).
"""

from __future__ import annotations

import pytest
import torch

from blockdiag_dist import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx
from blockdiag_dist.bidirectional import exchange_plan, plan_blocks
from blockdiag_dist.kernels.dense import dense_attention, plan_dense
from blockdiag_dist.kernels.varlen import plan_varlen_pieces, varlen_attention
from blockdiag_dist.plan import plan_step
from blockdiag_ref import DocLayout, reference_attention

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
# doc ids and block ids: images inside documents, one at a document's start, one at its end, two in one document,
# a block id reused in another document, padding in the middle and at the end
DOCS = torch.tensor([[1] * 9 + [2] * 7 + [0] * 2 + [3] * 5 + [0] * 2])
BLOCKS = torch.tensor([[0, 0, 4, 4, 4, 4, 4, 0, 0] + [4, 0, 3, 3, 3, 3, 0] + [0, 0] + [0, 0, 0, 7, 7] + [0, 0]])
TWO_ROWS = (torch.tensor([[1] * 6 + [2] * 5, [0, 0] + [3] * 9]),
            torch.tensor([[0, 1, 1, 1, 1, 0, 0, 0, 2, 2, 2], [0, 0, 0, 5, 5, 5, 5, 5, 5, 0, 0]]))
CASES = [pytest.param(DOCS, BLOCKS, id="one-row"), pytest.param(*TWO_ROWS, id="two-rows")]
# a block id met again later in its document (one block of two runs, text between them)
SPLIT = (torch.ones(1, 20, dtype=torch.long), torch.tensor([[0, 0, 5, 5, 5, 5] + [0] * 6 + [5, 5, 5] + [0] * 5]))


def _brute_mask(doc_ids, blocks, left, whole=False):
    B, S = doc_ids.shape
    lay = DocLayout.from_doc_ids(doc_ids)
    seg = lay.segment_ids
    m = torch.zeros(B, S, S, dtype=torch.bool)
    for b in range(B):
        for i in range(S):
            for j in range(S):
                if seg[b, i] == 0 or seg[b, i] != seg[b, j]:
                    continue
                causal = j <= i and (left < 0 or j >= i - left)
                same = blocks[b, i] != 0 and blocks[b, i] == blocks[b, j]
                m[b, i, j] = causal or (same and (whole or j > i))
    return m


@pytest.mark.parametrize("doc_ids, blocks", CASES)
@pytest.mark.parametrize("left", [-1, 2])
@pytest.mark.parametrize("whole", [False, True])
def test_the_reference_mask_is_its_definition(doc_ids, blocks, left, whole):
    lay = DocLayout.from_doc_ids(doc_ids)
    got = lay.materialize_mask(window_size=None if left < 0 else (left, 0), bidirectional_blocks=blocks,
                               whole_blocks=whole)[:, 0]
    assert torch.equal(got, _brute_mask(doc_ids, blocks, left, whole))
    if whole and left >= 0:  # an image longer than the window: its first key seen from its last only when whole
        assert not torch.equal(got, _brute_mask(doc_ids, blocks, left))


def test_block_labels_split_by_document_and_validate():
    labels = DocLayout.from_doc_ids(DOCS).block_labels(BLOCKS)
    assert labels.tolist() == [[0, 0, 1, 1, 1, 1, 1, 0, 0, 2, 0, 3, 3, 3, 3, 0, 0, 0, 0, 0, 0, 4, 4, 0, 0]]
    huge = torch.where(BLOCKS != 0, BLOCKS + 10**15, 0)  # tables sized by the blocks met, not by the largest id
    assert torch.equal(DocLayout.from_doc_ids(DOCS).block_labels(huge), labels)
    with pytest.raises(ValueError, match=r"expected an integer or bool tensor \[B, S\] = \[1, 25\], got \(\(1, 3\)"):
        DocLayout.from_doc_ids(DOCS).block_labels(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="expected block ids >= 0"):
        DocLayout.from_doc_ids(DOCS).block_labels(-BLOCKS)


def test_the_reference_equals_each_document_alone():
    g = torch.Generator().manual_seed(0)
    S = DOCS.shape[1]
    q, k, v = (torch.randn(1, 2, S, 3, generator=g, dtype=F64) for _ in range(3))
    out = reference_attention(q, k, v, DOCS, bidirectional_blocks=BLOCKS)
    for _, s, e in DocLayout.from_doc_ids(DOCS).segments.tolist():
        alone = reference_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], torch.ones(1, e - s, dtype=torch.long),
                                    bidirectional_blocks=BLOCKS[:, s:e])
        assert torch.allclose(out[:, :, s:e], alone, rtol=0, atol=1e-14)


@pytest.mark.parametrize("doc_ids, blocks", [*CASES, pytest.param(*SPLIT, id="split-block")])
@pytest.mark.parametrize("world, layout", [(2, "contiguous"), (3, "contiguous"), (4, "contiguous"), (3, "balanced"), (4, "auto")])
@pytest.mark.parametrize("left, whole", [(-1, False), (1, False), (1, True)])
def test_needed_sets_equal_brute_force(doc_ids, blocks, world, layout, left, whole):
    """Needed-only: exactly the keys the reference mask lets the rank's queries see (a split block's own runs,
    not the text between them; whole blocks: their keys before the window too)."""
    plan = plan_step(doc_ids, world, layout)
    sp = plan.shards.padded_len
    bp = plan_blocks(plan.layout, plan.shards, plan.documents, blocks)
    x = exchange_plan(plan, left, bp, whole)
    padded = torch.nn.functional.pad(doc_ids, (0, sp - doc_ids.shape[1]))
    mask = _brute_mask(padded, torch.nn.functional.pad(blocks, (0, sp - doc_ids.shape[1])), left, whole)
    later = False
    for rank in range(world):
        mine = set(plan.shards.positions[rank].tolist())
        want = {(b, p) for b in range(doc_ids.shape[0]) for qp in mine for p in mask[b, qp].nonzero().flatten().tolist()
                if p not in mine}
        assert {(f // sp, f % sp) for f in x.needed[rank].tolist()} == want, f"rank {rank}"
        later |= any(p > max(mine) for _, p in want)
    r = x.ranges
    assert bool((r[1:, 0] * 10**6 + r[1:, 1] * 10**3 + r[1:, 2] >= r[:-1, 0] * 10**6 + r[:-1, 1] * 10**3 + r[:-1, 3]).all() |
                (r.shape[0] < 2)), "ranges ordered and disjoint"
    if world == 2 and layout == "contiguous":
        assert later, "a block crosses the rank edge: keys after the rank's rows are needed"


def _run_rank(doc_ids, blocks, world, layout, left, path, rank, variant, whole=False):
    g = torch.Generator().manual_seed(7)
    plan = plan_step(doc_ids, world, layout)
    B, sp, D, hq, hkv = doc_ids.shape[0], plan.shards.padded_len, 4, 4, 2
    bp = plan_blocks(plan.layout, plan.shards, plan.documents, blocks)
    padded = torch.nn.functional.pad(doc_ids, (0, sp - doc_ids.shape[1]))
    pblocks = torch.nn.functional.pad(blocks, (0, sp - doc_ids.shape[1]))
    q, k, v = (torch.randn(B, h, sp, D, generator=g, dtype=F64) * s for h, s in ((hq, 2), (hkv, 2), (hkv, 1)))
    sinks = torch.randn(hq, generator=g, dtype=F64) if variant == "sinks" else None
    softcap = 5.0 if variant == "softcap" else None
    local = plan.local_flat_ids(rank)  # the key buffer: the rank's rows and the keys its plan fetches, nothing else
    key_flat = torch.cat([local, exchange_plan(plan, left, bp, whole).needed[rank]])
    grad = torch.randn(local.numel(), hq, D, generator=g, dtype=F64)
    qi, ki, vi = (t.detach().clone().requires_grad_() for t in (q, k, v))
    q_tok = qi.permute(0, 2, 1, 3).reshape(B * sp, hq, D)[local]
    kv_tok = torch.cat([ki.permute(0, 2, 1, 3).reshape(B * sp, -1), vi.permute(0, 2, 1, 3).reshape(B * sp, -1)], 1)[key_flat]
    opts = dict(heads_kv=hkv, dim_v=D, dropout_p=0.0, scale=None, sinks=sinks, softcap=softcap)
    if path == "dense":
        out = dense_attention(q_tok, kv_tok, plan_dense(local, key_flat, plan.segments, sp, left, bp.labels, whole), **opts)
    else:
        lut = torch.full((B * sp,), -1, dtype=torch.int64)
        lut[key_flat] = torch.arange(key_flat.numel())
        docs = plan.documents
        mine = docs.rank_pieces(rank)
        meta = plan_varlen_pieces(docs.kernel_pieces(rank), local.numel(), lut, sp, left, key_end=bp.piece_key_end[mine],
                                  labels=bp.labels, block_start=bp.piece_block_start[mine] if whole else None)
        out = varlen_attention(q_tok, kv_tok, meta, **opts)
    out.backward(grad)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, padded, enable_gqa=True, window_size=None if left < 0 else (left, 0),
                              bidirectional_blocks=pblocks, whole_blocks=whole, sinks=sinks, softcap=softcap)
    ref_tok = ref.permute(0, 2, 1, 3).reshape(B * sp, hq, D)[local]
    ref_tok.backward(grad)
    return out, ref_tok, (qi.grad, ki.grad, vi.grad), (qr.grad, kr.grad, vr.grad)


def _rel(a, b) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-3))


@pytest.mark.parametrize("doc_ids, blocks", [*CASES, pytest.param(*SPLIT, id="split-block")])
@pytest.mark.parametrize("world, layout, left", [(2, "contiguous", -1), (4, "contiguous", 2), (3, "balanced", -1)])
@pytest.mark.parametrize("path, variant", [("varlen", None), ("dense", None), ("varlen", "sinks"), ("varlen", "softcap"),
                                           ("dense", "softcap")])
def test_kernels_rank_by_rank(doc_ids, blocks, world, layout, left, path, variant):
    for rank in range(world):
        out, ref, grads, ref_grads = _run_rank(doc_ids, blocks, world, layout, left, path, rank, variant)
        assert _rel(out, ref) < 1e-10, f"rank {rank}: output"
        for name, a, b in zip("qkv", grads, ref_grads):
            assert _rel(a, b) < 1e-10, f"rank {rank}: d{name}"


@pytest.mark.parametrize("doc_ids, blocks", [*CASES, pytest.param(*SPLIT, id="split-block")])
@pytest.mark.parametrize("world, layout, left, path, variant", [
    (2, "contiguous", 1, "varlen", None), (4, "contiguous", 2, "dense", None), (3, "balanced", 0, "varlen", "softcap"),
    (4, "auto", 1, "varlen", None)])
def test_whole_blocks_kernels_rank_by_rank(doc_ids, blocks, world, layout, left, path, variant):
    """Whole blocks (the window OR the block): a block's keys before the window, on earlier ranks, and after the
    piece, on later ranks, fetched needed-only; outputs and q/k/v gradients equal the reference's."""
    for rank in range(world):
        out, ref, grads, ref_grads = _run_rank(doc_ids, blocks, world, layout, left, path, rank, variant, whole=True)
        assert _rel(out, ref) < 1e-10, f"rank {rank}: output"
        for name, a, b in zip("qkv", grads, ref_grads):
            assert _rel(a, b) < 1e-10, f"rank {rank}: d{name}"


@pytest.mark.parametrize("kernel", ["varlen", "dense"])
@pytest.mark.parametrize("left, whole", [(-1, False), (3, False), (1, True)])
def test_cp1_step_and_no_step_equal_the_reference(kernel, left, whole):
    g = torch.Generator().manual_seed(3)
    S = DOCS.shape[1]
    q, k, v = (torch.randn(1, h, S, 4, generator=g, dtype=F64, requires_grad=True) for h in (4, 2, 2))
    ws = None if left < 0 else (left, 0)
    ref = reference_attention(q, k, v, DOCS, enable_gqa=True, window_size=ws, bidirectional_blocks=BLOCKS,
                              whole_blocks=whole)
    want = torch.autograd.grad(ref.square().sum(), (q, k, v))
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(1, S, 1), "_packed_seq_ids": DOCS},
                                             kernel=kernel, bidirectional_blocks=BLOCKS)
    with ctx():
        out = cp_blockdiag_sdpa(q, k, v, is_causal=True, enable_gqa=True, window_size=ws, bidirectional_blocks=True,
                                whole_blocks=whole)
        got = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert _rel(out, ref) < 1e-12 and all(_rel(a, b) < 1e-12 for a, b in zip(got, want))
    s, e = 9, 16  # document 2 alone, without a step: block ids of its keys
    alone = cp_blockdiag_sdpa(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, enable_gqa=True, window_size=ws,
                              bidirectional_blocks=BLOCKS[:, s:e], whole_blocks=whole)
    assert _rel(alone, ref[:, :, s:e]) < 1e-12
    if whole:  # the union differs from the window bounding the block: the check can fail
        narrow = reference_attention(q, k, v, DOCS, enable_gqa=True, window_size=ws, bidirectional_blocks=BLOCKS)
        assert _rel(narrow, ref) > 1e-3


@pytest.mark.parametrize("blocks, in_step, match", [
    pytest.param(BLOCKS, True, r"bidirectional_blocks expected True under a CP step .*got a tensor of shape \(1, 25\)", id="tensor-in-step"),
    pytest.param(True, False, r"bidirectional_blocks expected \(without a step\) integer block ids of the keys \[B, Lk\] = \[1, 25\], got True", id="true-no-step"),
    pytest.param(BLOCKS[:, :5], False, r"block ids of the keys \[B, Lk\] = \[1, 25\], got \(\(1, 5\)", id="short"),
    pytest.param(BLOCKS.double(), False, r"integer block ids", id="float"),
])
def test_validation(blocks, in_step, match):
    S = DOCS.shape[1]
    q = torch.zeros(1, 2, S, 4)
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(1, S, 1)}, bidirectional_blocks=BLOCKS)
    with pytest.raises(ValueError, match=match):
        if in_step:
            with ctx():
                cp_blockdiag_sdpa(q, q, q, is_causal=True, bidirectional_blocks=blocks)
        else:
            cp_blockdiag_sdpa(q, q, q, is_causal=True, bidirectional_blocks=blocks)


def test_a_step_without_blocks_and_chunks_with_blocks_raise():
    S = DOCS.shape[1]
    q = torch.zeros(1, 2, S, 4)
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(1, S, 1)})
    with pytest.raises(ValueError, match="expected the step's blocks, got a step without any"), ctx():
        cp_blockdiag_sdpa(q, q, q, is_causal=True, bidirectional_blocks=True)
    with pytest.raises(ValueError, match=r"bidirectional_blocks: expected is_causal=True \(or a window_size\).* got "
                                         r"is_causal=False without a window"):
        cp_blockdiag_sdpa(q, q, q, is_causal=False, bidirectional_blocks=BLOCKS)
    with pytest.raises(ValueError, match=r"whole_blocks expected a bool, True only with bidirectional_blocks, got True "
                                         r"with bidirectional_blocks=None"):
        cp_blockdiag_sdpa(q, q, q, is_causal=True, whole_blocks=True)
    with pytest.raises(ValueError, match="bidirectional_blocks expected without chunk_size, got chunk_size=3"):
        cp_blockdiag_sdpa(q, q, q, is_causal=True, chunk_size=3, bidirectional_blocks=BLOCKS)
    with pytest.raises(ValueError, match=r"expected block ids of the full rows \[B, S\] = \[1, 25\]"):
        make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(1, S, 1)}, bidirectional_blocks=BLOCKS[:, 1:])
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(1, S, 1)}, bidirectional_blocks=BLOCKS)
    with pytest.raises(ValueError, match="expected one set of blocks per step, got a second, different one"):
        ctx.state.set_bidirectional_blocks(BLOCKS.clamp(max=1))
    ctx.state.set_bidirectional_blocks(BLOCKS.clone())  # the same blocks again: fine


@pytest.mark.parametrize("world, layout", [(1, "contiguous"), (2, "contiguous"), (3, "balanced")])
def test_pieces_without_blocks_run_as_without_blocks(world, layout):
    """One image in the step: the pieces none of whose queries lies in a block give, bit for bit, what the same
    call without blocks gives (they keep the maskless paths); a rank with no block query plans no labels."""
    one = torch.zeros_like(BLOCKS)
    one[0, 21:23] = 7  # an image in the last document only
    plan = plan_step(DOCS, world, layout)
    B, sp, D, hq, hkv = 1, plan.shards.padded_len, 4, 4, 2
    bp = plan_blocks(plan.layout, plan.shards, plan.documents, one)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, h, sp, D, generator=g, dtype=F64) for h in (hq, hkv, hkv))
    kv_all = torch.cat([k.permute(0, 2, 1, 3).reshape(B * sp, -1), v.permute(0, 2, 1, 3).reshape(B * sp, -1)], 1)
    seen_plain = False
    for rank in range(world):
        docs, local = plan.documents, plan.local_flat_ids(rank)
        key_flat = torch.cat([local, exchange_plan(plan, -1, bp).needed[rank]])
        lut = torch.full((B * sp,), -1, dtype=torch.int64)
        lut[key_flat] = torch.arange(key_flat.numel())
        q_tok = q.permute(0, 2, 1, 3).reshape(B * sp, hq, D)[local]
        opts = dict(heads_kv=hkv, dim_v=D, dropout_p=0.0, scale=None)
        pieces = docs.kernel_pieces(rank)
        with_blocks = plan_varlen_pieces(pieces, local.numel(), lut, sp, -1,
                                         key_end=bp.piece_key_end[docs.rank_pieces(rank)], labels=bp.labels)
        without = plan_varlen_pieces(pieces, local.numel(), lut, sp, -1)
        got, want = (varlen_attention(q_tok, kv_all[key_flat], m, **opts) for m in (with_blocks, without))
        in_block = bp.labels[local] != 0
        if not bool(in_block.any()):
            assert with_blocks.labels is None, f"rank {rank}: no block query, yet labels planned"
        free = ~in_block
        for p_start, p_len in pieces[:, :2].tolist():
            rows = torch.arange(p_start, p_start + p_len)
            if bool(in_block[rows].any()):
                free[rows] = False
        seen_plain |= with_blocks.plain is not None
        assert torch.equal(got[free], want[free]), f"rank {rank}: a piece without blocks changed"
    assert seen_plain, "no rank mixes pieces with and without blocks: the case does not test the split"
