"""The varlen kernel's maskless blocks (causal squares, unmasked prefixes, reversed bands) merged by log-sum-exp,
with their own backward: outputs and q, k, v gradients against the float64 reference, one rank's queries at a
time against an all-gathered key buffer (so pieces whose document started on another rank get prefix blocks).
The masked plan (what runs when the fused op cannot) is checked the same way."""

from __future__ import annotations

import pytest
import torch

from blockdiag_dist.kernels import varlen
from blockdiag_dist.kernels.varlen import plan_varlen, varlen_attention
from blockdiag_dist.plan import plan_step
from blockdiag_ref import DocLayout, reference_attention
from verify.tolerances import judge


def _ids(runs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor([[d for d, n in runs for _ in range(n)]])


CASES = [
    pytest.param(_ids([(1, 300)]), 2, "contiguous", -1, 4, 2, id="one-doc-cp2-gqa"),
    pytest.param(_ids([(1, 300)]), 3, "balanced", -1, 2, 2, id="one-doc-cp3-balanced"),
    pytest.param(_ids([(1, 1), (2, 2), (3, 1), (4, 40), (5, 3), (0, 5), (6, 70)]), 4, "contiguous", -1, 4, 1, id="tiny-pieces-padding"),
    pytest.param(_ids([(1, 150), (2, 7), (3, 120), (0, 3)]), 2, "balanced", -1, 2, 1, id="balanced-gqa-tail-padding"),
    pytest.param(_ids([(1, 200), (2, 90)]), 2, "contiguous", 17, 4, 2, id="window-17"),
    pytest.param(_ids([(1, 130), (2, 3), (3, 60)]), 3, "contiguous", 1, 2, 2, id="window-1"),
    pytest.param(_ids([(1, 64), (2, 64)]), 2, "balanced", 0, 2, 2, id="window-0"),
    pytest.param(_ids([(1, 100), (2, 40)]), 2, "contiguous", 40, 2, 2, id="window-binding-on-one-doc-only"),
    pytest.param(_ids([(1, 400), (2, 70), (3, 90)]), 2, "contiguous", 64, 4, 2, id="window-64-bands"),
    pytest.param(_ids([(1, 30), (2, 500)]), 3, "balanced", 100, 2, 1, id="window-100-bands-balanced"),
]


def _run(ids, world, layout, left, hq, hkv, dtype, rank, force_masked=False):
    plan = plan_step(ids, world, layout)
    B, sp, D = ids.shape[0], plan.shards.padded_len, 8
    padded = torch.nn.functional.pad(ids, (0, sp - ids.shape[1]))
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(B, hq, sp, D, generator=g, dtype=torch.float64) * 2
    k = torch.randn(B, hkv, sp, D, generator=g, dtype=torch.float64) * 2
    v = torch.randn(B, hkv, sp, D, generator=g, dtype=torch.float64)
    local, key_flat = plan.local_flat_ids(rank), plan.allgather_flat_ids()
    meta = plan_varlen(local, key_flat, plan.segments, plan.doc_starts, sp, left)
    grad = torch.randn(local.numel(), hq, D, generator=g, dtype=torch.float64)

    # implementation: tokens of this rank against the all-gathered key buffer, in ``dtype``
    qi, ki, vi = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    q_tok = qi.permute(0, 2, 1, 3).reshape(B * sp, hq, D)[local]
    kv_tok = torch.cat([ki.permute(0, 2, 1, 3).reshape(B * sp, hkv * D), vi.permute(0, 2, 1, 3).reshape(B * sp, hkv * D)], 1)
    if force_masked:
        saved, varlen.fused_unusable_reason = varlen.fused_unusable_reason, lambda *a: "forced"
    try:
        out = varlen_attention(q_tok, kv_tok[key_flat], meta, heads_kv=hkv, dim_v=D, dropout_p=0.0, scale=None)
    finally:
        if force_masked:
            varlen.fused_unusable_reason = saved
    out.backward(grad.to(dtype))

    # reference: float64, the whole sequence, the same rows
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    window = None if left < 0 else (left, 0)
    ref = reference_attention(qr, kr, vr, DocLayout.from_doc_ids(padded), enable_gqa=True, window_size=window)
    ref_tok = ref.permute(0, 2, 1, 3).reshape(B * sp, hq, D)[local]
    ref_tok.backward(grad)
    pad_rows = (plan.segments[local] == 0).nonzero().flatten()
    return out, ref_tok, (qi.grad, ki.grad, vi.grad), (qr.grad, kr.grad, vr.grad), pad_rows, (q, k, v, local, grad)


def _rel(a, b) -> float:
    """Largest error relative to the largest reference magnitude (absolute where the reference is below 1e-3,
    e.g. dq of a window of one key, exactly 0)."""
    return float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-3))


