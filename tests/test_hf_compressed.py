"""DeepSeek-V4 (attention over compressed blocks: CSA with its indexer, HCA, sliding layers with sinks) trains under
CP with the same few lines as Llama: the loss and every parameter's gradient equal each document run alone on one
device (stock ``eager``), at CP 1, 2, 4, on contiguous and balanced layouts, with and without activation
checkpointing, in float64. (Refused by the guard before: its compression windows start at the row's first token.)

Both sides run the model's hyper-connections and RMSNorms in float64 (``exact``, verify.model.compressed): their
float32 matrix products and norms would otherwise put float32 error into every gradient.
The primitive, :func:`blockdiag_dist.compressed_attention`, is also checked against its float64 reference."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")

from blockdiag_dist import Compression, CompressedIndex, compressed_attention, make_cp_blockdiag_batch_and_ctx, plan_step  # noqa: E402
from blockdiag_dist.guard import check_model  # noqa: E402
from blockdiag_ref import reference_compressed_attention  # noqa: E402
from verify.model.compressed import build_tiny_dsv4, cp_parity_step, dsv4_batch, dsv4_docs, truth  # noqa: E402
from verify.model.harness import compare, text_forward  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

FLOAT64_LIMIT = 1e-10
TIMEOUT = 300.0
_truth: list = []


def the_truth():
    if not _truth:
        _truth.append(truth())
    return _truth[0]


def problems(label: str, got) -> list[str]:
    c = compare(the_truth(), got, build_tiny_dsv4(), FLOAT64_LIMIT)
    bad = [f"{label}: loss {c.loss_rel:.1e}"] if c.loss_rel > FLOAT64_LIMIT else []
    bad += [f"{label}: {name} {err:.1e} ({c.summary()})" for name, err in c.per_param.items() if err > FLOAT64_LIMIT]
    if not any(n.startswith("DeepseekV4Attention: computed per document") for n in got.notes):
        bad.append(f"{label}: DeepseekV4Attention was not computed per document (notes {got.notes})")
    return bad


def test_cp1_matches_each_document_alone():
    assert not problems("cp1", cp_parity_step())
    grads = the_truth().grads  # the compressors and the sinks are trained here; the indexer is not (no gradient)
    assert all(abs(grads[f"model.layers.{i}.self_attn.{p}"]).sum() > 0
               for i, p in ((0, "compressor.kv_proj.weight"), (1, "compressor.position_bias"), (2, "sinks")))


CP_RUNS = {  # CP size -> (layout, activation checkpointing): one run each (CP 1 runs without checkpointing)
    2: [("balanced", "non_reentrant")],
    4: [("contiguous", "reentrant")],
}


@pytest.mark.parametrize("cp", sorted(CP_RUNS))
def test_cp_matches_each_document_alone(pools, cp):
    runs = CP_RUNS[cp]
    calls = [((), {"layout": layout, "checkpointing": ck}) for layout, ck in runs]
    names = [f"deepseek_v4 cp{cp} {layout} ckpt={ck}" for layout, ck in runs]
    found = []
    for name, per_rank in zip(names, pools(cp).run_many(cp_parity_step, calls, timeout=TIMEOUT, names=names)):
        assert isinstance(per_rank, list), per_rank
        found += problems(name, per_rank[0])
    ids = dsv4_batch(dsv4_docs())["_packed_seq_ids"]
    for layout, _ in runs:  # documents cross ranks: projections move
        assert sum(plan_step(ids, cp, layout).exchange(-1).needed_tokens()) > 0
    assert not found, "\n".join(found)


def _inputs(B, S, H, D, Hi, Di, rate, g):
    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, kv, sinks = r(B, H, S, D), r(B, S, D), r(H)
    ckv, cgate, bias = r(B, S, 2 * D), r(B, S, 2 * D), r(rate, 2 * D)
    iq, iw, ikv, igate, ibias = r(B, S, Hi, Di), r(B, S, Hi), r(B, S, 2 * Di), r(B, S, 2 * Di), r(rate, 2 * Di)
    return [t.requires_grad_() for t in (q, kv, sinks, ckv, cgate, bias)], (iq, iw, ikv, igate, ibias)


def _finish(pooled, positions):  # a norm-like function of the entry and its position, as a layer's finish
    return pooled / (1 + pooled.square().mean(-1, keepdim=True)).sqrt() + 0.01 * positions.unsqueeze(-1)


def test_primitive_matches_its_reference_padding_rows_zero():
    """compressed_attention (CP 1, gate softmax in float64) against the float64 reference: overlapping windows,
    an indexer keeping 2 entries, a short window, documents not starting at a window boundary and padding."""
    ids = torch.tensor([[1] * 3 + [2] * 13 + [3] * 9 + [0] * 3, [4] * 22 + [0] * 6])
    B, S, H, D, Hi, Di, rate = 2, 28, 2, 4, 2, 4, 3
    (q, kv, sinks, ckv, cgate, bias), (iq, iw, ikv, igate, ibias) = _inputs(B, S, H, D, Hi, Di, rate, torch.Generator().manual_seed(3))
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": torch.zeros_like(ids), "_packed_seq_ids": ids})
    f64 = torch.float64
    with ctx():
        comp = Compression(kv=ckv, gate=cgate, rate=rate, overlap=True, position_bias=bias, finish=_finish, pool_dtype=f64)
        index = CompressedIndex(query=iq, weights=iw, scale=0.5, topk=2, keys=Compression(
            kv=ikv, gate=igate, rate=rate, overlap=True, position_bias=ibias, finish=_finish, pool_dtype=f64))
        out = compressed_attention(q, kv, sinks, window=4, compression=comp, index=index, scale=0.7)
    ref = reference_compressed_attention(q, kv, sinks, ids, window=4, rate=rate, comp_kv=ckv, comp_gate=cgate,
                                         position_bias=bias, overlap=True, finish=_finish, scale=0.7, index=dict(
                                             query=iq, weights=iw, scale=0.5, topk=2, kv=ikv, gate=igate,
                                             position_bias=ibias, finish=_finish))
    assert (out - ref).abs().max() <= 1e-12 * ref.abs().max()
    assert torch.equal(out.transpose(1, 2)[ids == 0], torch.zeros_like(out.transpose(1, 2)[ids == 0]))
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=f64)
    leaves = (q, kv, sinks, ckv, cgate, bias)
    got = torch.autograd.grad((out * w).sum(), leaves)
    want = torch.autograd.grad((ref * w).sum(), leaves)
    for name, a, b in zip(("q", "kv", "sinks", "comp kv", "comp gate", "position_bias"), got, want):
        assert (a - b).abs().max() <= 1e-12 * max(b.abs().max(), 1e-300), name
    assert not got[1][ids == 0].any() and not got[3][ids == 0].any()  # padding projections: no gradient
    # the indexer's choice matters here: seeing every complete entry changes the output
    dense = reference_compressed_attention(q, kv, sinks, ids, window=4, rate=rate, comp_kv=ckv, comp_gate=cgate,
                                           position_bias=bias, overlap=True, finish=_finish, scale=0.7)
    assert (dense - ref).abs().max() > 1e-3


@pytest.mark.parametrize("ids", [[[0] * 8], [[1, 1, 2, 2, 2, 3, 0, 0]]], ids=["padding-only", "no-complete-window"])
def test_every_input_and_weight_gets_a_gradient_where_the_rows_use_none(ids):
    """A rank whose rows use no compressed entry (padding only; documents shorter than the rate) still gives the
    compressor's inputs, its position bias and the weights of its ``finish`` a gradient, exactly 0 where unused: the
    trainer's data-parallel reduction over the ranks waits for every parameter on every rank."""
    ids = torch.tensor(ids)
    B, S, H, D, Hi, Di, rate = 1, ids.shape[1], 2, 4, 2, 4, 4
    (q, kv, sinks, ckv, cgate, bias), _ = _inputs(B, S, H, D, Hi, Di, rate, torch.Generator().manual_seed(5))
    gain = torch.ones(D, dtype=torch.float64, requires_grad=True)  # a weight of the layer's finish (its norm's)
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": torch.zeros_like(ids), "_packed_seq_ids": ids})
    with ctx():
        comp = Compression(kv=ckv, gate=cgate, rate=rate, overlap=True, position_bias=bias,
                           finish=lambda pooled, positions: _finish(pooled, positions) * gain, pool_dtype=torch.float64)
        out = compressed_attention(q, kv, sinks, window=2, compression=comp)
    leaves = (q, kv, sinks, ckv, cgate, bias, gain)
    got = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
    names = ("q", "kv", "sinks", "comp kv", "comp gate", "position_bias", "finish's weight")
    assert [n for n, g in zip(names, got) if g is None] == []
    for name, g in zip(names[5:], got[5:]):
        assert not g.any(), name


