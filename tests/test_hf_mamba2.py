"""Mamba2 hybrids (Nemotron-H; Bamba, Granite-4 hybrids, Zamba2 and Mamba2 itself, whose Mamba2 layer is
Nemotron-H's line for line; Falcon-H1, with its multipliers and its optional norm) train
under CP with the same few lines as Llama: the loss and every parameter's gradient equal each document run alone
on one device, at CP 1, 2, 4 and DP 2 x CP 2, on every layout, in float64 (the truth with the Mamba2 layers in
float64, see verify.model.hybrid) and with activation checkpointing, reentrant and not. bf16 autocast, the stock
layer outside a step and the refusal of a cache or a mask are tests/test_hf_hybrid.py's, for every installed family.

What the models compute in float32 whatever their dtype, and what it costs here: Nemotron-H casts its logits to
float32 (``lm_head(...).float()``; Mamba2 too), so its loss is a float32 sum (measured 4e-8 against the per-document sum); its
RMSNorms (``x.float()``, ``weight.float()``) sum their weights' gradients over tokens in float32 (~1e-7); its MoE
routes in float32 and accumulates the experts in float32 (every gradient of the MoE model ~1e-7)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")

from blockdiag_dist import make_cp_blockdiag_batch_and_ctx  # noqa: E402
from verify.model.harness import text_forward  # noqa: E402
from verify.model.hybrid import build_tiny_hybrid, cp_parity_step, hybrid_batch, hybrid_docs  # noqa: E402

from mixer_checks import assert_summaries_cross, parity_problems  # noqa: E402
from test_hf_hybrid import cp_problems, the_truth  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

FLOAT64_LIMIT = 1e-10
FLOAT32_LIMIT = 1e-6  # what the model itself computes in float32 (see the module docstring; measured <= 2e-7)
TIMEOUT = 300.0
FLOAT32_LOSS = ("nemotron_h", "nemotron_h_moe", "mamba2")  # logits cast to float32 by the model
FLOAT32_EVERYWHERE = ("nemotron_h_moe",)  # float32 routing and expert accumulation: every gradient


def float32_reduced(family: str, name: str) -> bool:
    """Gradients the model sums in float32: Nemotron-H's RMSNorm weights outside the Mamba2 layers."""
    return family.startswith("nemotron_h") and name.endswith("norm.weight") and ".mixer." not in name or (
        family.startswith("nemotron_h") and name.endswith("norm_f.weight"))


def float64_problems(label: str, family: str, got) -> list[str]:
    return parity_problems(
        label, got, the_truth(family), build_tiny_hybrid(family), computed="ssd", layers="Mamba2", limit=FLOAT64_LIMIT,
        loss_limit=FLOAT32_LIMIT if family in FLOAT32_LOSS else FLOAT64_LIMIT,
        limit_of=lambda name: FLOAT32_LIMIT if family in FLOAT32_EVERYWHERE or float32_reduced(family, name) else FLOAT64_LIMIT)


@pytest.mark.parametrize("family", ["nemotron_h", "bamba", "granitemoehybrid", "zamba2", "mamba2", "falcon_h1",
                                    "falcon_h1_gate_first", "falcon_h1_nonorm"])
def test_cp1_matches_each_document_alone(family):
    """(Bamba, Granite-4 hybrids, Zamba2, Falcon-H1 and Mamba2 were refused by the guard before:
    tests/test_never_silent.py.)"""
    got = cp_parity_step(family)
    assert not float64_problems(f"{family} cp1", family, got)


CP_RUNS = {  # CP size -> (family, layout, checkpointing)
    2: [("nemotron_h", "contiguous", None), ("nemotron_h", "balanced", None), ("nemotron_h", "auto", None),
        ("nemotron_h", "contiguous", "reentrant"), ("nemotron_h", "balanced", "non_reentrant"),
        ("nemotron_h_moe", "balanced", None), ("bamba", "balanced", None), ("granitemoehybrid", "contiguous", None),
        ("zamba2", "balanced", None), ("mamba2", "auto", None), ("falcon_h1", "balanced", None),
        ("falcon_h1_nonorm", "contiguous", None)],
    4: [("nemotron_h", "contiguous", None), ("nemotron_h", "balanced", None), ("nemotron_h", "auto", None)],
}


@pytest.mark.parametrize("cp", sorted(CP_RUNS))
def test_cp_matches_each_document_alone(pools, cp):
    problems = cp_problems(pools, cp, CP_RUNS[cp], float64_problems, TIMEOUT)
    assert_summaries_cross(cp)  # documents cross ranks: summaries move
    assert not problems, "\n".join(problems)


def test_dp2_cp2_matches_each_document_alone(pools):
    per_rank = pools(4).run(cp_parity_step, args=("nemotron_h",), kwargs={"layout": "balanced", "dp": 2},
                            timeout=TIMEOUT, name="nemotron_h dp2 x cp2 balanced")
    assert not float64_problems("dp2 x cp2 balanced", "nemotron_h", per_rank[0])


def test_install_refuses_other_classes():
    from blockdiag_dist.integrations.hf_mixers import install_mamba2

    with pytest.raises(ValueError, match=r"install_mamba2: expected one of .*NemotronHMamba2Mixer.*, got Linear"):
        install_mamba2(torch.nn.Linear)


def test_a_pure_mamba2_model_without_the_opt_out_is_told_which_mixers_ran_per_document():
    """No attention reaches cp_blockdiag_sdpa in a pure Mamba2 model: the check still raises, and its message says
    that the step computed Mamba2Mixer per document and what a model without softmax attention passes; a step whose
    mixers the guard did not see gets no such hint."""
    from blockdiag_dist import AttentionNotRoutedError

    model = build_tiny_hybrid("mamba2")
    ctx, local = make_cp_blockdiag_batch_and_ctx(None, None, hybrid_batch(hybrid_docs()))
    with pytest.raises(AttentionNotRoutedError, match=r"computed its sequence mixers per document \(Mamba2Mixer\).*"
                                                      r"expect_attention=False; every layer not computed per document "
                                                      r"is still refused"):
        with ctx():
            text_forward(model, local)
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, hybrid_batch(hybrid_docs()))
    with pytest.raises(AttentionNotRoutedError) as err:
        with ctx():
            pass
    assert "expect_attention" not in str(err.value)
