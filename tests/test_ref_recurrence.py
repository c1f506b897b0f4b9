"""The float64 references of the recurrent mixers (blockdiag_ref.recurrence) against transformers' own torch
functions on single documents (an independent oracle), and per-document behaviour on packed rows."""

from __future__ import annotations

import pytest
import torch

from blockdiag_ref import (DocLayout, reference_causal_conv, reference_gated_delta_rule, reference_kda, reference_mamba2_mixer,
                           reference_selective_scan, reference_ssd)

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next",
                                 reason="transformers is not installed (the 'hf' extra)")


def gdr_inputs(S: int, Hk: int, Hv: int, K: int, V: int, seed: int, B: int = 1):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, S, Hk, K, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, S, Hv, V, generator=g, dtype=torch.float64)
    gate = -torch.rand(B, S, Hv, generator=g, dtype=torch.float64) * 2  # log decay <= 0
    beta = torch.rand(B, S, Hv, generator=g, dtype=torch.float64)
    return q, k, v, gate, beta


@pytest.mark.parametrize("S, Hk, Hv, K, V", [
    pytest.param(7, 1, 1, 4, 3, id="S7-1head"),
    pytest.param(70, 2, 4, 8, 5, id="S70-gva-two-chunks"),
    pytest.param(129, 2, 2, 3, 6, id="S129-three-chunks"),
])
def test_gated_delta_rule_matches_transformers_on_one_document(S, Hk, Hv, K, V):
    """transformers computes in float32 internally (both functions cast q, k, v, g, beta to float32): the
    reference agrees to float32 rounding, relative to the output's magnitude."""
    q, k, v, gate, beta = gdr_inputs(S, Hk, Hv, K, V, seed=S)
    ref = reference_gated_delta_rule(q, k, v, gate, beta, torch.ones(1, S, dtype=torch.long))
    for fn in (qwen3_next.torch_recurrent_gated_delta_rule, qwen3_next.torch_chunk_gated_delta_rule):
        theirs, _ = fn(q, k, v, g=gate, beta=beta, use_qk_l2norm_in_kernel=True)
        err = (theirs.double() - ref).abs().max() / ref.abs().max()
        assert err < 2e-6, f"{fn.__name__}: relative error {err:.2e}"


def test_gated_delta_rule_is_per_document():
    """A packed row (documents, middle padding, a reused id, B = 2) equals each document run alone; padding is 0."""
    ids = torch.tensor([[1, 1, 1, 0, 2, 2, 2, 2, 1, 1], [3, 3, 3, 3, 3, 3, 0, 0, 4, 4]])
    q, k, v, gate, beta = gdr_inputs(10, 2, 2, 4, 3, seed=1, B=2)
    out = reference_gated_delta_rule(q, k, v, gate, beta, ids)
    for row, start, end in DocLayout.from_doc_ids(ids).segments.tolist():
        alone = reference_gated_delta_rule(*(t[row:row + 1, start:end] for t in (q, k, v, gate, beta)),
                                           torch.ones(1, end - start, dtype=torch.long))
        torch.testing.assert_close(out[row:row + 1, start:end], alone, rtol=0, atol=0)
    assert (out[ids == 0] == 0).all()