@pytest.mark.parametrize("ids, world, layout, left, hq, hkv", CASES)
@pytest.mark.parametrize("masked", [False, True], ids=["maskless", "masked"])
def test_merge_matches_float64_reference(ids, world, layout, left, hq, hkv, masked):
    for rank in range(world):
        out, ref, grads, ref_grads, pad_rows, _ = _run(ids, world, layout, left, hq, hkv, torch.float64, rank, masked)
        assert _rel(out, ref) < 1e-10, f"rank {rank}: output"
        for name, a, b in zip("qkv", grads, ref_grads):
            assert _rel(a, b) < 1e-10, f"rank {rank}: d{name}"
        assert bool((out[pad_rows] == 0).all()), "padding rows must be exactly 0"


def test_merge_float32_error_within_twice_that_of_one_fused_call():
    """float32, one document cut by CP 2: the merged prefix + square blocks of rank 1 against torch's own SDPA
    on the whole document in float32 (the verifier's rule: at most 2x its error, plus a small floor)."""
    out, ref, grads, ref_grads, _, (q, k, v, local, grad) = _run(_ids([(1, 512)]), 2, "contiguous", -1, 4, 2, torch.float32, 1)
    qs, ks, vs = (t.detach().float().requires_grad_() for t in (q, k, v))
    base = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
    base_tok = base.permute(0, 2, 1, 3).reshape(512, 4, 8)[local]
    base_tok.backward(grad.float())
    assert judge("float32", _rel(out, ref), 1.0, _rel(base_tok, ref))[1]
    for name, a, b, r in zip("qkv", grads, (qs.grad, ks.grad, vs.grad), ref_grads):
        assert judge("float32", _rel(a, r), 1.0, _rel(b, r))[1], f"d{name}"


def test_padding_rows_get_no_gradient():
    ids = _ids([(1, 40), (0, 9), (2, 30), (0, 1)])
    for rank in range(2):
        out, _, grads, _, pad_rows, _ = _run(ids, 2, "contiguous", -1, 2, 2, torch.float32, rank)
        assert bool((out[pad_rows] == 0).all())
        flat_pad = (torch.nn.functional.pad(ids, (0, 80 - ids.shape[1])) == 0).flatten().nonzero().flatten()
        for g in grads:  # [B, H, Sp, D]: positions of padding get exactly 0
            assert bool((g.permute(0, 2, 1, 3).reshape(80, -1)[flat_pad] == 0).all())


def test_no_mask_and_no_bool_path_in_maskless_plan():
    plan = plan_step(_ids([(1, 300), (2, 50)]), 2, "contiguous")
    meta = plan_varlen(plan.local_flat_ids(1), plan.allgather_flat_ids(), plan.segments, plan.doc_starts, plan.shards.padded_len, -1)
    kinds = sorted((b.causal, tuple(b.q_index.shape), tuple(b.k_index.shape)) for b in meta.blocks.buckets)
    # rank 1 holds positions 175..349: doc 1's tail (125 queries after a 175-key prefix) and doc 2 (50)
    assert kinds == [(False, (1, 128), (1, 175)), (True, (1, 64), (1, 64)), (True, (1, 128), (1, 128))]
    assert all(b.mask is None for b in meta.blocks.buckets)


def test_range_buckets_compute_bitwise_what_gathered_buckets_do():
    """A bucket whose rows are one range runs on views of the inputs (no gather; its gradient added into the
    range): the same bits as running it on gathered copies. The cases reach both kinds and merged buckets."""
    import dataclasses

    seen = {"q range": 0, "k range": 0, "gathered": 0, "merged": 0}
    for p in CASES:
        ids, world, layout, left, hq, hkv = p.values
        plan = plan_step(ids, world, layout)
        sp = plan.shards.padded_len
        for rank in range(world):
            local, key_flat = plan.local_flat_ids(rank), plan.allgather_flat_ids()
            meta = plan_varlen(local, key_flat, plan.segments, plan.doc_starts, sp, left)
            bs = meta.blocks.buckets
            seen["q range"] += sum(b.q_start >= 0 for b in bs)
            seen["k range"] += sum(b.k_start >= 0 for b in bs)
            seen["gathered"] += sum(b.q_start < 0 for b in bs)
            seen["merged"] += sum(b.merged for b in bs)
            gathered = meta.with_blocks(dataclasses.replace(
                meta.blocks, buckets=tuple(dataclasses.replace(b, q_start=-1, k_start=-1) for b in bs),
                q_rest=meta.blocks.q_gather, k_rest=meta.blocks.k_gather))
            g = torch.Generator().manual_seed(rank)
            q_tok = torch.randn(local.numel(), hq, 8, generator=g)
            kv = torch.randn(key_flat.numel(), 2 * hkv * 8, generator=g)
            grad = torch.randn(local.numel(), hq, 8, generator=g)
            res = []
            for m in (meta, gathered):
                qi, kvi = q_tok.clone().requires_grad_(), kv.clone().requires_grad_()
                out = varlen_attention(qi, kvi, m, heads_kv=hkv, dim_v=8, dropout_p=0.0, scale=None)
                out.backward(grad)
                res.append((out.detach(), qi.grad, kvi.grad))
            for a, b, name in zip(*res, ("out", "dq", "dkv")):
                assert torch.equal(a, b), f"{p.id} rank {rank}: {name}"
    assert all(seen.values()), seen
