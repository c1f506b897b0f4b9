"""DeepSeek Sparse Attention: the float64 reference (blockdiag_ref.sparse) against its definition, and
blockdiag_dist.dsa_attention at CP 1 (chunked scoring, a given selection) against the reference. The multi-rank
runs are the verifier's (tests/test_verify_mixers.py) and the models' (tests/test_hf_sparse.py)."""

from __future__ import annotations

import pytest
import torch

from blockdiag_dist import DsaIndex, dsa_attention, make_cp_blockdiag_batch_and_ctx
from blockdiag_ref import reference_attention, reference_dsa_attention, reference_dsa_select, reference_sparse_attention

IDS = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 2, 2, 0, 3, 3, 3, 3, 3], [4] * 12 + [0] * 3])
B, S, H, D, HI, DI = 2, 15, 2, 4, 3, 5


def inputs(seed: int = 0, integers: bool = False):
    g = torch.Generator().manual_seed(seed)
    f = (lambda *s: torch.randint(-2, 3, s, generator=g).double()) if integers else (
        lambda *s: torch.randn(*s, generator=g, dtype=torch.float64))
    return {"q": torch.randn(B, H, S, D, generator=g, dtype=torch.float64), "k": torch.randn(B, H, S, D, generator=g, dtype=torch.float64),
            "v": torch.randn(B, H, S, D + 1, generator=g, dtype=torch.float64), "iq": f(B, S, HI, DI), "iw": f(B, S, HI),
            "ik": f(B, S, DI)}


def test_selection_is_the_top_k_of_the_document_prefix():
    x = inputs(integers=True)  # integer scores: many ties
    topk = 3
    sel = reference_dsa_select(x["iq"], x["iw"], x["ik"], IDS, topk, index_scale=0.5)
    assert sel.shape == (B, S, 3)
    for b in range(B):
        for i in range(S):
            got = sorted(j for j in sel[b, i].tolist() if j >= 0)
            if IDS[b, i] == 0:
                assert got == []
                continue
            start = i
            while start > 0 and IDS[b, start - 1] == IDS[b, i]:
                start -= 1
            n = i - start + 1
            scores = [float((x["iw"][b, i] * torch.relu(0.5 * x["iq"][b, i] @ x["ik"][b, start + j])).sum()) for j in range(n)]
            assert len(got) == min(topk, n)  # all of a short prefix: dense
            kept = [scores[j] for j in got]
            dropped = [scores[j] for j in range(n) if j not in got]
            assert not dropped or min(kept) >= max(dropped)


def test_dense_when_top_k_covers_every_prefix_and_padding_rows_are_zero():
    x = inputs()
    out, sel = reference_dsa_attention(x["q"], x["k"], x["v"], x["iq"], x["iw"], x["ik"], IDS, 64, index_scale=1.0)
    assert torch.equal(out, reference_attention(x["q"], x["k"], x["v"], IDS))
    assert sel.shape[-1] == 12 and bool((out[IDS.unsqueeze(1).expand_as(out[..., 0]) == 0] == 0).all())
    sparse, _ = reference_dsa_attention(x["q"], x["k"], x["v"], x["iq"], x["iw"], x["ik"], IDS, 2, index_scale=1.0)
    assert (sparse - out).abs().max() > 1e-3


def test_bad_input_is_refused_naming_expected_and_got():
    x = inputs()
    with pytest.raises(ValueError, match=r"topk: expected an int >= 1, got 0"):
        reference_dsa_select(x["iq"], x["iw"], x["ik"], IDS, 0, index_scale=1.0)
    with pytest.raises(ValueError, match=r"index_w: expected \[B, S, Hi\] = \[2, 15, 3\], got shape \(2, 15, 2\)"):
        reference_dsa_select(x["iq"], x["iw"][..., :2], x["ik"], IDS, 2, index_scale=1.0)
    with pytest.raises(ValueError, match=r"selection: expected \[B, S, K\] with B=2, S=15, got shape \(2, 14, 3\)"):
        reference_sparse_attention(x["q"], x["k"], x["v"], IDS, torch.zeros(2, 14, 3, dtype=torch.int64))