@pytest.mark.parametrize("S, H, K, V", [
    pytest.param(7, 1, 4, 3, id="S7-1head"),
    pytest.param(70, 2, 8, 5, id="S70-two-chunks"),
    pytest.param(129, 2, 3, 6, id="S129-three-chunks"),
])
def test_kda_matches_transformers_on_one_document(S, H, K, V):
    """Kimi Linear's own functions (its recurrent and chunked torch paths, which Ling's layer calls too) compute in
    float32: the reference agrees to float32 rounding, relative to the output's magnitude."""
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    q, k, v, _, beta = gdr_inputs(S, H, H, K, V, seed=S)
    gate = -torch.rand(1, S, H, K, generator=torch.Generator().manual_seed(S), dtype=torch.float64) * 2
    ref = reference_kda(q, k, v, gate, beta, torch.ones(1, S, dtype=torch.long))
    for fn in (kimi.recurrent_kimi_delta_attention, kimi.chunk_kimi_delta_attention):
        theirs, _ = fn(q, k, v, g=gate, beta=beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
        err = (theirs.double() - ref).abs().max() / ref.abs().max()
        assert err < 2e-6, f"{fn.__name__}: relative error {err:.2e}"


def test_kda_is_per_document_and_its_decay_is_per_channel():
    """A packed row equals each document alone; and a decay equal on every channel is the gated delta rule's."""
    ids = torch.tensor([[1, 1, 1, 0, 2, 2, 2, 2, 1, 1], [3, 3, 3, 3, 3, 3, 0, 0, 4, 4]])
    q, k, v, gate, beta = gdr_inputs(10, 2, 2, 4, 3, seed=1, B=2)
    per_channel = gate[..., None] * torch.linspace(0.2, 1.8, 4, dtype=torch.float64)
    out = reference_kda(q, k, v, per_channel, beta, ids)
    for row, start, end in DocLayout.from_doc_ids(ids).segments.tolist():
        alone = reference_kda(*(t[row:row + 1, start:end] for t in (q, k, v, per_channel, beta)),
                              torch.ones(1, end - start, dtype=torch.long))
        torch.testing.assert_close(out[row:row + 1, start:end], alone, rtol=0, atol=0)
    assert (out[ids == 0] == 0).all()
    same = reference_kda(q, k, v, gate[..., None].expand(-1, -1, -1, 4), beta, ids)
    torch.testing.assert_close(same, reference_gated_delta_rule(q, k, v, gate, beta, ids), rtol=1e-13, atol=1e-13)
    assert (same - out).abs().max() > 1e-3  # the per-channel decay changes the result


@pytest.mark.parametrize("W, bias", [pytest.param(4, False, id="W4"), pytest.param(2, True, id="W2-bias"),
                                     pytest.param(3, False, id="W3")])
def test_causal_conv_matches_transformers_on_one_document(W, bias):
    g = torch.Generator().manual_seed(W)
    S, C = 11, 5
    x = torch.randn(1, S, C, generator=g, dtype=torch.float64)
    weight = torch.randn(C, W, generator=g, dtype=torch.float64)
    b = torch.randn(C, generator=g, dtype=torch.float64) if bias else None
    ref = reference_causal_conv(x, torch.ones(1, S, dtype=torch.long), weight, b, "silu")
    theirs = qwen3_next.causal_conv1d_fn(x.transpose(1, 2), weight, b, activation="silu").transpose(1, 2)
    torch.testing.assert_close(ref, theirs, rtol=1e-13, atol=1e-13)


def test_causal_conv_reads_no_history_of_another_document():
    ids = torch.tensor([[1, 1, 2, 2, 2, 0, 2, 3]])
    x = torch.arange(1.0, 9.0).view(1, 8, 1)
    out = reference_causal_conv(x, ids, torch.tensor([[100.0, 10.0, 1.0]]))
    assert out.flatten().tolist() == [1.0, 12.0, 3.0, 34.0, 345.0, 0.0, 7.0, 8.0]


def test_references_refuse_malformed_shapes():
    with pytest.raises(ValueError, match=r"expected weight \[C, W\] with C = 3, got \(2, 4\)"):
        reference_causal_conv(torch.zeros(1, 4, 3), torch.ones(1, 4), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="expected Hv a multiple of Hk, got Hv=3, Hk=2"):
        reference_gated_delta_rule(*(torch.zeros(1, 4, 2, 2),) * 2, torch.zeros(1, 4, 3, 2), torch.zeros(1, 4, 3),
                                   torch.zeros(1, 4, 3), torch.ones(1, 4))


def test_references_are_differentiable_and_padding_gets_no_gradient():
    ids = torch.tensor([[1, 1, 0, 2, 2, 2]])
    q, k, v, gate, beta = (t.requires_grad_() for t in gdr_inputs(6, 1, 2, 3, 2, seed=2))
    reference_gated_delta_rule(q, k, v, gate, beta, ids).sum().backward()
    for t in (q, k, v, gate, beta):
        assert t.grad is not None and (t.grad[ids == 0] == 0).all() and t.grad[ids != 0].abs().sum() > 0
    x = torch.randn(1, 6, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    reference_causal_conv(x, ids, w, activation="silu").sum().backward()
    assert (x.grad[ids == 0] == 0).all() and w.grad.abs().sum() > 0


nemotron_h = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")


def ssd_inputs(S: int, H: int, Dh: int, G: int, N: int, seed: int, B: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, Dh, generator=g, dtype=torch.float64)
    dt = torch.rand(B, S, H, generator=g, dtype=torch.float64) * 0.5 + 0.01
    A = -torch.rand(H, generator=g, dtype=torch.float64) * 2
    Bm, Cm = (torch.randn(B, S, G, N, generator=g, dtype=torch.float64) for _ in range(2))
    D = torch.randn(H, generator=g, dtype=torch.float64)
    return x, dt, A, Bm, Cm, D


@pytest.mark.parametrize("S, H, Dh, G, N, chunk", [
    pytest.param(7, 1, 3, 1, 4, 4, id="S7-1head-two-chunks"),
    pytest.param(70, 4, 5, 2, 3, 16, id="S70-groups"),
])
def test_ssd_matches_transformers_on_one_document(S, H, Dh, G, N, chunk):
    """transformers' mamba2_chunk_scan computes in float32 (x, B, C, dt cast): agreement to float32 rounding."""
    x, dt, A, Bm, Cm, D = ssd_inputs(S, H, Dh, G, N, seed=S)
    ref = reference_ssd(x, dt, A, Bm, Cm, torch.ones(1, S, dtype=torch.long), D=D)
    theirs = nemotron_h.mamba2_chunk_scan(x, dt, A, Bm, Cm, chunk_size=chunk, D=D)
    err = (theirs.double() - ref).abs().max() / ref.abs().max()
    assert err < 2e-6, f"relative error {err:.2e}"


def test_mamba2_mixer_matches_transformers_on_one_document():
    """The whole layer against NemotronHMamba2Mixer's own forward on one document (float64 weights; the stock
    layer computes its SSD and gated norm in float32: agreement to float32 rounding); and with a time step
    clamped from below (``time_step_limit``), the clamp is honoured."""
    from transformers import NemotronHConfig

    cfg = NemotronHConfig(vocab_size=16, hidden_size=16, mamba_num_heads=4, mamba_head_dim=4, n_groups=2,
                          ssm_state_size=3, conv_kernel=3, chunk_size=8, layers_block_type=["linear_attention"],
                          use_conv_bias=True, time_step_min=0.3)
    torch.manual_seed(0)
    layer = nemotron_h.NemotronHMamba2Mixer(cfg, layer_idx=0).double()
    with torch.no_grad():
        for p in (layer.D, layer.norm.weight):
            p.add_(torch.randn_like(p) * 0.5)
        layer.dt_bias.copy_(torch.randn(4) * 0.5 - 1.0)  # softplus near 0.3: the clamp binds on some tokens
    h = torch.randn(1, 19, 16, dtype=torch.float64)
    theirs = layer(h)
    ours = reference_mamba2_mixer(h, torch.ones(1, 19, dtype=torch.long), dict(layer.named_parameters()),
                                  heads=4, head_dim=4, groups=2, state_size=3, time_step_limit=layer.time_step_limit,
                                  eps=layer.norm.variance_epsilon)
    err = (theirs - ours).abs().max() / theirs.abs().max()
    assert err < 1e-5, f"relative error {err:.2e}"
    unclamped = reference_mamba2_mixer(h, torch.ones(1, 19, dtype=torch.long), dict(layer.named_parameters()),
                                       heads=4, head_dim=4, groups=2, state_size=3, eps=layer.norm.variance_epsilon)
    assert (unclamped - theirs).abs().max() / theirs.abs().max() > 1e-3  # the clamp binds on these inputs


def test_ssd_is_per_document():
    ids = torch.tensor([[1, 1, 1, 0, 2, 2, 2, 2, 1, 1], [3, 3, 3, 3, 3, 3, 0, 0, 4, 4]])
    x, dt, A, Bm, Cm, D = ssd_inputs(10, 2, 3, 1, 2, seed=3, B=2)
    out = reference_ssd(x, dt, A, Bm, Cm, ids, D=D)
    for row, start, end in DocLayout.from_doc_ids(ids).segments.tolist():
        alone = reference_ssd(*(t[row:row + 1, start:end] for t in (x, dt)), A,
                              *(t[row:row + 1, start:end] for t in (Bm, Cm)), torch.ones(1, end - start, dtype=torch.long), D=D)
        torch.testing.assert_close(out[row:row + 1, start:end], alone, rtol=0, atol=0)
    assert (out[ids == 0] == 0).all()
    with pytest.raises(ValueError, match="expected H a multiple of G, got H=3, G=2"):
        reference_ssd(torch.zeros(1, 4, 3, 2), torch.zeros(1, 4, 3), torch.zeros(3), torch.zeros(1, 4, 2, 2),
                      torch.zeros(1, 4, 2, 2), torch.ones(1, 4))


mamba = pytest.importorskip("transformers.models.mamba.modeling_mamba")


def scan_inputs(S: int, I: int, G: int, N: int, seed: int, B: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, I, generator=g, dtype=torch.float64)
    dt = torch.rand(B, S, I, generator=g, dtype=torch.float64) * 0.5 + 0.01
    A = -torch.rand(I, N, generator=g, dtype=torch.float64) * 2
    Bm, Cm = (torch.randn(B, S, G, N, generator=g, dtype=torch.float64) for _ in range(2))
    D = torch.randn(I, generator=g, dtype=torch.float64)
    return x, dt, A, Bm, Cm, D


def test_selective_scan_matches_transformers_on_one_document():
    """transformers' mamba_selective_scan (its torch path: the loop over tokens; B cast to float32, and so the
    state updates): agreement to float32 rounding, with its bias and softplus of dt applied by it."""
    S, I, N = 23, 6, 4
    x, dt_raw, A, Bm, Cm, D = scan_inputs(S, I, 1, N, seed=5)
    bias = torch.randn(I, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    ref = reference_selective_scan(x, torch.nn.functional.softplus(dt_raw + bias), A, Bm, Cm,
                                   torch.ones(1, S, dtype=torch.long), D=D)
    theirs = mamba.mamba_selective_scan(x.transpose(1, 2), dt_raw.transpose(1, 2), A, Bm[:, :, 0].transpose(1, 2),
                                        Cm[:, :, 0].transpose(1, 2), D=D, delta_bias=bias, delta_softplus=True)
    err = (theirs.transpose(1, 2) - ref).abs().max() / ref.abs().max()
    assert err < 2e-6, f"relative error {err:.2e}"


def _mamba1_layer(variant: str):
    import transformers
    from transformers.models.falcon_mamba.modeling_falcon_mamba import FalconMambaMixer
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer
    from transformers.models.zamba.modeling_zamba import ZambaMambaMixer

    small = dict(hidden_size=16, num_hidden_layers=1)
    if variant in ("mamba", "falcon_mamba"):
        cls = mamba.MambaMixer if variant == "mamba" else FalconMambaMixer
        cfg_cls = transformers.MambaConfig if variant == "mamba" else transformers.FalconMambaConfig
        layer = cls(cfg_cls(**small, state_size=4, expand=2, conv_kernel=3, time_step_rank=3), layer_idx=0,
                    initialize_mixer_weights=False)
        (layer.init_mamba_weights if variant == "mamba" else layer.init_falcon_mamba_weights)()
        return layer
    mixer = dict(mamba_d_state=4, mamba_expand=2, mamba_d_conv=3, mamba_dt_rank=3)
    if variant == "jamba":
        return JambaMambaMixer(transformers.JambaConfig(**small, **mixer, attn_layer_period=2, attn_layer_offset=1), 0)
    return ZambaMambaMixer(transformers.ZambaConfig(**small, **mixer, n_mamba_heads=2, layers_block_type=["mamba"]), 0)


@pytest.mark.parametrize("variant", ["mamba", "falcon_mamba", "jamba", "zamba"])
def test_mamba1_mixer_matches_transformers_on_one_document(variant):
    """The whole layer against MambaMixer's, FalconMambaMixer's, JambaMambaMixer's and ZambaMambaMixer's own
    forward on one document (float64 weights moved away from their init; the stock layers compute the state's
    updates, and Falcon-Mamba's and Jamba's norms of dt, B, C, in float32: agreement to float32 rounding)."""
    from blockdiag_ref import reference_mamba1_mixer

    torch.manual_seed(0)
    layer = _mamba1_layer(variant).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    h = torch.randn(1, 17, 16, dtype=torch.float64)
    eps = {"jamba": getattr(getattr(layer, "dt_layernorm", None), "variance_epsilon", None),
           "falcon_mamba": getattr(layer, "rms_eps", None)}.get(variant) or 1e-6
    ours = reference_mamba1_mixer(h, torch.ones(1, 17, dtype=torch.long), dict(layer.named_parameters()),
                                  variant=variant, time_step_rank=layer.time_step_rank, state_size=layer.ssm_state_size,
                                  heads=getattr(layer, "n_mamba_heads", 1), eps=eps, activation=layer.activation)
    theirs = layer(h)
    err = (theirs - ours).abs().max() / theirs.abs().max()
    assert err < 1e-5, f"relative error {err:.2e}"


def test_selective_scan_is_per_document():
    ids = torch.tensor([[1, 1, 1, 0, 2, 2, 2, 2, 1, 1], [3, 3, 3, 3, 3, 3, 0, 0, 4, 4]])
    x, dt, A, Bm, Cm, D = scan_inputs(10, 4, 2, 3, seed=3, B=2)
    for t in (x, dt, Bm, Cm):
        t.requires_grad_()
    out = reference_selective_scan(x, dt, A, Bm, Cm, ids, D=D)
    for row, start, end in DocLayout.from_doc_ids(ids).segments.tolist():
        alone = reference_selective_scan(*(t[row:row + 1, start:end] for t in (x, dt)), A,
                                         *(t[row:row + 1, start:end] for t in (Bm, Cm)),
                                         torch.ones(1, end - start, dtype=torch.long), D=D)
        torch.testing.assert_close(out[row:row + 1, start:end], alone, rtol=0, atol=0)
    assert (out[ids == 0] == 0).all()
    out.sum().backward()
    for t in (x, dt, Bm, Cm):
        assert (t.grad[ids == 0] == 0).all() and t.grad[ids != 0].abs().sum() > 0
    with pytest.raises(ValueError, match="expected I a multiple of G, got I=5, G=2"):
        reference_selective_scan(torch.zeros(1, 4, 5), torch.zeros(1, 4, 5), torch.zeros(5, 2), torch.zeros(1, 4, 2, 2),
                                 torch.zeros(1, 4, 2, 2), torch.ones(1, 4))
    with pytest.raises(ValueError, match=r"A expected \[I, N\] = \[4, 3\], got \(4,\)"):
        reference_selective_scan(x, dt, torch.zeros(4), Bm, Cm, ids)


def _minimax_layer(block_size: int):
    """A float64 ``MiniMaxLightningAttention`` (layer 1 of 3: its own slope) with its decay tables recomputed in
    float64 from its slope (the stock layer computes them once, at init, in float32)."""
    import transformers
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    cfg = transformers.MiniMaxConfig(hidden_size=16, num_attention_heads=2, head_dim=6, num_hidden_layers=3,
                                     block_size=block_size, layer_types=["linear_attention"] * 3)
    torch.manual_seed(0)
    layer = MiniMaxLightningAttention(cfg, layer_idx=1).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    layer.query_decay, layer.key_decay, layer.diagonal_decay = layer.decay_factors(layer.slope_rate)
    return layer


@pytest.mark.parametrize("S, block", [pytest.param(5, 8, id="S5-one-block"), pytest.param(19, 8, id="S19-three-blocks")])
def test_lightning_attention_matches_transformers_on_one_document(S, block):
    """The reference core inside MiniMaxLightningAttention's own forward (its projections, silu, RMSNorm, sigmoid
    gate and out_proj around it) against the stock forward on one document: its blocks (intra-block decayed
    ``q k^T`` and the carried ``k^T v``) against the token-by-token state, in float64."""
    from blockdiag_ref import reference_lightning_attention

    layer = _minimax_layer(block)
    H, D = layer.num_attention_heads, layer.head_dim
    h = torch.randn(1, S, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(S))
    theirs, _ = layer(h, None, None)
    q, k, v = torch.nn.functional.silu(layer.qkv_proj(h)).view(1, S, H, 3 * D).split(D, dim=-1)
    core = reference_lightning_attention(q, k, v, layer.slope_rate.view(H), torch.ones(1, S, dtype=torch.long))
    ours = layer.out_proj(torch.sigmoid(layer.output_gate(h)) * layer.norm(core.reshape(1, S, H * D)))
    err = (theirs - ours).abs().max() / theirs.abs().max()
    assert err < 1e-13, f"relative error {err:.2e}"


def test_lightning_attention_is_per_document():
    from blockdiag_ref import reference_lightning_attention

    ids = torch.tensor([[1, 1, 1, 0, 2, 2, 2, 2, 1, 1], [3, 3, 3, 3, 3, 3, 0, 0, 4, 4]])
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(2, 10, 2, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 10, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    slope = torch.tensor([0.5, 0.05], dtype=torch.float64)
    out = reference_lightning_attention(q, k, v, slope, ids)
    for row, start, end in DocLayout.from_doc_ids(ids).segments.tolist():
        alone = reference_lightning_attention(*(t[row:row + 1, start:end] for t in (q, k, v)), slope,
                                              torch.ones(1, end - start, dtype=torch.long))
        torch.testing.assert_close(out[row:row + 1, start:end], alone, rtol=0, atol=0)
    assert (out[ids == 0] == 0).all()
    out.sum().backward()
    for t in (q, k, v):
        assert (t.grad[ids == 0] == 0).all() and t.grad[ids != 0].abs().sum() > 0
    with pytest.raises(ValueError, match=r"slope expected H = 2 numbers \(one per head\), got \(3,\)"):
        reference_lightning_attention(q, k, v, torch.ones(3), ids)
    with pytest.raises(ValueError, match=r"expected q, k \[B, S, H, K\] and v \[B, S, H, V\]"):
        reference_lightning_attention(q, k[:, :, :1], v, slope, ids)
