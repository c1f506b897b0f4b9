"""MiniMax (lightning attention, softmax attention and MoE feed-forwards) trains under CP with the same few lines as
Llama: the loss and every parameter's gradient equal each document run alone on one device, at CP 1, 2 and 4, on
every layout, in float64 (the truth with the lightning layers in float64: verify.model.hybrid's "mixers64"), with
activation checkpointing too. Outside a step the layer is transformers' own; a cache or a mask under a step is
refused.

What MiniMax computes in float32 whatever its dtype, and what it costs here (measured on this tiny model, float64,
against the CP 1 step): the lightning layer's decay tables (``query_decay``, ``key_decay``, ``diagonal_decay``, made
once at init in float32 and kept, rounded, in a float64 model: 3.8e-8 relative gradient error, loss 5.4e-12; the
tiny model recomputes them in float64, ``verify.model.hybrid.float64_decay_tables``; blockdiag computes the decays
``exp(-slope n)`` from the slope in the model's dtype); the lightning layer's RMSNorm over its heads
(``hidden_states.to(float32)``: with the tables, the stock layer as shipped is 1.1e-7 from the truth; the installed
layer normalises in the model's dtype, float32 at least); the decoder's RMSNorms (elementwise, the same rounding in
the truth and under CP) and the MoE router (per token, the same in both). Measured: loss and every gradient within
1e-15 of the truth at CP 1, 2 and 4."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")

from blockdiag_dist import make_cp_blockdiag_batch_and_ctx  # noqa: E402
from verify.model.hybrid import build_tiny_hybrid, cp_parity_step, hybrid_batch, hybrid_docs  # noqa: E402

from mixer_checks import assert_summaries_cross, parity_problems  # noqa: E402
from test_hf_hybrid import cp_problems, the_truth  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

FLOAT64_LIMIT = 1e-10
TIMEOUT = 300.0


def float64_problems(label: str, family: str, got) -> list[str]:
    return parity_problems(label, got, the_truth(family), build_tiny_hybrid(family), computed="lightning_attention",
                           layers="lightning", limit=FLOAT64_LIMIT)


CP_RUNS = {  # CP size -> (family, layout, checkpointing)
    2: [("minimax", "contiguous", None), ("minimax", "balanced", "non_reentrant"), ("minimax", "auto", None)],
    4: [("minimax", "contiguous", None), ("minimax", "balanced", None), ("minimax", "auto", "reentrant")],
}


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_minimax_matches_each_document_alone(pools, cp):
    """(Refused by the guard before, naming MiniMaxLightningAttention.)"""
    if cp == 1:
        problems = float64_problems("minimax cp1", "minimax", cp_parity_step("minimax"))
    else:
        problems = cp_problems(pools, cp, CP_RUNS[cp], float64_problems, TIMEOUT)
        assert_summaries_cross(cp, transitions=True)  # documents cross ranks: summaries (transitions at CP 4) move
    assert not problems, "\n".join(problems)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # its stock call below
def test_the_layer_outside_a_step_is_transformers_own_and_under_one_refuses_a_cache_or_a_mask():
    from verify.model.harness import text_forward

    model = build_tiny_hybrid("minimax")
    ctx, local = make_cp_blockdiag_batch_and_ctx(None, None, hybrid_batch(hybrid_docs()))
    with ctx():  # the guard installs the per-document forward on the class
        text_forward(model, local)
    layer = model.get_submodule("model.layers.0.self_attn")
    stock = type(layer).forward._blockdiag_stock
    h = torch.randn(2, 16, 32, dtype=torch.float64)
    for got, want in zip(layer(h, None, None), stock(layer, h, None, None)):
        assert torch.equal(got, want), "outside a step the installed forward must call the stock one"
    h = torch.randn(*local["input_ids"].shape, 32, dtype=torch.float64)
    with ctx():
        with pytest.raises(ValueError, match=r"MiniMaxLightningAttention \(layer 0\): expected no cache under a CP step "
                                             r"\(use_cache=False in training\), got object"):
            layer(h, None, None, object())  # positionally, as the stock signature orders them
        with pytest.raises(ValueError, match=r"expected no attention_mask under a CP step .*got a tensor of shape \(2, 64\)"):
            layer(h, None, torch.ones(2, 64))
        with pytest.raises(ValueError, match=r"expected no cache under a CP step .*got object"):
            layer(h, None, None, past_key_values=object())  # the deprecated name the stock decorator renames
        with pytest.raises(TypeError, match=r"MiniMaxLightningAttention.forward: too many positional arguments \(expected "
                                            r"the parameters of MiniMaxLightningAttention.forward: \(self, hidden_states, "
                                            r"position_embeddings, attention_mask, cache, \*\*kwargs\); got hidden_states, "
                                            r"4 more positional"):
            layer(h, None, None, None, None)
        for twice in ({"cache": None}, {"past_key_values": None}, {"attention_mask": None}):  # given twice
            with pytest.raises(TypeError, match=r"multiple values for argument '(cache|attention_mask)'"):
                layer(h, None, None, None, **twice)
    for twice in ({"cache": None}, {"past_key_values": None}, {"attention_mask": None}):  # as the stock refuses them
        with pytest.raises(TypeError, match=r"multiple values for argument '(cache|attention_mask)'"):
            layer(h, None, None, None, **twice)
    from blockdiag_dist.integrations.hf_mixers import install_lightning

    with pytest.raises(ValueError, match=r"install_lightning: expected one of \['MiniMaxLightningAttention'\], got Linear"):
        install_lightning(torch.nn.Linear)