def test_cp1_dsa_attention_chunked_equals_the_reference(monkeypatch):
    """One query per chunk (a tiny score budget) and the default budget give the reference's output and
    gradients; a given selection (GLM-5's shared layers) reproduces it; bad input is refused before computing."""
    import blockdiag_dist.sparse as sparse

    x = inputs(seed=3)
    wk, wv = torch.randn(D + 2, H * D, dtype=torch.float64), torch.randn(D + 2, H * (D + 1), dtype=torch.float64)
    latent = torch.randn(B, S, D + 2, dtype=torch.float64)

    def expand(rows):
        return (rows @ wk).view(-1, H, D), (rows @ wv).view(-1, H, D + 1)

    def keys(lat):
        k, v = expand(lat.reshape(B * S, -1))
        return k.view(B, S, H, D).transpose(1, 2), v.view(B, S, H, D + 1).transpose(1, 2)

    q0, lat0 = x["q"].clone().requires_grad_(), latent.clone().requires_grad_()
    ref, ref_sel = reference_dsa_attention(q0, *keys(lat0), x["iq"], x["iw"], x["ik"], IDS, 3, index_scale=0.7,
                                           score_dtype=torch.float32)
    (ref * torch.arange(D + 1.0, dtype=torch.float64)).sum().backward()
    for budget in (8, sparse.SCORE_BUDGET):
        monkeypatch.setattr(sparse, "SCORE_BUDGET", budget)
        ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": torch.ones(B, S, dtype=torch.int64),
                                                              "_packed_seq_ids": IDS})
        q, lat = x["q"].clone().requires_grad_(), latent.clone().requires_grad_()
        with ctx():
            index = DsaIndex(query=x["iq"], key=x["ik"], weights=x["iw"].float(), scale=0.7)
            out, sel = dsa_attention(q, lat, expand, topk=3, index=index)
            again, _ = dsa_attention(q, lat, expand, topk=3, selection=sel)
            (out * torch.arange(D + 1.0, dtype=torch.float64)).sum().backward()
            with pytest.raises(ValueError, match=r"expected exactly one of index .* and selection .*, got both"):
                dsa_attention(q, lat, expand, topk=3, index=index, selection=sel)
            with pytest.raises(ValueError, match=r"latent expected \[B, L, F\] = \[2, 15, F\], got \(2, 14, 6\)"):
                dsa_attention(q, lat[:, :14], expand, topk=3, index=index)
        assert torch.equal(sel.sort(-1).values, ref_sel.sort(-1).values)
        assert torch.allclose(out, ref, rtol=0, atol=1e-13) and torch.equal(again, out)
        assert torch.allclose(q.grad, q0.grad, rtol=0, atol=1e-12) and torch.allclose(lat.grad, lat0.grad, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"dsa_attention: expected an active CP step"):
        dsa_attention(q, lat, expand, topk=3, index=index)


def test_cp1_dsa_attention_with_sinks_equals_the_reference():
    """Per-head sinks (HY-V4's): the output and the gradients of queries, latents and sinks equal the reference's;
    the sinks change the output (a sink ignored would be caught); sinks of the wrong shape are refused."""
    x = inputs(seed=5)
    g = torch.Generator().manual_seed(6)
    wk, wv = (torch.randn(D + 2, H * d, generator=g, dtype=torch.float64) for d in (D, D + 1))
    latent = torch.randn(B, S, D + 2, generator=g, dtype=torch.float64)
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)

    def expand(rows):
        return (rows @ wk).view(-1, H, D), (rows @ wv).view(-1, H, D + 1)

    q0, lat0, s0 = x["q"].clone().requires_grad_(), latent.clone().requires_grad_(), sinks.clone().requires_grad_()
    k, v = (t.view(B, S, H, -1).transpose(1, 2) for t in expand(lat0.reshape(B * S, -1)))
    ref, _ = reference_dsa_attention(q0, k, v, x["iq"], x["iw"], x["ik"], IDS, 3, index_scale=0.7, sinks=s0,
                                     score_dtype=torch.float32)
    ref.pow(2).sum().backward()
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": torch.ones(B, S, dtype=torch.int64),
                                                          "_packed_seq_ids": IDS})
    q, lat, s = x["q"].clone().requires_grad_(), latent.clone().requires_grad_(), sinks.clone().requires_grad_()
    index = DsaIndex(query=x["iq"], key=x["ik"], weights=x["iw"].float(), scale=0.7)
    with ctx():
        out, _ = dsa_attention(q, lat, expand, topk=3, index=index, sinks=s)
        out.pow(2).sum().backward()
        plain, _ = dsa_attention(q, lat, expand, topk=3, index=index)
        with pytest.raises(ValueError, match=r"sinks expected a floating-point tensor \[H\] = \[2\] .*got torch.float64 \(3,\)"):
            dsa_attention(q, lat, expand, topk=3, index=index, sinks=torch.zeros(3, dtype=torch.float64))
    assert torch.allclose(out, ref, rtol=0, atol=1e-13) and (plain - out).abs().max() > 1e-2
    for got, want in ((q.grad, q0.grad), (lat.grad, lat0.grad), (s.grad, s0.grad)):
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()
    assert bool((s.grad != 0).all())
