"""The float64 references of the recurrent mixers (blockdiag_ref.recurrence) against transformers' own torch
functions on single documents (an independent oracle), and per-document behaviour on packed rows."""

from __future__ import annotations

import pytest
import torch

from blockdiag_ref import DocLayout, reference_causal_conv, reference_gated_delta_rule

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