def test_fsdp_over_the_cp_ranks_where_a_rank_makes_no_complete_window(pools):
    """The step a trainer takes: FSDP2 reduces each rank's gradients over the CP ranks, and every rank must give the
    same parameters a gradient (on gloo a parameter missing on one rank aborts the ranks: ``Received data size
    doesn't match expected size``). Ranks 2 and 3 hold documents of 2-3 tokens only, shorter than every compression
    rate: they still give the compressors' position biases and norms their zero gradient. The loss and every
    gradient equal each document run alone on one device; the indexer's weights have no gradient on any rank, as in
    stock transformers."""
    from mp_checks import fsdp_step

    from verify.model.sparse import dsa_docs

    lengths = (16, 16, 3, 3, 2, 3, 3, 2, 3, 3)  # 54 of 64 positions; rank r of 4 holds positions 16r .. 16r + 15
    per_rank = pools(4).run(fsdp_step, ("deepseek_v4", lengths), timeout=TIMEOUT, name="fsdp deepseek_v4 cp4")
    without = {tuple(r["without_gradient"]) for r in per_rank}
    assert len(without) == 1 and all(".indexer." in n for n in next(iter(without))), without
    c = compare(truth(dsa_docs(lengths=lengths)), per_rank[0]["step"], build_tiny_dsv4(), FLOAT64_LIMIT)
    bad = [f"{n} {e:.1e}" for n, e in c.per_param.items() if e > FLOAT64_LIMIT]
    assert c.loss_rel <= FLOAT64_LIMIT and not bad, (c.loss_rel, bad, c.summary())


def test_under_a_step_a_mask_or_a_cache_is_refused_and_compressors_elsewhere_stay_refused():
    model = build_tiny_dsv4()
    attn = model.model.layers[0].self_attn
    ctx, local = make_cp_blockdiag_batch_and_ctx(None, None, dsv4_batch(dsv4_docs()))
    with ctx():
        text_forward(model, local)  # installs the per-document forward
        h = torch.zeros(2, 64, 32, dtype=torch.float64)
        pos = torch.arange(64).unsqueeze(0)
        pe = {k: model.model.rotary_emb(h, pos, layer_type=k) for k in ("main", "compress")}
        with pytest.raises(ValueError, match=r"DeepseekV4Attention \(layer 0\): expected no attention_mask under a "
                                             r"CP step .*got a tensor of shape \(2, 1, 64, 64\)"):
            attn(h, pe, pos, torch.ones(2, 1, 64, 64, dtype=torch.bool))
        with pytest.raises(ValueError, match=r"expected no cache under a CP step .*got object"):
            attn(h, pe, pos, None, cache=object())
    kinds = [(f.cls, f.per_document is not None) for f in check_model(model) if f.kind == "compressed_attention"]
    assert kinds == [("DeepseekV4Attention", True)] * 3

    class OtherAttention(torch.nn.Module):  # a compressor outside the installed layers stays refused, by name
        def __init__(self):
            super().__init__()
            self.compressor = type(attn.compressor)(model.config)

    found = check_model(OtherAttention())
    assert [(f.name, f.cls, f.per_document) for f in found] == [("compressor", "DeepseekV4HCACompressor", None)]
    assert "is not computed per document under CP: it is attention over compressed blocks" in found[0].message()
